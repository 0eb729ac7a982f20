"""A run's settings with every automatic choice made, once.

``resolve`` is pure: from the configuration, the number of processes and the model's config it
decides what ``-1 = auto`` leaves open (for long rows the stages, sequence segments and tiled
MLPs; then the resident stages and the layers that keep their activations, all from the memory
plan of one replica's pipeline), keeps a resumed checkpoint's
layers per stage, and says so in log lines (and that a family not registered runs on the
self-checked generic path).
Its answer holds the run's spec (``pipeline.spec.run_spec``): each stage's layers and mode, the
kernels, the programs and the adapters, derived from the decided settings once. Training runs it
on rank 0 (auto reads that rank's GPU) and broadcasts the result; ``--plan`` and a ``Trainer``
built directly (tests) run it themselves, all three through ``resolve_run``. Everything after it
reads the ``Resolved`` and decides or derives nothing again. The model's rules on what it decided
(``model_rules.check_choices``) run on its answer.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipeline.config import TrainConfig, partition_counts
from pipeline.plan.fit import plan_spec, resolve_kept, resolve_resident
from pipeline.plan.layout import replica_config
from pipeline.plan.long_rows import resolve_long_rows
from pipeline.plan.model_rules import check_choices
from pipeline.spec.partition import stage_layers
from pipeline.plan.saved import saved_partition
from pipeline.spec.run_spec import RunSpec
from pipeline.stage.selfcheck import generic_path_line


@dataclass(frozen=True)
class Resolved:
    """What every rank runs.

    Attributes:
        cfg: the configuration with every automatic choice decided (global batch, all replicas):
            what the data and the checkpoints take.
        spec: one replica's pipeline (``pipeline.run.replicas``) derived from it once: each
            stage's layers and mode, the layers that keep their activations, the kernels, the
            programs, the adapters, the ranks of one pipeline (processes / ``data_parallel``).
        lines: what the automatic choices were, one log line each.
    """

    cfg: TrainConfig
    spec: RunSpec
    lines: tuple[str, ...] = ()

    @property
    def replica(self) -> TrainConfig:
        """One replica's pipeline as the config of a single pipeline (``RunSpec.cfg``)."""
        return self.spec.cfg


def resolve(cfg: TrainConfig, world_size: int, hf_config, saved_parts: list[int] | None = None) -> Resolved:
    """``saved_parts``: the decoder layers per stage of the checkpoint the run resumes from
    (``pipeline.plan.saved.saved_partition``), kept where they fit."""
    size = world_size // cfg.data_parallel
    long_rows = ""
    if -1 in (cfg.num_stages, cfg.seq_chunks) or cfg.tiled_mlp == "auto":
        chosen, long_rows = resolve_long_rows(replica_config(cfg), hf_config, size, cfg.data_parallel)
        cfg = dataclasses.replace(cfg, num_stages=chosen.num_stages, seq_chunks=chosen.seq_chunks,
                                  tiled_mlp=chosen.tiled_mlp)
    cfg, partition = resume_partition(cfg, hf_config, size, saved_parts)
    replica_cfg, resident = resolve_resident(replica_config(cfg), hf_config, size, cfg.data_parallel)
    kept, recompute = resolve_kept(replica_cfg, hf_config, size, cfg.data_parallel)
    cfg = dataclasses.replace(cfg, resident_stages=replica_cfg.resident_stages)
    check_choices(cfg, hf_config, size)
    spec = plan_spec(replica_config(cfg), hf_config, size, kept=kept, data_parallel=cfg.data_parallel)
    return Resolved(cfg, spec, tuple(line for line in (generic_path_line(hf_config), long_rows, partition, resident,
                                                       recompute) if line))


def resolve_run(cfg: TrainConfig, world_size: int, hf_config) -> Resolved:
    """``resolve`` for a run as launched: with the decoder layers per stage of the checkpoint it
    resumes from (``cfg.resume`` in ``cfg.save_dir``), where there is one."""
    return resolve(cfg, world_size, hf_config, saved_partition(cfg.resume, cfg.save_dir))


def resume_partition(cfg: TrainConfig, hf_config, size: int, saved: list[int] | None) -> tuple[TrainConfig, str]:
    """``cfg`` with the checkpoint's decoder layers per stage (``saved``) as its ``partition``
    where this run's would differ, and a log line saying so: the AdamW state is saved per stage,
    and the cost partition depends on the processes. Unchanged with counts given, or another
    number of stages or layers (those restart AdamW)."""
    if saved is None or len(saved) != cfg.num_stages or sum(saved) != hf_config.num_hidden_layers \
            or partition_counts(cfg.partition) is not None:
        return cfg, ""
    now = [len(p) for p in stage_layers(replica_config(cfg), hf_config, size)]
    if now == saved:
        return cfg, ""
    return (dataclasses.replace(cfg, partition=",".join(map(str, saved))),
            f"partition: the checkpoint's decoder layers per stage {saved} (its AdamW state is per stage; "
            f"partition {cfg.partition} gives {now} here)")


__all__ = ["Resolved", "resolve", "resolve_run", "resume_partition"]
