"""Whole rows with autograd's graph kept from a stage's forward to its backward: the default way
of running a stage, in training and in evaluation. Under ``activation_checkpointing`` the stage
itself checkpoints its layers as it was built (``Stage.recomputed``; ``keep_layers`` spares the
last ones), so recompute-checkpointing is this runner too.

Held between a micro-batch's forward and backward: the stage input (a leaf whose gradient goes
back upstream), the output (the backward's root) and what autograd saved for the backward.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from pipeline.spec.compute_bytes import per_token, weight_grad_bytes
from pipeline.runners.base import (Arrival, Iteration, Key, Mode, differentiate, forward_input,
                                   forward_result, routing, whole_pass)
from schedule.ir import Action, Op

if TYPE_CHECKING:
    from pipeline.spec.footprint import Ledger
    from pipeline.runners.offloaded import HostActivations


class WholeRows:
    """A ``pipeline.stage.model.Stage`` on whole micro-batches, graph kept."""

    @staticmethod
    def applies(mode: Mode) -> bool:
        return True  # what no other runner takes

    def __init__(self, stage, store, host: HostActivations | None):
        self.stage, self.store = stage, store
        self.last = stage.is_last
        self.end_iteration()

    def begin(self, it: Iteration) -> None:
        self.end_iteration()
        self.it = it

    def end_iteration(self) -> None:
        self.it: Iteration | None = None
        self.inputs: dict[Key, torch.Tensor] = {}  # stage inputs, whose gradient goes upstream
        self.roots: dict[Key, torch.Tensor] = {}   # outputs (the last stage: its scaled loss)

    def forward(self, key: Key, x: Arrival) -> torch.Tensor | None:
        it = self.it
        x = forward_input(self, x)
        if not self.stage.is_first:
            x.requires_grad_(True)
            self.inputs[key] = x
        start = it.clock.mark()
        with routing(self.stage, key, it):
            out, loss = whole_pass(self.stage, self.store, it, key, x, self.last)
        self.roots[key] = out
        return forward_result(it, key, self.last, out, loss, start)

    def backward(self, key: Key, grad: Arrival) -> torch.Tensor | None:
        it = self.it
        with routing(self.stage, key, it):  # a checkpointed layer recomputes in here
            self.store.before_compute(backward=True, clock=it.clock)
            out = self.roots.pop(key)
            g = grad.take()
            start = it.clock.mark()
            differentiate(it, key, self.last, out, g)
            g = self.inputs.pop(key).grad if not self.stage.is_first else None
            it.clock.span("compute", start, it.clock.mark())
        self.stage.routing.release(key)
        return g

    @classmethod
    def account(cls, a: Action, ledger: "Ledger") -> None:
        kept_graph(a, ledger)


def kept_graph(a: Action, ledger: "Ledger", freed: Callable[[Action, "Ledger"], None] | None = None) -> None:
    """What a stage whose graph lives from forward to backward holds: autograd's saved tensors of
    the micro-batch (segment), its received input (kept for its gradient; a local one is counted
    as the previous stage's output) and its output (kept for the backward and, when sent, until
    the iteration ends); the backward frees the saved tensors and the input, hands a local
    gradient on, and peaks with a layer's gradients and the largest weight's. ``freed``: what
    else changes once the saved tensors are freed (segments: the carried keys' gradients)."""
    s, n, io = ledger.compute(a)
    inp, last = ledger.inp, ledger.inp.stages[a.stage].last
    if a.op is Op.FORWARD:
        per_tok, fwd_t, _ = per_token(inp, s, a.seg)
        ledger.per_mb[(s, a.mb, a.seg)] = per_tok * n
        ledger.saved += per_tok * n
        if ledger.crosses(s, s - 1):
            ledger.held += io  # the received input, kept for its gradient (a local one is counted as an output)
        if not last:
            ledger.held += io  # the output: kept for backward and, when sent, until the iteration ends
        ledger.note_peak(a, fwd_t * n)
        return
    _, _, bwd_t = per_token(inp, s, a.seg)
    ledger.grad_buffer(s)
    ledger.saved -= ledger.per_mb.pop((s, a.mb, a.seg))
    if freed is not None:
        freed(a, ledger)
    if s > 0 and not ledger.crosses(s, s - 1):
        ledger.held += io  # the input's gradient, handed to the previous stage of this rank
    # a received input is freed and its gradient, sent on, lives until the iteration ends
    if not last and not ledger.crosses(s, s + 1):
        ledger.held -= 2 * io  # the output (the next stage's input) and the gradient it got back
    ledger.note_peak(a, bwd_t * n + weight_grad_bytes(inp, s))


__all__ = ["WholeRows", "kept_graph"]
