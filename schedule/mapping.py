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
from schedule.ir import COMPUTE_OPS, Op, Schedule, round_robin
from schedule.spec import ProgramSpec

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
        method: "exhaustive" or "greedy".
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
    stage_bytes: list[int],
    program: ProgramSpec,
    *,
    stage_compute_s: dict[int, tuple[float, float]] | None = None,
    link_gbps: float | list[float] = 25.0,
    root_gbps: float | dict[int, float] | None = None,
    gpu_ids: list[int] | None = None,
    step_s: float = 0.0,
    tokens_per_microbatch: int = 4096,
    tflops: float = 60.0,
    exhaustive_max: int = EXHAUSTIVE_MAX,
) -> MappingPlan:
    """Pick the rank -> GPU permutation with the smallest predicted step time.

    Args:
        topology_groups: root group of each GPU (``Topology.groups()``); one rank per GPU.
        stage_bytes: bytes one LOAD of each stage moves (parameters in the compute dtype).
        program: what the ranks' programs are built from; its ``num_stages`` must be a
            multiple of the GPUs (round-robin over them).
        stage_compute_s: ``{stage: (fwd s, bwd s)}`` per micro-batch; default
            ``estimate_compute_s(stage_bytes, tokens_per_microbatch, tflops)``.
        link_gbps: each GPU's host link, GB/s (one value or one per GPU).
        root_gbps: a root group's uplink per direction, GB/s; default the fastest link (the
            GPUs under one root share one x16 uplink).
        gpu_ids: physical ids of the GPUs in ``topology_groups`` order (default 0..N-1).
        exhaustive_max: largest GPU count searched exhaustively.
    """
    n, num_stages = len(topology_groups), program.num_stages
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
    stage_to_rank = round_robin(num_stages, n)
    actions = program.build(stage_to_rank)
    compute = stage_compute_s or estimate_compute_s(stage_bytes, tokens_per_microbatch, tflops)
    cost = _PermutationCost(actions, stage_to_rank, topology_groups, compute, stage_bytes, links, roots, step_s)
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
        evaluated=cost.evaluated,
    )


class _PermutationCost:
    """The predicted step time of a rank -> GPU permutation, each distinct one simulated once."""

    def __init__(self, actions: Schedule, stage_to_rank: list[int], topology_groups: list[int],
                 compute: dict[int, tuple[float, float]], stage_bytes: list[int], links: list[float],
                 roots: float | dict[int, float], step_s: float) -> None:
        self.actions, self.stage_to_rank, self.topology_groups = actions, stage_to_rank, topology_groups
        self.compute, self.stage_bytes, self.links, self.roots, self.step_s = compute, stage_bytes, links, roots, step_s
        self.cache: dict[tuple, float] = {}

    @property
    def evaluated(self) -> int:
        """Distinct permutations simulated so far."""
        return len(self.cache)

    def root_gbps(self, group: int) -> float:
        return float(self.roots) if isinstance(self.roots, (int, float)) else float(self.roots[group])

    def __call__(self, perm: tuple[int, ...]) -> float:
        # The cost model sees only each rank's (root pattern, link, root bandwidth): rename
        # roots by first use so that equivalent permutations are simulated once.
        groups = self.topology_groups
        names: dict[int, int] = {}
        key = tuple((names.setdefault(groups[g], len(names)), self.links[g], self.root_gbps(groups[g])) for g in perm)
        if key not in self.cache:
            self.cache[key] = predict(self.actions, self.stage_to_rank, list(perm), groups, self.compute,
                                      self.stage_bytes, self.links, self.roots, step_s=self.step_s).step_time
        return self.cache[key]


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


# --- from a plan to the trainer's stage -> rank mapping -----------------------------------------
MAPPING_MODES = ("planned", "round_robin")
# Earlier names, still accepted (with a warning): they did one of the two things above.
RENAMED_MAPPING_MODES = {"auto": "planned", "cross": "planned", "sequential": "round_robin", "manual": "round_robin"}
DEFAULT_TFLOPS = 60.0  # achieved bf16 TFLOP/s per GPU assumed for compute when nothing was measured


def position_mapping(position_rank: Sequence[int], num_stages: int) -> list[int]:
    """Stage -> rank mapping that is round-robin over pipeline *positions*, position ``p``
    being played by rank ``position_rank[p]``: stage ``s`` runs on ``position_rank[s % N]``.

    This is how a rank -> GPU permutation is applied once the processes exist: instead of
    moving rank ``p`` onto GPU ``gpu_of_rank[p]`` (which needs ``CUDA_VISIBLE_DEVICES`` before
    launch), the rank already sitting on that GPU takes position ``p``'s stages.
    """
    n = len(position_rank)
    if sorted(position_rank) != list(range(n)):
        raise ValueError(f"position_rank {list(position_rank)} must be a permutation of ranks 0..{n - 1}")
    if num_stages < n or num_stages % n:
        raise ValueError(f"num_stages ({num_stages}) must be a positive multiple of the {n} ranks")
    return [position_rank[s % n] for s in range(num_stages)]


@dataclass(frozen=True)
class MappingChoice:
    """What the trainer runs with, and why.

    Attributes:
        mode: the ``mapping`` setting that was asked for.
        stage_to_rank: ``stage_to_rank[s]`` is the rank of stage ``s``.
        position_rank: rank playing pipeline position ``p`` (identity = round-robin).
        start_offset_s: per rank, seconds its host waits at the start of an iteration
            (load staggering, ``plan_stagger``); all zero when not staggered.
        reason: one line for the log: which mapping, why, predicted step times.
        plan: the planner's result when it ran.
    """

    mode: str
    stage_to_rank: list[int]
    position_rank: list[int]
    start_offset_s: list[float]
    reason: str
    plan: MappingPlan | None = None


def choose_mapping(
    mode: str,
    num_ranks: int,
    program: ProgramSpec,
    *,
    rank_groups: list[int] | None,
    rank_link_gbps: list[float] | None = None,
    stage_bytes: list[int] | None = None,
    stage_compute_s: dict[int, tuple[float, float]] | None = None,
    tokens_per_microbatch: int = 4096,
    tflops: float = DEFAULT_TFLOPS,
    has_gpus: bool = True,
    stagger: bool = True,
    visible_devices: str = "",
    topology_source: str = "",
) -> MappingChoice:
    """Decide the stage -> rank mapping for ``mode`` (one of ``MAPPING_MODES``). Pure: every
    rank given the same inputs gets the same answer.

    Args:
        rank_groups: root group of the GPU each rank runs on (rank order), None if unknown.
        rank_link_gbps: host link GB/s of each rank's GPU (default 25 each).
        program: what the ranks' programs are built from (stages included).
        stage_bytes: bytes a LOAD of each stage moves.
        has_gpus: the ranks run on GPUs ("auto" plans only then).
        stagger: let ``plan_stagger`` hold back ranks whose first load would slow an
            earlier stage's load under the same root.
        visible_devices: ``CUDA_VISIBLE_DEVICES`` as given (named in round_robin's log line).
    """
    if mode not in MAPPING_MODES:
        raise ValueError(f"mapping {mode!r}: choose one of {', '.join(MAPPING_MODES)}")
    num_stages, offload, prefetch = program.num_stages, program.offload, program.prefetch
    identity = list(range(num_ranks))
    zeros = [0.0] * num_ranks

    def fixed(reason: str) -> MappingChoice:
        return MappingChoice(mode, position_mapping(identity, num_stages), identity, zeros, reason)

    if mode == "round_robin":
        gpus = f", rank r on the r-th GPU of CUDA_VISIBLE_DEVICES={visible_devices}" if visible_devices else ""
        return fixed(f"mapping round_robin: stage s on rank s % {num_ranks}{gpus} (asked for; planner not run)")
    why_not = None
    if rank_groups is None:  # a topology file plans without GPUs too: what-if plans and CPU tests
        why_not = "GPU topology unknown (nvidia-smi and sysfs gave nothing; set topology: <file>)" if has_gpus \
            else "no GPUs"  # nothing to place: no advice about GPU topologies
    elif len(rank_groups) != num_ranks:
        why_not = f"topology describes {len(rank_groups)} GPUs for {num_ranks} ranks"
    elif stage_bytes is None:
        why_not = "stage sizes unknown"
    elif not offload:
        why_not = "use_offload is off (no parameter loads to spread)"
    if why_not is not None:
        return fixed(f"mapping planned -> round_robin: {why_not}")
    links = rank_link_gbps or [25.0] * num_ranks
    plan = plan_mapping(rank_groups, stage_bytes, program, stage_compute_s=stage_compute_s, link_gbps=links,
                        gpu_ids=identity, tokens_per_microbatch=tokens_per_microbatch, tflops=tflops)
    stage_to_rank = position_mapping(plan.gpu_of_rank, num_stages)
    offsets, note = zeros, ""
    if stagger and offload and prefetch:
        compute = stage_compute_s or estimate_compute_s(stage_bytes, tokens_per_microbatch, tflops)
        st = plan_stagger(program.build(stage_to_rank), stage_to_rank, identity, rank_groups, compute, stage_bytes,
                          links, max(links))
        offsets = st.offsets
        note = (f"; load stagger: rank start offsets {[float(f'{o:.3g}') for o in offsets]} s, predicted step "
                f"{st.base_step_time:.4g}s -> {st.step_time:.4g}s" if any(offsets) else
                "; load stagger: none predicted to help")
    source = f" from {topology_source}" if topology_source else ""
    gain = 1.0 - plan.step_time / plan.sequential_step_time if plan.sequential_step_time > 0 else 0.0
    reason = (f"mapping {mode}: stage -> rank {stage_to_rank} (position p on rank {plan.gpu_of_rank}[p]; roots of "
              f"the ranks' GPUs {rank_groups}{source}); predicted step {plan.step_time:.4g}s, round_robin "
              f"{plan.sequential_step_time:.4g}s ({gain:+.1%} saved), worst {plan.worst_step_time:.4g}s "
              f"(position p on rank {plan.worst_gpu_of_rank}[p]){note}")
    return MappingChoice(mode, stage_to_rank, list(plan.gpu_of_rank), offsets, reason, plan)


# --- load staggering ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stagger:
    """Per-rank start offsets and their predicted effect (``offsets`` all zero: not worth it)."""

    offsets: list[float]
    step_time: float
    base_step_time: float


def plan_stagger(
    program: Schedule,
    stage_to_rank: list[int],
    gpu_of_rank: list[int],
    groups: list[int],
    stage_compute_s: dict[int, tuple[float, float]],
    stage_bytes: Sequence[int],
    link_gbps: float | Sequence[float],
    root_gbps: float | dict[int, float],
    *,
    step_s: float = 0.0,
) -> Stagger:
    """Hold back ranks whose first LOAD would share a root with an earlier-needed one.

    At the start of an iteration every rank issues its first LOAD at once; under a shared
    root they split its bandwidth, so the load of the stage that computes first (on the
    critical path) takes longer than it needs to. Per root group, ranks are taken in the
    order their first compute starts (predicted without offsets); each later rank waits
    until the earlier ranks' first loads would be done alone, but never so long that its own
    first load (alone) could not end before its first compute would have started. The
    offsets are kept only if the cost model predicts a shorter step with them; the trainer
    applies them as a host wait before the rank's first action (the host is in step with the
    device then: the previous iteration ended with a synchronize).
    """
    ranks = sorted(program)
    base = predict(program, stage_to_rank, gpu_of_rank, groups, stage_compute_s, stage_bytes, link_gbps,
                   root_gbps, step_s=step_s)
    alone, first_need = {}, {}
    for r in ranks:
        first_load = next((a for a in program[r] if a.op is Op.LOAD), None)
        first_comp = next((s for s, _, a in base.timeline[r] if a.op in COMPUTE_OPS), None)
        if first_load is None or first_comp is None:
            continue
        g = gpu_of_rank[r]
        root = root_gbps if isinstance(root_gbps, (int, float)) else root_gbps[groups[g]]
        link = link_gbps if isinstance(link_gbps, (int, float)) else link_gbps[g]
        alone[r] = stage_bytes[first_load.stage] / (min(float(link), float(root)) * 1e9)
        first_need[r] = first_comp
    offsets = [0.0] * len(ranks)
    for root in sorted({groups[gpu_of_rank[r]] for r in alone}):
        t = 0.0
        for r in sorted((r for r in alone if groups[gpu_of_rank[r]] == root), key=lambda r: (first_need[r], r)):
            offsets[r] = max(0.0, min(t, first_need[r] - alone[r]))
            t = offsets[r] + alone[r]
    if not any(offsets):
        return Stagger(offsets, base.step_time, base.step_time)
    staggered = predict(program, stage_to_rank, gpu_of_rank, groups, stage_compute_s, stage_bytes, link_gbps,
                        root_gbps, step_s=step_s, start_offset_s=offsets)
    if staggered.step_time < base.step_time * (1 - _REL_TIE):
        return Stagger(offsets, staggered.step_time, base.step_time)
    return Stagger([0.0] * len(ranks), base.step_time, base.step_time)


# --- comparing mappings (for --plan and the simulated table) ---------------------------------------
@dataclass(frozen=True)
class MappingRow:
    """One mapping's prediction. ``exposed_transfer_s`` is the largest over ranks."""

    name: str
    gpu_of_rank: list[int]
    step_time: float
    bubble_fraction: float
    exposed_transfer_s: float
    staggered_step_time: float
    offsets: list[float]


def compare_mappings(
    topology_groups: list[int],
    stage_bytes: list[int],
    program: ProgramSpec,
    *,
    stage_compute_s: dict[int, tuple[float, float]] | None = None,
    tokens_per_microbatch: int = 4096,
    tflops: float = DEFAULT_TFLOPS,
    link_gbps: float | list[float] = 25.0,
    root_gbps: float | dict[int, float] | None = None,
    gpu_ids: list[int] | None = None,
) -> tuple[MappingPlan, list[MappingRow]]:
    """Plan the mapping, then predict the cross (chosen), sequential (identity) and worst
    mappings in detail, each without and with load staggering. Arguments as ``plan_mapping``."""
    n = len(topology_groups)
    ids = list(range(n)) if gpu_ids is None else list(gpu_ids)
    links = [float(link_gbps)] * n if isinstance(link_gbps, (int, float)) else [float(x) for x in link_gbps]
    roots = root_gbps if root_gbps is not None else max(links)
    compute = stage_compute_s or estimate_compute_s(stage_bytes, tokens_per_microbatch, tflops)
    plan = plan_mapping(topology_groups, stage_bytes, program, stage_compute_s=compute, link_gbps=links,
                        root_gbps=roots, gpu_ids=ids)
    stage_to_rank = plan.stage_to_rank
    actions = program.build(stage_to_rank)
    rows = []
    for name, gpus in (("cross", plan.gpu_of_rank), ("sequential", ids), ("worst", plan.worst_gpu_of_rank)):
        perm = [ids.index(g) for g in gpus]
        p = predict(actions, stage_to_rank, perm, topology_groups, compute, stage_bytes, links, roots)
        st = (plan_stagger(actions, stage_to_rank, perm, topology_groups, compute, stage_bytes, links, roots)
              if program.offload and program.prefetch else Stagger([0.0] * n, p.step_time, p.step_time))
        rows.append(MappingRow(name, list(gpus), p.step_time, p.bubble_fraction,
                               max(p.exposed_transfer_s.values(), default=0.0), st.step_time, st.offsets))
    return plan, rows


def describe_plan(
    topology_groups: list[int],
    stage_params: Sequence[int],
    program: ProgramSpec,
    seq_length: int,
    micro_batch_size: int,
    *,
    gpu_ids: list[int] | None = None,
    link_gbps: float | list[float] = 25.0,
    root_gbps: float | dict[int, float] | None = None,
    bytes_per_param: int = 2,
    tflops: float = DEFAULT_TFLOPS,
) -> str:
    """Text block for ``--plan``: the chosen rank -> GPU mapping, the ``CUDA_VISIBLE_DEVICES``
    order that realises it, and predicted step time / bubble / exposed transfer time of the
    cross, sequential and worst mappings (without and with load staggering).

    Args:
        topology_groups: root group of each GPU (``Topology.groups()``), one rank per GPU.
        stage_params: parameter count of each stage (``len`` = ``program.num_stages``).
        program: what the ranks' programs are built from.
        seq_length, micro_batch_size: tokens of a micro-batch = their product.
        gpu_ids: physical GPU ids in ``topology_groups`` order (``Topology.indices()``).
        link_gbps, root_gbps: host link / root uplink GB/s (``Topology.link_gbps()``).
        bytes_per_param: bytes per parameter of the compute copy (2 for bf16).
        tflops: achieved TFLOP/s per GPU assumed for forward (2 FLOPs / param / token) and
            backward (twice that).
    """
    stage_bytes = [int(p) * bytes_per_param for p in stage_params]
    if len(stage_bytes) != program.num_stages:
        raise ValueError(f"stage_params has {len(stage_bytes)} entries but the program has {program.num_stages} stages")
    tokens = seq_length * micro_batch_size
    schedule_name, num_microbatches = program.schedule, program.num_microbatches
    offload, prefetch, resident = program.offload, program.prefetch, program.resident
    plan, rows = compare_mappings(topology_groups, stage_bytes, program, tokens_per_microbatch=tokens, tflops=tflops,
                                  link_gbps=link_gbps, root_gbps=root_gbps, gpu_ids=gpu_ids)
    ids = list(range(len(topology_groups))) if gpu_ids is None else list(gpu_ids)
    roots = " ".join(f"GPU{g}:{chr(65 + r) if r < 26 else r}" for g, r in zip(ids, topology_groups))
    links = link_gbps if isinstance(link_gbps, (int, float)) else "/".join(f"{x:g}" for x in link_gbps)
    lines = [
        f"mapping plan: {len(stage_bytes)} stages on {len(ids)} GPUs, schedule {schedule_name}, "
        f"{num_microbatches} micro-batches of {micro_batch_size}x{seq_length} tokens, offload={offload} "
        f"prefetch={prefetch}" + (f" resident_stages={resident}" if offload and resident else ""),
        f"  root complexes: {roots}; host links {links} GB/s, shared per root",
        f"  chosen: rank -> GPU {plan.gpu_of_rank} ({plan.method}, {plan.evaluated} simulations); launch with "
        f"CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES={plan.cuda_visible_devices} "
        f"(or mapping: cross, which permutes stages instead)",
        f"  {'mapping':<10} {'rank -> GPU':<24} {'step s':>8} {'bubble':>7} {'exposed xfer s':>15} "
        f"{'staggered step s':>17}",
    ]
    for row in rows:
        lines.append(f"  {row.name:<10} {str(row.gpu_of_rank):<24} {row.step_time:>8.3f} "
                     f"{row.bubble_fraction:>7.1%} {row.exposed_transfer_s:>15.3f} {row.staggered_step_time:>17.3f}")
    lines.append(f"  assumed: {tflops:g} TFLOP/s per GPU, {bytes_per_param} bytes/param loaded and offloaded, "
                 f"optimizer step time not modelled (the same for every mapping)")
    return "\n".join(lines)
