"""The world as data-parallel replicas of one pipeline: D x P processes, global rank = replica x P
+ position (docs/design.md, "Data-parallel replicas"). Pure: which rank is which, one replica's
config (what schedules, placement and memory plans take) and its share of a batch; the groups
that sum the replicas' gradients are ``pipeline.run.replicas``'s."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipeline.config import TrainConfig


@dataclass(frozen=True)
class Layout:
    """Where one process sits among ``data_parallel`` replicas of a ``pipeline_size``-rank pipeline."""

    rank: int            # global rank
    data_parallel: int   # D
    pipeline_size: int   # P

    @property
    def replica(self) -> int:
        return self.rank // self.pipeline_size

    @property
    def position(self) -> int:
        """The pipeline rank: what schedules, mappings and the executor call ``rank``."""
        return self.rank % self.pipeline_size

    def global_rank(self, position: int, replica: int | None = None) -> int:
        """The global rank of ``position`` in ``replica`` (default: this process's replica)."""
        return (self.replica if replica is None else replica) * self.pipeline_size + position

    def peers(self, position: int | None = None) -> list[int]:
        """Global ranks of ``position`` (default: this one) in every replica, replica order."""
        p = self.position if position is None else position
        return [r * self.pipeline_size + p for r in range(self.data_parallel)]


def layout(cfg: TrainConfig, rank: int, world_size: int) -> Layout:
    return Layout(rank, cfg.data_parallel, world_size // cfg.data_parallel)


def replica_config(cfg: TrainConfig) -> TrainConfig:
    """What one replica runs, as the config of a single pipeline: ``batch_size / D`` rows in
    ``num_chunks / D`` micro-batches of the same size. Schedules, placement and the memory plan
    take this; data and checkpoints keep the global config."""
    D = cfg.data_parallel
    if D == 1:
        return cfg
    return dataclasses.replace(cfg, batch_size=cfg.batch_size // D, num_chunks=cfg.num_chunks // D,
                               data_parallel=1)


SHARD_ALIGN = 64  # elements: a range of a sharded step is a whole number of the fused AdamW kernel's vectors


def shard_bounds(numel: int, peers: int) -> list[tuple[int, int]]:
    """Each of ``peers`` replicas' range of a sharded stage's ``numel`` flat parameters, in peer
    order (``pipeline.run.replicas.ShardPeers``); the last ones are empty for a stage too small."""
    per = -(-numel // (peers * SHARD_ALIGN)) * SHARD_ALIGN
    return [(min(r * per, numel), min((r + 1) * per, numel)) for r in range(peers)]


def shards_step(cfg: TrainConfig, offloaded: bool, tied_copy: bool, numel: int) -> bool:
    """Whether the ``data_parallel`` replicas split a stage's CPU AdamW step (ZeRO-1 on host state):
    an offloaded stage of ``numel`` parameters that holds no copy of a tied matrix (both copies
    must step alike), with no delayed update, not LoRA (its adapters step on the device), and a
    range for every peer. The one rule for the stores (``pipeline.run.build``) and the plan."""
    D = cfg.data_parallel
    return (D > 1 and offloaded and not tied_copy and not cfg.delayed_update and not cfg.lora_rank
            and all(hi > lo for lo, hi in shard_bounds(numel, D)))


def replica_share(items: list, lay: Layout) -> list:
    """This replica's contiguous 1/D of ``items`` (the global batch's micro-batches)."""
    n = len(items) // lay.data_parallel
    return items[lay.replica * n:(lay.replica + 1) * n]


__all__ = ["Layout", "SHARD_ALIGN", "layout", "replica_config", "replica_share", "shard_bounds", "shards_step"]
