"""Automatic choices for long rows: ``num_stages -1``, ``seq_chunks -1`` and ``tiled_mlp
auto`` resolved into the first configuration whose memory plan fits, in an order that is data
(``AUTO_SEQ_CHUNKS``, ``AUTO_TILED``), and the longest row that fits for ``--plan``."""
from __future__ import annotations

import dataclasses

import torch

import schedule as sched
from models import spec_for
from pipeline.config import TrainConfig
from pipeline.plan.fit import USABLE_FRACTION, Assessment, assess, auto_capacity, device_type, gpu_capacity
from pipeline.plan.memory import gib


# The order in which automatic long-row settings are tried: whole rows before sequence segments
# (measured faster at 16K and 32K on one GPU), an untiled MLP before a tiled one (tiles
# cost one more MLP forward), then the fewest stages that fit (more stages cost little with every
# stage offloaded: each parameter is loaded twice a step however the layers are cut).
AUTO_SEQ_CHUNKS = (1, 2, 4, 8, 16, 32, 64)


AUTO_TILED = ("false", "true")


def _auto_options(cfg: TrainConfig, hf_config, size: int) -> tuple[list[int], list[int], list[str]]:
    """The stage counts, seq_chunks and tiled_mlp values an automatic choice may take: the
    configured value where it is not auto; what the run's other settings allow where it is."""
    routed = spec_for(hf_config).moe is not None
    num_layers = hf_config.num_hidden_layers
    stages = [cfg.num_stages] if cfg.num_stages != -1 else [S for S in range(size, num_layers + 3) if S % size == 0]
    whole_only = routed or cfg.fuse_last_stage == "true" or cfg.compile_layers == "true"
    chunks = [cfg.seq_chunks] if cfg.seq_chunks != -1 else \
        [k for k in AUTO_SEQ_CHUNKS if k <= cfg.seq_length and (k == 1 or not whole_only)]
    tiles = [cfg.tiled_mlp] if cfg.tiled_mlp != "auto" else \
        (["false"] if routed or cfg.compile_layers == "true" else list(AUTO_TILED))
    return stages, chunks, tiles


def _fewest_stages(cfg: TrainConfig, hf_config, size: int, stages: list[int]) -> TrainConfig | None:
    """``cfg`` with the fewest of ``stages`` whose plan fits (``_fits_here``; found by bisection: a stage's memory
    falls as the stages grow), None when even the most do not fit."""
    def fits(S: int) -> bool:
        trial = dataclasses.replace(cfg, num_stages=S)
        return _fits_here(assess(trial, hf_config, sched.round_robin(S, size)))

    if not fits(stages[-1]):
        return None
    lo, hi = 0, len(stages) - 1  # stages[hi] fits
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(stages[mid]):
            hi = mid
        else:
            lo = mid + 1
    return dataclasses.replace(cfg, num_stages=stages[hi])


def _fits_here(a: "Assessment") -> bool:
    """What an automatic choice must fit: the GPU, and on a machine with one (the machine that
    trains) its host memory too; ``--plan`` for a GPU on a machine without one checks the GPU
    alone (this machine's host memory says nothing about the other's)."""
    return a.fits if torch.cuda.is_available() else a.gpu_fits


def resolve_long_rows(cfg: TrainConfig, hf_config, world_size: int) -> tuple[TrainConfig, str]:
    """``cfg`` with ``num_stages``, ``seq_chunks`` and ``tiled_mlp`` decided where they are auto
    (-1, -1, auto), and a log line saying what was chosen; unchanged (and no line) when none is.

    The first of whole rows, then 2, 4, 8 ... segments; untiled, then tiled; the fewest stages
    whose memory plan fits (``AUTO_SEQ_CHUNKS``, ``AUTO_TILED``). Without a GPU: the first of
    them (nothing to fit). When nothing fits, the most frugal (most segments, tiled, most stages),
    which ``check_fits`` then refuses with advice."""
    auto = [k for k, on in (("num_stages", cfg.num_stages == -1), ("seq_chunks", cfg.seq_chunks == -1),
                            ("tiled_mlp", cfg.tiled_mlp == "auto")) if on]
    if not auto:
        return cfg, ""
    stages, chunks, tiles = _auto_options(cfg, hf_config, world_size)
    first = dataclasses.replace(cfg, num_stages=stages[0], seq_chunks=chunks[0], tiled_mlp=tiles[0])

    def line(chosen: TrainConfig, why: str) -> str:
        return (f"long rows: num_stages {chosen.num_stages}, seq_chunks {chosen.seq_chunks}, tiled_mlp "
                f"{chosen.tiled_mlp} ({', '.join(auto)} auto: {why})")

    quiet = auto == ["tiled_mlp"]  # the default alone: a line only when it tiles
    if device_type(cfg) != "cuda" or (quiet and gpu_capacity(cfg) is None):
        return first, "" if quiet else line(first, "no GPU, nothing to fit")
    cap = auto_capacity(cfg, auto[0], "a number")
    for k in chunks:
        for tiled in tiles:
            chosen = _fewest_stages(dataclasses.replace(cfg, seq_chunks=k, tiled_mlp=tiled), hf_config,
                                    world_size, stages)
            if chosen is not None:
                if quiet and chosen.tiled_mlp == "false":
                    return chosen, ""
                peak = assess(chosen, hf_config, sched.round_robin(chosen.num_stages, world_size)).worst.device_peak
                return chosen, line(chosen, f"the first that fits, estimated peak {gib(peak)} within "
                                            f"{USABLE_FRACTION:.0%} of {gib(cap)}")
    frugal = dataclasses.replace(cfg, num_stages=stages[-1], seq_chunks=chunks[-1], tiled_mlp=tiles[-1])
    return frugal, line(frugal, "nothing fits; the most frugal")


def longest_row(cfg: TrainConfig, hf_config, world_size: int, limit: int = 2**20,
                step: int = 1024) -> list[tuple[int, TrainConfig]]:
    """The longest ``seq_length`` (a multiple of ``step``, at most ``limit``) whose plan fits, as
    whole rows and with the most sequence segments ``cfg`` allows (the two ends: more segments
    hold less), each the most frugal way ``cfg`` leaves open (the most stages, a tiled MLP where
    allowed): (tokens, configuration) per seq_chunks tried, tokens 0 where none fits."""
    stages, chunks, tiles = _auto_options(dataclasses.replace(cfg, seq_length=limit), hf_config, world_size)
    out = []
    for k in dict.fromkeys((chunks[0], chunks[-1])):
        trial = dataclasses.replace(cfg, num_stages=stages[-1], seq_chunks=k, tiled_mlp=tiles[-1],
                                    allow_long_sequences=True)

        def fits(n: int) -> bool:
            t = dataclasses.replace(trial, seq_length=n * step)
            return k <= t.seq_length and _fits_here(assess(t, hf_config, sched.round_robin(t.num_stages, world_size)))

        lo, hi = 0, limit // step  # lo fits (0: nothing yet), hi may not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        out.append((lo * step, dataclasses.replace(trial, seq_length=lo * step)))
    return out


def longest_row_line(cfg: TrainConfig, hf_config, world_size: int) -> str:
    """``--plan``'s line on the longest row that fits this GPU (``longest_row``)."""
    cap = gib(gpu_capacity(cfg) or 0)
    found = [f"{n} tokens with num_stages {c.num_stages}, seq_chunks {c.seq_chunks}, tiled_mlp {c.tiled_mlp}"
             if n else f"less than 1024 tokens with seq_chunks {c.seq_chunks}"
             for n, c in longest_row(cfg, hf_config, world_size)]
    return f"longest row that fits {cap} (the plan's estimate, in steps of 1024): " + "; ".join(found)


__all__ = ["AUTO_SEQ_CHUNKS", "AUTO_TILED", "longest_row", "longest_row_line", "resolve_long_rows"]
