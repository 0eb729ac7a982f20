"""Check a schedule before any process runs it: static rules, then a simulation of the
executor that finds channel-order mismatches and deadlocks.

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

Every error is a ``ScheduleError`` whose message names the values and ends with the rank x
step grid, the faulty cells marked ``>>like this<<``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple, NoReturn

from schedule.ir import (COMM_OPS, COMPUTE_OPS, RECV_OPS, SEND_OPS, Action, Channel, Op, Schedule, channel, crosses,
                         kv_predecessor, num_segments_of, offloaded_stages, peer_recv, peer_stage, producer, recv_for,
                         remote_producer, segment_indices, send_for, tie_actions, tie_covers)

# What a forward-only (evaluation) program must not contain.
_GRADIENT_OPS = frozenset({Op.BACKWARD, Op.SEND_B, Op.RECV_B, Op.OFFLOAD_GRADS, Op.NORM, Op.STEP, Op.TIE})
Cell = tuple[int, int]  # (rank, step index); step == len(list) means "the end of the list"
_GRID_COLUMNS = 16  # steps per block of the grid, so long schedules stay readable


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message carries the values and the marked grid."""


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


def format_grid(schedule: Schedule, mark: Iterable[Cell] | Cell | None = None) -> str:
    """Rank x step grid of a schedule, one row per rank, marked cells shown ``>>2F0<<``."""
    if isinstance(mark, tuple) and len(mark) == 2 and all(isinstance(x, int) for x in mark):
        mark = [mark]
    marks = set(mark or ())
    ranks = sorted(schedule)
    cells = {r: [str(a) for a in schedule[r]] for r in ranks}
    for r, i in sorted(marks):
        if r not in cells:
            continue
        if i >= len(cells[r]):
            cells[r] += [""] * (i - len(cells[r])) + ["<end>"]
        cells[r][i] = f">>{cells[r][i]}<<"
    num_cols = max([len(c) for c in cells.values()] + [0])
    label = max([len(f"rank {r}") for r in ranks] + [4])
    blocks = []
    for lo in range(0, max(num_cols, 1), _GRID_COLUMNS):
        cols = range(lo, min(lo + _GRID_COLUMNS, num_cols))
        width = {j: max([len(str(j))] + [len(cells[r][j]) for r in ranks if j < len(cells[r])]) for j in cols}
        lines = ["step".ljust(label) + " | " + " ".join(str(j).ljust(width[j]) for j in cols)]
        for r in ranks:
            row = " ".join((cells[r][j] if j < len(cells[r]) else "").ljust(width[j]) for j in cols)
            lines.append(f"rank {r}".ljust(label) + " | " + row)
        blocks.append("\n".join(line.rstrip() for line in lines))
    return "\n\n".join(blocks)


def _fail(schedule: Schedule, message: str, marks: Iterable[Cell] = ()) -> NoReturn:
    raise ScheduleError(f"{message}\n{format_grid(schedule, list(marks))}")


def validate(
    schedule: Schedule,
    mapping: list[int],
    num_stages: int,
    num_microbatches: int,
    *,
    compute_only: bool = False,
    forward_only: bool = False,
    tied: bool = False,
    num_segments: int = 1,
) -> None:
    """Raise ``ScheduleError`` unless ``schedule`` is a correct program for the executor.

    Args:
        schedule: ``{rank: [Action, ...]}``.
        mapping: ``mapping[s]`` is the rank of stage ``s``.
        num_stages: number of stages; every (stage, micro-batch) needs one F and one B.
        num_microbatches: number of micro-batches.
        compute_only: check a generator's output (F and B only, communication implicit, no
            optimizer actions) instead of a fully lowered program.
        forward_only: an evaluation program: every (stage, micro-batch) needs one F and
            nothing may touch gradients or the optimizer (no B, SEND_B/RECV_B, O, NORM, S, T).
        tied: the first and last stage hold copies of one tied matrix: each rank holding one
            runs its ``tie_actions`` once, after its tied stages' last backward and before their
            OFFLOAD_GRADS and STEP and its NORM; without ``tied`` no TIE may appear.
        num_segments: sequence segments per micro-batch (K): every (stage, micro-batch,
            segment) needs its computes, in segment order (``kv_predecessor``); with 1, no
            action may name a segment.
    """
    S, M, K = num_stages, num_microbatches, num_segments
    if K < 1:
        raise ScheduleError(f"num_segments ({K}) must be >= 1")
    if len(mapping) != S:
        raise ScheduleError(f"mapping has {len(mapping)} entries ({mapping}) but num_stages is {S}")
    num_ranks = max(mapping) + 1
    if sorted(schedule) != list(range(num_ranks)):
        _fail(schedule, f"schedule has ranks {sorted(schedule)}; mapping {mapping} needs ranks 0..{num_ranks - 1}")

    where: dict[Action, Cell] = {}  # every action but LOAD / DROP / NORM is unique in the schedule
    norms: dict[int, int] = {}
    for r, acts in sorted(schedule.items()):
        for i, a in enumerate(acts):
            if not isinstance(a, Action):
                _fail(schedule, f"rank {r} step {i}: {a!r} is not an Action", [(r, i)])
            if forward_only and a.op in _GRADIENT_OPS:
                _fail(schedule, f"rank {r} step {i}: {a} in a forward-only schedule (no gradients, no "
                                f"optimizer: only F, SEND_F, RECV_F, L, D allowed)", [(r, i)])
            if compute_only and a.op not in COMPUTE_OPS:
                _fail(schedule, f"rank {r} step {i}: {a} in a compute-only schedule (only F and B allowed)", [(r, i)])
            if a.op is Op.NORM:
                if r in norms:
                    _fail(schedule, f"rank {r} has two NORM actions (steps {norms[r]} and {i}); "
                                    f"NORM is one collective per rank", [(r, norms[r]), (r, i)])
                norms[r] = i
                continue
            if not 0 <= a.stage < S:
                _fail(schedule, f"rank {r} step {i}: {a} names stage {a.stage}; stages are 0..{S - 1}", [(r, i)])
            if a.op in COMPUTE_OPS | COMM_OPS and not (a.mb is not None and 0 <= a.mb < M):
                _fail(schedule, f"rank {r} step {i}: {a} names micro-batch {a.mb}; micro-batches are "
                                f"0..{M - 1}", [(r, i)])
            if a.op in COMPUTE_OPS | COMM_OPS and not (a.seg is None if K == 1 else a.seg is not None and 0 <= a.seg < K):
                want = "no segment (num_segments 1)" if K == 1 else f"a segment 0..{K - 1}"
                _fail(schedule, f"rank {r} step {i}: {a} names segment {a.seg}; expected {want}", [(r, i)])
            if mapping[a.stage] != r:
                _fail(schedule, f"rank {r} step {i}: {a} is on rank {r} but stage {a.stage} belongs to rank "
                                f"{mapping[a.stage]} (mapping {mapping})", [(r, i)])
            if a.op in COMM_OPS and not crosses(mapping, a.stage, peer_stage(a)):
                _fail(schedule, f"rank {r} step {i}: {a} has no peer: the neighbouring stage is on this "
                                f"rank or does not exist (mapping {mapping})", [(r, i)])
            if a.op in (Op.LOAD, Op.DROP):
                continue
            if a in where:
                _fail(schedule, f"{a} appears twice (rank {where[a][0]} step {where[a][1]} and rank {r} "
                                f"step {i})", [where[a], (r, i)])
            where[a] = (r, i)

    # Every (stage, micro-batch) runs F then B (F only when forward-only), each exactly once,
    # after its local inputs.
    ops = (Op.FORWARD,) if forward_only else (Op.FORWARD, Op.BACKWARD)
    segs = segment_indices(K)
    missing = [str(Action(s, op, m, j)) for s in range(S) for m in range(M) for j in segs for op in ops
               if Action(s, op, m, j) not in where]
    if missing:
        more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        need = "one F" if forward_only else "one F and one B"
        per = "per micro-batch" if K == 1 else "per micro-batch and segment"
        count = f"{S} stages x {M} micro-batches" + ("" if K == 1 else f" x {K} segments")
        _fail(schedule, f"missing compute actions: {', '.join(missing[:8])}{more}; every stage needs {need} "
                        f"{per} ({count})")
    for a, (r, i) in sorted(where.items(), key=lambda x: x[1]):
        if a.op not in COMPUTE_OPS:
            continue
        fwd = Action(a.stage, Op.FORWARD, a.mb, a.seg)
        if a.op is Op.BACKWARD and where[fwd][1] > i:
            _fail(schedule, f"rank {r} step {i}: {a} runs before its forward {fwd}", [(r, i), where[fwd]])
        kv = kv_predecessor(a, K)
        if kv is not None and where[kv][1] > i:
            why = ("attends to its keys/values" if a.op is Op.FORWARD
                   else "produces the gradients of its keys/values (backwards run the last segment first)")
            _fail(schedule, f"rank {r} step {i}: {a} runs before {kv} (step {where[kv][1]}), which {why}",
                  [(r, i), where[kv]])
        src = producer(a, S)
        if src is None:
            pass
        elif not remote_producer(a, mapping):
            if where[src][1] > i:
                _fail(schedule, f"rank {r} step {i}: {a} runs before {src}, whose output it needs "
                                f"(both on rank {r})", [(r, i), where[src]])
        elif not compute_only:
            recv = recv_for(a)
            if recv not in where or where[recv][1] > i:
                _fail(schedule, f"rank {r} step {i}: {a} needs {recv} posted before it (its input comes from "
                                f"stage {src.stage} on rank {mapping[src.stage]})", [(r, i)])
            send = send_for(src)
            if send not in where:
                _fail(schedule, f"{src} (rank {where[src][0]}) has no {send} for {a} on rank {r}",
                      [where[src], (r, i)])
            if where[send][1] < where[src][1]:
                _fail(schedule, f"rank {where[send][0]} step {where[send][1]}: {send} is issued before "
                                f"{src} produced the tensor", [where[send], where[src]])
    for a, cell in where.items():
        if a.op in SEND_OPS and peer_recv(a) not in where:
            _fail(schedule, f"rank {cell[0]} step {cell[1]}: {a} has no matching {peer_recv(a)} on rank "
                            f"{channel(a, mapping)[1]}", [cell])

    if not compute_only:
        _check_residency(schedule, mapping, where, forward_only)
        if not forward_only:
            _check_tie(schedule, mapping, where, norms, tied)
            _check_optimizer(schedule, mapping, where, norms)
    simulate(schedule, mapping)


def _check_residency(schedule: Schedule, mapping: list[int], where: dict[Action, Cell],
                     forward_only: bool = False) -> None:
    """An offloaded stage (one that is loaded somewhere) computes only between a LOAD and the
    next DROP / OFFLOAD_GRADS; a stage that is never loaded is never released either."""
    offloaded = offloaded_stages(schedule)
    for r, acts in sorted(schedule.items()):
        resident: dict[int, int] = {}  # stage -> step of its LOAD
        released: dict[int, int] = {}  # stage -> step of its last DROP / OFFLOAD_GRADS
        backward_done: set[int] = set()
        for i, a in enumerate(acts):
            if a.op in (Op.DROP, Op.OFFLOAD_GRADS) and a.stage not in offloaded:
                _fail(schedule, f"rank {r} step {i}: {a} but stage {a.stage} is never loaded (its parameters "
                                f"are never offloaded)", [(r, i)])
            if a.stage not in offloaded:
                continue
            if a.op is Op.LOAD:
                if a.stage in resident:
                    _fail(schedule, f"rank {r} step {i}: {a} loads stage {a.stage}, already resident since step "
                                    f"{resident[a.stage]}", [(r, resident[a.stage]), (r, i)])
                resident[a.stage] = i
            elif a.op in (Op.DROP, Op.OFFLOAD_GRADS):
                if a.stage not in resident:
                    _fail(schedule, f"rank {r} step {i}: {a} releases stage {a.stage}, which is not resident",
                          [(r, i)])
                if a.op is Op.DROP and a.stage in backward_done:
                    _fail(schedule, f"rank {r} step {i}: {a} drops stage {a.stage} after a backward: its "
                                    f"gradients would be lost; use {a.stage}O", [(r, i)])
                del resident[a.stage]
                released[a.stage] = i
            elif a.op in COMPUTE_OPS:
                if a.stage not in resident:
                    before = [(r, released[a.stage])] if a.stage in released else []
                    _fail(schedule, f"rank {r} step {i}: {a} runs while stage {a.stage} is not resident "
                                    f"(no {a.stage}L since its last release)", before + [(r, i)])
                if a.op is Op.BACKWARD:
                    backward_done.add(a.stage)
        if resident:
            s = min(resident)
            _fail(schedule, f"rank {r}: stage {s} is still resident at the end (loaded at step {resident[s]}); "
                            f"its gradients must be offloaded with {s}O", [(r, resident[s]), (r, len(acts))])
    if forward_only:
        return
    for s in sorted(offloaded):
        r = mapping[s]
        last_b = _last_backward(where, s)
        o = where.get(Action(s, Op.OFFLOAD_GRADS))
        if o is None or o[1] < last_b:
            _fail(schedule, f"rank {r}: stage {s} needs one {s}O after its last backward (step {last_b})",
                  [(r, last_b)] + ([o] if o else []))


def _check_tie(schedule: Schedule, mapping: list[int], where: dict[Action, Cell], norms: dict[int, int],
               tied: bool) -> None:
    """With ``tied``, every rank runs its ``tie_actions`` (and no other TIE) after the last backward
    of the tied stages it holds, before their OFFLOAD_GRADS (the gradient is still in the device
    buffer), before their STEP and before the rank's NORM. Without ``tied``, no TIE."""
    present = [a for a in where if a.op is Op.TIE]
    if not tied:
        if present:
            _fail(schedule, f"{present[0]} in a schedule without tied embeddings", [where[present[0]]])
        return
    if len(mapping) < 2:
        _fail(schedule, f"tied embeddings over {len(mapping)} stage need no TIE: one stage shares one matrix")
    want = {a for r in schedule for a in tie_actions(r, mapping)}
    for a in present:
        if a not in want:
            _fail(schedule, f"rank {where[a][0]} step {where[a][1]}: {a} is not a TIE of this mapping (expected "
                            f"{', '.join(map(str, sorted(want)))})", [where[a]])
    for t in sorted(want):
        r = mapping[t.stage]
        if t not in where:
            _fail(schedule, f"rank {r}: no {t}: the tied gradient of stages {tie_covers(t, mapping)} is never "
                            f"exchanged (tied embeddings)", [(r, len(schedule[r]))])
        i = where[t][1]
        for s in tie_covers(t, mapping):
            last_b = _last_backward(where, s)
            if i < last_b:
                _fail(schedule, f"rank {r} step {i}: {t} runs before stage {s}'s last backward (step {last_b}); the "
                                f"tied gradient is not complete", [(r, i), (r, last_b)])
            for op, why in ((Op.OFFLOAD_GRADS, "moved the gradient off the device"), (Op.STEP, "stepped")):
                other = where.get(Action(s, op))
                if other is not None and other[1] < i:
                    _fail(schedule, f"rank {r} step {i}: {t} comes after {s}{op.value} (step {other[1]}), which "
                                    f"{why} without the other copy's share; {t} must come first", [other, (r, i)])
        if r in norms and norms[r] < i:
            _fail(schedule, f"rank {r} step {i}: {t} comes after NORM (step {norms[r]}); the norm must see the "
                            f"exchanged gradient", [(r, norms[r]), (r, i)])


def _last_backward(where: dict[Action, Cell], stage: int) -> int:
    """The step of ``stage``'s last backward on its rank."""
    return max(cell[1] for a, cell in where.items() if a.stage == stage and a.op is Op.BACKWARD)


def _check_optimizer(schedule: Schedule, mapping: list[int], where: dict[Action, Cell], norms: dict[int, int]) -> None:
    """STEP once per stage after its final gradients; NORM, if any, on every rank before its STEPs."""
    if norms and sorted(norms) != sorted(schedule):
        lacking = sorted(set(schedule) - set(norms))
        _fail(schedule, f"ranks {lacking} have no NORM but ranks {sorted(norms)} do: NORM is a collective over "
                        f"all ranks", [(r, i) for r, i in norms.items()])
    for s, r in enumerate(mapping):
        step = where.get(Action(s, Op.STEP))
        last_b = _last_backward(where, s)
        if step is None:
            _fail(schedule, f"rank {r}: stage {s} has no {s}S (optimizer step); every stage steps once after its "
                            f"last backward (step {last_b})", [(r, last_b)])
        if step[1] < last_b:
            _fail(schedule, f"rank {r} step {step[1]}: {s}S runs before stage {s}'s last backward (step {last_b})",
                  [step, (r, last_b)])
        o = where.get(Action(s, Op.OFFLOAD_GRADS))
        if o is not None and step[1] < o[1]:
            _fail(schedule, f"rank {r} step {step[1]}: {s}S runs before {s}O (step {o[1]}) moved its gradients "
                            f"to the host", [step, o])
        if r in norms and step[1] < norms[r]:
            _fail(schedule, f"rank {r} step {step[1]}: {s}S runs before NORM (step {norms[r]}); clipping needs "
                            f"the global norm first", [step, (r, norms[r])])
    for r, n in norms.items():
        late = [i for i, a in enumerate(schedule[r]) if a.op in (Op.BACKWARD, Op.OFFLOAD_GRADS, Op.TIE) and i > n]
        if late:
            _fail(schedule, f"rank {r} step {n}: NORM comes before {schedule[r][late[0]]} (step {late[0]}); the "
                            f"norm must cover every gradient of the rank", [(r, n), (r, late[0])])


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
                _fail(schedule, f"channel rank {ch[0]} -> rank {ch[1]}, message #{k}: rank {s.rank} sends "
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
                        _fail(schedule, f"rank {r} step {i}: {a} has no peer stage on another rank "
                                        f"(mapping {mapping})", [(r, i)])
                    ch = channel(a, mapping)
                    if ch[0 if a.op in SEND_OPS else 1] != r:
                        _fail(schedule, f"rank {r} step {i}: {a} belongs on rank "
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
                        _fail(schedule, f"rank {r} step {i}: {a} runs before its forward", [(r, i)])
                    kv = kv_predecessor(a, num_segments)
                    if kv is not None and kv not in done:
                        _fail(schedule, f"rank {r} step {i}: {a} runs before {kv} on the same rank (segment order)",
                              [(r, i)])
                    if src is None:
                        pass
                    elif not remote_producer(a, mapping):
                        if src not in done:
                            _fail(schedule, f"rank {r} step {i}: {a} runs before {src} on the same rank",
                                  [(r, i)])
                        start = max(start, done[src])
                    elif implicit:
                        if src not in done:
                            break
                        start = max(start, done[src])
                    else:
                        slot = recv_slot.get((r, recv_for(a)))
                        if slot is None:
                            _fail(schedule, f"rank {r} step {i}: {a} needs {recv_for(a)} posted before it",
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
        _fail(schedule, "deadlock: no rank can progress\n  " + "\n  ".join(lines), marks)
    for ch, vs in recvs.items():
        if len(vs) > len(sends.get(ch, [])):
            v = vs[len(sends.get(ch, []))]
            _fail(schedule, f"rank {v.rank} step {v.step}: {v.action} is never matched by a SEND on channel rank "
                            f"{ch[0]} -> rank {ch[1]}", [(v.rank, v.step)])

    makespan = max(clock.values(), default=0.0)
    busy = sum(e - s for acts in timeline.values() for s, e, a in acts if a.op in COMPUTE_OPS)
    bubble = 1.0 - busy / (len(ranks) * makespan) if makespan > 0 else 0.0
    return SimResult(timeline, makespan, bubble)
