"""The core guarantee: pipeline training == ordinary single-process training of the HF model.

In-process runs (one process holding every stage) cover each schedule and offload mode
quickly; torchrun runs over gloo (2 and 4 processes with 2 virtual stages each) are in
tests/multi_process/test_gloo_equivalence.py. The
mutation tests show the comparison fails when a micro-batch meets the wrong labels, a
stage's gradient is lost, or a layer is skipped.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.reference import (assert_same_training, in_process_trainer, reference_train, train_in_process,
                                    trained)
from tests.helpers.runs import ITERS, expect_mismatch, reference_result, tiny_cfg


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
@pytest.mark.parametrize("offload,prefetch", [(False, False), (True, False), (True, True)])
def test_in_process_matches_reference(tiny_model_dir, schedule, offload, prefetch):
    cfg = tiny_cfg(tiny_model_dir, schedule=schedule, use_offload=offload, use_prefetch=prefetch)
    assert_same_training(*train_in_process(cfg).outcome, *reference_result(str(tiny_model_dir)))


@pytest.mark.parametrize("schedule,resident", [("gpipe", 1), ("interleaved", 3), ("1f1b", 2)])
@pytest.mark.parametrize("grad_clip", [1.0, pytest.param(0.0, marks=pytest.mark.slow)])
def test_resident_stages_match_reference(tiny_model_dir, schedule, resident, grad_clip):
    """Offload with some stages kept resident (their AdamW on the device, the others' on the
    optimizer thread): the training is the same, with and without the clipping norm."""
    cfg = tiny_cfg(tiny_model_dir, schedule=schedule, use_offload=True, resident_stages=resident, grad_clip=grad_clip)
    trainer = in_process_trainer(cfg)
    assert sorted(s for s, st in trainer.stores.items() if not st.offload) == list(range(resident))
    run = trained(trainer)
    ref = reference_train(tiny_cfg(tiny_model_dir, grad_clip=grad_clip), str(tiny_model_dir)) if grad_clip == 0.0 \
        else reference_result(str(tiny_model_dir))
    assert_same_training(*run.outcome, *ref)


@pytest.mark.parametrize("schedule,resident,device_steps", [("interleaved", 1, 2), ("gpipe", 0, 1)])
@pytest.mark.parametrize("grad_clip", [1.0, pytest.param(0.0, marks=pytest.mark.slow)])
def test_device_steps_match_reference(tiny_model_dir, schedule, resident, device_steps, grad_clip):
    """Offload with the last offloaded stages of each process stepped on the device
    (``device_steps``; the same kernel on the CPU) beside the others' CPU steps: the training is
    the same, with the clipping norm and without it (then each device step follows its
    stage's gradient offload during the backward)."""
    cfg = tiny_cfg(tiny_model_dir, schedule=schedule, use_offload=True, resident_stages=resident,
                   device_steps=device_steps, grad_clip=grad_clip)
    trainer = in_process_trainer(cfg)
    stepped = sorted(s for s, st in trainer.stores.items() if st.offload and st.residency.device_step)
    assert stepped == list(range(cfg.num_stages - device_steps, cfg.num_stages))
    run = trained(trainer)
    ref = reference_train(tiny_cfg(tiny_model_dir, grad_clip=grad_clip), str(tiny_model_dir)) if grad_clip == 0.0 \
        else reference_result(str(tiny_model_dir))
    assert_same_training(*run.outcome, *ref)


@pytest.mark.parametrize("schedule", ["gpipe", "interleaved"])
@pytest.mark.slow
def test_checkpointing_matches_reference(tiny_model_dir, schedule):
    """Activation checkpointing recomputes every layer, and the last stage's head and loss, in
    the backward: the training is the same."""
    cfg = tiny_cfg(tiny_model_dir, schedule=schedule, use_offload=True, activation_checkpointing=True)
    assert_same_training(*train_in_process(cfg).outcome, *reference_result(str(tiny_model_dir)))


@pytest.mark.slow
def test_compiled_layers_match_reference(tiny_model_dir):
    """``compile_layers``: every decoder layer through torch.compile (inductor's C++ kernels
    here), with offload (weights rebound at every LOAD), kept and recomputed layers: the
    training is the same, and one graph serves every layer."""
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    cfg = tiny_cfg(tiny_model_dir, schedule="1f1b", num_stages=2, use_offload=True, activation_checkpointing=True,
                   keep_layers=1, compile_layers="true")
    trainer = in_process_trainer(cfg)
    run = trained(trainer)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1
    assert_same_training(*run.outcome, *reference_result(str(tiny_model_dir)))


@pytest.mark.parametrize("schedule,keep", [("1f1b", 1), pytest.param("gpipe", 2, marks=pytest.mark.slow)])
def test_kept_layers_match_reference(tiny_model_dir, schedule, keep):
    """Checkpointing that keeps some layers' activations (``keep_layers``: the stages' last
    layers run without recompute) trains the same."""
    cfg = tiny_cfg(tiny_model_dir, schedule=schedule, num_stages=2, use_offload=True, activation_checkpointing=True,
               keep_layers=keep)
    trainer = in_process_trainer(cfg)
    last = cfg.num_stages - 1  # fused: it recomputes none
    assert all(stage.recomputed == (0 if s == last else len(stage.model.layers) - keep)
               for s, stage in trainer.stages.items())
    run = trained(trainer)
    assert_same_training(*run.outcome, *reference_result(str(tiny_model_dir)))


def test_chunked_loss_matches_reference(tiny_model_dir, monkeypatch):
    """Checkpointed, the last stage's head and loss run in chunks of tokens (7 here, which do not
    divide a micro-batch's 128): the training is the same, every token counted once."""
    import pipeline.stage.model as model_mod

    calls = []
    real = model_mod.checkpoint
    monkeypatch.setattr(model_mod, "loss_chunk_tokens", lambda vocab: 7)
    monkeypatch.setattr(model_mod, "checkpoint",
                        lambda fn, *a, **kw: calls.append(getattr(fn, "__name__", "")) or real(fn, *a, **kw))
    cfg = tiny_cfg(tiny_model_dir, schedule="1f1b", num_stages=2, activation_checkpointing=True,
                   fuse_last_stage="false")
    trainer = in_process_trainer(cfg)
    run = trained(trainer)
    assert calls.count("_loss") == ITERS * cfg.num_chunks * -(-cfg.batch_size // cfg.num_chunks * cfg.seq_length // 7)
    assert_same_training(*run.outcome, *reference_result(str(tiny_model_dir)))


@pytest.mark.parametrize("schedule,offload,checkpointing", [
    ("1f1b", True, True), ("gpipe", False, False),
    pytest.param("interleaved", True, False, marks=pytest.mark.slow),
    pytest.param("gpipe", True, True, marks=pytest.mark.slow)])
def test_fused_last_stage_matches_reference(tiny_model_dir, monkeypatch, schedule, offload, checkpointing):
    """``fuse_last_stage``: the last stage's forward runs its loss (in chunks of 7 tokens, which
    do not divide a micro-batch's 128) and its backward at once; nothing of it is checkpointed,
    every token's loss is differentiated once, and the training is the same."""
    import pipeline.stage.model as model_mod

    losses_made, checkpointed = [], []
    real_loss, real_checkpoint = model_mod.Stage._loss, model_mod.checkpoint
    monkeypatch.setattr(model_mod, "loss_chunk_tokens", lambda vocab: 7)
    monkeypatch.setattr(model_mod.Stage, "_loss",
                        lambda self, h, t: losses_made.append(t.numel()) or real_loss(self, h, t))
    # what is checkpointed: a layer (a partial of the module) or the loss (the bound method)
    monkeypatch.setattr(model_mod, "checkpoint", lambda fn, *a, **kw: checkpointed.append(getattr(fn, "func", fn))
                        or real_checkpoint(fn, *a, **kw))
    cfg = tiny_cfg(tiny_model_dir, schedule=schedule, use_offload=offload, activation_checkpointing=checkpointing,
                   fuse_last_stage="true")
    trainer = in_process_trainer(cfg)
    run = trained(trainer)
    tokens = cfg.batch_size // cfg.num_chunks * cfg.seq_length
    assert losses_made == ITERS * cfg.num_chunks * ([7] * (tokens // 7) + [tokens % 7])
    last = trainer.stages[cfg.num_stages - 1]
    assert not any(fn in list(last.model.layers.values()) or getattr(fn, "__name__", "") == "_loss"
                   for fn in checkpointed)
    assert bool(checkpointed) == checkpointing  # the other stages still recompute theirs
    assert_same_training(*run.outcome, *reference_result(str(tiny_model_dir)))


@pytest.mark.parametrize("schedule,offload", [
    ("interleaved", True), pytest.param("1f1b", False, marks=pytest.mark.slow),
    pytest.param("gpipe", False, marks=pytest.mark.slow), pytest.param("gpipe", True, marks=pytest.mark.slow),
    pytest.param("1f1b", True, marks=pytest.mark.slow), pytest.param("interleaved", False, marks=pytest.mark.slow)])
def test_activation_offload_matches_reference(tiny_model_dir, schedule, offload):
    """activation_offload: forwards build no graph, each stage input waits in the stash, and
    every backward recomputes its stage whole (no layer checkpointed again): the same training."""
    cfg = tiny_cfg(tiny_model_dir, schedule=schedule, use_offload=offload, activation_offload=True)
    trainer = in_process_trainer(cfg)
    assert all(stage.recomputed == 0 for stage in trainer.stages.values())
    run = trained(trainer)
    assert len(trainer.executor.runners.stash) == 0  # every input went back to its backward
    assert_same_training(*run.outcome, *reference_result(str(tiny_model_dir)))


@pytest.mark.slow
def test_activation_offload_with_checkpointed_loss_matches_reference(tiny_model_dir):
    """With activation_checkpointing too, the last stage's loss stays chunked and checkpointed
    inside the recompute; the layers are recomputed once."""
    cfg = tiny_cfg(tiny_model_dir, schedule="1f1b", use_offload=True, activation_offload=True,
                   activation_checkpointing=True)
    assert_same_training(*train_in_process(cfg).outcome, *reference_result(str(tiny_model_dir)))


@pytest.mark.slow
def test_truncated_model_matches_reference(tiny_model_dir):
    cfg = tiny_cfg(tiny_model_dir, num_layers=3, num_stages=5, schedule="1f1b")
    assert_same_training(*train_in_process(cfg).outcome, *reference_result(str(tiny_model_dir), 3))


# --- the comparison must be able to fail -------------------------------------------------------
def test_detects_wrong_labels(tiny_model_dir, monkeypatch):
    from data import Batch

    original = Batch.microbatches

    def rotated(self, n):  # micro-batch m gets the targets of micro-batch m+1
        mbs = original(self, n)
        targets = [mb.targets for mb in mbs]
        return [Batch(mb.input_ids, mb.labels, targets[(i + 1) % n], mb.num_targets) for i, mb in enumerate(mbs)]

    expect_mismatch(tiny_model_dir, monkeypatch, lambda mp: mp.setattr(Batch, "microbatches", rotated))


def test_detects_another_microbatch_input(tiny_model_dir, monkeypatch):
    """activation_offload: a backward that gets another micro-batch's stage input (the first
    other one of its stage still held) recomputes the wrong forward."""
    from offload.activations import ActivationStash

    original = ActivationStash.restore

    def swapped(self, key):
        held = [k for k in [*self._host, *self._back] if k[0] == key[0] and k != key]
        return original(self, held[0] if held else key)

    expect_mismatch(tiny_model_dir, monkeypatch, lambda mp: mp.setattr(ActivationStash, "restore", swapped),
                    schedule="gpipe", activation_offload=True)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3], ids=["middle", "fused_last"])
def test_detects_lost_gradient(tiny_model_dir, monkeypatch, stage):
    from offload.store import StageStore

    original = StageStore.offload_grads

    def lossy(self, *args, **kw):  # the stage's gradient never reaches the host
        if self.module.index == stage:
            self.grad.zero_()
        original(self, *args, **kw)

    expect_mismatch(tiny_model_dir, monkeypatch, lambda mp: mp.setattr(StageStore, "offload_grads", lossy))


@pytest.mark.slow
def test_detects_lost_gradient_of_a_resident_stage(tiny_model_dir, monkeypatch):
    from offload.store import StageStore

    original = StageStore.step

    def lossy(self, *args, **kw):  # the resident stage 0 steps without its gradient
        if not self.offload and self.module.index == 0:
            self.grad.zero_()
        return original(self, *args, **kw)

    expect_mismatch(tiny_model_dir, monkeypatch, lambda mp: mp.setattr(StageStore, "step", lossy),
                    resident_stages=1)


@pytest.mark.slow
def test_detects_skipped_layer(tiny_model_dir, monkeypatch):
    from pipeline.stage import model as model_mod

    original = model_mod.build_stage

    def skipping(*args, **kw):
        stage = original(*args, **kw)
        layers = list(stage.model.layers.values())
        if layers and stage.index == 1:
            layers[0].forward = lambda h, **_: h  # weights stay, compute is skipped
        return stage

    expect_mismatch(tiny_model_dir, monkeypatch, lambda mp: mp.setattr("pipeline.run.build.build_stage", skipping))


def test_detects_fused_loss_gradient_scaled_wrong(tiny_model_dir, monkeypatch):
    """The fused last stage's backward must scale the loss by 1 / (predicted tokens of the
    batch), as the normalised loss's backward does: counting only the micro-batch's is caught."""
    from pipeline.runners.fused_last import FusedLast

    original = FusedLast._forward_backward

    def per_microbatch(self, key, x):
        it = self.it
        total, it.num_targets = it.num_targets, max(1, int((it.microbatches[key[1]].targets != -100).sum()))
        try:
            original(self, key, x)
        finally:
            it.num_targets = total

    expect_mismatch(tiny_model_dir, monkeypatch, lambda mp: mp.setattr(FusedLast, "_forward_backward", per_microbatch))
