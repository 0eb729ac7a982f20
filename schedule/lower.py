"""Lowering passes: list -> list functions that turn a compute-only schedule into the
program the executor runs. Each pass is pure and can be tested on its own; ``build`` chains
them and validates the result.

Order of the passes: ``add_send_recv`` -> ``add_load_offload`` (if offloading parameters)
-> ``add_tie`` (if the embedding is tied over several stages) -> ``add_optimizer``.

With offload, some stages may stay resident (``resident_stages``): they get no LOAD, DROP or
OFFLOAD_GRADS, and their STEP runs on the GPU at the end of the rank's list (``add_optimizer``).
"""
from __future__ import annotations

from typing import NamedTuple

from schedule.generate import generate, generate_forward
from schedule.ir import (COMPUTE_OPS, Action, Channel, Op, Schedule, channel, peer_recv, recv_for, remote_consumer,
                         remote_producer, send_for, stages_of, tie_actions, tie_covers)
from schedule.validate import validate


def add_send_recv(schedule: Schedule, mapping: list[int], ahead: int = 0) -> Schedule:
    """Insert SEND/RECV actions for every cross-rank activation and gradient.

    A SEND goes right after the compute that produces the tensor. A RECV goes ``ahead`` computes
    before the compute that consumes it (0: right before it; a rank's first computes post theirs
    at the start), though never above a SEND of its own micro-batch (what it receives may be made
    from what that sends, and a receive waiting on the device must not be trusted to let the
    send it needs run), then moves earlier where needed so that on every channel ``(src, dst)``
    receives are posted in the order of the sends (the channels are FIFO).

    Why ahead: with NCCL a receive starts when the device reaches it, so one posted right before
    its consumer puts the whole transfer in front of that compute; posted a compute early, the
    tensor moves while that compute runs. Each compute ahead holds one more receive buffer.
    Neighbouring stages on one rank pass the tensor locally, with no communication.
    """
    if ahead < 0:
        raise ValueError(f"ahead ({ahead}) must be >= 0 computes")
    base: Schedule = {}
    for r, acts in schedule.items():
        base[r] = []
        for a in acts:
            base[r].append(a)
            if a.op in COMPUTE_OPS and remote_consumer(a, mapping):
                base[r].append(send_for(a))
    # Per channel, the RECV each SEND expects, in the order the sends are issued.
    send_seq: dict[Channel, list[Action]] = {}
    for r in sorted(base):
        for a in base[r]:
            if a.op in (Op.SEND_F, Op.SEND_B):
                send_seq.setdefault(channel(a, mapping), []).append(peer_recv(a))
    out: Schedule = {}
    for r, acts in base.items():
        computes = [i for i, a in enumerate(acts) if a.op in COMPUTE_OPS]
        consumer_at = {}  # recv -> index in ``acts`` of the action it is posted before
        last_send: dict[int, int] = {}  # micro-batch -> index of its latest SEND so far
        for n, i in enumerate(computes):
            a = acts[i]
            if remote_producer(a, mapping):
                # Not above a SEND of the same micro-batch: the tensor received may be made from it.
                consumer_at[recv_for(a)] = max(computes[max(0, n - ahead)], last_send.get(a.mb, -1) + 1)
            if i + 1 < len(acts) and acts[i + 1].op in (Op.SEND_F, Op.SEND_B):
                last_send[a.mb] = i + 1
        placed = []  # (anchor index, channel, seq in channel, recv)
        for ch, recvs in send_seq.items():
            if ch[1] != r:
                continue
            anchor = len(acts)
            # Walk backwards: a recv must be posted no later than any recv after it on the channel.
            for k in range(len(recvs) - 1, -1, -1):
                anchor = min(anchor, consumer_at.get(recvs[k], len(acts)))
                placed.append((anchor, ch, k, recvs[k]))
        placed.sort(key=lambda p: p[:3])
        new, j = [], 0
        for i, a in enumerate(acts + [None]):
            while j < len(placed) and placed[j][0] == i:
                new.append(placed[j][3])
                j += 1
            if a is not None:
                new.append(a)
        out[r] = new
    return out


def resident_stages(mapping: list[int], per_rank: int) -> frozenset[int]:
    """The stages kept on the GPU, with their optimizer state, in an offloading run: the first
    ``per_rank`` stages of each rank in ascending order, which is the order every schedule here
    first computes them. These are the stages whose optimizer steps the next iteration would
    wait for first (with clipping all steps wait for the norm; without, the rank's first stage
    has the last backward), so stepping them on the GPU hides the most CPU optimizer time."""
    if per_rank < 0:
        raise ValueError(f"resident stages per rank must be >= 0, got {per_rank}")
    return frozenset(s for r in set(mapping) for s in stages_of(r, mapping)[:per_rank])


def device_stepped_stages(mapping: list[int], resident: frozenset[int], per_rank: int) -> frozenset[int]:
    """The offloaded stages whose AdamW step runs on their GPU (``device_steps``): each rank's last
    ``per_rank`` stages that are not ``resident``, in ascending order, which is the order every
    schedule here first computes them. These are the steps the next iteration needs last: with
    clipping every step waits for the norm after the last backward, and the CPU steps the rest in
    the order the next forward needs them while the GPU steps these beside it."""
    if per_rank < 0:
        raise ValueError(f"device-stepped stages per rank must be >= 0, got {per_rank}")
    out: set[int] = set()
    for r in set(mapping):
        offloaded = [s for s in stages_of(r, mapping) if s not in resident]
        out.update(offloaded[len(offloaded) - min(per_rank, len(offloaded)):])
    return frozenset(out)


class Interval(NamedTuple):
    """A span of one stage's compute on a rank; first/last index its compute actions."""

    stage: int
    first: int
    last: int
    final: bool  # holds the stage's last backward: ends with OFFLOAD_GRADS, not DROP


def stage_intervals(actions: list[Action]) -> list[Interval]:
    """Residency intervals of each stage in one rank's list, ordered by start.

    A stage's forward span and backward span merge into one interval when they overlap or
    when no other stage computes between them (dropping and reloading would be pure waste).
    """
    spans: dict[int, dict[Op, list[int]]] = {}
    for i, a in enumerate(actions):
        if a.op in COMPUTE_OPS:
            spans.setdefault(a.stage, {}).setdefault(a.op, []).append(i)
    intervals = []
    for s, by_op in spans.items():
        f, b = by_op.get(Op.FORWARD), by_op.get(Op.BACKWARD)
        if f and b:
            between = {actions[i].stage for i in range(f[-1] + 1, b[0]) if actions[i].op in COMPUTE_OPS}
            if b[0] < f[-1] or not between:
                intervals.append(Interval(s, f[0], b[-1], True))
                continue
        if f:
            # A forward-only interval never holds gradients, not even in a forward-only
            # (evaluation) schedule: it ends with DROP.
            intervals.append(Interval(s, f[0], f[-1], False))
        if b:
            intervals.append(Interval(s, b[0], b[-1], True))
    return sorted(intervals, key=lambda iv: iv.first)


def add_load_offload(schedule: Schedule, mapping: list[int], prefetch: bool,
                     resident: frozenset[int] = frozenset()) -> Schedule:
    """Insert parameter LOAD / DROP / OFFLOAD_GRADS actions around each stage's residency intervals
    (none for the stages in ``resident``, which stay on the device).

    LOAD goes before an interval, DROP after a forward-only interval (the parameters did not
    change, so no copy back), OFFLOAD_GRADS after a stage's final interval (after its last backward
    and that backward's SEND). Without prefetch a LOAD sits right before the interval's first
    compute. With prefetch, interval k's LOAD moves up to where interval k-1 starts (before the
    RECV of its first compute), but not before interval k-2 (or an earlier interval of the same
    stage) has been dropped, so its copy overlaps compute and at most two intervals' parameters
    are resident at once; the first interval loads at the start of the list. A DROP
    immediately followed by a LOAD of the same stage cancels out: the parameters just stay
    resident.
    """
    out: Schedule = {}
    for r, acts in schedule.items():
        intervals = [iv for iv in stage_intervals(acts) if iv.stage not in resident]
        inserts: list[tuple[int, int, int, Action]] = []  # (gap, D/O before L, order, action)
        end_gap, start_gap = [], []
        for k, iv in enumerate(intervals):
            first = acts[iv.first]
            leading_recv = iv.first > 0 and acts[iv.first - 1] == recv_for(first)
            start_gap.append(iv.first - 1 if leading_recv else iv.first)
            gap = iv.last + 1
            if gap < len(acts) and acts[gap] == send_for(acts[iv.last]):
                gap += 1  # release after the SEND has been issued from the output
            end_gap.append(gap)
            inserts.append((gap, 0, k, Action(iv.stage, Op.OFFLOAD_GRADS if iv.final else Op.DROP)))
        for k, iv in enumerate(intervals):
            if not prefetch:
                gap = iv.first
            elif k == 0:
                gap = 0
            else:
                gap = start_gap[k - 1]
                if k >= 2:
                    gap = max(gap, end_gap[k - 2])
                same = [end_gap[j] for j in range(k) if intervals[j].stage == iv.stage]
                gap = min(max([gap] + same), iv.first)
            inserts.append((gap, 1, k, Action(iv.stage, Op.LOAD)))
        inserts.sort(key=lambda x: x[:3])
        new, j = [], 0
        for i, a in enumerate(acts + [None]):
            gap_actions = []
            while j < len(inserts) and inserts[j][0] == i:
                gap_actions.append(inserts[j][3])
                j += 1
            for s in {x.stage for x in gap_actions if x.op is Op.DROP}:
                if Action(s, Op.LOAD) in gap_actions:
                    gap_actions.remove(Action(s, Op.DROP))
                    gap_actions.remove(Action(s, Op.LOAD))
            new += gap_actions
            if a is not None:
                new.append(a)
        out[r] = new
    return out


def add_tie(schedule: Schedule, mapping: list[int]) -> Schedule:
    """Insert the TIE action(s) of a tied embedding (``schedule.ir.tie_actions``): on each rank
    holding stage 0 or the last stage, right after the rank's last compute (and that compute's
    SEND), and an OFFLOAD_GRADS of a tied stage that came earlier moves to right after the TIE.

    After the rank's last compute, not after the tied stage's last backward: TIE is a collective
    between the two ranks, and the last stage's rank still owes the first stage's rank gradients
    of its other stages (interleaved); once every compute of both ranks is listed before their
    TIEs, neither waits in it for work the other has yet to do. The OFFLOAD_GRADS moves because with
    offload the gradient lives in the stage's device buffer until then: the earlier-finishing
    stage keeps its buffers until the exchange. Run after ``add_load_offload`` and before
    ``add_optimizer`` (whose NORM and STEPs then follow the TIE)."""
    out: Schedule = {}
    for r, acts in schedule.items():
        ties = tie_actions(r, mapping)
        if not ties:
            out[r] = list(acts)
            continue
        last = max(i for i, a in enumerate(acts) if a.op in COMPUTE_OPS)
        if last + 1 < len(acts) and acts[last + 1] == send_for(acts[last]):
            last += 1
        covered = {s for t in ties for s in tie_covers(t, mapping)}
        moved = [a for a in acts[:last + 1] if a.op is Op.OFFLOAD_GRADS and a.stage in covered]
        head = [a for a in acts[:last + 1] if a not in moved]
        out[r] = head + ties + moved + list(acts[last + 1:])
    return out


def add_optimizer(schedule: Schedule, mapping: list[int], clip: bool, offload: bool,
                  resident: frozenset[int] = frozenset()) -> Schedule:
    """Insert optimizer STEP actions (and one NORM per rank when ``clip``). With ``offload``,
    the stages in ``resident`` are not offloaded (their STEP follows no OFFLOAD_GRADS).

    ``clip`` asks for the global gradient norm: for clipping, and for skipping a step whose
    gradients are not finite (the norm is then non-finite on every rank alike).

    Without clipping an offloaded stage steps as soon as its gradients are in host memory:
    right after its OFFLOAD_GRADS, on the CPU optimizer thread, overlapping the rank's remaining
    backwards. A stage on the device steps at the end of the rank's list, as with clipping: its
    step is a few milliseconds of GPU kernels that would overlap nothing earlier, and under NCCL
    a device step placed before the rank's last receives are posted can deadlock the first
    backward (the cause is not known, the step makes no host sync: docs/design.md, "Known
    limitations"). At the end of the list every receive is already posted.

    With clipping every rank first finishes all its work, then NORM (a collective over all
    ranks: the global gradient norm must be known before any step), then steps its stages in
    the order the next iteration computes them: with offload the steps run on a CPU thread,
    one after the other, and the next iteration's first stage can start as soon as its own
    step is done.
    """
    out: Schedule = {}
    for r, acts in schedule.items():
        last_b = {a.stage: i for i, a in enumerate(acts) if a.op is Op.BACKWARD}
        missing = [s for s in stages_of(r, mapping) if s not in last_b]
        if missing:
            raise ValueError(f"rank {r}: stages {missing} have no backward; cannot place their STEP")
        first_use: dict[int, int] = {}
        for i, a in enumerate(acts):
            if a.op in COMPUTE_OPS:
                first_use.setdefault(a.stage, i)
        by_use = sorted(last_b, key=first_use.get)
        if clip:
            out[r] = list(acts) + [Action(-1, Op.NORM)] + [Action(s, Op.STEP) for s in by_use]
            continue
        after: dict[int, int] = {}  # index of the action a STEP follows -> stage
        for s, i in last_b.items():
            if not offload or s in resident:
                continue
            # The stage's OFFLOAD_GRADS: right after its last backward (and SEND), or after a TIE
            o = acts.index(Action(s, Op.OFFLOAD_GRADS)) if Action(s, Op.OFFLOAD_GRADS) in acts[i:] else None
            if o is None:
                raise ValueError(f"rank {r}: offload=True but stage {s}'s last backward (step {i}) is not "
                                 f"followed by {s}O; run add_load_offload first")
            after[o] = s
        new = []
        for i, a in enumerate(acts):
            new.append(a)
            if i in after:
                new.append(Action(after[i], Op.STEP))
        out[r] = new + [Action(s, Op.STEP) for s in by_use if s not in after.values()]
    return out


def build(
    name: str,
    num_stages: int,
    num_microbatches: int,
    mapping: list[int],
    *,
    offload: bool,
    prefetch: bool,
    clip: bool,
    resident: int = 0,
    tied: bool = False,
    num_segments: int = 1,
    receive_ahead: int = 0,
) -> Schedule:
    """Generate, lower and validate the full program of every rank.

    Args:
        name: schedule name, see ``generate``.
        num_stages: pipeline stages (virtual stages included).
        num_microbatches: micro-batches per iteration.
        mapping: ``mapping[s]`` is the rank of stage ``s``.
        offload: keep parameters on the host and load them per residency interval.
        prefetch: issue each LOAD one interval early (only meaningful with ``offload``).
        clip: the global gradient norm is needed (clipping, or skipping non-finite steps):
            adds one NORM per rank before the steps.
        resident: with ``offload``, stages per rank that stay on the device (``resident_stages``).
        tied: the first and last stage hold copies of one tied matrix (``tie_word_embeddings``
            over more than one stage): adds their gradient exchange (``add_tie``).
        num_segments: sequence segments per micro-batch (``seq_chunks``); the passes treat a
            (micro-batch, segment) like a micro-batch, the generator orders the segments.
        receive_ahead: computes by which a RECV precedes its consumer (``add_send_recv``'s ``ahead``).
    """
    keep = resident_stages(mapping, resident) if offload else frozenset()
    schedule = generate(name, num_stages, num_microbatches, mapping, num_segments)
    schedule = add_send_recv(schedule, mapping, receive_ahead)
    if offload:
        schedule = add_load_offload(schedule, mapping, prefetch, keep)
    if tied:
        schedule = add_tie(schedule, mapping)
    schedule = add_optimizer(schedule, mapping, clip=clip, offload=offload, resident=keep)
    validate(schedule, mapping, num_stages, num_microbatches, tied=tied, num_segments=num_segments)
    return schedule


def build_forward(
    num_stages: int,
    num_microbatches: int,
    mapping: list[int],
    *,
    offload: bool,
    prefetch: bool,
    resident: int = 0,
    num_segments: int = 1,
    receive_ahead: int = 0,
) -> Schedule:
    """The forward-only program of every rank (evaluation): F, SEND_F / RECV_F and, with
    offload, LOAD / DROP; no B, no OFFLOAD_GRADS, no NORM, no STEP. Validated like ``build``.

    Args: as for ``build``.
    """
    schedule = generate_forward(num_stages, num_microbatches, mapping, num_segments)
    schedule = add_send_recv(schedule, mapping, receive_ahead)
    if offload:
        schedule = add_load_offload(schedule, mapping, prefetch, resident_stages(mapping, resident))
    validate(schedule, mapping, num_stages, num_microbatches, forward_only=True, num_segments=num_segments)
    return schedule
