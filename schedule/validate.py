"""Check a schedule before any process runs it: static rules, then a simulation of the
executor that finds channel-order mismatches and deadlocks.

The executor contract the rules and the simulation model is in ``schedule.simulate``.

Every error is a ``ScheduleError`` whose message names the values and ends with the rank x
step grid, the faulty cells marked ``>>like this<<``.
"""
from __future__ import annotations

from dataclasses import dataclass

from schedule.grid import Cell, ScheduleError, fail
from schedule.ir import (COMM_OPS, COMPUTE_OPS, SEND_OPS, Action, Op, Schedule, channel, crosses, kv_predecessor,
                         offloaded_stages, peer_recv, peer_stage, producer, recv_for, remote_producer, segment_indices,
                         send_for, tie_actions, tie_covers)
from schedule.simulate import simulate

# What a forward-only (evaluation) program must not contain.
_GRADIENT_OPS = frozenset({Op.BACKWARD, Op.SEND_B, Op.RECV_B, Op.OFFLOAD_GRADS, Op.NORM, Op.STEP, Op.TIE})


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
    if num_segments < 1:
        raise ScheduleError(f"num_segments ({num_segments}) must be >= 1")
    if len(mapping) != num_stages:
        raise ScheduleError(f"mapping has {len(mapping)} entries ({mapping}) but num_stages is {num_stages}")
    num_ranks = max(mapping) + 1
    if sorted(schedule) != list(range(num_ranks)):
        fail(schedule, f"schedule has ranks {sorted(schedule)}; mapping {mapping} needs ranks 0..{num_ranks - 1}")
    bounds = _Bounds(num_stages, num_microbatches, num_segments)

    where, norms = _locate_actions(schedule, mapping, bounds, compute_only, forward_only)
    _check_computes_present(schedule, where, bounds, forward_only)
    for a, (r, i) in sorted(where.items(), key=lambda x: x[1]):
        if a.op in COMPUTE_OPS:
            _check_compute_inputs(schedule, mapping, where, bounds, a, r, i, compute_only)
    for a, cell in where.items():
        if a.op in SEND_OPS and peer_recv(a) not in where:
            fail(schedule, f"rank {cell[0]} step {cell[1]}: {a} has no matching {peer_recv(a)} on rank "
                           f"{channel(a, mapping)[1]}", [cell])

    if not compute_only:
        _check_residency(schedule, mapping, where, forward_only)
        if not forward_only:
            _check_tie(schedule, mapping, where, norms, tied)
            _check_optimizer(schedule, mapping, where, norms)
    simulate(schedule, mapping)


@dataclass(frozen=True)
class _Bounds:
    """What the actions of a schedule may name: stages, micro-batches and segments 0..n-1."""

    num_stages: int
    num_microbatches: int
    num_segments: int


def _locate_actions(schedule: Schedule, mapping: list[int], bounds: _Bounds, compute_only: bool,
                    forward_only: bool) -> tuple[dict[Action, Cell], dict[int, int]]:
    """Check each action on its own and find where each one is: ``(where, norms)``, the cell of
    every action but LOAD / DROP / NORM (each unique in the schedule) and each rank's NORM step."""
    where: dict[Action, Cell] = {}
    norms: dict[int, int] = {}
    for r, acts in sorted(schedule.items()):
        for i, a in enumerate(acts):
            if not isinstance(a, Action):
                fail(schedule, f"rank {r} step {i}: {a!r} is not an Action", [(r, i)])
            if forward_only and a.op in _GRADIENT_OPS:
                fail(schedule, f"rank {r} step {i}: {a} in a forward-only schedule (no gradients, no "
                               f"optimizer: only F, SEND_F, RECV_F, L, D allowed)", [(r, i)])
            if compute_only and a.op not in COMPUTE_OPS:
                fail(schedule, f"rank {r} step {i}: {a} in a compute-only schedule (only F and B allowed)", [(r, i)])
            if a.op is Op.NORM:
                if r in norms:
                    fail(schedule, f"rank {r} has two NORM actions (steps {norms[r]} and {i}); "
                                   f"NORM is one collective per rank", [(r, norms[r]), (r, i)])
                norms[r] = i
                continue
            _check_fields(schedule, mapping, bounds, a, r, i)
            if a.op in (Op.LOAD, Op.DROP):
                continue
            if a in where:
                fail(schedule, f"{a} appears twice (rank {where[a][0]} step {where[a][1]} and rank {r} "
                               f"step {i})", [where[a], (r, i)])
            where[a] = (r, i)
    return where, norms


def _check_fields(schedule: Schedule, mapping: list[int], bounds: _Bounds, a: Action, r: int, i: int) -> None:
    """Action ``a`` (rank ``r``, step ``i``) names a stage, micro-batch and segment that exist,
    sits on its stage's rank, and a SEND/RECV has a peer on another rank."""
    num_stages, num_microbatches, num_segments = bounds.num_stages, bounds.num_microbatches, bounds.num_segments
    if not 0 <= a.stage < num_stages:
        fail(schedule, f"rank {r} step {i}: {a} names stage {a.stage}; stages are 0..{num_stages - 1}", [(r, i)])
    if a.op in COMPUTE_OPS | COMM_OPS and not (a.mb is not None and 0 <= a.mb < num_microbatches):
        fail(schedule, f"rank {r} step {i}: {a} names micro-batch {a.mb}; micro-batches are "
                       f"0..{num_microbatches - 1}", [(r, i)])
    whole_rows = num_segments == 1
    if a.op in COMPUTE_OPS | COMM_OPS and not (a.seg is None if whole_rows
                                               else a.seg is not None and 0 <= a.seg < num_segments):
        want = "no segment (num_segments 1)" if whole_rows else f"a segment 0..{num_segments - 1}"
        fail(schedule, f"rank {r} step {i}: {a} names segment {a.seg}; expected {want}", [(r, i)])
    if mapping[a.stage] != r:
        fail(schedule, f"rank {r} step {i}: {a} is on rank {r} but stage {a.stage} belongs to rank "
                       f"{mapping[a.stage]} (mapping {mapping})", [(r, i)])
    if a.op in COMM_OPS and not crosses(mapping, a.stage, peer_stage(a)):
        fail(schedule, f"rank {r} step {i}: {a} has no peer: the neighbouring stage is on this "
                       f"rank or does not exist (mapping {mapping})", [(r, i)])


def _check_computes_present(schedule: Schedule, where: dict[Action, Cell], bounds: _Bounds,
                            forward_only: bool) -> None:
    """Every (stage, micro-batch, segment) has its F and B (F only when forward-only)."""
    num_stages, num_microbatches, num_segments = bounds.num_stages, bounds.num_microbatches, bounds.num_segments
    ops = (Op.FORWARD,) if forward_only else (Op.FORWARD, Op.BACKWARD)
    segs = segment_indices(num_segments)
    missing = [str(Action(s, op, m, j)) for s in range(num_stages) for m in range(num_microbatches) for j in segs
               for op in ops if Action(s, op, m, j) not in where]
    if missing:
        more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        need = "one F" if forward_only else "one F and one B"
        per = "per micro-batch" if num_segments == 1 else "per micro-batch and segment"
        count = (f"{num_stages} stages x {num_microbatches} micro-batches"
                 + ("" if num_segments == 1 else f" x {num_segments} segments"))
        fail(schedule, f"missing compute actions: {', '.join(missing[:8])}{more}; every stage needs {need} "
                       f"{per} ({count})")


def _check_compute_inputs(schedule: Schedule, mapping: list[int], where: dict[Action, Cell], bounds: _Bounds,
                          a: Action, r: int, i: int, compute_only: bool) -> None:
    """Compute ``a`` (rank ``r``, step ``i``) comes after its forward, its segment predecessor
    and its producer; an input from another rank is received before it and sent after it is made."""
    fwd = Action(a.stage, Op.FORWARD, a.mb, a.seg)
    if a.op is Op.BACKWARD and where[fwd][1] > i:
        fail(schedule, f"rank {r} step {i}: {a} runs before its forward {fwd}", [(r, i), where[fwd]])
    kv = kv_predecessor(a, bounds.num_segments)
    if kv is not None and where[kv][1] > i:
        why = ("attends to its keys/values" if a.op is Op.FORWARD
               else "produces the gradients of its keys/values (backwards run the last segment first)")
        fail(schedule, f"rank {r} step {i}: {a} runs before {kv} (step {where[kv][1]}), which {why}",
             [(r, i), where[kv]])
    src = producer(a, bounds.num_stages)
    if src is None:
        return
    if not remote_producer(a, mapping):
        if where[src][1] > i:
            fail(schedule, f"rank {r} step {i}: {a} runs before {src}, whose output it needs "
                           f"(both on rank {r})", [(r, i), where[src]])
        return
    if compute_only:
        return
    recv = recv_for(a)
    if recv not in where or where[recv][1] > i:
        fail(schedule, f"rank {r} step {i}: {a} needs {recv} posted before it (its input comes from "
                       f"stage {src.stage} on rank {mapping[src.stage]})", [(r, i)])
    send = send_for(src)
    if send not in where:
        fail(schedule, f"{src} (rank {where[src][0]}) has no {send} for {a} on rank {r}", [where[src], (r, i)])
    if where[send][1] < where[src][1]:
        fail(schedule, f"rank {where[send][0]} step {where[send][1]}: {send} is issued before "
                       f"{src} produced the tensor", [where[send], where[src]])


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
                fail(schedule, f"rank {r} step {i}: {a} but stage {a.stage} is never loaded (its parameters "
                                f"are never offloaded)", [(r, i)])
            if a.stage not in offloaded:
                continue
            if a.op is Op.LOAD:
                if a.stage in resident:
                    fail(schedule, f"rank {r} step {i}: {a} loads stage {a.stage}, already resident since step "
                                    f"{resident[a.stage]}", [(r, resident[a.stage]), (r, i)])
                resident[a.stage] = i
            elif a.op in (Op.DROP, Op.OFFLOAD_GRADS):
                if a.stage not in resident:
                    fail(schedule, f"rank {r} step {i}: {a} releases stage {a.stage}, which is not resident",
                          [(r, i)])
                if a.op is Op.DROP and a.stage in backward_done:
                    fail(schedule, f"rank {r} step {i}: {a} drops stage {a.stage} after a backward: its "
                                    f"gradients would be lost; use {a.stage}O", [(r, i)])
                del resident[a.stage]
                released[a.stage] = i
            elif a.op in COMPUTE_OPS:
                if a.stage not in resident:
                    before = [(r, released[a.stage])] if a.stage in released else []
                    fail(schedule, f"rank {r} step {i}: {a} runs while stage {a.stage} is not resident "
                                    f"(no {a.stage}L since its last release)", before + [(r, i)])
                if a.op is Op.BACKWARD:
                    backward_done.add(a.stage)
        if resident:
            s = min(resident)
            fail(schedule, f"rank {r}: stage {s} is still resident at the end (loaded at step {resident[s]}); "
                            f"its gradients must be offloaded with {s}O", [(r, resident[s]), (r, len(acts))])
    if forward_only:
        return
    for s in sorted(offloaded):
        r = mapping[s]
        last_b = _last_backward(where, s)
        o = where.get(Action(s, Op.OFFLOAD_GRADS))
        if o is None or o[1] < last_b:
            fail(schedule, f"rank {r}: stage {s} needs one {s}O after its last backward (step {last_b})",
                  [(r, last_b)] + ([o] if o else []))


def _check_tie(schedule: Schedule, mapping: list[int], where: dict[Action, Cell], norms: dict[int, int],
               tied: bool) -> None:
    """With ``tied``, every rank runs its ``tie_actions`` (and no other TIE) after the last backward
    of the tied stages it holds, before their OFFLOAD_GRADS (the gradient is still in the device
    buffer), before their STEP and before the rank's NORM. Without ``tied``, no TIE."""
    present = [a for a in where if a.op is Op.TIE]
    if not tied:
        if present:
            fail(schedule, f"{present[0]} in a schedule without tied embeddings", [where[present[0]]])
        return
    if len(mapping) < 2:
        fail(schedule, f"tied embeddings over {len(mapping)} stage need no TIE: one stage shares one matrix")
    want = {a for r in schedule for a in tie_actions(r, mapping)}
    for a in present:
        if a not in want:
            fail(schedule, f"rank {where[a][0]} step {where[a][1]}: {a} is not a TIE of this mapping (expected "
                            f"{', '.join(map(str, sorted(want)))})", [where[a]])
    for t in sorted(want):
        r = mapping[t.stage]
        if t not in where:
            fail(schedule, f"rank {r}: no {t}: the tied gradient of stages {tie_covers(t, mapping)} is never "
                            f"exchanged (tied embeddings)", [(r, len(schedule[r]))])
        i = where[t][1]
        for s in tie_covers(t, mapping):
            last_b = _last_backward(where, s)
            if i < last_b:
                fail(schedule, f"rank {r} step {i}: {t} runs before stage {s}'s last backward (step {last_b}); the "
                                f"tied gradient is not complete", [(r, i), (r, last_b)])
            for op, why in ((Op.OFFLOAD_GRADS, "moved the gradient off the device"), (Op.STEP, "stepped")):
                other = where.get(Action(s, op))
                if other is not None and other[1] < i:
                    fail(schedule, f"rank {r} step {i}: {t} comes after {s}{op.value} (step {other[1]}), which "
                                    f"{why} without the other copy's share; {t} must come first", [other, (r, i)])
        if r in norms and norms[r] < i:
            fail(schedule, f"rank {r} step {i}: {t} comes after NORM (step {norms[r]}); the norm must see the "
                            f"exchanged gradient", [(r, norms[r]), (r, i)])


def _last_backward(where: dict[Action, Cell], stage: int) -> int:
    """The step of ``stage``'s last backward on its rank."""
    return max(cell[1] for a, cell in where.items() if a.stage == stage and a.op is Op.BACKWARD)


def _check_optimizer(schedule: Schedule, mapping: list[int], where: dict[Action, Cell], norms: dict[int, int]) -> None:
    """STEP once per stage after its final gradients; NORM, if any, on every rank before its STEPs."""
    if norms and sorted(norms) != sorted(schedule):
        lacking = sorted(set(schedule) - set(norms))
        fail(schedule, f"ranks {lacking} have no NORM but ranks {sorted(norms)} do: NORM is a collective over "
                        f"all ranks", [(r, i) for r, i in norms.items()])
    for s, r in enumerate(mapping):
        step = where.get(Action(s, Op.STEP))
        last_b = _last_backward(where, s)
        if step is None:
            fail(schedule, f"rank {r}: stage {s} has no {s}S (optimizer step); every stage steps once after its "
                            f"last backward (step {last_b})", [(r, last_b)])
        if step[1] < last_b:
            fail(schedule, f"rank {r} step {step[1]}: {s}S runs before stage {s}'s last backward (step {last_b})",
                  [step, (r, last_b)])
        o = where.get(Action(s, Op.OFFLOAD_GRADS))
        if o is not None and step[1] < o[1]:
            fail(schedule, f"rank {r} step {step[1]}: {s}S runs before {s}O (step {o[1]}) moved its gradients "
                            f"to the host", [step, o])
        if r in norms and step[1] < norms[r]:
            fail(schedule, f"rank {r} step {step[1]}: {s}S runs before NORM (step {norms[r]}); clipping needs "
                            f"the global norm first", [step, (r, norms[r])])
    for r, n in norms.items():
        late = [i for i, a in enumerate(schedule[r]) if a.op in (Op.BACKWARD, Op.OFFLOAD_GRADS, Op.TIE) and i > n]
        if late:
            fail(schedule, f"rank {r} step {n}: NORM comes before {schedule[r][late[0]]} (step {late[0]}); the "
                            f"norm must cover every gradient of the rank", [(r, n), (r, late[0])])
