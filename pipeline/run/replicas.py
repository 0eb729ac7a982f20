"""Data-parallel replicas of the pipeline (``data_parallel: D``): the groups that sum their gradients
and losses, and the peers that share a stage's CPU AdamW step; the layout (which rank is which)
is ``pipeline.plan.layout``'s.

The world of ``D x P`` processes is D replicas of one P-rank pipeline. Global rank
``g = replica * P + position``: the ranks of one replica are consecutive, so torchrun (which
numbers a node's processes consecutively) keeps a replica on one node whenever a node has at
least P processes. Everything below the trainer (schedules, mapping, executor, p2p) sees only
the pipeline position, 0..P-1, exactly as a run of one pipeline does.

Each replica runs ``num_chunks / D`` of the global batch's micro-batches (replica r the r-th
contiguous share), each of the same size as with one pipeline, and normalises its loss by the
global batch's target count. So the replicas' gradients and losses are partial sums of the
global batch's, and the sum over the D peers of a stage (``GradSync``) is that stage's gradient
of the whole batch: no averaging, the same normalisation as one pipeline.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from offload.shared import SharedHost, probe
from pipeline.plan.layout import Layout, shard_bounds


SHARE_HOST = os.environ.get("MMOC_SHARE_HOST", "1") != "0"


class GradSync:
    """The process groups across replicas and the sums over them.

    Group creation is collective over the whole world: every rank creates every position's
    group, in position order, and keeps its own. With NCCL a second, gloo group per position
    carries host tensors (the fp32 gradients of offloaded stages live in host memory)."""

    def __init__(self, layout: Layout, timeout_s: float | None = None, pin: bool = False):
        """``pin``: the host buffers the peers share are page-locked (CUDA)."""
        self.layout, self.pin = layout, pin
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
        host_too = dist.get_backend() != "gloo"
        self.group = self.host_group = self.pipeline_group = self.shard_group = None
        for p in range(layout.pipeline_size):
            ranks = layout.peers(p)
            group = dist.new_group(ranks, timeout=timeout)  # collective: every rank calls
            host = dist.new_group(ranks, timeout=timeout, backend="gloo") if host_too else group
            # the sharded step's exchange, on the optimizer thread: a group no other thread uses
            shard = dist.new_group(ranks, timeout=timeout, backend="gloo")
            if p == layout.position:
                self.group, self.host_group, self.shard_group = group, host, shard
        for r in range(layout.data_parallel):  # the NORM all-reduce stays within a replica
            group = dist.new_group([layout.global_rank(p, r) for p in range(layout.pipeline_size)], timeout=timeout)
            if r == layout.replica:
                self.pipeline_group = group
        # Sharded stages share their host buffers when every position's peers can (one node);
        # else, or with MMOC_SHARE_HOST=0, their gradients are summed and their stepped ranges
        # exchanged over gloo.
        ok = probe(self.shard_group, layout.replica, layout.data_parallel, pin) and SHARE_HOST
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, ok)
        self.shared = all(everyone)

    def sum_(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place over this position's D peers (blocking on the host with gloo)."""
        dist.all_reduce(tensor, group=self.host_group if tensor.device.type == "cpu" else self.group)

    def sum_norms(self, whole: torch.Tensor, ranges: torch.Tensor) -> torch.Tensor:
        """The squared gradient norm of the whole model from this rank's squared norms: ``whole``
        of the stages it holds whole (summed over the replicas already: every replica has them, so
        replica 0's count), ``ranges`` of the ranges it holds of shared sharded stages (each range
        on one peer). One all-reduce over every rank (device tensors under NCCL)."""
        both = torch.stack([whole if self.layout.replica == 0 else torch.zeros_like(whole), ranges])
        dist.all_reduce(both)
        return both.sum()

    def sum_loss(self, loss: float | None) -> float | None:
        """The global batch's loss from each replica's share (loss positions only; the peers of
        a position all call it or none does)."""
        if loss is None:
            return None
        t = torch.tensor([loss], dtype=torch.float64)
        dist.all_reduce(t, group=self.host_group)
        return float(t)


class ShardPeers:
    """The D peers of a position splitting an offloaded stage's CPU AdamW step (ZeRO-1 on host
    state, ``offload.adamw.ShardPeers``): peer r (replica r) steps the r-th range of the flat
    parameters, ranges aligned to ``SHARD_ALIGN`` elements so each is a whole number of the fused
    kernel's vectors (the same bits as one step over everything). With ``host`` the peers map the
    stage's host buffers together (``offload.shared``); one per store, which keeps the peers'
    gradient buffers here."""

    def __init__(self, layout: Layout, group, host: SharedHost | None = None):
        self.index, self.peers, self.group, self.host = layout.replica, layout.peers(), group, host
        self.grads: list[torch.Tensor] | None = None  # shared: every peer's gradient buffer

    @property
    def shared(self) -> bool:
        return self.host is not None

    def bounds(self, numel: int) -> list[tuple[int, int]]:
        return shard_bounds(numel, len(self.peers))

    def exchange(self, flat: torch.Tensor) -> None:
        for src, (lo, hi) in zip(self.peers, self.bounds(flat.numel())):
            if hi > lo:
                dist.broadcast(flat[lo:hi], src=src, group=self.group)

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        return self.host.one(numel, dtype) if self.host is not None else None

    def grad_buffer(self, numel: int) -> torch.Tensor | None:
        if self.host is None:
            return None
        self.grads = self.host.each(numel, torch.float32)
        return self.grads[self.index]

    def sum_grads(self, lo: int, hi: int) -> torch.Tensor:
        dist.barrier(group=self.group)  # every peer's gradient has landed in its buffer
        mine = self.grads[self.index][lo:hi]
        for peer, grads in enumerate(self.grads):
            if peer != self.index:
                mine.add_(grads[lo:hi])
        return mine

    def stepped(self, master: torch.Tensor) -> None:
        if self.host is not None:
            dist.barrier(group=self.group)  # every range of the one copy is stepped
        else:
            self.exchange(master)


def shard_peers(sync: GradSync) -> ShardPeers:
    """The peers of this position that shard a stage (one that ``pipeline.plan.layout.shards_step``
    says is sharded), sharing its host buffers when ``sync`` found that they can."""
    host = SharedHost(sync.shard_group, sync.layout.replica, sync.layout.data_parallel, sync.pin) if sync.shared \
        else None
    return ShardPeers(sync.layout, sync.shard_group, host)


__all__ = ["GradSync", "ShardPeers", "shard_peers"]
