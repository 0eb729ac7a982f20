"""A run's settings with every automatic choice made, once.

``resolve`` is pure: from the configuration, the number of processes and the model's config it
decides what ``-1 = auto`` leaves open (the resident stages, then the layers that keep their
activations, both from the memory plan of one replica's pipeline) and says so in log lines.
Training runs it on rank 0 (auto reads that rank's GPU) and broadcasts the result; ``--plan``
and a ``Trainer`` built directly (tests) run it themselves. Everything after it reads the
``Resolved`` and decides nothing again.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipeline.config import TrainConfig
from pipeline.plan import resolve_kept, resolve_resident
from pipeline.replicas import replica_config


@dataclass(frozen=True)
class Resolved:
    """What every rank runs.

    Attributes:
        cfg: the configuration with ``resident_stages`` decided (global batch, all replicas).
        kept: per stage, the decoder layers that keep their activations under checkpointing.
        pipeline_size: the ranks of one pipeline (processes / ``data_parallel``).
        lines: what the automatic choices were, one log line each.
    """

    cfg: TrainConfig
    kept: tuple[int, ...]
    pipeline_size: int
    lines: tuple[str, ...] = ()

    @property
    def replica(self) -> TrainConfig:
        """One replica's pipeline as the config of a single pipeline (``pipeline.replicas``):
        what schedules, placement and the memory plan take."""
        return replica_config(self.cfg)


def resolve(cfg: TrainConfig, world_size: int, hf_config) -> Resolved:
    size = world_size // cfg.data_parallel
    one, resident = resolve_resident(replica_config(cfg), hf_config, size)
    kept, recompute = resolve_kept(one, hf_config, size)
    return Resolved(dataclasses.replace(cfg, resident_stages=one.resident_stages), kept, size,
                    tuple(line for line in (resident, recompute) if line))


__all__ = ["Resolved", "resolve"]
