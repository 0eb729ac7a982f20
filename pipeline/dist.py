"""Process-group setup and teardown, and rank-aware logging."""
from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm import tqdm


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @staticmethod
    def from_environ() -> "DistEnv":
        """Read torchrun's variables; a plain ``python main.py`` is a world of one."""
        get = lambda k, d: int(os.environ.get(k, d))  # noqa: E731
        return DistEnv(get("RANK", 0), get("WORLD_SIZE", 1), get("LOCAL_RANK", 0), get("LOCAL_WORLD_SIZE", 1))


def pick_device(requested: str, env: DistEnv) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", env.local_rank % max(1, torch.cuda.device_count()))


def cap_gpu_memory(device: torch.device, gib: float) -> None:
    """Let this process allocate at most ``gib`` GiB on CUDA ``device`` (all of it when the card has less)."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), device)


def init_distributed(env: DistEnv, device: torch.device, timeout_s: float) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if env.world_size == 1 and "MASTER_ADDR" not in os.environ:
        return  # a single plain process needs no process group
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def gather_objects(obj) -> list:
    """Every rank's ``obj``, in rank order (on every rank)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


class Log:
    """One logger for the run: info from one chosen rank, warnings and errors from any rank."""

    def __init__(self, rank: int, speaker: int = 0):
        self.rank, self.speaker = rank, speaker

    def info(self, msg: str) -> None:
        if self.rank == self.speaker:
            # tqdm.write prints above a live progress bar instead of through it; with no bar it is print.
            # The whole line in one write: torchrun runs workers unbuffered (-u), and a text and its
            # newline written apart interleave with other ranks' lines on a shared pipe.
            tqdm.write(f"{msg}\n", file=sys.stdout, end="")
            sys.stdout.flush()

    def warn(self, msg: str) -> None:
        tqdm.write(f"[rank {self.rank}] warning: {msg}\n", file=sys.stderr, end="")
        sys.stderr.flush()
