"""Long rows, one process, float32: every path that splits a row trains exactly like the unsplit model.

* Segment attention through the kernels' dispatch (``pipeline.stage.attention``): on the CPU the
  bottom-right-aligned causal kernel runs as torch's materialised form of it, which checks the
  alignment the GPU kernels get; the explicit-mask reference path is the default on the CPU.
* Carried keys/values in host memory (``offload.kv``) between a stage's forwards and backwards.
* Tiled MLPs (``pipeline.stage.tiled``).
* The trainer with all of them, against plain Hugging Face training, for gpipe, 1f1b and
  interleaved, with and without parameter offload, with sliding windows and packed rows (over two
  processes: tests/multi_process/test_gloo_long_rows.py).
* Whole rows through cuDNN: its padded causal kernel's arithmetic, and when a run takes it.

Mutations (a segment attending one key too many or too few, keys/values brought back from the
wrong place, a lost key/value gradient, a dropped MLP tile) fail the same comparisons. The plan of
long rows and the one-line out-of-memory error: tests/one_process/test_long_rows_plan.py.
Tolerances as tests/one_process/test_segments.py: relative to the norm, at the float32 noise of
each gradient.
"""
from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F

import pipeline.stage.attention as attention
import pipeline.stage.segments as segments
import pipeline.stage.tiled as tiled
from offload.kv import CarriedKV
from pipeline.spec.shapes import segment_bounds
from pipeline.stage.model import build_stage
from pipeline.stage.segments import SegmentStage
from tests.helpers.reference import assert_same_training, reference_train, train_in_process
from tests.helpers.runs import tiny_cfg
from tests.helpers.segments import (LENGTHS, LONG, TINY_TILE_MIB, TOL, make_batch, make_config, make_stages,
                                    mismatch, noise_floor, reference, rel, run_segments)

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
    """Counters of the MLP tiles run and the keys/values sent to host memory (the runs' tiles of
    10 tokens: ``mlp_tile_mib`` TINY_TILE_MIB)."""
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
    # whole rows, tiled, checkpointed
    pytest.param("1f1b", True, dict(tiled_mlp="true", mlp_tile_mib=TINY_TILE_MIB, activation_checkpointing=True),
                 marks=pytest.mark.slow),
    pytest.param("gpipe", False, LONG, marks=pytest.mark.slow),
    pytest.param("gpipe", True, LONG, marks=pytest.mark.slow),
    pytest.param("1f1b", False, LONG, marks=pytest.mark.slow),
    pytest.param("1f1b", True, LONG, marks=pytest.mark.slow),
    pytest.param("interleaved", False, LONG, marks=pytest.mark.slow),
    pytest.param("gpipe", True, dict(tiled_mlp="true", mlp_tile_mib=TINY_TILE_MIB, activation_offload=True,
                                     activation_checkpointing=True),
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
    from tests.helpers.architectures import arch_cfg, make_model

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


# --- whole rows through cuDNN ----------------------------------------------------------------------
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
