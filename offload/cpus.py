"""Which CPU cores a rank's optimizer threads may use.

torchrun sets ``OMP_NUM_THREADS=1``; left so, the CPU AdamW of a 7B stage runs several times
slower than the host allows. Each rank gets its share of the cores: of its GPU's NUMA node
when the host has more than one (the host copies of that GPU's stages are then touched by
cores near its PCIe root), else of all the cores the process may run on.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path


def parse_cpulist(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (the sysfs cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def node_cpus(sysfs_root: str | os.PathLike = "/sys") -> dict[int, list[int]]:
    """NUMA node -> its CPUs, from sysfs ({} where sysfs has no node information)."""
    out = {}
    for node in sorted(Path(sysfs_root, "devices/system/node").glob("node[0-9]*")):
        try:
            out[int(node.name[4:])] = parse_cpulist((node / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    return out


def optimizer_cpus(local_rank: int, gpu_numa: list[int | None], nodes: dict[int, list[int]],
                   allowed: list[int]) -> list[int]:
    """The cores of ``local_rank``: its NUMA node's allowed cores, split evenly among the local
    ranks whose GPUs share that node (all allowed cores, split among all local ranks, when
    the node is unknown or the host has a single node)."""
    mine = gpu_numa[local_rank] if local_rank < len(gpu_numa) else None
    if len(nodes) > 1 and mine in nodes:
        pool = [c for c in nodes[mine] if c in set(allowed)]
        peers = [r for r, n in enumerate(gpu_numa) if n == mine]
    else:
        pool, peers = sorted(allowed), list(range(len(gpu_numa)))
    if not pool:
        return sorted(allowed)
    share = max(1, len(pool) // max(1, len(peers)))
    i = peers.index(local_rank) if local_rank in peers else 0
    chunk = pool[i * share:(i + 1) * share]
    return chunk or pool[-share:]


def pin_current_thread(cpus: list[int]) -> None:
    """Pin the calling thread (Linux: pid 0 is the thread) and size torch's pool to match.
    Threads it starts later (OpenMP workers) inherit the mask."""
    import torch

    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cpus)
        except OSError:
            pass  # a container may forbid it; the thread count below still applies
    torch.set_num_threads(max(1, len(cpus)))


@contextlib.contextmanager
def intra_op_threads(n: int):
    """Let this thread's torch ops use ``n`` threads for a while (start-up: zeroing and copying a
    rank's tens of GB of host state on torchrun's one thread takes most of a minute), then go
    back to what it was, so the main thread does not compete with the optimizer's cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


__all__ = ["intra_op_threads", "node_cpus", "optimizer_cpus", "parse_cpulist", "pin_current_thread"]
