"""Learning-rate schedule, AdamW settings and float16 loss scaling, shared by the pipeline and the
reference trainer."""
from __future__ import annotations

import math

from offload.adamw import OptimSettings
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
