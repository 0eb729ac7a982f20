"""Point-to-point channels between pipeline ranks.

Each directed pair of ranks gets one process group per kind of message ('F' activations,
'B' gradients). A channel then carries messages one way only, in the order both sides
issue them, which is exactly what the schedule validator checks (FIFO per channel). With
NCCL this also keeps a send on one channel from queueing behind a receive on another.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

Channel = tuple[str, int, int]  # (kind, src rank, dst rank)


def channels_for(mapping: list[int]) -> list[Channel]:
    """Every channel the stage -> rank mapping needs, in a fixed order (group creation is collective)."""
    keys = set()
    for s in range(len(mapping) - 1):
        a, b = mapping[s], mapping[s + 1]
        if a != b:
            keys.add(("F", a, b))
            keys.add(("B", b, a))
    return sorted(keys)


class P2P:
    """Async send/recv on per-channel groups. Returned works are waited on by the executor."""

    def __init__(self, mapping: list[int], timeout_s: float | None = None):
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.groups = {}
        # new_group's own default is 30 min whatever the default group's: pass the run's timeout on
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
        for key in channels_for(mapping):
            _, src, dst = key
            members = [src, dst] if src < dst else [dst, src]
            group = dist.new_group(members, timeout=timeout)  # collective: every rank calls
            if self.rank in (src, dst):
                self.groups[key] = group

    def send(self, kind: str, tensor: torch.Tensor, dst: int):
        return dist.isend(tensor, dst=dst, group=self.groups[(kind, self.rank, dst)])

    def recv(self, kind: str, tensor: torch.Tensor, src: int):
        return dist.irecv(tensor, src=src, group=self.groups[(kind, src, self.rank)])
