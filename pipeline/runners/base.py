"""What every runner shares: the protocol, one iteration's state, and the pieces of a stage's pass
that more than one way of running it uses.

A runner is one way of running a stage's work (``pipeline.runners``: the plain or checkpointed
stage, the fused last stage, activation offload, sequence segments, long rows). The executor
routes tensors to it and from it; the runner computes, holds what its backward needs, and says
what memory that is (``account``, which the memory plan sums). So what a mode does and what the
plan counts for it are written in one file.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, ClassVar, Protocol

import torch

from pipeline.spec.run_spec import Mode
from pipeline.stage.model import backward_where_needed
from schedule.ir import Action

if TYPE_CHECKING:
    from pipeline.spec.footprint import Ledger

Key = tuple[int, int, "int | None"]  # (stage, micro-batch, segment): what buffers are keyed by


class Arrival:
    """A tensor the executor hands a runner, taken when the runner needs it: a receive is waited
    for only then (``work.wait()``: device-side with NCCL, a host wait with gloo), so the runner
    decides whether its compute may start before it (activation offload's recompute does)."""

    def __init__(self, take: Callable[[], torch.Tensor | None]):
        self._take = take

    @staticmethod
    def of(t: torch.Tensor | None) -> "Arrival":
        """A tensor that is here already."""
        return Arrival(lambda: t)

    def take(self) -> torch.Tensor | None:
        return self._take()


@dataclass
class Iteration:
    """One run of an action list (``Executor.run``): everything that lives from its first action
    to its end, and nothing that outlives it.

    The runners read the first group; the executor routes the second between stages and ranks
    (keyed by (stage, micro-batch, segment)); NORM and STEP write the third."""

    microbatches: list              # pipeline.run.executor.MicroBatch, on the rank's device
    lengths: tuple[int, ...]        # a row's segment lengths (one segment: the whole row)
    bounds: list[tuple[int, int]]   # [start, end) columns of each segment
    num_targets: int                # predicted tokens of the global batch: the loss's normaliser
    lr: float
    loss_scale: float
    training: bool
    clock: object                   # pipeline.run.executor.StepClock
    router: object | None = None    # pipeline.stage.router_loss.RouterLoss, in training only
    losses: list[torch.Tensor] = field(default_factory=list)  # the last stage's, normalised
    # routed by the executor
    local_in: dict = field(default_factory=dict)    # activation from a same-rank stage
    local_grad: dict = field(default_factory=dict)  # input gradient for a same-rank stage
    recvs: dict = field(default_factory=dict)       # (op, stage, micro-batch, segment) -> (buffer, work)
    to_send: dict = field(default_factory=dict)     # outputs waiting for their SEND_F
    grads_out: dict = field(default_factory=dict)   # input gradients waiting for their SEND_B
    sends: list = field(default_factory=list)       # (work, tensor): kept alive until the send completed
    # the optimizer's
    has_norm: bool = False
    clip_coef: float | None = None
    grad_norm: float | None = None
    skip_step: bool = False
    summed: set = field(default_factory=set)        # stages whose gradient is summed over the replicas

    def columns(self, t: torch.Tensor, seg: int | None) -> torch.Tensor:
        """The columns of micro-batch tensor ``t`` [b, T] that segment ``seg`` covers (all without one)."""
        if seg is None:
            return t
        start, end = self.bounds[seg]
        return t[:, start:end]

    def release_sent(self) -> None:
        """Drop the sent tensors whose sends are done (otherwise they live to the end of the
        iteration, one per micro-batch). ``is_completed`` does not block."""
        self.sends = [(work, t) for work, t in self.sends if not work.is_completed()]


class Runner(Protocol):
    """One way of running a stage's work, chosen once per stage (``runner_for``).

    ``forward`` returns what goes on to the next stage (None from the last stage, whose loss it
    adds to ``Iteration.losses``); ``backward`` returns the gradient w.r.t. the stage's input
    (None on the first stage). Each calls its store's ``before_compute`` first and records its
    compute span on the iteration's clock. ``account`` is what the memory plan asks: the bytes a
    runner of this kind holds and frees at a FORWARD or BACKWARD action, as changes to the rank's
    ``Ledger``, and the action's peak (``Ledger.note_peak``). A runner is made as
    ``cls(stage, store, host)``: ``host`` is the rank's ``offloaded.HostActivations`` (stage inputs
    and carried keys/values in host memory, ``activation_offload``), None without it."""

    applies: ClassVar[Callable[[Mode], bool]]

    def begin(self, it: Iteration) -> None:
        """Start iteration ``it`` with fresh per-iteration state."""

    def end_iteration(self) -> None:
        """Drop what the iteration left (a forward-only pass's kept tensors); until the next
        ``begin`` the runner holds nothing."""

    def forward(self, key: Key, x: Arrival) -> torch.Tensor | None: ...

    def backward(self, key: Key, grad: Arrival) -> torch.Tensor | None: ...

    @classmethod
    def account(cls, a: Action, ledger: "Ledger") -> None: ...


@contextlib.contextmanager
def routing(stage, key: Key, it: Iteration):
    """Stage ``key[0]``'s routers record (first pass) or replay (recomputes) the routing of ``key``
    in training (``models.moe``); a forward-only pass records nothing."""
    with stage.routing.pass_(key if it.training else None):
        yield


def whole_pass(stage, store, it: Iteration, a_key: Key, x: torch.Tensor, last: bool
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stage ``stage`` on a whole micro-batch ``a_key[1]``: (what its backward starts from, the
    normalised loss on the last stage, else None). On the last stage the first is the loss times
    the loss scale (float16: every gradient is then scaled, see LossScaler). Autograd saves views
    of the weights through the store's hooks."""
    mb = it.microbatches[a_key[1]]
    with store.saved_tensor_hooks():
        out = stage(x, mb.targets, **mb.packing()) if last else stage(x, **mb.packing())
    return normalised(out, it, last)


def normalised(out: torch.Tensor, it: Iteration, last: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(backward root, loss): a hidden state as it is; the last stage's summed token loss over
    the batch's targets, times the loss scale for its backward."""
    if not last:
        return out, None
    loss = out / it.num_targets
    return (loss * it.loss_scale if it.loss_scale != 1.0 else loss), loss


def forward_input(runner, x: Arrival, backward: bool = False) -> torch.Tensor:
    """Before a forward of ``runner``'s stage: its weights ready (the store waits for its LOAD;
    ``backward``: a forward that differentiates too binds the gradient buffer), then its input
    taken (a receive waited for)."""
    runner.store.before_compute(backward=backward, clock=runner.it.clock)
    return x.take()


def forward_done(it: Iteration, key: Key, last: bool) -> None:
    """The router loss's partial sums of ``key``'s forward, handed on (training only)."""
    if it.router is not None:
        it.router.forward_done(key, last, it.microbatches[key[1]].input_ids.numel())


def forward_result(it: Iteration, key: Key, last: bool, out: torch.Tensor, loss: torch.Tensor | None,
                   start) -> torch.Tensor | None:
    """After a stage's forward of ``key``: the router loss's sums handed on, the loss kept (last
    stage), the compute span since ``start`` closed; what goes on to the next stage (None from
    the last)."""
    forward_done(it, key, last)
    if last:
        it.losses.append(loss.detach())
    it.clock.span("compute", start, it.clock.mark())
    return None if last else out


def differentiate(it: Iteration, key: Key, last: bool, out: torch.Tensor, grad: torch.Tensor | None) -> None:
    """The backward of a whole micro-batch from ``out`` (the last stage's scaled loss: d = 1; else
    the output, against ``grad``), with the routed layers' roots of the router loss."""
    roots, grads = [], []
    if it.router is not None:
        roots, grads = it.router.roots(key, last, it.microbatches[key[1]].input_ids.numel(), it.loss_scale)
    backward_where_needed([out] + roots, [torch.ones_like(out) if last else grad] + grads)


__all__ = ["Arrival", "Iteration", "Key", "Mode", "Runner", "differentiate", "forward_done", "forward_input",
           "forward_result", "normalised", "routing", "whole_pass"]
