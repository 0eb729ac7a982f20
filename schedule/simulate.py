"""A simulation of the executor over a lowered schedule: its timing (``SimResult``: timeline,
makespan, bubble), and the channel-order mismatches and deadlocks it runs into, each a
``ScheduleError`` with the marked grid (``schedule.grid``).

Executor contract modelled here (each rank runs its list strictly in order):

* SEND/RECV are non-blocking when issued. Messages travel on FIFO channels keyed
  ``(src_rank, dst_rank)``, activations and gradients alike (see ``schedule.ir.channel``):
  the k-th SEND on a channel matches the k-th RECV on it, and both must name the same tensor.
* A RECV completes once its SEND has been issued and every earlier message on the channel
  completed; a SEND completes once its RECV has been posted (rendezvous).
* F(s, m) / B(s, m) block until the RECV they consume has completed.
* With sequence segments (``seg``), a compute of segment j runs after its ``kv_predecessor``
  on the same rank: F(s, m.j) after F(s, m.j-1), B(s, m.j) after B(s, m.j+1).
* At the end of its list a rank blocks until all its SENDs completed.
* NORM is a collective: it blocks until every rank has reached its NORM.
* TIE (tied embeddings) is a collective of the ranks holding the first and the last stage: it
  blocks until each of them has reached its TIE. It reads the tied gradients from the stages'
  device buffers, so it comes after their last backward and before their OFFLOAD_GRADS, NORM and STEP.
* A stage with a LOAD anywhere in the schedule is offloaded: it computes only while
  resident, after a LOAD and before the next DROP / OFFLOAD_GRADS. A stage never loaded stays on
  the device (no offload, or one of the resident stages of an offloading run).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

from schedule.grid import fail
from schedule.ir import (COMM_OPS, COMPUTE_OPS, RECV_OPS, SEND_OPS, Action, Channel, Op, Schedule, channel, crosses,
                         kv_predecessor, num_segments_of, peer_recv, peer_stage, producer, recv_for, remote_producer)


@dataclass
class SimResult:
    """Timing of a simulated iteration.

    Attributes:
        timeline: per rank, ``(start, end, action)`` in list order.
        makespan: time at which the last rank finishes.
        bubble_fraction: ``1 - total compute time / (num_ranks * makespan)``.
    """

    timeline: dict[int, list[tuple[float, float, Action]]]
    makespan: float
    bubble_fraction: float


def default_cost(a: Action) -> float:
    """F costs 1, B costs 2, everything else 0."""
    return {Op.FORWARD: 1.0, Op.BACKWARD: 2.0}.get(a.op, 0.0)


class _Msg(NamedTuple):
    action: Action
    rank: int
    step: int
    time: float  # issue time of a SEND (after its cost), post time of a RECV


def simulate(schedule: Schedule, mapping: list[int], cost: Callable[[Action], float] | None = None) -> SimResult:
    """Run the executor contract on the schedule; raise ``ScheduleError`` on a deadlock or a
    channel-order mismatch.

    Every action occupies its rank for ``cost(action)`` (default: F 1, B 2, others 0),
    starting when its inputs are there. A schedule with no SEND/RECV at all (a generator's
    output) is simulated with implicit communication: a compute waits for its producer.
    """
    run = _Simulation(schedule, mapping, cost or default_cost)
    progress = True
    while progress:
        progress = False
        for r in run.ranks:
            progress = run.advance_rank(r) or progress
    if len(run.finished) < len(run.ranks):
        run.fail_deadlock()
    run.check_unmatched_recvs()
    return run.result()


class _Simulation:
    """The state of one ``simulate`` run: each rank's position in its list and clock, the
    messages posted on each channel, the computes done, and who reached each collective."""

    def __init__(self, schedule: Schedule, mapping: list[int], cost: Callable[[Action], float]) -> None:
        self.schedule, self.mapping, self.cost = schedule, mapping, cost
        self.num_stages = len(mapping)
        self.num_segments = num_segments_of(schedule)
        self.ranks = sorted(schedule)
        # a generator's output: no SEND/RECV, a compute waits for its producer directly
        self.implicit = not any(a.op in COMM_OPS for acts in schedule.values() for a in acts)
        self.pc = {r: 0 for r in self.ranks}
        self.clock = {r: 0.0 for r in self.ranks}
        self.timeline: dict[int, list[tuple[float, float, Action]]] = {r: [] for r in self.ranks}
        self.done: dict[Action, float] = {}
        self.sends: dict[Channel, list[_Msg]] = {}
        self.recvs: dict[Channel, list[_Msg]] = {}
        self.recv_slot: dict[tuple[int, Action], tuple[Channel, int]] = {}
        self.recv_done: dict[Channel, list[float]] = {}
        self.norm_at: dict[int, float] = {}
        self.tie_ranks = {r for r in self.ranks if any(a.op is Op.TIE for a in schedule[r])}
        self.tie_at: dict[int, float] = {}
        self.finished: set[int] = set()

    def advance_rank(self, r: int) -> bool:
        """Run rank ``r``'s actions until one must wait; True if it moved (or just finished)."""
        acts = self.schedule[r]
        progress = False
        while self.pc[r] < len(acts):
            i, a = self.pc[r], acts[self.pc[r]]
            start = self.start_time(r, i, a)
            if start is None:
                break
            end = start + self.cost(a)
            if a.op in COMPUTE_OPS:
                self.done[a] = end
            self.timeline[r].append((start, end, a))
            self.clock[r] = end
            self.pc[r] += 1
            progress = True
        if self.pc[r] == len(acts) and r not in self.finished and not self.pending_sends(r):
            self.finished.add(r)
            progress = True
        return progress

    def start_time(self, r: int, i: int, a: Action) -> float | None:
        """When action ``a`` (rank ``r``, step ``i``) starts; None while it must wait."""
        start = self.clock[r]
        if a.op in SEND_OPS or a.op in RECV_OPS:
            self.post(r, i, a, start)
            return start
        if a.op in COMPUTE_OPS:
            return self.compute_start(r, i, a, start)
        if a.op is Op.NORM:
            return _collective(self.norm_at, r, start, len(self.ranks))
        if a.op is Op.TIE:
            return _collective(self.tie_at, r, start, len(self.tie_ranks))
        return start

    def post(self, r: int, i: int, a: Action, start: float) -> None:
        """Put SEND/RECV ``a`` on its channel and check it against the message it pairs with."""
        if not 0 <= a.stage < self.num_stages or not crosses(self.mapping, a.stage, peer_stage(a)):
            fail(self.schedule, f"rank {r} step {i}: {a} has no peer stage on another rank "
                                f"(mapping {self.mapping})", [(r, i)])
        ch = channel(a, self.mapping)
        if ch[0 if a.op in SEND_OPS else 1] != r:
            fail(self.schedule, f"rank {r} step {i}: {a} belongs on rank "
                                f"{ch[0 if a.op in SEND_OPS else 1]}", [(r, i)])
        if a.op in SEND_OPS:
            queue = self.sends.setdefault(ch, [])
            queue.append(_Msg(a, r, i, start + self.cost(a)))
        else:
            queue = self.recvs.setdefault(ch, [])
            self.recv_slot[(r, a)] = (ch, len(queue))
            queue.append(_Msg(a, r, i, start))
        self.check_pair(ch, len(queue) - 1)

    def compute_start(self, r: int, i: int, a: Action, start: float) -> float | None:
        """When F/B ``a`` may start: after its forward, its segment predecessor and its input."""
        schedule = self.schedule
        if a.op is Op.BACKWARD and Action(a.stage, Op.FORWARD, a.mb, a.seg) not in self.done:
            fail(schedule, f"rank {r} step {i}: {a} runs before its forward", [(r, i)])
        kv = kv_predecessor(a, self.num_segments)
        if kv is not None and kv not in self.done:
            fail(schedule, f"rank {r} step {i}: {a} runs before {kv} on the same rank (segment order)", [(r, i)])
        src = producer(a, self.num_stages)
        if src is None:
            return start
        if not remote_producer(a, self.mapping):
            if src not in self.done:
                fail(schedule, f"rank {r} step {i}: {a} runs before {src} on the same rank", [(r, i)])
            return max(start, self.done[src])
        if self.implicit:
            return max(start, self.done[src]) if src in self.done else None
        slot = self.recv_slot.get((r, recv_for(a)))
        if slot is None:
            fail(schedule, f"rank {r} step {i}: {a} needs {recv_for(a)} posted before it", [(r, i)])
        t = self.completion(*slot)
        return None if t is None else max(start, t)

    def check_pair(self, ch: Channel, k: int) -> None:
        """The ``k``-th SEND and RECV on channel ``ch``, once both are posted, name one tensor."""
        sends, recvs = self.sends.get(ch, []), self.recvs.get(ch, [])
        if k < len(sends) and k < len(recvs):
            s, v = sends[k], recvs[k]
            if peer_recv(s.action) != v.action:
                fail(self.schedule, f"channel rank {ch[0]} -> rank {ch[1]}, message #{k}: rank {s.rank} sends "
                                    f"{s.action} (step {s.step}) but rank {v.rank} posts {v.action} (step {v.step}) "
                                    f"as its receive #{k}; receives must be posted in the order of the sends "
                                    f"(expected {peer_recv(s.action)})", [(s.rank, s.step), (v.rank, v.step)])

    def completion(self, ch: Channel, k: int) -> float | None:
        """When the ``k``-th message on ``ch`` completes (after every earlier one); None if not yet."""
        times = self.recv_done.setdefault(ch, [])
        while len(times) <= k:
            j = len(times)
            if j >= len(self.sends.get(ch, [])) or j >= len(self.recvs[ch]):
                return None
            times.append(max(self.sends[ch][j].time, self.recvs[ch][j].time, times[-1] if times else 0.0))
        return times[k]

    def pending_sends(self, r: int) -> list[tuple[Channel, _Msg]]:
        return [(ch, m) for ch, ms in self.sends.items() for k, m in enumerate(ms)
                if m.rank == r and k >= len(self.recvs.get(ch, []))]

    def fail_deadlock(self) -> None:
        """Raise the deadlock with what each unfinished rank waits for."""
        lines, marks = [], []
        for r in self.ranks:
            if r not in self.finished:
                lines.append(self.waiting_for(r))
                marks.append((r, self.pc[r]))
        fail(self.schedule, "deadlock: no rank can progress\n  " + "\n  ".join(lines), marks)

    def waiting_for(self, r: int) -> str:
        """One line: what unfinished rank ``r`` waits for."""
        pc = self.pc[r]
        if pc == len(self.schedule[r]):
            ch, m = self.pending_sends(r)[0]
            return (f"rank {r} at the end of its list waits for {m.action} (step {m.step}) to be received "
                    f"by rank {ch[1]}, which never posts {peer_recv(m.action)}")
        a = self.schedule[r][pc]
        if a.op is Op.NORM:
            return (f"rank {r} step {pc}: NORM waits for ranks {sorted(set(self.ranks) - set(self.norm_at))} "
                    f"to reach their NORM")
        if a.op is Op.TIE:
            return (f"rank {r} step {pc}: {a} waits for ranks {sorted(self.tie_ranks - set(self.tie_at))} "
                    f"to reach their TIE")
        if self.implicit:
            return f"rank {r} step {pc}: {a} waits for {producer(a, self.num_stages)}"
        ch, k = self.recv_slot[(r, recv_for(a))]
        why = ("its SEND has not been issued" if k >= len(self.sends.get(ch, []))
               else "an earlier message on the channel has not completed")
        return (f"rank {r} step {pc}: {a} waits for {recv_for(a)} (message #{k} on channel "
                f"rank {ch[0]} -> rank {ch[1]}): {why}")

    def check_unmatched_recvs(self) -> None:
        for ch, vs in self.recvs.items():
            if len(vs) > len(self.sends.get(ch, [])):
                v = vs[len(self.sends.get(ch, []))]
                fail(self.schedule, f"rank {v.rank} step {v.step}: {v.action} is never matched by a SEND on channel "
                                    f"rank {ch[0]} -> rank {ch[1]}", [(v.rank, v.step)])

    def result(self) -> SimResult:
        makespan = max(self.clock.values(), default=0.0)
        busy = sum(e - s for acts in self.timeline.values() for s, e, a in acts if a.op in COMPUTE_OPS)
        bubble = 1.0 - busy / (len(self.ranks) * makespan) if makespan > 0 else 0.0
        return SimResult(self.timeline, makespan, bubble)


def _collective(reached: dict[int, float], r: int, start: float, num_members: int) -> float | None:
    """Rank ``r`` reached a collective at ``start``: when it runs (the last member's arrival),
    None until all ``num_members`` have reached it."""
    reached.setdefault(r, start)
    if len(reached) < num_members:
        return None
    return max(reached.values())
