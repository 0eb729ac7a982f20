"""Activation offload (``activation_offload``, docs/design.md), whole rows: in training a stage's
forward builds no graph and its input waits in host memory (``offload.activations``); its
backward brings the input back, recomputes the stage with a graph (no layer checkpointed a second
time) and differentiates it. The copy back of this rank's next backward's input starts before
the recompute, so it overlaps it. Outputs are kept only until SEND_F has sent them: sent tensors
whose sends are done are dropped at every compute.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from offload.activations import ActivationStash
from offload.kv import CarriedKV
from pipeline.spec.compute_bytes import attention_work, mlp_work, per_token, weight_grad_bytes
from pipeline.spec.footprint import MemoryInputs
from pipeline.runners.base import (Arrival, Iteration, Key, Mode, differentiate, forward_input,
                                   forward_result, routing, whole_pass)
from schedule.ir import Action, Op, crosses

if TYPE_CHECKING:
    from pipeline.spec.footprint import Ledger


class HostActivations:
    """What one rank's recomputing stages keep in host memory between forwards and backwards: the
    stage inputs (``ActivationStash``) and, with sequence segments, the carried keys/values
    (``CarriedKV``), with the order of the rank's recomputing backwards, so that each starts
    bringing back the next one's. One per rank, used by the thread that interprets the action
    list only (the stash's and the keys' own streams: their modules' docstrings)."""

    def __init__(self, device: torch.device, segmented: bool):
        self.stash = ActivationStash(device)
        self.kv = CarriedKV(device) if segmented else None
        self.recomputing: set[int] = set()  # stages whose backward recomputes from here (their runners say)
        self.next_backward: dict[Key, Key] = {}

    def begin(self, actions: list[Action]) -> None:
        order = [(a.stage, a.mb, a.seg) for a in actions if a.op is Op.BACKWARD and a.stage in self.recomputing]
        self.next_backward = dict(zip(order, order[1:]))
        self.stash.clear()
        if self.kv is not None:
            self.kv.clear()

    def input_back(self, key: Key, it: Iteration) -> torch.Tensor:
        """``key``'s stage input for its recompute (stage 0: its tokens), and the copy back of the
        next backward's input (and carried keys/values) started: nothing if that forward has not
        run yet, or they are on the device already."""
        x = self.stash.restore(key) if key[0] > 0 else it.columns(it.microbatches[key[1]].input_ids, key[2])
        nxt = self.next_backward.get(key)
        if nxt is not None:
            if nxt[0] > 0:
                self.stash.prefetch(nxt)
            if nxt[2] is not None:
                self.kv.prefetch(nxt[:2])  # its stage's carried keys/values (``SegmentStage.prefetch``)
        return x


class OffloadedRows:
    """A stage on whole micro-batches whose inputs wait in host memory and whose backward recomputes."""

    @staticmethod
    def applies(mode: Mode) -> bool:
        return mode.training and mode.activation_offload and not mode.segmented

    def __init__(self, stage, store, host: HostActivations):
        self.stage, self.store, self.host = stage, store, host
        self.last = stage.is_last
        self.host.recomputing.add(stage.index)
        self.end_iteration()

    def begin(self, it: Iteration) -> None:
        self.it = it

    def end_iteration(self) -> None:
        self.it: Iteration | None = None  # the stash of stage inputs is the rank's (``HostActivations.begin``)

    def forward(self, key: Key, x: Arrival) -> torch.Tensor | None:
        it = self.it
        x = forward_input(self, x)
        if not self.stage.is_first:
            self.host.stash.save(key, x)  # stage 0 needs none: its tokens stay in the micro-batch
        it.release_sent()
        start = it.clock.mark()
        # no graph: the backward recomputes this forward from the stashed input
        with torch.no_grad(), routing(self.stage, key, it):
            out, loss = whole_pass(self.stage, self.store, it, key, x, self.last)
        return forward_result(it, key, self.last, out, loss, start)

    def backward(self, key: Key, grad: Arrival) -> torch.Tensor | None:
        it = self.it
        with routing(self.stage, key, it):  # the recompute replays the forward's routing
            self.store.before_compute(backward=True, clock=it.clock)
            it.release_sent()
            # the recompute needs no gradient yet: it runs before the wait for the one sent back
            x = self.host.input_back(key, it)
            if not self.stage.is_first:
                x.requires_grad_(True)
            start = it.clock.mark()
            out = whole_pass(self.stage, self.store, it, key, x, self.last)[0]
            g = grad.take()
            differentiate(it, key, self.last, out, g)
            g = x.grad if not self.stage.is_first else None
            it.clock.span("compute", start, it.clock.mark())
        self.stage.routing.release(key)
        return g

    @classmethod
    def account(cls, a: Action, ledger: "Ledger") -> None:
        recomputed(a, ledger)


def recomputed(a: Action, ledger: "Ledger") -> None:
    """A recomputing stage's F or B: sent tensors released at the compute, what it holds after
    (``offloaded_compute``), its input in host memory from the forward to the backward, and the
    action's peak."""
    s, n, io = ledger.compute(a)
    ledger.release_sent()
    extra, held_delta, ledger.sent = offloaded_compute(ledger.inp, a, io)
    ledger.held += held_delta + ledger.sent
    if a.op is Op.BACKWARD:
        ledger.grad_buffer(s)
    if s > 0:
        ledger.stashed += io if a.op is Op.FORWARD else -io
        ledger.stash_peak = max(ledger.stash_peak, ledger.stashed)
    ledger.note_peak(a, extra + (weight_grad_bytes(ledger.inp, s) if a.op is Op.BACKWARD else 0))


def offloaded_compute(inp: MemoryInputs, a: Action, io: float) -> tuple[float, float, float]:
    """One F or B of stage ``a.stage`` as (transient bytes, change of the tensors held after it,
    bytes of it sent to another rank). A forward runs without a graph: its input (until copied
    to the host) and one layer's working set. A backward holds the input brought back (and the
    next backward's, prefetched), the received gradient and the stage's whole activations of one
    micro-batch (segment: of its tokens, attending to the earlier segments' keys). Outputs and
    input gradients are held until a stage of this rank takes them, or, sent, until the next
    compute."""
    s, st = a.stage, inp.stages[a.stage]
    tokens = inp.span(a.seg)[2]
    full, fwd_t, bwd_t = per_token(inp, s, a.seg)
    if a.op is Op.FORWARD:
        start, end, _ = inp.span(a.seg)  # a forward without a graph: one layer's working set at a time
        layer_work = max(mlp_work(inp, tokens)[0], attention_work(inp, start, end)[0]) if st.num_layers else 0
        transient = max(fwd_t, layer_work) * tokens + (io if s > 0 else 0)
        local_in = s > 0 and not crosses(inp.mapping, s, s - 1)
        out = io if not st.last else 0.0
        to_peer = out if not st.last and crosses(inp.mapping, s, s + 1) else 0.0
        return transient, out - to_peer - (io if local_in else 0.0), to_peer
    local_grad = not st.last and not crosses(inp.mapping, s, s + 1)
    # the input brought back and the next backward's prefetched; a received gradient (a local one
    # is held already, counted where the next stage's backward made it)
    received = io if not st.last and not local_grad else 0
    transient = (full + bwd_t) * tokens + (2 * io if s > 0 else 0) + received
    grad = io if s > 0 else 0.0
    to_peer = grad if s > 0 and crosses(inp.mapping, s, s - 1) else 0.0
    return transient, grad - to_peer - (io if local_grad else 0.0), to_peer


__all__ = ["HostActivations", "OffloadedRows", "offloaded_compute", "recomputed"]
