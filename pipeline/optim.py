"""Learning-rate schedule and AdamW settings shared by the pipeline and the reference trainer."""
from __future__ import annotations

import math

from offload.store import OptimSettings
from pipeline.config import TrainConfig


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
    """Whether the schedule needs the global gradient norm (NORM): to clip, or to skip a step
    whose gradients are not finite."""
    return cfg.grad_clip > 0 or cfg.max_skipped_steps >= 0
