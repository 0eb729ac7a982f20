"""Host buffers that the data-parallel peers of a pipeline position on one node map together.

A sharded stage (ZeRO-1 over the replicas, ``pipeline.run.replicas.ShardPeers``) steps one range
of its flat masters on each peer. With private buffers every peer must then receive the other
ranges, and sum the replicas' gradients first, through gloo: 4 bytes a parameter each way, a
3B model's offloaded half in seconds. Mapped together, the peers read each other's gradients and
write one copy of the masters, so a step needs only a barrier.

Each buffer is an anonymous memory file (``memfd_create``) that its maker sizes and the others
open through ``/proc/<pid>/fd/<fd>`` while it is still open there (a barrier); the mappings keep
the memory from then on, and it goes with the last of them. On CUDA each process page-locks its
mappings of the buffers it copies to or from the device (``streams.page_lock``)."""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from offload.streams import page_lock


def _memfd(nbytes: int) -> int:
    fd = os.memfd_create("mmoc-pipe-host", 0)
    os.ftruncate(fd, max(nbytes, 1))
    return fd


def _mapped(path: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=numel, dtype=dtype)


class SharedHost:
    """Buffers of the ``num_peers`` peers in ``group`` (a gloo group of processes on one node,
    this one ``index`` in it). Collective: every peer asks for the same buffers in the same order,
    from the thread that owns ``group``."""

    def __init__(self, group, index: int, num_peers: int, cuda: bool):
        self.group, self.index, self.num_peers, self.cuda = group, index, num_peers, cuda

    def _exchange(self, fd: int | None) -> list[tuple[int, int | None]]:
        where: list = [None] * self.num_peers
        dist.all_gather_object(where, (os.getpid(), fd), group=self.group)
        return where

    def _map_all(self, where: list, numel: int, dtype: torch.dtype) -> list[torch.Tensor | None]:
        out = [None if fd is None else _mapped(f"/proc/{pid}/fd/{fd}", numel, dtype) for pid, fd in where]
        dist.barrier(group=self.group)  # every peer has mapped every buffer: their makers may close them
        for pid, fd in where:
            if pid == os.getpid() and fd is not None:
                os.close(fd)
        return out

    def one(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """One buffer every peer maps (made by peer 0; uninitialised), page-locked on CUDA."""
        fd = _memfd(numel * dtype.itemsize) if self.index == 0 else None
        return page_lock(self._map_all(self._exchange(fd), numel, dtype)[0], self.cuda)

    def each(self, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """One buffer per peer, in peer order, every peer mapping all of them; this peer writes
        ``[index]`` (zeroed; page-locked on CUDA, where its copies from the device land) and only
        reads the others."""
        fd = _memfd(numel * dtype.itemsize)
        out = self._map_all(self._exchange(fd), numel, dtype)
        page_lock(out[self.index], self.cuda).zero_()
        return out


def probe(group, index: int, num_peers: int, cuda: bool = False) -> bool:
    """Whether the peers in ``group`` can share host buffers: on one host (the same name), and each
    can make a memory file the others map and read back (Linux, /proc readable) and, with ``cuda``,
    page-lock its mapping. Collective over
    ``group``; no peer raises between its collectives, so a failure anywhere is every peer's False.
    The caller agrees over every position's peers before relying on it."""
    fd = None
    try:
        fd = _memfd(8)
        os.pwrite(fd, (index + 1).to_bytes(8, "little"), 0)
    except (OSError, AttributeError):  # AttributeError: no os.memfd_create here
        pass
    where: list = [None] * num_peers
    dist.all_gather_object(where, (socket.gethostname(), os.getpid(), fd), group=group)
    ok = fd is not None and all(f is not None and host == socket.gethostname() for host, _, f in where)
    if ok:
        try:
            maps = [_mapped(f"/proc/{pid}/fd/{f}", 1, torch.int64) for _, pid, f in where]
            ok = [int(m.item()) for m in maps] == list(range(1, num_peers + 1))
            page_lock(maps[index], cuda)
        except (OSError, RuntimeError):
            ok = False
    dist.barrier(group=group)  # every peer has read every file: their makers may close them
    if fd is not None:
        os.close(fd)
    return ok


__all__ = ["SharedHost", "probe"]
