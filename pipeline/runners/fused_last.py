"""The fused last stage (``fuse_last_stage``, docs/design.md): in training with whole rows, the
last stage's FORWARD runs its backward too (``Stage.forward_backward``: no layer checkpointed, the
logits made and differentiated a loss chunk at a time), so nothing of the micro-batch but its
input's gradient waits for the BACKWARD action, which only hands that gradient on. The actions
stay where the schedule put them: communication, loads and offloads do not change.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from pipeline.spec.compute_bytes import per_token, weight_grad_bytes
from pipeline.spec.footprint import MemoryInputs
from pipeline.runners.base import Arrival, Iteration, Key, Mode, forward_input, routing
from schedule.ir import Action, Op

if TYPE_CHECKING:
    from pipeline.spec.footprint import Ledger
    from pipeline.runners.offloaded import HostActivations


class FusedLast:
    """The last stage, forward and backward in its FORWARD."""

    @staticmethod
    def applies(mode: Mode) -> bool:
        # a segment's backward needs the later segments' (gradients of keys and values): not fusable
        return mode.training and mode.last and mode.fused_last and not mode.segmented

    def __init__(self, stage, store, host: HostActivations | None):
        self.stage, self.store = stage, store
        # with activation_offload, the rank's sent tensors are released at each compute
        self.releases_sent = host is not None
        self.end_iteration()

    def begin(self, it: Iteration) -> None:
        self.end_iteration()
        self.it = it

    def end_iteration(self) -> None:
        self.it: Iteration | None = None
        self.grads: dict[Key, torch.Tensor | None] = {}  # input gradients the forwards made

    def forward(self, key: Key, x: Arrival) -> None:
        it = self.it
        x = forward_input(self, x, backward=True)  # its backward runs now: nothing waits for it
        if self.releases_sent:
            it.release_sent()
        start = it.clock.mark()
        with routing(self.stage, key, it):
            self._forward_backward(key, x)
        it.clock.span("compute", start, it.clock.mark())
        return None

    def _forward_backward(self, key: Key, x: torch.Tensor) -> None:
        """The forward, loss and backward of ``key``'s micro-batch; the gradient w.r.t. its input
        waits for the BACKWARD action. The loss scale and the normalisation ride in as the
        backward's scale, as through a whole-row stage's loss."""
        it = self.it
        mb = it.microbatches[key[1]]

        def router_roots():  # after the forward: the router loss's totals and this stage's roots
            it.router.forward_done(key, True, mb.input_ids.numel())
            return it.router.roots(key, True, mb.input_ids.numel(), it.loss_scale)

        extra = router_roots if it.router is not None else None
        with self.store.saved_tensor_hooks():
            loss, g = self.stage.forward_backward(x, mb.targets, it.loss_scale / it.num_targets, **mb.packing(),
                                                  extra=extra)
        self.stage.routing.release(key)
        it.losses.append(loss / it.num_targets)
        self.grads[key] = g

    def backward(self, key: Key, grad: Arrival) -> torch.Tensor | None:
        with routing(self.stage, key, self.it):
            self.store.before_compute(backward=True, clock=self.it.clock)
            g = self.grads.pop(key)
        self.stage.routing.release(key)
        return g

    @classmethod
    def account(cls, a: Action, ledger: "Ledger") -> None:
        """The forward holds the input's gradient (a received input freed for it) and peaks with
        ``fused_transient``; the backward computes nothing (no peak of its own) and, offloading
        activations, sends the gradient, released at the next compute."""
        s, n, io = ledger.compute(a)
        if a.op is Op.FORWARD:
            ledger.grad_buffer(s)
            if ledger.inp.activation_offload:
                ledger.release_sent()
                if s > 0 and not ledger.crosses(s, s - 1):
                    ledger.held -= io  # a recomputing stage's output, held for this forward alone
            ledger.held += io if s > 0 else 0.0  # the input's gradient (a received input freed for it)
            ledger.note_peak(a, fused_transient(ledger.inp, s, n) + weight_grad_bytes(ledger.inp, s))
        elif ledger.inp.activation_offload and s > 0 and ledger.crosses(s, s - 1):
            ledger.sent += io  # sent now, freed at the next compute


def fused_transient(inp: MemoryInputs, s: int, tokens: int) -> float:
    """What the last stage's forward of one micro-batch adds while it runs its backward: every
    layer's activations (none checkpointed), the detached final hidden state's gradient and the
    worst of a loss chunk's and a layer's backward."""
    whole = replace(inp, checkpointing=True, activation_offload=True)  # nothing recomputed, loss chunked
    saved, _, bwd = per_token(whole, s)
    return (saved + inp.dtype_bytes * inp.shape.hidden + bwd) * tokens


__all__ = ["FusedLast", "fused_transient"]
