"""Schedule generators: the compute-only order (F and B actions) of every rank.

All schedules come from one list-scheduling engine, a small discrete simulation with
forward cost 1 and backward cost 2. Each rank has a fixed forward order, a fixed backward
order and a warm-up count ``W``; whenever it is idle it takes its next forward while at most
``W`` forwards are in flight (forward done, backward not yet), else its next backward. A
rank whose preferred action is not ready waits, or in the 1F1B family runs a ready backward
instead of a forward that is not ready (it would idle, and a backward only frees memory).
Steady state is strict: at most ``W + 1`` forwards (and their activations) are ever in
flight, as in the real schedules. With a partial last group of micro-batches the strict
Megatron order would stall; the backfill rule is what keeps any ``M >= 1`` working.

The schedules differ only in their orders and warm-up counts:

* ``gpipe``: forwards stage by stage, then backwards stage by stage; ``W`` = all forwards.
* ``interleaved``: Megatron's interleaved 1F1B; micro-batches in groups of ``N`` (ranks),
  chunk-major inside a group, ``W_r = 2 (N - r - 1) + (v - 1) N``.
* ``1f1b``: the same with one group of all ``M`` micro-batches (breadth-first / looped
  1F1B); with one stage per rank both are classic 1F1B, ``W_r = N - r - 1``.

With ``num_segments`` K > 1 (sequence-level pipelining, Seq1F1B) each micro-batch's rows are
cut into K sequence segments and the unit of work is (rows, segment): forwards take the
segments in order, backwards in reverse (the last segment first, since its key/value gradients
flow to the earlier ones), and a segment waits for its neighbour of the same rows at the same
stage (``schedule.ir.kv_predecessor``) as well as for its producer. The warm-up counts segments:
a rank must hold the K forwards of one micro-batch before the backward of its last segment can
start, so ``W_r`` grows by ``K - 1`` (and the interleaved group term by a factor of K).
"""
from __future__ import annotations

import math

from schedule.ir import Action, Op, Schedule, kv_predecessor, producer, round_robin, segment_indices, stages_of

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved")
# Costs the engine orders by; the simulator in validate.py uses the same defaults.
FORWARD_COST = 1.0
BACKWARD_COST = 2.0


def check_mapping(num_stages: int, num_microbatches: int, mapping: list[int] | None,
                  num_segments: int = 1) -> tuple[list[int], int]:
    """The stage -> rank mapping a generator uses (``mapping``, default one stage per rank) and
    its number of ranks; raise if the arguments are malformed."""
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches ({num_microbatches}) must be >= 1")
    if num_segments < 1:
        raise ValueError(f"num_segments ({num_segments}) must be >= 1 (1: whole sequences)")
    if mapping is None:
        mapping = round_robin(num_stages, num_stages)
    if num_stages < 1:
        raise ValueError(f"num_stages ({num_stages}) must be >= 1")
    if len(mapping) != num_stages:
        raise ValueError(f"mapping has {len(mapping)} entries ({mapping}) but num_stages is {num_stages}")
    num_ranks = max(mapping) + 1
    idle = [r for r in range(num_ranks) if r not in mapping]
    if min(mapping) < 0 or idle:
        raise ValueError(f"mapping {mapping} must give every rank 0..{num_ranks - 1} at least one stage; "
                         f"ranks without a stage: {idle}")
    return mapping, num_ranks


def generate(name: str, num_stages: int, num_microbatches: int, mapping: list[int] | None = None,
             num_segments: int = 1) -> Schedule:
    """Compute-only schedule (F and B actions) of every rank.

    Args:
        name: one of ``SCHEDULE_NAMES``.
        num_stages: number of pipeline stages (virtual stages included).
        num_microbatches: micro-batches per iteration, >= 1.
        mapping: ``mapping[s]`` is the rank of stage ``s``; default one stage per rank. For
            virtual stages pass ``round_robin(num_stages, world_size)``.
        num_segments: sequence segments per micro-batch (K); 1 leaves ``seg`` None.

    Returns:
        ``{rank: [Action, ...]}``; a rank's chunks are its stages in ascending order.
    """
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {list(SCHEDULE_NAMES)}")
    mapping, num_ranks = check_mapping(num_stages, num_microbatches, mapping, num_segments)
    # A rank's place in the pipeline is the order of its first stage (rank r under round-robin).
    firsts = sorted(range(num_ranks), key=lambda r: stages_of(r, mapping)[0])
    position = {r: i for i, r in enumerate(firsts)}

    f_orders, b_orders, warmups = {}, {}, {}
    for r in range(num_ranks):
        stages = stages_of(r, mapping)
        num_chunks = len(stages)
        group = num_ranks if name == "interleaved" else num_microbatches
        f_orders[r], b_orders[r] = _grouped_orders(stages, num_microbatches, group, num_segments)
        total = len(f_orders[r])
        if name == "gpipe":
            warmups[r] = total
        elif num_chunks == 1:
            warmups[r] = min(total, num_ranks - position[r] - 1 + num_segments - 1)
        else:
            warmups[r] = min(total, 2 * (num_ranks - position[r] - 1) + (num_chunks - 1) * group * num_segments
                             + num_segments - 1)
    return list_schedule(f_orders, b_orders, warmups, num_stages, backfill=name != "gpipe", num_segments=num_segments)


def _grouped_orders(stages: list[int], num_microbatches: int, group: int,
                    num_segments: int = 1) -> tuple[list[Action], list[Action]]:
    """Forward and backward orders: micro-batch groups in turn, chunk-major inside a group; a
    micro-batch's segments in order for forwards, in reverse for backwards."""
    fsegs = segment_indices(num_segments)
    bsegs = fsegs[::-1]
    forwards, backwards = [], []
    for first in range(0, num_microbatches, group):
        mbs = range(first, min(first + group, num_microbatches))
        forwards += [Action(s, Op.FORWARD, m, j) for s in stages for m in mbs for j in fsegs]
        backwards += [Action(s, Op.BACKWARD, m, j) for s in reversed(stages) for m in mbs for j in bsegs]
    return forwards, backwards


def list_schedule(
    f_orders: dict[int, list[Action]],
    b_orders: dict[int, list[Action]],
    warmups: dict[int, int],
    num_stages: int,
    backfill: bool = True,
    num_segments: int = 1,
) -> Schedule:
    """Merge each rank's forward and backward orders by simulating the pipeline.

    An idle rank takes its next forward while at most ``warmups[r]`` forwards are in flight,
    else its next backward, and waits if that one is not ready. With ``backfill`` a rank whose
    next forward is not ready takes its next backward instead when that one is ready (it would
    idle otherwise, and a backward only frees memory). If every rank waits (a warm-up count too
    small for an unusual mapping), the smallest relaxation is made: idle ranks take a ready
    backward, or else the lowest idle rank takes a ready extra forward. This cannot stall when
    the orders are consistent with one global order, as those built here are. With
    ``num_segments`` > 1 an action is ready only once its ``kv_predecessor`` has finished too.

    Raises:
        ValueError: the orders are inconsistent (every rank waits and nothing is ready).
    """
    merge = _OrderMerge(f_orders, b_orders, num_stages, num_segments)
    while not all(merge.finished(r) for r in merge.out):
        idle = [r for r in merge.out if merge.free[r] <= merge.now and not merge.finished(r)]
        started = False
        for r in idle:
            f, b = merge.next_f(r), merge.next_b(r)
            want_forward = f is not None and (b is None or merge.in_flight(r) <= warmups[r])
            a = f if want_forward else b
            if backfill and want_forward and not merge.ready(a) and merge.ready(b):
                a = b  # idle otherwise; a backward only frees memory
            if merge.ready(a):
                merge.start(r, a)
                started = True
        if not started and all(merge.free[r] <= merge.now for r in merge.out):
            merge.relax(idle)
        busy = [merge.free[r] for r in merge.out if merge.free[r] > merge.now]
        if busy:
            merge.now = min(busy)
    return merge.out


class _OrderMerge:
    """The state of ``list_schedule``'s simulation: how far each rank is in its forward and
    backward orders, when it is free, the computes done and the clock."""

    def __init__(self, f_orders: dict[int, list[Action]], b_orders: dict[int, list[Action]], num_stages: int,
                 num_segments: int) -> None:
        self.f_orders, self.b_orders = f_orders, b_orders
        self.num_stages, self.num_segments = num_stages, num_segments
        self.done: dict[Action, float] = {}  # compute action -> finish time
        self.out: Schedule = {r: [] for r in f_orders}
        self.num_forwards = {r: 0 for r in f_orders}
        self.num_backwards = {r: 0 for r in f_orders}
        self.free = {r: 0.0 for r in f_orders}
        self.now = 0.0

    def ready(self, a: Action | None) -> bool:
        if a is None:
            return False
        d, kv = producer(a, self.num_stages), kv_predecessor(a, self.num_segments)
        return ((d is None or self.done.get(d, math.inf) <= self.now)
                and (kv is None or self.done.get(kv, math.inf) <= self.now))

    def next_f(self, r: int) -> Action | None:
        return self.f_orders[r][self.num_forwards[r]] if self.num_forwards[r] < len(self.f_orders[r]) else None

    def next_b(self, r: int) -> Action | None:
        return self.b_orders[r][self.num_backwards[r]] if self.num_backwards[r] < len(self.b_orders[r]) else None

    def start(self, r: int, a: Action) -> None:
        if a.op is Op.FORWARD:
            self.num_forwards[r] += 1
        else:
            self.num_backwards[r] += 1
        self.free[r] = self.now + (FORWARD_COST if a.op is Op.FORWARD else BACKWARD_COST)
        self.done[a] = self.free[r]
        self.out[r].append(a)

    def in_flight(self, r: int) -> int:
        """Forwards rank ``r`` has taken whose backward it has not."""
        return self.num_forwards[r] - self.num_backwards[r]

    def finished(self, r: int) -> bool:
        return self.num_forwards[r] == len(self.f_orders[r]) and self.num_backwards[r] == len(self.b_orders[r])

    def relax(self, idle: list[int]) -> None:
        """Every rank waits on another: relax the warm-up rule, backwards first (they free memory)."""
        relaxed = [r for r in idle if self.ready(self.next_b(r))]
        if not relaxed:
            relaxed = [r for r in idle if self.ready(self.next_f(r))][:1]
        if not relaxed:
            waiting = {r: (self.next_f(r), self.next_b(r)) for r in idle}
            raise ValueError(f"schedule engine stalled at time {self.now}: next (forward, backward) per rank "
                             f"{waiting}; the forward/backward orders are inconsistent")
        for r in relaxed:
            self.start(r, self.next_b(r) if self.ready(self.next_b(r)) else self.next_f(r))


def generate_forward(num_stages: int, num_microbatches: int, mapping: list[int] | None = None,
                     num_segments: int = 1) -> Schedule:
    """Compute-only schedule with forwards only (evaluation): no B, so no gradients and no step.

    Each rank runs its stages in ascending order, every micro-batch of a stage before the next
    stage (stage-major). Nothing waits on a backward, so the pipeline simply fills; with
    offload a stage is then resident for one interval per call (one LOAD, one DROP). With
    ``num_segments`` a micro-batch's segments follow each other in order.
    """
    mapping, num_ranks = check_mapping(num_stages, num_microbatches, mapping, num_segments)
    segs = segment_indices(num_segments)
    f_orders = {r: [Action(s, Op.FORWARD, m, j) for s in stages_of(r, mapping) for m in range(num_microbatches)
                    for j in segs] for r in range(num_ranks)}
    b_orders = {r: [] for r in range(num_ranks)}
    warmups = {r: len(f_orders[r]) for r in range(num_ranks)}
    return list_schedule(f_orders, b_orders, warmups, num_stages, backfill=False, num_segments=num_segments)
