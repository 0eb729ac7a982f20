"""The plan of long rows, without a GPU: what it counts of tiled MLPs and of the carried
keys/values in host memory, the automatic choice of stages, segments and tiles, the longest row
that fits (the host included where its size is given), cuDNN asked in the run's dtype; and the
one-line error of a run that runs out of GPU memory anyway, naming the action and the plan's
peak. The runs that train long rows against the reference: tests/one_process/test_long_rows.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import pipeline.stage.attention as attention
from pipeline.stage.segments import SegmentStage
from tests.helpers.runs import tiny_cfg


def _long_cfg(**kw):
    from pipeline.config import make_config as cfg_of

    base = dict(model="llama-3b", dataset="synthetic", allow_long_sequences=True, seq_length=131072, batch_size=1,
                num_chunks=1, num_stages=26, device="cuda", dtype="bfloat16", use_offload=True, resident_stages=0,
                activation_checkpointing=True, activation_offload=True, gpu_memory_gb=24.0)
    return cfg_of({**base, **kw})


def _peak(cfg):
    from pipeline.plan.source import preset_config
    from pipeline.plan.fit import memory_plan
    from schedule import round_robin

    ranks, _ = memory_plan(cfg, preset_config(cfg.model), round_robin(cfg.num_stages, 1), "cuda")
    return ranks[0]


def test_plan_counts_tiles_and_keys_in_host_memory():
    """A tiled MLP leaves one tile's intermediates in a backward's transient (128K tokens: the
    untiled eager layer's four saved 2.1 GiB tensors and its backward's three more are what it
    saves, less a tile's backward; the norms' float32 backward is the tiled layer's peak then);
    with segments the carried keys/values of every stage but its first layer's wait in host memory,
    not on the device."""
    untiled = _peak(_long_cfg(tiled_mlp="false", compile_layers="false"))
    tiles = _peak(_long_cfg(tiled_mlp="true"))
    assert tiles.parts["transient"] < untiled.parts["transient"] - 2 * 2**30, (tiles.parts, untiled.parts)
    seg = _peak(_long_cfg(tiled_mlp="true", seq_chunks=8, num_stages=13))
    kv_row = 26 * 2 * 2 * 3200 * 131072  # every layer's keys and values of the whole row, bf16
    # two layers a stage: the second's wait in host memory, the first's are made again from the inputs
    assert 0.3 * kv_row < seg.host_parts["carried_kv"] < 0.5 * kv_row, seg.host_parts
    assert seg.parts["activations"] < 0.2 * kv_row, seg.parts  # on the device: a stage's sweep at most
    assert _peak(_long_cfg(tiled_mlp="true", seq_chunks=8)).host_parts["carried_kv"] == 0  # one layer a stage


def test_mlp_tile_mib_sizes_the_tiles_the_run_and_the_plan_take():
    """``mlp_tile_mib``: twice the MiB, twice the tokens a tile (llama-3b in bf16: 15534 at the
    default 256), in the run's kernels and in what the plan walks (test_config: 0 is refused)."""
    from pipeline.plan.fit import memory_inputs, plan_spec
    from pipeline.plan.source import preset_config
    from schedule import round_robin

    hf = preset_config("llama-3b")
    for mib, tokens in ((256.0, 15534), (512.0, 31068)):
        spec = plan_spec(_long_cfg(tiled_mlp="true", mlp_tile_mib=mib), hf, 1, "cuda")
        inp, _ = memory_inputs(spec, round_robin(spec.num_stages, 1))
        assert spec.kernels.mlp_tile_tokens == inp.mlp_tile_tokens == tokens


def test_automatic_choice_takes_the_first_that_fits():
    """Whole rows before segments, untiled before tiled, the fewest stages: each choice fits and
    one stage fewer would not."""
    from pipeline.plan.source import preset_config
    from pipeline.plan.fit import assess
    from pipeline.plan.long_rows import resolve_long_rows
    from schedule import round_robin

    hf = preset_config("llama-3b")
    fits = lambda c: assess(c, hf, round_robin(c.num_stages, 1)).gpu_fits  # noqa: E731
    chosen = {}
    for n, cap in ((16384, 24.0), (131072, 24.0), (131072, 16.0)):
        cfg, line = resolve_long_rows(_long_cfg(seq_length=n, num_stages=-1, seq_chunks=-1, gpu_memory_gb=cap), hf, 1)
        assert fits(cfg) and "the first that fits" in line, line
        assert cfg.num_stages == 1 or not fits(dataclasses.replace(cfg, num_stages=cfg.num_stages - 1))
        chosen[(n, cap)] = (cfg.seq_chunks, cfg.tiled_mlp)
    # 128K: whole rows do not fit 90% of 24 GiB (a tiled layer's norms back-propagate in float32)
    assert chosen[(16384, 24.0)] == (1, "false") and chosen[(131072, 24.0)] == (2, "true"), chosen
    assert chosen[(131072, 16.0)][0] > 1, chosen  # whole rows do not fit 16 GiB at 128K: segments
    # set values are kept; without a GPU nothing is searched
    cfg, _ = resolve_long_rows(_long_cfg(seq_length=16384, num_stages=-1, seq_chunks=4), hf, 1)
    assert cfg.seq_chunks == 4
    cfg, line = resolve_long_rows(_long_cfg(num_stages=-1, device="cpu", dtype="float32"), hf, 1)
    assert "no GPU" in line and cfg.seq_chunks == 1


def test_plan_prints_the_longest_row():
    from pipeline.plan.source import preset_config
    from pipeline.plan.long_rows import longest_row, longest_row_line

    cfg = _long_cfg(model="tiny", num_stages=-1, seq_chunks=-1, gpu_memory_gb=1.0)
    tokens, chosen, whole = longest_row(cfg, preset_config("tiny"), 1, limit=2**18)
    assert 1024 <= whole < tokens and chosen.seq_chunks > 1 and chosen.seq_length == tokens, (tokens, chosen, whole)
    line = longest_row_line(cfg, preset_config("tiny"), 1)
    assert line.startswith("longest row that fits 1.00 GiB (1 micro-batch of 1 row") and \
        f"{tokens} tokens with num_stages {chosen.num_stages}, seq_chunks {chosen.seq_chunks}" in line and \
        f"whole rows up to {whole} tokens" in line, line


def test_longest_row_is_what_a_run_of_that_length_accepts(monkeypatch):
    """One search: on a machine with a GPU the host is checked too, and where segments' carried
    keys/values do not fit the host, the longest row is the whole rows' (never shorter); a run of
    that length resolves to a configuration that fits, and one 1024 tokens longer finds none."""
    from pipeline.plan import long_rows
    from pipeline.plan.fit import assess
    from pipeline.plan.source import preset_config
    from schedule import round_robin

    monkeypatch.setattr(long_rows, "_fits_here", lambda a, cfg: a.fits)  # the host counts, as on the GPU machine
    hf = preset_config("llama-3b")
    cfg = _long_cfg(num_stages=-1, seq_chunks=-1, tiled_mlp="auto", host_memory_gb=100.0)
    tokens, chosen, whole = long_rows.longest_row(cfg, hf, 1, limit=2**19, step=8192)
    assert tokens >= whole > 0, (tokens, whole)
    a = assess(chosen, hf, round_robin(chosen.num_stages, 1))
    assert a.fits and chosen.seq_length == tokens, (a.worst.device_peak, a.total_host)
    longer, _ = long_rows.resolve_long_rows(dataclasses.replace(cfg, seq_length=tokens + 8192), hf, 1)
    assert not assess(longer, hf, round_robin(longer.num_stages, 1)).fits


def test_a_given_host_size_bounds_the_longest_row_on_a_machine_without_a_gpu(monkeypatch):
    """``--plan`` here for another machine whose host memory is given: the longest-row line is what
    the plan accepts at that length, host included (LoRA of Llama-3-8B at 24 GiB and 123 GiB of host
    memory: the GPU alone took 464,896 tokens, whose plan then needed 133.5 GiB of host memory), and
    the line says the host is counted."""
    from pipeline.plan import long_rows
    from pipeline.plan.fit import assess
    from pipeline.plan.source import preset_config
    from schedule import round_robin

    hf = preset_config("llama-3-8b")
    cfg = _long_cfg(model="llama-3-8b", num_stages=-1, seq_chunks=-1, tiled_mlp="auto", host_memory_gb=40.0,
                    lora_rank=16, lora_target_modules="all-linear")
    found = long_rows.longest_row(cfg, hf, 1, limit=2**19, step=16384)
    tokens, chosen, _ = found
    a = assess(chosen, hf, round_robin(chosen.num_stages, 1))
    assert tokens > 0 and a.fits and a.gpu_fits, (tokens, a.total_host / 2**30)
    # one step longer the host does not hold the plan, though the GPU alone would: the host is what
    # bounds it here (the GPU alone's search would go further)
    longer = dataclasses.replace(cfg, seq_length=tokens + 16384)
    with_host, _ = long_rows.resolve_long_rows(longer, hf, 1)
    assert not assess(with_host, hf, round_robin(with_host.num_stages, 1)).fits
    gpu_only, _ = long_rows.resolve_long_rows(dataclasses.replace(longer, host_memory_gb=0.0), hf, 1)
    assert assess(gpu_only, hf, round_robin(gpu_only.num_stages, 1)).gpu_fits, gpu_only
    # the line's search is the one above, in finer steps: its head is what this test reads
    monkeypatch.setattr(long_rows, "longest_row", lambda *args, **kw: found)
    assert "fits 24.00 GiB and 40.00 GiB of host memory" in long_rows.longest_row_line(cfg, hf, 1)


def test_out_of_memory_line_names_the_action_the_plan_and_a_change():
    from types import SimpleNamespace

    from pipeline.plan.source import preset_config
    from pipeline.plan.fit import out_of_memory_line, plan_spec
    from schedule import round_robin

    cfg = _long_cfg(tiled_mlp="true")
    err = SimpleNamespace(rank=0, action="24B0", text="backward of stage 24, micro-batch 0", tried=3 * 2**30,
                          allocated=19 * 2**30, reserved=20 * 2**30)
    line = out_of_memory_line(err, plan_spec(cfg, preset_config("llama-3b"), 1), round_robin(26, 1))
    assert "\n" not in line
    for needle in ("rank 0 ran out of GPU memory in action 24B0 (backward of stage 24", "asked for 3.00 GiB",
                   "19.00 GiB allocated", "of a 24.00 GiB cap", "the plan's peak for this rank was",
                   "to leave that margin, try seq_chunks: 2"):
        assert needle in line, (needle, line)


def test_out_of_memory_is_one_line_error(tiny_model_dir, monkeypatch):
    """The executor turns an out-of-memory error into OutOfMemory naming the action; train() into
    one TrainingError line (main.py prints it as one error: line)."""
    from pipeline.dist import DistEnv
    from pipeline.run.metrics import TrainingError
    from pipeline.train import train

    real = SegmentStage.recompute_forward

    def oom(self, mb, seg, *a, **kw):
        if self.stage.index == 1 and seg == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.15 GiB. GPU 0 has a total capacity")
        return real(self, mb, seg, *a, **kw)

    monkeypatch.setattr(SegmentStage, "recompute_forward", oom)
    cfg = tiny_cfg(tiny_model_dir, seq_chunks=3, activation_offload=True, use_offload=True, num_iterations=1)
    with pytest.raises(TrainingError) as e:
        train(cfg, DistEnv(0, 1, 0, 1))
    msg = str(e.value)
    assert "\n" not in msg and "in action 1B0.1 (backward of stage 1, micro-batch 0, segment 1" in msg, msg
    assert "asked for 3.15 GiB" in msg and "the plan's peak for this rank was" in msg, msg


def test_the_plan_asks_the_gpu_for_cudnn_in_the_dtype_it_will_compute_in(monkeypatch, tiny_model_dir):
    """With ``dtype: auto`` (the default) on a GPU, the plan asks whether cuDNN takes bfloat16
    rows: the question is put with the device the run will compute on, not the plan's device
    name (a string, which ``compute_dtype`` cannot read)."""
    from transformers import AutoConfig

    from pipeline.plan import fit

    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(attention, "cudnn_takes", lambda device, dtype, *shape: asked.append((device, dtype)) or True)
    cfg = tiny_cfg(tiny_model_dir, dtype="auto", device="cuda", attn_implementation="auto")
    assert fit.plan_spec(cfg, AutoConfig.from_pretrained(tiny_model_dir), 1, "cuda").kernels.cudnn
    assert asked == [(torch.device("cuda", 0), torch.bfloat16)]
