"""Learning-rate schedule and AdamW settings shared by the pipeline and the reference trainer."""
from __future__ import annotations

import math

import torch

from offload.store import OptimSettings
from pipeline.config import TrainConfig


def compute_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    """The dtype stages compute in (master weights are always float32)."""
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up, then decay to
    ``lr * min_lr_ratio`` at the last step."""
    if step < cfg.warmup_iterations:
        return cfg.lr * (step + 1) / cfg.warmup_iterations
    decay_steps = max(1, cfg.num_iterations - cfg.warmup_iterations - 1)
    progress = min(1.0, (step - cfg.warmup_iterations) / decay_steps)
    floor = cfg.min_lr_ratio
    if cfg.lr_schedule == "constant":
        factor = 1.0
    elif cfg.lr_schedule == "linear":
        factor = 1.0 - (1.0 - floor) * progress
    else:
        factor = floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * factor


def optim_settings(cfg: TrainConfig, fused: bool | None = None) -> OptimSettings:
    return OptimSettings(weight_decay=cfg.weight_decay, betas=(cfg.adam_beta1, cfg.adam_beta2),
                         eps=cfg.adam_eps, fused=fused)


def needs_norm(cfg: TrainConfig) -> bool:
    """Whether the schedule needs the global gradient norm (NORM): to clip, to skip a step
    whose gradients are not finite, or (float16) to find loss-scale overflows."""
    return cfg.grad_clip > 0 or cfg.max_skipped_steps >= 0 or cfg.dtype == "float16"


class LossScaler:
    """Dynamic loss scaling for float16 compute (the policy of ``torch.amp.GradScaler``).

    The last stage multiplies its loss by ``scale``; every gradient in the pipeline is then
    scaled too, which keeps small gradients out of float16's subnormal range. The pipeline's
    NORM already all-reduces the squared gradient norm, so an overflow anywhere is seen by every
    rank alike: the step is skipped everywhere and the scale halves. After ``window`` finite
    steps in a row it doubles. ``window == 0`` keeps the scale fixed.
    """

    def __init__(self, scale: float, window: int):
        self.scale, self.window, self.good_steps = float(scale), window, 0

    def update(self, overflow: bool) -> bool:
        """Adjust the scale after a step; True when ``overflow`` was a scale overflow (the scale
        was above 1 and has halved), a normal event and not a fault."""
        if not self.window:
            return False
        if overflow:
            expected = self.scale > 1.0
            self.scale, self.good_steps = max(self.scale / 2, 2.0 ** -24), 0
            return expected
        self.good_steps += 1
        if self.good_steps >= self.window:
            self.scale, self.good_steps = self.scale * 2, 0
        return False

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
