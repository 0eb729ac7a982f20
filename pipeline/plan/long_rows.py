"""Automatic choices for long rows: ``num_stages -1``, ``seq_chunks -1`` and ``tiled_mlp
auto`` resolved into the first configuration whose memory plan fits, in an order that is data
(``AUTO_SEQ_CHUNKS``, ``AUTO_TILED``), and the longest row that fits for ``--plan``."""
from __future__ import annotations

import dataclasses

import torch

import schedule as sched
from models import spec_for
from pipeline.config import TrainConfig
from pipeline.plan.fit import (USABLE_FRACTION, Assessment, assess, auto_capacity, device_type, gpu_capacity,
                               host_capacity)
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


def _fewest_stages(cfg: TrainConfig, hf_config, size: int, stages: list[int], data_parallel: int = 1
                   ) -> TrainConfig | None:
    """``cfg`` with the fewest of ``stages`` whose plan fits (``_fits_here``; found by bisection: a stage's memory
    falls as the stages grow), None when even the most do not fit. ``cfg``: one replica's pipeline, of
    ``data_parallel``."""
    def fits(S: int) -> bool:
        trial = dataclasses.replace(cfg, num_stages=S)
        return _fits_here(assess(trial, hf_config, sched.round_robin(S, size), replicas=(1, data_parallel)), trial)

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


def _host_known(cfg: TrainConfig) -> bool:
    """Whether the training machine's host memory is known here: on a machine with a GPU (that
    machine), or ``host_memory_gb`` given; ``--plan`` for a GPU on a machine without one, told
    nothing of the other's host, knows only the GPU's."""
    return torch.cuda.is_available() or bool(cfg.host_memory_gb)


def _fits_here(a: "Assessment", cfg: TrainConfig) -> bool:
    """What an automatic choice must fit: the GPU, and the host memory where it is known."""
    return a.fits if _host_known(cfg) else a.gpu_fits


def resolve_long_rows(cfg: TrainConfig, hf_config, world_size: int, data_parallel: int = 1
                      ) -> tuple[TrainConfig, str]:
    """``cfg`` (one replica's pipeline, of ``data_parallel``) with ``num_stages``, ``seq_chunks``
    and ``tiled_mlp`` decided where they are auto (-1, -1, auto), and a log line saying what was
    chosen; unchanged (and no line) when none is.

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
                                    world_size, stages, data_parallel)
            if chosen is not None:
                if quiet and chosen.tiled_mlp == "false":
                    return chosen, ""
                peak = assess(chosen, hf_config, sched.round_robin(chosen.num_stages, world_size),
                              replicas=(1, data_parallel)).worst.device_peak
                return chosen, line(chosen, f"the first that fits, estimated peak {gib(peak)} within "
                                            f"{USABLE_FRACTION:.0%} of {gib(cap)}")
    frugal = dataclasses.replace(cfg, num_stages=stages[-1], seq_chunks=chunks[-1], tiled_mlp=tiles[-1])
    return frugal, line(frugal, "nothing fits; the most frugal")


def longest_row(cfg: TrainConfig, hf_config, world_size: int, limit: int = 2**20,
                step: int = 1024) -> tuple[int, TrainConfig | None, int]:
    """The longest ``seq_length`` (a multiple of ``step``, at most ``limit``) that a run of ``cfg``
    with its automatic long-row choices would accept: some configuration of those ``cfg`` leaves
    open (``_auto_options``: stages, whole rows or segments, tiled or not) fits, as
    ``resolve_long_rows`` and ``check_fits`` would find it (the same ``_fits_here``: on a machine
    with a GPU, or with ``host_memory_gb``, the host memory too). Returns (tokens, the
    configuration ``resolve_long_rows`` picks at that length, the longest as whole rows);
    (0, None, 0) when not even ``step`` fits."""
    stages, chunks, tiles = _auto_options(dataclasses.replace(cfg, seq_length=limit), hf_config, world_size)
    base = dataclasses.replace(cfg, allow_long_sequences=True)

    def fits(n: int, ks: list[int]) -> bool:
        # the most stages hold the least a stage; whether fewer would do is resolve_long_rows' to find
        return any(_fits_here(assess(t, hf_config, sched.round_robin(t.num_stages, world_size)), t)
                   for k in ks if k <= n * step for tiled in tiles
                   for t in [dataclasses.replace(base, seq_length=n * step, num_stages=stages[-1], seq_chunks=k,
                                                 tiled_mlp=tiled)])

    def longest(ks: list[int]) -> int:
        lo, hi = 0, limit // step  # lo fits (0: nothing yet), hi may not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid, ks) else (lo, mid - 1)
        return lo * step

    whole = longest([1]) if 1 in chunks else 0
    tokens = longest(chunks) if chunks != [1] else whole
    if not tokens:
        return 0, None, 0
    at = dataclasses.replace(base, seq_length=tokens)
    if cfg.num_stages != -1 and cfg.seq_chunks != -1 and cfg.tiled_mlp != "auto":
        return tokens, at, whole
    return tokens, resolve_long_rows(at, hf_config, world_size)[0], whole


def longest_row_line(cfg: TrainConfig, hf_config, world_size: int) -> str:
    """``--plan``'s line on the longest row that fits this GPU (``longest_row``): what a run of
    that length would be given, and the longest as whole rows where segments go further."""
    cap = gib(gpu_capacity(cfg) or 0)
    if _host_known(cfg):
        cap += f" and {gib(host_capacity(cfg) or 0)} of host memory"
    rows = cfg.batch_size // cfg.num_chunks
    mbs = f"{cfg.num_chunks} micro-batch{'es' if cfg.num_chunks > 1 else ''}"
    head = f"longest row that fits {cap} ({mbs} of {rows} row{'s' if rows > 1 else ''}, the plan's " \
           f"estimate, in steps of 1024): "
    tokens, c, whole = longest_row(cfg, hf_config, world_size)
    if c is None:
        return head + "less than 1024 tokens"
    line = head + f"{tokens} tokens with num_stages {c.num_stages}, seq_chunks {c.seq_chunks}, tiled_mlp {c.tiled_mlp}"
    if c.seq_chunks > 1 and whole:
        line += f"; whole rows up to {whole} tokens"
    return line


__all__ = ["AUTO_SEQ_CHUNKS", "AUTO_TILED", "longest_row", "longest_row_line", "resolve_long_rows"]
