"""float16 compute with dynamic loss scaling: trains like float32 within float16's precision,
and an overflow skips the step on every rank and halves the scale."""
from __future__ import annotations

import pytest
import torch

from pipeline.run.metrics import TrainingError
from pipeline.run.optim import LossScaler
from tests.helpers.reference import in_process_trainer, train_in_process, trained, trainer_masters
from tests.helpers.runs import tiny_cfg


def test_loss_scaler_policy():
    s = LossScaler(1024.0, window=2)
    assert s.update(overflow=True) is True  # a scale overflow: expected, not a fault
    assert s.scale == 512.0
    s.update(False)
    assert s.scale == 512.0
    s.update(False)
    assert s.scale == 1024.0 and s.good_steps == 0
    s.update(False)
    s.update(True)  # an overflow also resets the run of good steps
    assert s.scale == 512.0 and s.good_steps == 0
    fixed = LossScaler(8.0, window=0)
    assert fixed.update(True) is False
    assert fixed.scale == 8.0
    restored = LossScaler(1.0, 2)
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.slow
def test_float16_trains_like_float32(tiny_model_dir, offload):
    full = train_in_process(tiny_cfg(tiny_model_dir, schedule="1f1b", dtype="float32", use_offload=offload))
    half = train_in_process(tiny_cfg(tiny_model_dir, schedule="1f1b", dtype="float16", use_offload=offload))
    assert half.trainer.scaler is not None and not any(h["skipped"] for h in half.history)
    for a, b in zip(half.history, full.history):
        assert abs(a["loss"] - b["loss"]) <= 5e-3 * abs(b["loss"]), (a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 5e-2 * b["grad_norm"], (a["grad_norm"], b["grad_norm"])
    for k, v in full.masters.items():
        assert (half.masters[k] - v).norm() <= 1e-2 * v.norm(), k


@pytest.mark.parametrize("stores", [{}, dict(use_offload=True, resident_stages=1, device_steps=1)])
def test_overflow_skips_the_step_and_halves_the_scale(tiny_model_dir, stores):
    """An overflow skips every stage's step: resident (float16 gradients, no fp32 copy), offloaded
    on the CPU and offloaded stepped on the device alike; the weights stay as they were."""
    cfg = tiny_cfg(tiny_model_dir, schedule="1f1b", dtype="float16", loss_scale=2.0 ** 40, loss_scale_window=1000,
               num_iterations=1, **stores)
    trainer = in_process_trainer(cfg)
    before = trainer_masters(trainer)
    run = trained(trainer)
    assert run.history[0]["skipped"] and trainer.scaler.scale == 2.0 ** 39
    assert all(torch.equal(before[k], run.masters[k]) for k in before)


@pytest.mark.slow
def test_a_fixed_scale_that_always_overflows_stops_the_run(tiny_model_dir):
    cfg = tiny_cfg(tiny_model_dir, schedule="1f1b", dtype="float16", loss_scale=2.0 ** 40, loss_scale_window=0,
               num_iterations=4, max_skipped_steps=2)
    with pytest.raises(TrainingError, match="3 steps in a row"):
        train_in_process(cfg)


@pytest.mark.slow
def test_float16_lora_trains_like_float32(tiny_model_dir):
    """LoRA adapters under float16 compute and loss scaling, the base weights frozen and offloaded:
    the losses, norms and adapters of float32 within float16's precision."""
    from pipeline.stage.lora import adapter_tensors

    lora = dict(lora_rank=4, lora_alpha=8.0, lora_target_modules="all-linear", adam_eps=1e-4, use_offload=True)
    runs = {dtype: train_in_process(tiny_cfg(tiny_model_dir, schedule="1f1b", dtype=dtype, **lora))
            for dtype in ("float32", "float16")}
    full, half = runs["float32"], runs["float16"]
    assert half.trainer.scaler is not None and not any(h["skipped"] for h in half.history)
    for a, b in zip(half.history, full.history):
        assert abs(a["loss"] - b["loss"]) <= 5e-3 * abs(b["loss"]), (a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 5e-2 * b["grad_norm"], (a["grad_norm"], b["grad_norm"])
    adapters = [{k: v for s in r.trainer.stores.values() for k, v in adapter_tensors(s).items()} for r in (full, half)]
    assert adapters[0] and adapters[0].keys() == adapters[1].keys()
    # 5%: a B matrix starts at zero, so after three steps it is nothing but AdamW updates, each
    # about lr whatever its gradient's size, and float16's noise flips some of them (0.9% seen);
    # a lost or stale adapter gradient moves it by its whole size
    for k, v in adapters[0].items():
        assert (adapters[1][k].float() - v.float()).norm() <= 5e-2 * v.float().norm(), k
