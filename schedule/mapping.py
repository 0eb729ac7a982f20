"""Choose which physical GPU each pipeline rank runs on, to limit PCIe contention (pure).

Stages go to ranks round-robin (rank ``r`` runs stages ``r, r + N, ...``), and consecutive
stages load their parameters (and offload their gradients) close in time. GPUs under one
root group share its uplink to host memory, so ranks that hold consecutive stages should
sit under different roots ("cross mapping"). The stage -> rank mapping is fixed; what is
chosen is the permutation ``gpu_of_rank``: rank ``r`` runs on physical GPU ``gpu_of_rank[r]``.

Every candidate is scored with the cost model (``schedule/costmodel.py``): its predicted
step time. Up to ``exhaustive_max`` GPUs every permutation is considered (permutations that
look the same to the cost model, i.e. the same root pattern up to renaming, are simulated
once); above that a greedy construction is refined by pairwise swaps. Ties go to the
permutation closest to the identity (the sequential mapping).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

from schedule.costmodel import predict
from schedule.ir import Schedule, round_robin
from schedule.lower import build as build_schedule

EXHAUSTIVE_MAX = 8   # 8! = 40320 permutations: still well under a second of bookkeeping
_REL_TIE = 1e-9      # step times this close (relative) are a tie


@dataclass(frozen=True)
class MappingPlan:
    """The chosen rank -> GPU permutation and what the cost model predicts for it.

    Attributes:
        gpu_of_rank: rank ``r`` runs on GPU ``gpu_of_rank[r]`` (ids as given in ``gpu_ids``).
        stage_to_rank: ``stage_to_rank[s]`` is the rank of stage ``s`` (round-robin).
        step_time: predicted seconds per iteration of the chosen mapping.
        sequential_step_time: predicted for the identity mapping (rank r on the r-th GPU).
        worst_step_time / worst_gpu_of_rank: the slowest mapping considered.
        method: "exhaustive", "greedy" or "manual".
        evaluated: distinct cost-model runs made.
    """

    gpu_of_rank: list[int]
    stage_to_rank: list[int]
    step_time: float
    sequential_step_time: float
    worst_step_time: float
    worst_gpu_of_rank: list[int]
    method: str
    evaluated: int

    @property
    def cuda_visible_devices(self) -> str:
        """Value for ``CUDA_VISIBLE_DEVICES`` (with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``) so that
        local rank r gets device r = GPU ``gpu_of_rank[r]``."""
        return ",".join(str(g) for g in self.gpu_of_rank)

    def describe(self) -> str:
        gain = 1.0 - self.step_time / self.sequential_step_time if self.sequential_step_time > 0 else 0.0
        return (f"mapping: rank -> GPU {self.gpu_of_rank} ({self.method}, {self.evaluated} simulations): predicted "
                f"step {self.step_time:.3f}s, sequential {self.sequential_step_time:.3f}s ({gain:+.1%} saved), "
                f"worst {self.worst_step_time:.3f}s with {self.worst_gpu_of_rank}")


def manual_mapping(cuda_visible_devices: list[int]) -> tuple[list[int], str]:
    """The user's own GPU order, unchanged: when they set it, the planner does not run."""
    return list(cuda_visible_devices), (f"CUDA_VISIBLE_DEVICES={','.join(map(str, cuda_visible_devices))} was set "
                                        f"by the user: rank r uses its r-th GPU; mapping planner not run")


def estimate_compute_s(stage_bytes: Sequence[int], tokens_per_microbatch: int, tflops: float,
                       bytes_per_param: int = 2) -> dict[int, tuple[float, float]]:
    """Rough (forward, backward) seconds per micro-batch: 2 FLOPs per parameter and token
    forward, twice that backward, at ``tflops`` achieved (attention is ignored)."""
    out = {}
    for s, b in enumerate(stage_bytes):
        fwd = 2.0 * (b / bytes_per_param) * tokens_per_microbatch / (tflops * 1e12)
        out[s] = (fwd, 2.0 * fwd)
    return out


def plan_mapping(
    topology_groups: list[int],
    num_stages: int,
    stage_bytes: list[int],
    schedule_name: str,
    num_microbatches: int,
    *,
    stage_compute_s: dict[int, tuple[float, float]] | None = None,
    link_gbps: float | list[float] = 25.0,
    root_gbps: float | dict[int, float] | None = None,
    gpu_ids: list[int] | None = None,
    offload: bool = True,
    prefetch: bool = True,
    clip: bool = False,
    step_s: float = 0.0,
    tokens_per_microbatch: int = 4096,
    tflops: float = 60.0,
    exhaustive_max: int = EXHAUSTIVE_MAX,
    build: Callable[..., Schedule] | None = None,
) -> MappingPlan:
    """Pick the rank -> GPU permutation with the smallest predicted step time.

    Args:
        topology_groups: root group of each GPU (``Topology.groups()``); one rank per GPU.
        num_stages: pipeline stages, >= number of GPUs (round-robin over the GPUs).
        stage_bytes: bytes one LOAD of each stage moves (parameters in the compute dtype).
        schedule_name, num_microbatches, offload, prefetch, clip: as for ``schedule.lower.build``.
        stage_compute_s: ``{stage: (fwd s, bwd s)}`` per micro-batch; default
            ``estimate_compute_s(stage_bytes, tokens_per_microbatch, tflops)``.
        link_gbps: each GPU's host link, GB/s (one value or one per GPU).
        root_gbps: a root group's uplink per direction, GB/s; default the fastest link (the
            GPUs under one root share one x16 uplink).
        gpu_ids: physical ids of the GPUs in ``topology_groups`` order (default 0..N-1).
        exhaustive_max: largest GPU count searched exhaustively.
        build: schedule builder, default ``schedule.lower.build``.
    """
    n = len(topology_groups)
    if n < 1:
        raise ValueError("topology_groups is empty: need the root group of at least one GPU")
    if len(stage_bytes) != num_stages:
        raise ValueError(f"stage_bytes has {len(stage_bytes)} entries ({stage_bytes}) but num_stages is {num_stages}")
    ids = list(range(n)) if gpu_ids is None else list(gpu_ids)
    if len(ids) != n:
        raise ValueError(f"gpu_ids {ids} must name the {n} GPUs of topology_groups {topology_groups}")
    links = [float(link_gbps)] * n if isinstance(link_gbps, (int, float)) else [float(x) for x in link_gbps]
    if len(links) != n:
        raise ValueError(f"link_gbps has {len(links)} values ({links}) for {n} GPUs")
    roots = root_gbps if root_gbps is not None else max(links)
    build = build or build_schedule
    stage_to_rank = round_robin(num_stages, n)
    program = build(schedule_name, num_stages, num_microbatches, stage_to_rank, offload=offload,
                    prefetch=prefetch, clip=clip)
    compute = stage_compute_s or estimate_compute_s(stage_bytes, tokens_per_microbatch, tflops)
    root_of = (lambda g: float(roots)) if isinstance(roots, (int, float)) else (lambda g: float(roots[g]))
    cache: dict[tuple, float] = {}

    def cost(perm: tuple[int, ...]) -> float:
        # The cost model sees only each rank's (root pattern, link, root bandwidth): rename
        # roots by first use so that equivalent permutations are simulated once.
        names: dict[int, int] = {}
        key = tuple((names.setdefault(topology_groups[g], len(names)), links[g], root_of(topology_groups[g]))
                    for g in perm)
        if key not in cache:
            cache[key] = predict(program, stage_to_rank, list(perm), topology_groups, compute, stage_bytes,
                                 links, roots, step_s=step_s).step_time
        return cache[key]

    identity = tuple(range(n))
    if n <= exhaustive_max:
        candidates = list(itertools.permutations(range(n)))
        method = "exhaustive"
    else:
        candidates = _greedy_candidates(topology_groups, cost)
        method = "greedy"
    scored = [(cost(p), p) for p in candidates]
    best_t = min(t for t, _ in scored)
    ties = [p for t, p in scored if t <= best_t * (1 + _REL_TIE) + 1e-12]
    best = min(ties, key=lambda p: (sum(a != b for a, b in zip(p, identity)), p))
    worst_t, worst = max(scored, key=lambda x: x[0])  # the first of equal worst ones
    return MappingPlan(
        gpu_of_rank=[ids[g] for g in best],
        stage_to_rank=stage_to_rank,
        step_time=best_t,
        sequential_step_time=cost(identity),
        worst_step_time=worst_t,
        worst_gpu_of_rank=[ids[g] for g in worst],
        method=method,
        evaluated=len(cache),
    )


def _greedy_candidates(groups: list[int], cost: Callable[[tuple[int, ...]], float],
                       max_passes: int = 3) -> list[tuple[int, ...]]:
    """Cross mapping by construction, then pairwise-swap descent on the cost model.

    Construction: rank by rank, take the lowest-numbered free GPU of the root group used
    least recently (ties: more free GPUs, then lower group id), so consecutive ranks
    alternate roots as long as possible. Returns every permutation evaluated, including the
    identity and the grouped mapping (GPUs sorted by root), so the caller can report both.
    """
    n = len(groups)
    free = {g: sorted(i for i in range(n) if groups[i] == g) for g in sorted(set(groups))}
    last_used = {g: -1 for g in free}
    perm = []
    for r in range(n):
        g = min((g for g in free if free[g]), key=lambda g: (last_used[g], -len(free[g]), g))
        perm.append(free[g].pop(0))
        last_used[g] = r
    seen = [tuple(range(n)), tuple(sorted(range(n), key=lambda i: (groups[i], i))), tuple(perm)]
    best, best_t = tuple(perm), cost(tuple(perm))
    for _ in range(max_passes):
        improved = False
        for i, j in itertools.combinations(range(n), 2):
            if groups[best[i]] == groups[best[j]]:
                continue  # two GPUs of one root: the swap changes no contention
            p = list(best)
            p[i], p[j] = p[j], p[i]
            t = cost(tuple(p))
            seen.append(tuple(p))
            if t < best_t * (1 - _REL_TIE):
                best, best_t, improved = tuple(p), t, True
        if not improved:
            break
    return seen
