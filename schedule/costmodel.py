"""Predict the step time of a lowered schedule on a given GPU topology (pure, no torch).

An event-driven simulation of the executor (``pipeline/run/executor.py`` with ``offload/store.py``):

* Each rank runs its list in order on one compute lane. F/B of stage ``s`` take the given
  seconds and start once the rank reached them, the stage's latest LOAD has completed and
  the producer finished (``F(s-1, m)``, ``B(s+1, m)``, or ``F(last, m)`` for the last
  backward), plus ``p2p_latency_s`` when the producer is on another rank. SEND, RECV and
  DROP take no time.
* LOAD (host -> device, ``stage_bytes[s]``) and OFFLOAD_GRADS (device -> host, the gradients)
  are asynchronous: issued when the compute lane reaches them, started once the rank's
  previous transfer in the same direction finished (one copy stream per direction), and
  done when their bytes went through. Transfers of GPUs under one root group, in one
  direction, share the root's bandwidth max-min fairly (each also capped by its own link),
  re-divided whenever a transfer starts or ends. The two directions do not interfere.
* STEP of an offloaded stage (one with an OFFLOAD_GRADS) runs on the rank's CPU lane (the
  optimizer thread) for ``step_s`` once the stage's OFFLOAD_GRADS completed; STEP of a stage that
  stays on the GPU takes no time (a fused GPU kernel, milliseconds). A later LOAD of an
  offloaded stage does not block the rank (the executor hands it to its loader thread): its
  copy streams behind the step (chunk by chunk as the step writes them), so it may start
  when the step starts and ends no earlier than the step; the stage's compute waits for the
  copy. Only a LOAD whose step has not even started blocks the rank. (That copy moves the
  fp32 masters, twice a bf16 stage's bytes; the model counts ``stage_bytes``: the copy is
  hidden behind the step, whose end is what it waits for.)
* ``pending_steps``: optimizer steps of the previous iteration still running when this one
  starts (stage -> when each ends); they hold the CPU lane and their stages' LOADs.
  ``predict_steady`` uses them to predict an iteration in a steady state, where the steps
  overlap the next iteration's forwards, instead of one from a clean start.
* NORM is a barrier across ranks that also waits for each rank's offloads (the host reads
  the gradients), then takes ``norm_s``.
* ``start_offset_s[r]``: rank ``r`` issues nothing before that time (load staggering: the
  trainer holds the rank's host back that long at the start of the iteration).

With sequence segments (actions with ``seg``), ``stage_compute_s`` stays the time of a whole
micro-batch and a segment's compute takes its share of it (``segment_share``, default equal;
``pipeline/run/timeline.py`` passes the measured shares). A segment's wait for the earlier
segment of the same rows needs no rule here: both run on the same compute lane, in list order.

Issuing a transfer when the compute lane reaches it is conservative: the real host thread
runs ahead of the GPU, so a copy can start up to one compute earlier.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from schedule.ir import COMPUTE_OPS, Action, Op, Schedule, num_segments_of, producer, remote_producer

_EPS = 1e-9  # seconds: events closer than this are simultaneous


@dataclass
class Prediction:
    """Predicted timing of one iteration.

    Attributes:
        step_time: time at which the last action (compute, transfer or optimizer step) ends.
        host_end: time at which the last action other than an optimizer step ends: where the
            next iteration starts (its steps may still be running).
        timeline: per rank, ``(start, end, action)`` of every action, sorted by start.
        bubble_fraction: ``1 - total F/B time / (num_ranks * step_time)``.
        exposed_transfer_s: per rank, compute-lane time spent waiting on transfers (a LOAD
            before F/B, offloads before NORM).
    """

    step_time: float
    timeline: dict[int, list[tuple[float, float, Action]]]
    bubble_fraction: float
    exposed_transfer_s: dict[int, float] = field(default_factory=dict)
    host_end: float = 0.0

    def events(self) -> list[dict]:
        """The timeline as event dicts (the format ``pipeline/run/timeline.py`` writes)."""
        return [{"rank": r, "name": str(a), "op": a.op.value, "stage": a.stage, "mb": a.mb, "seg": a.seg,
                 "start": s, "end": e}
                for r, rows in sorted(self.timeline.items()) for s, e, a in rows]


@dataclass
class _Transfer:
    rank: int
    action: Action
    key: tuple[int, str]  # (root group, direction)
    cap: float            # bytes/s of the GPU's own link
    left: float           # bytes still to move
    start: float = math.nan
    rate: float = 0.0
    not_before: float = 0.0  # a LOAD whose stage's optimizer step starts then ...
    not_until: float = 0.0   # ... and ends then: the copy streams behind it, done no earlier


def cpu_stepped_stages(schedule: Schedule) -> frozenset[int]:
    """Stages whose STEP the model puts on the CPU lane: those whose gradients the program
    offloads (every other STEP is a GPU kernel, instant here)."""
    return frozenset(a.stage for acts in schedule.values() for a in acts if a.op is Op.OFFLOAD_GRADS)


def _per(value: float | Sequence[float] | Mapping[int, float], i: int) -> float:
    return float(value) if isinstance(value, (int, float)) else float(value[i])


def predict(
    schedule: Schedule,
    mapping: list[int],
    gpu_of_rank: list[int],
    groups: list[int],
    stage_compute_s: Mapping[int, tuple[float, float]],
    stage_bytes: Sequence[int],
    link_gbps: float | Sequence[float],
    root_gbps: float | Mapping[int, float],
    *,
    offload_bytes: Sequence[int] | None = None,
    step_s: float = 0.0,
    norm_s: float = 0.0,
    p2p_latency_s: float = 0.0,
    start_offset_s: Sequence[float] | None = None,
    pending_steps: Mapping[int, float] | None = None,
    segment_share: Sequence[float] | None = None,
) -> Prediction:
    """Simulate one iteration of ``schedule``; see the module docstring for the semantics.

    Args:
        schedule: lowered per-rank action lists.
        mapping: ``mapping[s]`` is the rank of stage ``s``.
        gpu_of_rank: physical GPU (index into ``groups``) that rank ``r`` runs on.
        groups: root group of each physical GPU.
        stage_compute_s: ``{stage: (forward s, backward s)}`` per micro-batch.
        stage_bytes: bytes a LOAD of each stage moves; OFFLOAD_GRADS moves ``offload_bytes``
            (default the same: gradients in the compute dtype).
        link_gbps: GB/s of each GPU's own link (one value, or one per physical GPU).
        root_gbps: GB/s of a root group per direction (one value, or ``{group: GB/s}``).
        start_offset_s: per rank, seconds before it issues its first action (default none).
        pending_steps: ``{stage: seconds}`` when the previous iteration's step of each stage
            ends, counted from this iteration's start (default none).
        segment_share: with sequence segments, the fraction of a micro-batch's compute each
            segment takes; default ``1 / K`` each.
    """
    share = _segment_shares(schedule, segment_share)
    _check_stage_inputs(len(mapping), stage_compute_s, stage_bytes)
    ranks = sorted(schedule)
    if start_offset_s is not None and len(start_offset_s) < len(ranks):
        raise ValueError(f"start_offset_s has {len(start_offset_s)} values ({list(start_offset_s)}) "
                         f"for ranks {ranks}")
    ready = {r: 0.0 if start_offset_s is None else float(start_offset_s[r]) for r in ranks}
    unknown = sorted(s for s in (pending_steps or {}) if not 0 <= s < len(mapping))
    if unknown:
        raise ValueError(f"pending_steps names stages {unknown}; the schedule has stages 0..{len(mapping) - 1}")
    topology = _Topology(gpu_of_rank, groups, link_gbps, root_gbps)
    costs = _Costs(stage_compute_s, stage_bytes, stage_bytes if offload_bytes is None else offload_bytes, share,
                   step_s, norm_s, p2p_latency_s)
    pending = {s: float(t) for s, t in (pending_steps or {}).items() if t > 0}
    simulation = _Simulation(schedule, mapping, topology, costs, ready, pending)
    simulation.run()
    return simulation.prediction()


def _segment_shares(schedule: Schedule, segment_share: Sequence[float] | None) -> list[float]:
    """Each segment's fraction of a micro-batch's compute: ``segment_share``, or equal shares."""
    num_segments = num_segments_of(schedule)
    share = [1.0 / num_segments] * num_segments if segment_share is None else [float(x) for x in segment_share]
    if len(share) != num_segments:
        raise ValueError(f"segment_share has {len(share)} values ({share}) for a schedule of {num_segments} segments")
    return share


def _check_stage_inputs(num_stages: int, stage_compute_s: Mapping[int, tuple[float, float]],
                        stage_bytes: Sequence[int]) -> None:
    if len(stage_bytes) != num_stages:
        raise ValueError(f"stage_bytes has {len(stage_bytes)} entries for {num_stages} stages")
    missing = [s for s in range(num_stages) if s not in stage_compute_s]
    if missing:
        raise ValueError(f"stage_compute_s has no (forward, backward) seconds for stages {missing}")


@dataclass(frozen=True)
class _Topology:
    """Where each rank's copies go: its GPU, that GPU's link and its root group's shared link."""

    gpu_of_rank: list[int]
    groups: list[int]
    link_gbps: float | Sequence[float]
    root_gbps: float | Mapping[int, float]

    def root_bytes_per_s(self, root: int) -> float:
        return _per(self.root_gbps, root) * 1e9


@dataclass(frozen=True)
class _Costs:
    """What each action costs: compute seconds per stage, bytes per copy, fixed seconds."""

    stage_compute_s: Mapping[int, tuple[float, float]]
    stage_bytes: Sequence[int]
    offload_bytes: Sequence[int]
    segment_share: list[float]
    step_s: float
    norm_s: float
    p2p_latency_s: float

    def compute_s(self, a: Action) -> float:
        seconds = self.stage_compute_s[a.stage][0 if a.op is Op.FORWARD else 1]
        return seconds * (1.0 if a.seg is None else self.segment_share[a.seg])


class _Simulation:
    """One iteration of ``predict``, event by event.

    Each rank has a compute lane (its list, in order, ``pc`` the index of its next action), a
    CPU lane (the optimizer steps) and a copy lane per direction; copies in flight share their
    root group's bandwidth. ``run`` alternates between issuing everything that can start at
    ``now`` (``settle``) and moving the clock to the next event (``advance``).
    """

    def __init__(self, schedule: Schedule, mapping: list[int], topology: _Topology, costs: _Costs,
                 ready: dict[int, float], pending: dict[int, float]) -> None:
        self.schedule, self.mapping, self.topology, self.costs = schedule, mapping, topology, costs
        self.num_stages = len(mapping)
        self.ranks = sorted(schedule)
        self.pc = {r: 0 for r in self.ranks}
        self.ready = ready  # when the rank reached (or reaches) its next action
        self.cpu_free = {r: max([t for s, t in pending.items() if mapping[s] == r], default=0.0) for r in self.ranks}
        self.exposed = {r: 0.0 for r in self.ranks}
        self.timeline: dict[int, list[tuple[float, float, Action]]] = {r: [] for r in self.ranks}
        self.done: dict[Action, float] = {}          # compute action -> end
        self.load_done: dict[int, float] = {}        # stage -> end of its latest LOAD (inf while moving)
        self.offload_done: dict[int, float] = {}
        self.step_end: dict[int, float] = dict(pending)
        self.step_start: dict[int, float] = {s: 0.0 for s in pending}  # already running at the start
        self.steps: dict[int, deque] = {r: deque() for r in self.ranks}  # (stage, issue time) waiting for the CPU lane
        self.cpu_stepped = cpu_stepped_stages(schedule)
        self.norm_at: dict[int, float] = {}
        self.lanes: dict[tuple[int, str], deque] = {}
        self.busy: set[tuple[int, str]] = set()
        self.active: list[_Transfer] = []
        self.now = 0.0

    def run(self) -> None:
        while True:
            self.settle()
            if self.finished():
                return
            self.reshare()
            self.advance(self.next_event_time())

    def settle(self) -> None:
        """Issue, step and release at ``now`` until nothing more can start."""
        progressed = True
        while progressed:
            progressed = False
            for r in self.ranks:
                while self.pc[r] < len(self.schedule[r]) and self.ready[r] <= self.now + _EPS and self.issue(r):
                    progressed = True
            progressed = self.pump_steps() or progressed
            progressed = self.release_norm() or progressed

    def finished(self) -> bool:
        return (all(self.pc[r] == len(self.schedule[r]) for r in self.ranks) and not self.active
                and not any(self.steps.values()))

    def issue(self, r: int) -> bool:
        """Try to run rank ``r``'s next action at ``now``; False if it must wait."""
        a = self.schedule[r][self.pc[r]]
        s = a.stage
        if a.op in COMPUTE_OPS:
            if not self.compute(r, a):
                return False
        elif a.op is Op.LOAD:
            if math.isinf(self.step_end.get(s, 0.0)):  # its step has not started: the host waits until it has
                return False
            self.load_done[s] = math.inf
            self.enqueue(r, a, self.costs.stage_bytes[s], "h2d", not_before=self.step_start.get(s, 0.0),
                         not_until=self.step_end.get(s, 0.0))
        elif a.op is Op.OFFLOAD_GRADS:
            self.offload_done[s] = math.inf
            self.enqueue(r, a, self.costs.offload_bytes[s], "d2h")
        elif a.op is Op.STEP and s in self.cpu_stepped:
            self.step_end[s] = math.inf
            self.steps[r].append((s, self.now))
        elif a.op is Op.NORM:
            self.norm_at.setdefault(r, self.ready[r])
            return False  # released by release_norm
        else:  # SEND / RECV / DROP, a GPU STEP: issued, no lane time
            self.timeline[r].append((self.now, self.now, a))
        if a.op not in COMPUTE_OPS:
            self.ready[r] = max(self.ready[r], self.now)
        self.pc[r] += 1
        return True

    def compute(self, r: int, a: Action) -> bool:
        """Run F/B ``a`` once its producer and its stage's latest LOAD are done; False if it must wait."""
        dep = producer(a, self.num_stages)
        if dep is not None and dep not in self.done:
            return False
        if dep is None:
            dep_t = 0.0
        else:
            dep_t = self.done[dep] + (self.costs.p2p_latency_s if remote_producer(a, self.mapping) else 0.0)
        load_t = self.load_done.get(a.stage, 0.0)
        if math.isinf(load_t):
            return False
        start = max(self.now, dep_t, load_t)
        self.exposed[r] += max(0.0, load_t - max(self.ready[r], dep_t))  # ready[r]: when the rank got here
        end = start + self.costs.compute_s(a)
        self.done[a] = end
        self.ready[r] = end
        self.timeline[r].append((start, end, a))
        return True

    def enqueue(self, r: int, a: Action, nbytes: float, direction: str, not_before: float = 0.0,
                not_until: float = 0.0) -> None:
        topology = self.topology
        gpu = topology.gpu_of_rank[r]
        t = _Transfer(r, a, (topology.groups[gpu], direction), _per(topology.link_gbps, gpu) * 1e9, float(nbytes),
                      not_before=not_before, not_until=not_until)
        if not (t.cap > 0 and _per(topology.root_gbps, t.key[0]) > 0):
            raise ValueError(f"GPU {gpu}: link_gbps ({_per(topology.link_gbps, gpu)}) and root_gbps of group "
                             f"{t.key[0]} ({_per(topology.root_gbps, t.key[0])}) must be > 0")
        self.lanes.setdefault((r, direction), deque()).append(t)
        self.start_lane(r, direction)

    def start_lane(self, r: int, direction: str) -> None:
        """Start the first queued transfer of the lane that may start now (FIFO otherwise)."""
        queue = self.lanes.get((r, direction))
        if (r, direction) in self.busy or not queue:
            return
        for t in queue:
            if t.not_before <= self.now + _EPS:
                queue.remove(t)
                t.start = self.now
                self.active.append(t)
                self.busy.add((r, direction))
                return

    def pump_steps(self) -> bool:
        """Start the queued optimizer steps whose gradients have reached the host."""
        moved = False
        for r in self.ranks:
            steps = self.steps[r]
            while steps and math.isfinite(self.offload_done.get(steps[0][0], 0.0)):
                s, issued = steps.popleft()
                start = max(issued, self.cpu_free[r], self.offload_done.get(s, 0.0))
                self.step_start[s], self.step_end[s] = start, start + self.costs.step_s
                self.cpu_free[r] = self.step_end[s]
                self.timeline[r].append((start, self.step_end[s], Action(s, Op.STEP)))
                moved = True
        return moved

    def release_norm(self) -> bool:
        """Run NORM on every rank once all reached it and their offloads are done."""
        if len(self.norm_at) < len(self.ranks):
            return False
        own = {r: max([t for s, t in self.offload_done.items() if self.mapping[s] == r], default=0.0)
               for r in self.ranks}
        if any(math.isinf(t) for t in own.values()):
            return False
        t = max(max(self.norm_at[r], own[r]) for r in self.ranks)
        for r in self.ranks:
            self.exposed[r] += max(0.0, own[r] - self.norm_at[r])
            self.timeline[r].append((self.norm_at[r], t + self.costs.norm_s, self.schedule[r][self.pc[r]]))
            self.ready[r] = t + self.costs.norm_s
            self.pc[r] += 1
        self.norm_at.clear()
        return True

    def reshare(self) -> None:
        """Max-min fair rates per (root, direction): equal shares, capped by each link."""
        by_key: dict[tuple[int, str], list[_Transfer]] = {}
        for t in self.active:
            by_key.setdefault(t.key, []).append(t)
        for (root, _), transfers in by_key.items():
            for t in transfers:
                t.rate = 0.0
            moving = [t for t in transfers if t.left > 0]  # a copy done but for its step takes no share
            left, num_left = self.topology.root_bytes_per_s(root), len(moving)
            for t in sorted(moving, key=lambda t: t.cap):
                t.rate = min(t.cap, left / num_left)
                left, num_left = left - t.rate, num_left - 1

    def next_event_time(self) -> float:
        """When the next rank becomes ready, a copy ends or a queued copy may start."""
        now = self.now
        candidates = [self.ready[r] for r in self.ranks
                      if self.pc[r] < len(self.schedule[r]) and self.ready[r] > now + _EPS]
        candidates += [now + t.left / t.rate for t in self.active if t.rate > 0]
        candidates += [max(now, t.not_until) for t in self.active if t.left <= 0]  # moved, done with its step
        candidates += [t.not_before for queue in self.lanes.values() for t in queue if t.not_before > now + _EPS]
        if not candidates:
            stuck = {r: str(self.schedule[r][self.pc[r]]) for r in self.ranks if self.pc[r] < len(self.schedule[r])}
            raise ValueError(f"cost model deadlocked at t={now:.6g}s: next action per waiting rank {stuck}; "
                             f"validate the schedule first (schedule.validate)")
        return min(candidates)

    def advance(self, t_next: float) -> None:
        """Move the copies in flight to ``t_next``, retire those done and start what the freed lanes hold."""
        for t in self.active:
            t.left -= t.rate * (t_next - self.now)
        self.now = t_next
        for t in self.active:
            if t.left <= t.rate * _EPS:
                t.left = 0.0  # moved; a load behind a step may still wait for the step's end
        finished = [t for t in self.active if t.left <= 0 and t.not_until <= self.now + _EPS]
        for t in finished:
            self.active.remove(t)
            self.busy.discard((t.rank, t.key[1]))
            (self.load_done if t.action.op is Op.LOAD else self.offload_done)[t.action.stage] = self.now
            self.timeline[t.rank].append((t.start, self.now, t.action))
        for r, direction in list(self.lanes):  # lanes freed now, and loads whose step just ended
            self.start_lane(r, direction)

    def prediction(self) -> Prediction:
        timeline = self.timeline
        step_time = max((e for rows in timeline.values() for _, e, _ in rows), default=0.0)
        host_end = max((e for rows in timeline.values() for _, e, a in rows if a.op is not Op.STEP), default=0.0)
        busy_s = sum(e - s for rows in timeline.values() for s, e, a in rows if a.op in COMPUTE_OPS)
        bubble = 1.0 - busy_s / (len(self.ranks) * step_time) if step_time > 0 else 0.0
        for rows in timeline.values():
            rows.sort(key=lambda x: (x[0], x[1]))
        return Prediction(step_time, timeline, bubble, self.exposed, host_end)


def predict_steady(*args, iterations: int = 4, **kwargs) -> Prediction:
    """``predict`` for an iteration in a steady state: each simulated iteration starts with the
    previous one's optimizer steps still running (``pending_steps``), as the executor's next
    iteration starts while its steps run. Returns the last of ``iterations`` simulated
    iterations; its ``host_end`` is the steady step time. The arguments are ``predict``'s."""
    pred, pending = None, None
    for _ in range(max(1, iterations)):
        pred = predict(*args, pending_steps=pending, **kwargs)
        pending = {a.stage: e - pred.host_end for rows in pred.timeline.values() for _, e, a in rows
                   if a.op is Op.STEP and e > pred.host_end}
    return pred


def _prefix_cost(n: int, key_cost: float) -> float:
    """Cost of positions 0..n-1: each costs 1 plus ``key_cost`` per key it attends (p + 1)."""
    return n + key_cost * n * (n + 1) / 2


def balanced_segments(seq_length: int, num_segments: int, key_cost: float = 0.0, multiple: int = 1) -> list[int]:
    """Lengths of ``num_segments`` contiguous segments of a causal sequence whose compute is as
    even as rounding allows (Seq1F1B's partition): position ``p`` costs ``1 + key_cost * (p + 1)``
    (it attends to ``p + 1`` keys), so later segments are shorter. ``key_cost`` 0 gives the
    equal split (lengths at most one apart). Boundaries are rounded to a ``multiple`` of tokens
    where that leaves every segment at least one (kernels like aligned lengths); the last
    segment takes the remainder.

    Raises:
        ValueError: fewer tokens than segments, or a negative ``key_cost``.
    """
    if num_segments < 1 or seq_length < num_segments:
        raise ValueError(f"cannot cut a sequence of {seq_length} tokens into {num_segments} segments: "
                         f"need 1 <= num_segments <= seq_length")
    if key_cost < 0 or multiple < 1:
        raise ValueError(f"key_cost ({key_cost}) must be >= 0 and multiple ({multiple}) >= 1")
    total = _prefix_cost(seq_length, key_cost)
    bounds = [0]
    for i in range(1, num_segments):
        target = total * i / num_segments
        # Solve n + key_cost n (n + 1) / 2 = target for n (the prefix holding i shares).
        if key_cost == 0:
            n = target
        else:
            a, b = key_cost / 2, 1 + key_cost / 2
            n = (-b + math.sqrt(b * b + 4 * a * target)) / (2 * a)
        cut = int(math.floor(n / multiple + 0.5)) * multiple
        if multiple > 1 and not bounds[-1] < cut <= seq_length - (num_segments - i):
            cut = int(math.floor(n + 0.5))  # alignment would empty a segment: fall back to tokens
        lo, hi = bounds[-1] + 1, seq_length - (num_segments - i)
        bounds.append(min(max(cut, lo), hi))
    bounds.append(seq_length)
    return [b - a for a, b in zip(bounds, bounds[1:])]
