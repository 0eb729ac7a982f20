"""Long rows, one process, float32: every path that splits a row trains exactly like the unsplit model.

* Segment attention through the kernels' dispatch (``pipeline.stage.attention``): on the CPU the
  bottom-right-aligned causal kernel runs as torch's materialised form of it, which checks the
  alignment the GPU kernels get; the explicit-mask reference path is the default on the CPU.
* Carried keys/values in host memory (``offload.kv``) between a stage's forwards and backwards.
* Tiled MLPs (``pipeline.stage.tiled``).
* The trainer with all of them, against plain Hugging Face training, for gpipe, 1f1b and
  interleaved, with and without parameter offload, with sliding windows and packed rows (over two
  processes: tests/multi_process/test_gloo_long_rows.py).

Mutations (a segment attending one key too many or too few, keys/values brought back from the
wrong place, a lost key/value gradient, a dropped MLP tile) fail the same comparisons. The plan
(tiles, keys/values in host memory, the automatic choices, the longest row) and the one-line
out-of-memory error are checked without a GPU. Tolerances as tests/one_process/test_segments.py: relative
to the norm, at the float32 noise of each gradient.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

import pipeline.spec.shapes as shapes
import pipeline.stage.attention as attention
import pipeline.stage.segments as segments
import pipeline.stage.tiled as tiled
from offload.kv import CarriedKV
from pipeline.spec.shapes import segment_bounds
from pipeline.stage.model import build_stage
from pipeline.stage.segments import SegmentStage
from tests.helpers.reference import assert_same_training, reference_train, train_in_process
from tests.helpers.runs import tiny_cfg
from tests.helpers.segments import (LENGTHS, LONG, TOL, make_batch, make_config, make_stages, mismatch, noise_floor,
                                    reference, rel, run_segments)

EQUAL = LENGTHS["equal"]  # 4 x 24: segments of one shape, so a mix-up shows in the numbers


# --- attention: the kernels' dispatch ------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "llama_tied"])
def test_segment_kernels_equal_the_unsplit_row(arch):
    """Segments 1.. take the bottom-right-aligned causal kernel, segment 0 the causal one."""
    config = make_config(arch, "sdpa")  # GQA: the keys are grouped
    (stage,) = make_stages(config)
    x, targets = make_batch(config.vocab_size)
    ref = reference(stage, x, targets)
    floor = noise_floor(stage, x, targets, ref)
    attention.KERNEL_CALLS.clear()
    with attention.kernels("kernels"):
        got = run_segments(stage, x, targets, LENGTHS["balanced"])
    assert attention.KERNEL_CALLS["lower_right"] > 0 and attention.KERNEL_CALLS["causal"] > 0, attention.KERNEL_CALLS
    assert attention.KERNEL_CALLS["reference"] == 0
    assert not mismatch(ref, got, floor), mismatch(ref, got, floor)


def _shifted_lower_right(n: int):
    """The segment kernel with its diagonal moved by ``n`` keys (1: one key too many; -1: too few)."""
    def kernel(query, key, value, dropout, scale, gqa):
        tq, tk = query.shape[-2], key.shape[-2]
        allowed = torch.ones(tq, tk, dtype=torch.bool).tril(diagonal=tk - tq + n)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scale, enable_gqa=gqa)

    return kernel


def _shifted_attend_mask(n: int):
    real = attention.attend_mask

    def mask(seq_len, device, window=None, q_start=0):
        allowed = real(seq_len, device, window, q_start)
        q = torch.arange(q_start, seq_len)[:, None]
        k = torch.arange(seq_len)[None, :]
        return allowed | (k == q + 1) if n > 0 else allowed & (k != q)

    return mask


@pytest.mark.parametrize("n", [1, -1])
def test_one_key_too_many_or_too_few_fails(n, monkeypatch):
    config = make_config("llama", "sdpa")
    (stage,) = make_stages(config)
    x, targets = make_batch(config.vocab_size)
    ref = reference(stage, x, targets)
    with monkeypatch.context() as m:  # the kernel path
        m.setattr(attention, "lower_right", _shifted_lower_right(n))
        with attention.kernels("kernels"):
            assert mismatch(ref, run_segments(stage, x, targets, EQUAL))
    with monkeypatch.context() as m:  # the reference path (the explicit mask)
        m.setattr(attention, "attend_mask", _shifted_attend_mask(n))
        assert mismatch(ref, run_segments(stage, x, targets, EQUAL))


def test_attention_mask_checks_its_shape():
    mask = attention.AttnMask(24, 48)
    q, k = torch.randn(1, 2, 20, 8), torch.randn(1, 2, 48, 8)
    with pytest.raises(RuntimeError, match="queries 24..47 over 48 keys, given 20 queries"):
        attention.attention(type("M", (), {"num_key_value_groups": 1, "is_causal": True})(), q, k, k, mask)


def test_windows_and_records_take_the_reference_on_the_cpu():
    """And on a GPU, flex for windows and records over at least one flex block of keys."""
    assert attention.choose(attention.AttnMask(0, 96), torch.device("cpu")) == "causal"
    assert attention.choose(attention.AttnMask(0, 96, window=100), torch.device("cpu")) == "causal"
    assert attention.choose(attention.AttnMask(24, 96), torch.device("cpu")) == "reference"
    assert attention.choose(attention.AttnMask(0, 96, window=32), torch.device("cpu")) == "reference"
    assert attention.choose(attention.AttnMask(24, 160, window=32), torch.device("cuda")) == "flex"
    assert attention.choose(attention.AttnMask(0, 128, doc_ids=torch.zeros(1, 128)), torch.device("cuda")) == "flex"
    assert attention.choose(attention.AttnMask(24, 127, window=32), torch.device("cuda")) == "reference"
    assert attention.choose(attention.AttnMask(24, 96), torch.device("cuda")) == "lower_right"
    with attention.kernels("reference"):
        assert attention.choose(attention.AttnMask(24, 96), torch.device("cuda")) == "reference"


# --- carried keys/values in host memory ----------------------------------------------------------
def run_two_microbatches(stage, x, targets, lengths, kv: CarriedKV | None, prefetch: bool = True):
    """activation_offload's order for two micro-batches of the rows: every forward (no graph),
    then each micro-batch's backwards, last segment first, each recomputing its segment; with
    ``prefetch`` the micro-batch's keys/values are asked back one backward early."""
    stage.zero_grad(set_to_none=True)
    runner = SegmentStage(stage, lengths, recompute=True, kv_host=kv)
    half = x.shape[0] // 2
    rows = [slice(0, half), slice(half, None)]
    bounds = segment_bounds(lengths)
    loss = 0
    with torch.no_grad():
        for mb, r in enumerate(rows):
            for j, (a, b) in enumerate(bounds):
                loss = loss + runner.forward(mb, j, x[r, a:b], targets[r, a:b])
            if kv is not None:  # the micro-batch's keys/values went to host memory after its last forward
                assert (stage.index, mb) in kv
    if kv is not None:
        assert kv.host_bytes() > 0
    for mb, r in enumerate(rows):
        for j in reversed(range(len(bounds))):
            a, b = bounds[j]
            runner.recompute_forward(mb, j, x[r, a:b], targets[r, a:b])
            runner.backward(mb, j)
            if prefetch and j == 0 and mb == 0:
                runner.prefetch(1)
    assert not runner.carry and not runner.saved
    if kv is not None:
        assert not (stage.index, 0) in kv and not (stage.index, 1) in kv
    return loss.detach(), {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("prefetch", [True, False])
def test_carried_keys_and_values_in_host_memory(prefetch):
    config = make_config("mistral", "sdpa")  # GQA and a window across segments
    (stage,) = make_stages(config)
    x, targets = make_batch(config.vocab_size, rows_len=(96, 70, 50, 20))
    ref = reference(stage, x, targets)
    floor = noise_floor(stage, x, targets, ref)
    got = run_two_microbatches(stage, x, targets, LENGTHS["balanced"], CarriedKV(torch.device("cpu")), prefetch)
    assert not mismatch(ref, got, floor), mismatch(ref, got, floor)


def test_keys_and_values_brought_back_wrong_fail(monkeypatch):
    """Control, then: every leaf brought back with another leaf's keys (same shapes: equal
    segments), zeros brought back, and the key/value gradients lost."""
    config = make_config("llama", "sdpa")
    (stage,) = make_stages(config)
    x, targets = make_batch(config.vocab_size, rows_len=(96, 70, 50, 20))
    ref = reference(stage, x, targets)
    run = lambda: run_two_microbatches(stage, x, targets, EQUAL, CarriedKV(torch.device("cpu")))  # noqa: E731
    assert not mismatch(ref, run())
    offload = CarriedKV.offload

    def swapped(self, key, leaves):
        offload(self, key, leaves)
        pairs = self._host[key]
        self._host[key] = list(zip([leaf for leaf, _ in pairs], [h for _, h in pairs][::-1]))

    def zeroed(self, key, leaves):
        offload(self, key, leaves)
        for _, host in self._host[key]:
            host.zero_()

    for patch in (swapped, zeroed):
        with monkeypatch.context() as m:
            m.setattr(CarriedKV, "offload", patch)
            assert mismatch(ref, run()), patch.__name__  # the recompute attends to other keys than the forward
    with monkeypatch.context() as m:
        m.setattr(segments, "kv_gradients", lambda new, carry, seg: ([], []))
        got = run()
        assert rel(got[0], ref[0]) < TOL and any("k_proj" in line or "v_proj" in line for line in mismatch(ref, got))


def test_offload_needs_recompute():
    config = make_config("llama", "sdpa")
    (stage,) = make_stages(config)
    with pytest.raises(ValueError, match="only with recompute"):
        SegmentStage(stage, EQUAL, kv_host=CarriedKV(torch.device("cpu")))


# --- tiled MLPs ------------------------------------------------------------------------------------
def _tiled_stage(config, plain, tokens: int, checkpointing: bool = False):
    stage = build_stage(config, 0, 1, range(config.num_hidden_layers), model_dir=None, seed=0,
                        checkpointing=checkpointing, mlp_tile_tokens=tokens)
    stage.load_state_dict(plain.state_dict())
    return stage


@pytest.mark.parametrize("arch,checkpointing", [("llama", False), ("mistral", True), ("qwen2_sliding", False)])
def test_tiled_mlp_equals_the_untiled(arch, checkpointing):
    """Tiles of 10 tokens over 3 rows of 96 (28 whole tiles and one of 8): whole rows, with
    checkpointed layers re-running their tiles, and sequence segments through tiled MLPs."""
    config = make_config(arch, "sdpa")
    (plain,) = make_stages(config)
    stage = _tiled_stage(config, plain, 10, checkpointing)
    x, targets = make_batch(config.vocab_size)
    ref = reference(plain, x, targets)
    floor = noise_floor(plain, x, targets, ref)
    calls = []
    real = tiled.TiledForward.run_tile
    with pytest.MonkeyPatch.context() as m:
        m.setattr(tiled.TiledForward, "run_tile", lambda self, t: calls.append(t.shape[0]) or real(self, t))
        got = reference(stage, x, targets)
        assert not mismatch(ref, got, floor), mismatch(ref, got, floor)
        assert 8 in calls and max(calls) == 10, sorted(set(calls))
        got = run_segments(stage, x, targets, LENGTHS["balanced"])
        assert not mismatch(ref, got, floor), mismatch(ref, got, floor)
    with torch.no_grad():
        torch.testing.assert_close(stage(x), plain(x), rtol=1e-5, atol=1e-5)


def test_a_pass_no_longer_than_a_tile_keeps_no_mlp_intermediates():
    """The plan counts a tiled MLP's pass shorter than a tile as one recomputed tile; kept
    intermediates (intermediate_size wide) in a fused last stage put a 4-bit 70B run at 4K tokens
    over its plan."""
    config = make_config("llama", "sdpa")
    (plain,) = make_stages(config)
    x, targets = make_batch(config.vocab_size)
    stage = _tiled_stage(config, plain, x.numel())
    widths = []

    def keep(t):
        widths.append(t.shape[-1] if t.dim() else 0)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        got = reference(stage, x, targets)
    assert config.intermediate_size not in widths, sorted(set(widths))
    ref = reference(plain, x, targets)
    assert not mismatch(ref, got, noise_floor(plain, x, targets, ref))


def test_a_dropped_tile_fails(monkeypatch):
    config = make_config("llama", "sdpa")
    (plain,) = make_stages(config)
    stage = _tiled_stage(config, plain, 10)
    x, targets = make_batch(config.vocab_size)
    ref = reference(plain, x, targets)
    real = tiled.TiledForward.run_tile
    calls = [0]

    def second(self, t) -> bool:  # each layer's second tile of 29 (tokens 10-19 of the first row)
        calls[0] += 1
        return calls[0] % 29 == 2

    def no_gradient(self, t):  # its output cut from the graph
        out = real(self, t)
        return out.detach() if second(self, t) else out

    def zeroed(self, t):
        out = real(self, t)
        return torch.zeros_like(out) if second(self, t) else out

    monkeypatch.setattr(tiled.TiledForward, "run_tile", no_gradient)
    got = reference(stage, x, targets)
    assert rel(got[0], ref[0]) < TOL and any("mlp" in line for line in mismatch(ref, got))
    monkeypatch.setattr(tiled.TiledForward, "run_tile", zeroed)
    assert rel(reference(stage, x, targets)[0], ref[0]) >= TOL


# --- the trainer: everything together, against plain training --------------------------------------
@contextlib.contextmanager
def small_tiles(monkeypatch, counts: dict):
    """MLP tiles of 10 tokens for the tiny model (float32, intermediate 128), and counters of the
    tiles run and the keys/values sent to host memory."""
    monkeypatch.setattr(shapes, "MLP_TILE_BYTES", 10 * 4 * 128)
    real_tile, real_offload = tiled.TiledForward.run_tile, CarriedKV.offload

    def tile(self, t):
        counts["tiles"] = counts.get("tiles", 0) + 1
        return real_tile(self, t)

    def offload(self, key, leaves):
        counts["kv"] = counts.get("kv", 0) + 1
        return real_offload(self, key, leaves)

    monkeypatch.setattr(tiled.TiledForward, "run_tile", tile)
    monkeypatch.setattr(CarriedKV, "offload", offload)
    yield


@functools.lru_cache(maxsize=None)
def _sdpa_reference(model_dir: str):
    """Plain training of the tiny model with sdpa attention (what every long-row run here
    reproduces: schedules, segments, offload and tiles change nothing of it)."""
    return reference_train(tiny_cfg(model_dir, attn_implementation="sdpa"), model_dir)


@pytest.mark.parametrize("schedule,offload,kw", [
    ("interleaved", True, LONG),
    pytest.param("1f1b", True, dict(tiled_mlp="true", activation_checkpointing=True),  # whole rows, tiled, checkpointed
                 marks=pytest.mark.slow),
    pytest.param("gpipe", False, LONG, marks=pytest.mark.slow),
    pytest.param("gpipe", True, LONG, marks=pytest.mark.slow),
    pytest.param("1f1b", False, LONG, marks=pytest.mark.slow),
    pytest.param("1f1b", True, LONG, marks=pytest.mark.slow),
    pytest.param("interleaved", False, LONG, marks=pytest.mark.slow),
    pytest.param("gpipe", True, dict(tiled_mlp="true", activation_offload=True, activation_checkpointing=True),
                 marks=pytest.mark.slow),
])
def test_long_rows_train_like_the_reference(tiny_model_dir, monkeypatch, schedule, offload, kw):
    counts: dict = {}
    with small_tiles(monkeypatch, counts):
        cfg = tiny_cfg(tiny_model_dir, schedule=schedule, use_offload=offload, attn_implementation="sdpa", **kw)
        run = train_in_process(cfg)
    assert counts.get("tiles", 0) > 0 and (counts.get("kv", 0) > 0) == (kw.get("seq_chunks", 1) > 1), counts
    assert all(stage.mlp_tile_tokens == 10 for stage in run.trainer.stages.values())
    assert_same_training(*run.outcome, *_sdpa_reference(str(tiny_model_dir)))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mistral", "qwen2_sliding"])
def test_sliding_windows_train_like_the_reference(tmp_path_factory, monkeypatch, arch):
    """Windows shorter than the row, crossing segment boundaries, with the carried keys/values in
    host memory and tiled MLPs (sdpa: the explicit-mask reference on the CPU)."""
    from tests.helpers.architectures import make_model, tiny_cfg as arch_cfg

    counts: dict = {}
    path = make_model(arch, str(tmp_path_factory.mktemp("long_models")))
    with small_tiles(monkeypatch, counts):
        # adam_eps 1e-6 as runs.tiny_cfg: a near-zero gradient's step is summation noise at 1e-8
        cfg = arch_cfg(path, attn_implementation="sdpa", schedule="1f1b", use_offload=True, adam_eps=1e-6, **LONG)
        losses, params = train_in_process(cfg).outcome
    assert counts.get("tiles") and counts.get("kv"), counts
    assert_same_training(losses, params, *reference_train(cfg, cfg.model))


@pytest.mark.slow
def test_packed_rows_train_like_the_reference(tiny_model_dir, tmp_path, monkeypatch):
    from tests.helpers.runs import text_records

    counts: dict = {}
    with small_tiles(monkeypatch, counts):
        cfg = tiny_cfg(tiny_model_dir, dataset=text_records(tmp_path / "var.jsonl", 2, 30), packing=True,
                       batch_size=4, num_chunks=2, num_stages=2, schedule="1f1b", use_offload=True,
                       attn_implementation="sdpa", **{**LONG, "seq_chunks": 4})
        losses, params = train_in_process(cfg).outcome
    assert counts.get("tiles") and counts.get("kv"), counts
    assert_same_training(losses, params, *reference_train(cfg, cfg.model))


# --- the plan ----------------------------------------------------------------------------------------
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


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 10), (4, 2, 13), (2, 2, 16)])
def test_padded_causal_attention_equals_the_unpadded(heads, kv_heads, head_dim):
    """The cuDNN path's arithmetic, through the math kernel on the CPU: the head dimension padded
    to a multiple of 8 with zeros and the scale kept at the model's, outputs and q, k, v
    gradients equal unpadded causal attention (float64, grouped keys too)."""
    from torch.nn.attention import SDPBackend

    gen = torch.Generator().manual_seed(head_dim)
    leaves = [torch.randn(2, h, 24, head_dim, generator=gen, dtype=torch.float64, requires_grad=True)
              for h in (heads, kv_heads, kv_heads)]
    up = torch.randn(2, heads, 24, head_dim, generator=gen, dtype=torch.float64)
    results = []
    for fn in (lambda q, k, v: attention.padded_causal(q, k, v, None, SDPBackend.MATH),
               lambda q, k, v: F.scaled_dot_product_attention(
                   q, k, v, is_causal=True, enable_gqa=heads != kv_heads)):
        out = fn(*leaves)
        grads = torch.autograd.grad((out * up).sum(), leaves)
        results.append([out, *grads])
    for a, b in zip(*results):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_whole_rows_take_cudnn_only_on_a_gpu_with_the_auto_backend():
    from pipeline.config import ATTN_BACKENDS

    assert ATTN_BACKENDS == attention.BACKENDS  # the setting's choices are the module's
    assert not attention.cudnn_takes(torch.device("cpu"), torch.bfloat16, 4, 4, 16)
    attention.use_backend("flash")
    try:
        assert not attention.cudnn_takes(torch.device("cuda", 0), torch.bfloat16, 4, 4, 16)
    finally:
        attention.use_backend("auto")
    with pytest.raises(ValueError, match="attention backend"):
        attention.use_backend("cudnn")


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
