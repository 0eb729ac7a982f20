"""The action IR: what one rank does, in order, during one training iteration.

A schedule is plain data: ``dict[rank, list[Action]]``. Generators produce the compute
actions (F and B); lowering passes insert communication, parameter movement and optimizer
actions; the executor in ``pipeline/`` interprets the result without reordering it.

An action prints compactly and parses back::

    2F0        forward of stage 2 on micro-batch 0
    2B3        backward of stage 2 on micro-batch 3
    1SEND_F0   send stage 1's output activation of micro-batch 0 to the rank of stage 2
    2RECV_F0   receive stage 2's input activation of micro-batch 0 from the rank of stage 1
    2SEND_B0   send the gradient w.r.t. stage 2's input of micro-batch 0 to the rank of stage 1
    1RECV_B0   receive the gradient w.r.t. stage 1's output of micro-batch 0
    3L         load stage 3's parameters host -> device
    3D         drop stage 3's device parameters (no copy back: they did not change)
    3O         offload stage 3's gradients device -> host and free its device memory
    3S         optimizer step of stage 3
    NORM       all-reduce of the squared gradient norm across ranks (for global clipping)
    0T         tied embeddings: sum the shared matrix's gradient of stage 0 (embedding) with
               the last stage's (head), so both copies hold the gradient of both uses; one
               all-reduce between the two ranks (each lists the T of the stage it holds), or a
               local add where one rank holds both (it lists 0T only)

A micro-batch index is opaque to the IR: the data side decides which rows it stands for.
With sequence-level pipelining (``seq_chunks``, docs/seq_pipelining.md) every sequence is cut
into K contiguous segments and a micro-batch is a pair (rows, segment), printed after a dot::

    2F0.1      forward of stage 2 on the rows of micro-batch 0, segment 1
    1SEND_B3.0 send the input gradient of stage 1, rows 3, segment 0

Segments of the same rows at one stage depend on each other (``kv_predecessor``): segment j's
forward attends to the keys and values of segments < j, and segment j's backward needs the
gradients of its keys and values, which the backwards of segments > j produce. Without
segments (K = 1) ``seg`` is None and an action prints without one (``2F0``).
"""
from __future__ import annotations

import re
from enum import Enum
from typing import NamedTuple


class Op(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    LOAD = "L"
    DROP = "D"
    OFFLOAD_GRADS = "O"  # the stage's gradients to host memory (its weights are dropped too)
    STEP = "S"
    NORM = "NORM"
    TIE = "T"


COMPUTE_OPS = frozenset({Op.FORWARD, Op.BACKWARD})
COMM_OPS = frozenset({Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B})
SEND_OPS = frozenset({Op.SEND_F, Op.SEND_B})
RECV_OPS = frozenset({Op.RECV_F, Op.RECV_B})
# Ops that carry a micro-batch index; the others are per stage (or per rank for NORM).
MICROBATCH_OPS = COMPUTE_OPS | COMM_OPS
RANK_OPS = frozenset({Op.NORM})

_ACTION_RE = re.compile(r"^(\d*)(SEND_F|RECV_F|SEND_B|RECV_B|NORM|F|B|L|D|O|S|T)(\d*)(?:\.(\d+))?$")


class Action(NamedTuple):
    """One step of a rank's program. ``stage`` is -1 for rank-level ops (NORM); ``seg`` is the
    sequence segment of the micro-batch's rows, None without sequence-level pipelining."""

    stage: int
    op: Op
    mb: int | None = None
    seg: int | None = None

    def __str__(self) -> str:
        if self.op in RANK_OPS:
            return self.op.value
        mb = "" if self.mb is None else str(self.mb)
        seg = "" if self.seg is None else f".{self.seg}"
        return f"{self.stage}{self.op.value}{mb}{seg}"

    def __repr__(self) -> str:
        return str(self)

    @staticmethod
    def parse(text: str) -> "Action":
        m = _ACTION_RE.match(text.strip())
        if m is None:
            raise ValueError(f"cannot parse action {text!r}: expected e.g. '2F0', '2F0.1', '1SEND_F3', '3L', 'NORM'")
        stage, op, mb, seg = m.group(1), Op(m.group(2)), m.group(3), m.group(4)
        if seg is not None and not mb:
            raise ValueError(f"cannot parse action {text!r}: a segment (.{seg}) needs a micro-batch index")
        if op in RANK_OPS:
            if stage or mb:
                raise ValueError(f"cannot parse action {text!r}: {op.value} takes no stage or micro-batch")
            return Action(-1, op)
        if not stage:
            raise ValueError(f"cannot parse action {text!r}: missing stage index")
        if (op in MICROBATCH_OPS) != bool(mb):
            need = "needs" if op in MICROBATCH_OPS else "takes no"
            raise ValueError(f"cannot parse action {text!r}: {op.value} {need} a micro-batch index")
        return Action(int(stage), op, int(mb) if mb else None, None if seg is None else int(seg))


Schedule = dict[int, list[Action]]


def format_schedule(schedule: Schedule) -> str:
    """One line per rank: ``rank 0: 0L 0F0 0F1 ...``."""
    return "\n".join(f"rank {r}: " + " ".join(map(str, acts)) for r, acts in sorted(schedule.items()))


def round_robin(num_stages: int, world_size: int) -> list[int]:
    """Default stage -> rank mapping: stage s runs on rank s % world_size (virtual stages)."""
    return [s % world_size for s in range(num_stages)]


def stages_of(rank: int, mapping: list[int]) -> list[int]:
    """Stages owned by ``rank``, ascending."""
    return [s for s, r in enumerate(mapping) if r == rank]


def offloaded_stages(schedule: Schedule) -> frozenset[int]:
    """Stages whose parameters the program moves between host and device (it loads them);
    every other stage stays on the device (no offload, or a resident stage)."""
    return frozenset(a.stage for acts in schedule.values() for a in acts if a.op is Op.LOAD)


def tied_stages(num_stages: int) -> tuple[int, int]:
    """The stages holding a copy of a tied embedding matrix: the first (embedding) and the last
    (head). Only meaningful with more than one stage (one stage shares one Parameter)."""
    return 0, num_stages - 1


def tie_actions(rank: int, mapping: list[int]) -> list[Action]:
    """The TIE action(s) ``rank`` runs when the embedding is tied: ``0T`` on the rank of stage 0,
    ``{S-1}T`` on the rank of the last stage unless that is the same rank (one local add)."""
    first, last = tied_stages(len(mapping))
    out = [Action(first, Op.TIE)] if mapping[first] == rank else []
    if mapping[last] == rank and mapping[first] != rank:
        out.append(Action(last, Op.TIE))
    return out


def tie_covers(a: Action, mapping: list[int]) -> list[int]:
    """The stages of ``a``'s rank whose tied gradient TIE action ``a`` completes."""
    return [s for s in tied_stages(len(mapping)) if mapping[s] == mapping[a.stage]]


def crosses(mapping: list[int], s: int, t: int) -> bool:
    """Whether the tensor between stage ``s`` and its neighbour ``t`` (``s - 1`` or ``s + 1``)
    travels between ranks: ``t`` exists and runs on another rank than ``s``. Neighbours on one
    rank pass the tensor locally, with no SEND or RECV; past either end there is no tensor."""
    return 0 <= t < len(mapping) and mapping[t] != mapping[s]


def peer_stage(a: Action) -> int:
    """The neighbouring stage a SEND or RECV exchanges its tensor with: the next stage for
    activations sent and gradients received, the previous stage for the other two."""
    if a.op in (Op.SEND_F, Op.RECV_B):
        return a.stage + 1
    if a.op in (Op.SEND_B, Op.RECV_F):
        return a.stage - 1
    raise ValueError(f"peer_stage needs a SEND or RECV action, got {a}")


def send_for(a: Action) -> Action:
    """The SEND that carries compute ``a``'s output (activation or input gradient) to the
    neighbouring stage; it exists where ``remote_consumer(a, mapping)``."""
    if a.op not in COMPUTE_OPS:
        raise ValueError(f"send_for needs an F or B action, got {a}")
    return Action(a.stage, Op.SEND_F if a.op is Op.FORWARD else Op.SEND_B, a.mb, a.seg)


def recv_for(a: Action) -> Action:
    """The RECV that brings compute ``a``'s input (activation or output gradient) from the
    neighbouring stage; it exists where ``remote_producer(a, mapping)``."""
    if a.op not in COMPUTE_OPS:
        raise ValueError(f"recv_for needs an F or B action, got {a}")
    return Action(a.stage, Op.RECV_F if a.op is Op.FORWARD else Op.RECV_B, a.mb, a.seg)


def peer_recv(send: Action) -> Action:
    """The RECV on the peer rank that matches ``send`` (named by the consumer's stage)."""
    if send.op not in SEND_OPS:
        raise ValueError(f"peer_recv needs a SEND_F or SEND_B action, got {send}")
    return Action(peer_stage(send), Op.RECV_F if send.op is Op.SEND_F else Op.RECV_B, send.mb, send.seg)


Channel = tuple[int, int]  # (src rank, dst rank)


def channel(a: Action, mapping: list[int]) -> Channel:
    """``(src_rank, dst_rank)`` of a SEND or RECV.

    Activations and gradients from one rank to another share one FIFO channel. On GPUs the
    NCCL kernels of one device need not progress independently of each other (CUDA promises no
    concurrency between streams), so messages between a pair of ranks behave as one queue even
    on separate communicators: a receive posted ahead of the message that is really next on the
    link waits behind it. A message that fits in NCCL's buffers is sent anyway; a larger one (a
    16 MiB activation) is sent only once its receive runs, so the two ranks wait on each other
    forever. Hence the executor sends both kinds on one communicator per rank pair, and the
    lowering posts receives in send order."""
    if a.op not in COMM_OPS:
        raise ValueError(f"channel needs a SEND or RECV action, got {a}")
    here, peer = mapping[a.stage], mapping[peer_stage(a)]
    return (here, peer) if a.op in SEND_OPS else (peer, here)


def producer(a: Action, num_stages: int) -> Action | None:
    """The compute whose output compute ``a`` consumes (None for a first-stage forward)."""
    if a.op is Op.FORWARD:
        return None if a.stage == 0 else Action(a.stage - 1, Op.FORWARD, a.mb, a.seg)
    if a.stage == num_stages - 1:
        return Action(a.stage, Op.FORWARD, a.mb, a.seg)
    return Action(a.stage + 1, Op.BACKWARD, a.mb, a.seg)


def kv_predecessor(a: Action, num_segments: int) -> Action | None:
    """The compute of the same stage and rows that compute ``a`` (of a segment) must follow on
    its rank, because of attention across segments: a forward of segment j attends to the
    keys/values of segment j - 1 (and, through it, of every earlier one), and a backward of
    segment j needs the gradients of its keys/values, which the backward of segment j + 1
    completes (the backward of the last segment comes first). None without segments, for the
    first segment's forward and for the last segment's backward."""
    if a.seg is None or a.op not in COMPUTE_OPS:
        return None
    if a.op is Op.FORWARD:
        return Action(a.stage, Op.FORWARD, a.mb, a.seg - 1) if a.seg > 0 else None
    return Action(a.stage, Op.BACKWARD, a.mb, a.seg + 1) if a.seg + 1 < num_segments else None


def segment_indices(num_segments: int) -> list[int | None]:
    """The ``seg`` of each segment of a micro-batch, in forward order: ``[None]`` without
    segments (K = 1), else ``0..K-1``."""
    return [None] if num_segments == 1 else list(range(num_segments))


def num_segments_of(schedule: Schedule) -> int:
    """K of a schedule: one more than its largest segment index, 1 when no action has one."""
    return 1 + max((a.seg for acts in schedule.values() for a in acts if a.seg is not None), default=0)


def remote_producer(a: Action, mapping: list[int]) -> bool:
    """Whether compute ``a`` consumes a tensor made on another rank (so needs a RECV)."""
    return crosses(mapping, a.stage, peer_stage(recv_for(a)))


def remote_consumer(a: Action, mapping: list[int]) -> bool:
    """Whether compute ``a``'s output is consumed on another rank (so needs a SEND)."""
    return crosses(mapping, a.stage, peer_stage(send_for(a)))
