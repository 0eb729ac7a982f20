"""Point-to-point channels between pipeline ranks.

Each ordered pair of ranks that exchanges tensors gets one process group, which carries
activations and gradients from the first rank to the second (``schedule.ir.channel``). A
channel then carries messages one way only, in the order both sides issue them, which is
exactly what the schedule validator checks (FIFO per channel). With NCCL a send never queues
behind a receive of the same rank (they are on different groups); activations and gradients
share a group because the device would not keep them apart anyway.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from schedule.ir import Channel, crosses, tied_stages


def channels_for(mapping: list[int]) -> list[Channel]:
    """Every channel the stage -> rank mapping needs, in a fixed order (group creation is collective)."""
    keys = set()
    for s in range(len(mapping) - 1):
        if crosses(mapping, s, s + 1):
            a, b = mapping[s], mapping[s + 1]
            keys.add((a, b))  # activations of stage s, and gradients of stage s + 1 the other way
            keys.add((b, a))
    return sorted(keys)


class P2P:
    """Async send/recv on per-channel groups. Returned works are waited on by the executor."""

    def __init__(self, mapping: list[int], timeout_s: float | None = None, tied: bool = False,
                 replicas: int = 1):
        """``tied``: the first and last stage hold copies of a tied matrix; when they are on two
        ranks, those two get a group of their own for the TIE all-reduce.

        ``replicas``: the world is that many pipelines of ``P = world / replicas`` ranks
        (``pipeline.run.replicas``: global rank = replica * P + pipeline rank). ``rank``, ``send``'s
        ``dst`` and ``recv``'s ``src`` are pipeline ranks; each replica gets its own groups."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        size = world // replicas
        me = dist.get_rank() if dist.is_initialized() else 0
        self.rank, self.base = me % size, me - me % size  # pipeline rank; global rank of pipeline rank 0
        self.groups = {}
        self.tie_group = None
        # new_group's own default is 30 min whatever the default group's: pass the run's timeout on
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
        pair = sorted({mapping[s] for s in tied_stages(len(mapping))})
        for base in range(0, world, size):  # every replica's groups, in replica order, on every rank
            for src, dst in channels_for(mapping):
                group = dist.new_group(sorted((base + src, base + dst)), timeout=timeout)  # collective
                if base == self.base and self.rank in (src, dst):
                    self.groups[(src, dst)] = group
            if tied and len(pair) == 2:
                # after the channels, on every rank alike: group creation is collective
                group = dist.new_group([base + r for r in pair], timeout=timeout)
                if base == self.base and self.rank in pair:
                    self.tie_group = group

    def all_reduce_tied(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place with the other tied copy's rank (blocking on the host with gloo;
        with NCCL the compute stream waits). Two operands: the sum is the same bits on both."""
        dist.all_reduce(tensor, group=self.tie_group)

    def send(self, tensor: torch.Tensor, dst: int):
        return dist.isend(tensor, dst=self.base + dst, group=self.groups[(self.rank, dst)])

    def recv(self, tensor: torch.Tensor, src: int):
        return dist.irecv(tensor, src=self.base + src, group=self.groups[(src, self.rank)])
