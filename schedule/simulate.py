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
    cost = cost or default_cost
    num_stages = len(mapping)
    num_segments = num_segments_of(schedule)
    ranks = sorted(schedule)
    implicit = not any(a.op in COMM_OPS for acts in schedule.values() for a in acts)
    pc = {r: 0 for r in ranks}
    clock = {r: 0.0 for r in ranks}
    timeline: dict[int, list[tuple[float, float, Action]]] = {r: [] for r in ranks}
    done: dict[Action, float] = {}
    sends: dict[Channel, list[_Msg]] = {}
    recvs: dict[Channel, list[_Msg]] = {}
    recv_slot: dict[tuple[int, Action], tuple[Channel, int]] = {}
    recv_done: dict[Channel, list[float]] = {}
    norm_at: dict[int, float] = {}
    tie_ranks = {r for r in ranks if any(a.op is Op.TIE for a in schedule[r])}
    tie_at: dict[int, float] = {}
    finished: set[int] = set()

    def check_pair(ch: Channel, k: int) -> None:
        if k < len(sends.get(ch, [])) and k < len(recvs.get(ch, [])):
            s, v = sends[ch][k], recvs[ch][k]
            if peer_recv(s.action) != v.action:
                fail(schedule, f"channel rank {ch[0]} -> rank {ch[1]}, message #{k}: rank {s.rank} sends "
                                f"{s.action} (step {s.step}) but rank {v.rank} posts {v.action} (step {v.step}) as "
                                f"its receive #{k}; receives must be posted in the order of the sends "
                                f"(expected {peer_recv(s.action)})", [(s.rank, s.step), (v.rank, v.step)])

    def completion(ch: Channel, k: int) -> float | None:
        times = recv_done.setdefault(ch, [])
        while len(times) <= k:
            j = len(times)
            if j >= len(sends.get(ch, [])) or j >= len(recvs[ch]):
                return None
            times.append(max(sends[ch][j].time, recvs[ch][j].time, times[-1] if times else 0.0))
        return times[k]

    def pending_sends(r: int) -> list[tuple[Channel, _Msg]]:
        return [(ch, m) for ch, ms in sends.items() for k, m in enumerate(ms)
                if m.rank == r and k >= len(recvs.get(ch, []))]

    progress = True
    while progress:
        progress = False
        for r in ranks:
            acts = schedule[r]
            while pc[r] < len(acts):
                i, a = pc[r], acts[pc[r]]
                start = clock[r]
                if a.op in SEND_OPS or a.op in RECV_OPS:
                    if not 0 <= a.stage < num_stages or not crosses(mapping, a.stage, peer_stage(a)):
                        fail(schedule, f"rank {r} step {i}: {a} has no peer stage on another rank "
                                        f"(mapping {mapping})", [(r, i)])
                    ch = channel(a, mapping)
                    if ch[0 if a.op in SEND_OPS else 1] != r:
                        fail(schedule, f"rank {r} step {i}: {a} belongs on rank "
                                        f"{ch[0 if a.op in SEND_OPS else 1]}", [(r, i)])
                    if a.op in SEND_OPS:
                        queue = sends.setdefault(ch, [])
                        queue.append(_Msg(a, r, i, start + cost(a)))
                    else:
                        queue = recvs.setdefault(ch, [])
                        recv_slot[(r, a)] = (ch, len(queue))
                        queue.append(_Msg(a, r, i, start))
                    check_pair(ch, len(queue) - 1)
                elif a.op in COMPUTE_OPS:
                    src = producer(a, num_stages)
                    if a.op is Op.BACKWARD and Action(a.stage, Op.FORWARD, a.mb, a.seg) not in done:
                        fail(schedule, f"rank {r} step {i}: {a} runs before its forward", [(r, i)])
                    kv = kv_predecessor(a, num_segments)
                    if kv is not None and kv not in done:
                        fail(schedule, f"rank {r} step {i}: {a} runs before {kv} on the same rank (segment order)",
                              [(r, i)])
                    if src is None:
                        pass
                    elif not remote_producer(a, mapping):
                        if src not in done:
                            fail(schedule, f"rank {r} step {i}: {a} runs before {src} on the same rank",
                                  [(r, i)])
                        start = max(start, done[src])
                    elif implicit:
                        if src not in done:
                            break
                        start = max(start, done[src])
                    else:
                        slot = recv_slot.get((r, recv_for(a)))
                        if slot is None:
                            fail(schedule, f"rank {r} step {i}: {a} needs {recv_for(a)} posted before it",
                                  [(r, i)])
                        t = completion(*slot)
                        if t is None:
                            break
                        start = max(start, t)
                elif a.op is Op.NORM:
                    norm_at.setdefault(r, start)
                    if len(norm_at) < len(ranks):
                        break
                    start = max(norm_at.values())
                elif a.op is Op.TIE:
                    tie_at.setdefault(r, start)
                    if len(tie_at) < len(tie_ranks):
                        break
                    start = max(tie_at.values())
                end = start + cost(a)
                if a.op in COMPUTE_OPS:
                    done[a] = end
                timeline[r].append((start, end, a))
                clock[r] = end
                pc[r] += 1
                progress = True
            if pc[r] == len(acts) and r not in finished and not pending_sends(r):
                finished.add(r)
                progress = True

    if len(finished) < len(ranks):
        lines, marks = [], []
        for r in ranks:
            if r in finished:
                continue
            if pc[r] == len(schedule[r]):
                ch, m = pending_sends(r)[0]
                lines.append(f"rank {r} at the end of its list waits for {m.action} (step {m.step}) to be received "
                             f"by rank {ch[1]}, which never posts {peer_recv(m.action)}")
            else:
                a = schedule[r][pc[r]]
                if a.op is Op.NORM:
                    lines.append(f"rank {r} step {pc[r]}: NORM waits for ranks "
                                 f"{sorted(set(ranks) - set(norm_at))} to reach their NORM")
                elif a.op is Op.TIE:
                    lines.append(f"rank {r} step {pc[r]}: {a} waits for ranks "
                                 f"{sorted(tie_ranks - set(tie_at))} to reach their TIE")
                elif implicit:
                    lines.append(f"rank {r} step {pc[r]}: {a} waits for {producer(a, num_stages)}")
                else:
                    ch, k = recv_slot[(r, recv_for(a))]
                    why = ("its SEND has not been issued" if k >= len(sends.get(ch, []))
                           else "an earlier message on the channel has not completed")
                    lines.append(f"rank {r} step {pc[r]}: {a} waits for {recv_for(a)} (message #{k} on channel "
                                 f"rank {ch[0]} -> rank {ch[1]}): {why}")
            marks.append((r, pc[r]))
        fail(schedule, "deadlock: no rank can progress\n  " + "\n  ".join(lines), marks)
    for ch, vs in recvs.items():
        if len(vs) > len(sends.get(ch, [])):
            v = vs[len(sends.get(ch, []))]
            fail(schedule, f"rank {v.rank} step {v.step}: {v.action} is never matched by a SEND on channel rank "
                            f"{ch[0]} -> rank {ch[1]}", [(v.rank, v.step)])

    makespan = max(clock.values(), default=0.0)
    busy = sum(e - s for acts in timeline.values() for s, e, a in acts if a.op in COMPUTE_OPS)
    bubble = 1.0 - busy / (len(ranks) * makespan) if makespan > 0 else 0.0
    return SimResult(timeline, makespan, bubble)
