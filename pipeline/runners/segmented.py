"""Sequence segments (``seq_chunks: K``, Seq1F1B, docs/seq_pipelining.md) with autograd's graph kept:
an action names a segment of its micro-batch's columns (``2F0.1``) and the stage runs through a
``pipeline.stage.segments.SegmentStage``, which carries each layer's keys and values from a
segment's forward to the later segments of its micro-batch and feeds their gradients back in the
segment's backward. In training and in evaluation; with ``activation_offload`` in training the
segments run as long rows (``pipeline.runners.offloaded_segments``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pipeline.spec.footprint import MemoryInputs
from pipeline.runners.base import (Arrival, Iteration, Key, Mode, forward_input, forward_result, normalised,
                                   routing)
from pipeline.runners.whole_rows import kept_graph
from pipeline.stage.segments import SegmentStage
from schedule.ir import Action

if TYPE_CHECKING:
    from pipeline.spec.footprint import Ledger
    from pipeline.runners.offloaded import HostActivations


class Segmented:
    """A stage one (rows, segment) at a time, graph kept; a fresh ``SegmentStage`` each iteration
    (what it carries lives from a micro-batch's first forward to its last backward)."""

    recompute = False  # SegmentStage(recompute=...): forwards keep their graph

    @staticmethod
    def applies(mode: Mode) -> bool:
        return mode.segmented

    def __init__(self, stage, store, host: HostActivations | None):
        self.stage, self.store = stage, store
        self.last = stage.is_last
        self.kv_host = None
        self.end_iteration()

    def begin(self, it: Iteration) -> None:
        self.end_iteration()
        self.it = it
        self.segments = SegmentStage(self.stage, it.lengths, recompute=self.recompute, kv_host=self.kv_host)

    def end_iteration(self) -> None:
        self.it: Iteration | None = None
        self.segments: SegmentStage | None = None
        self.roots: dict[Key, torch.Tensor] = {}

    def forward(self, key: Key, x: Arrival) -> torch.Tensor | None:
        it = self.it
        x = forward_input(self, x)  # the SegmentStage makes its own input leaf
        start = it.clock.mark()
        with routing(self.stage, key, it):
            out, loss = segment_pass(self, key, x)
        self.roots[key] = out
        return forward_result(it, key, self.last, out, loss, start)

    def backward(self, key: Key, grad: Arrival) -> torch.Tensor | None:
        it = self.it
        with routing(self.stage, key, it):
            self.store.before_compute(backward=True, clock=it.clock)
            out = self.roots.pop(key)
            g = grad.take()
            start = it.clock.mark()
            g = segment_backward(self, key, out, g)
            it.clock.span("compute", start, it.clock.mark())
        self.stage.routing.release(key)
        return g

    @classmethod
    def account(cls, a: Action, ledger: "Ledger") -> None:
        kept_graph(a, ledger, freed=carried_grads)


def segment_pass(runner, key: Key, x: torch.Tensor, recompute: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``runner``'s stage on segment ``key[2]`` of micro-batch ``key[1]`` through its
    ``SegmentStage`` (``recompute``: activation offload's forward again, right before the
    backward): (the backward's root, the normalised loss on the last stage)."""
    it, (_, m, seg) = runner.it, key
    mb = it.microbatches[m]
    targets = it.columns(mb.targets, seg) if runner.last else None
    packed = {}
    if mb.segment_ids is not None:  # the records' ids so far keep attention within a record
        packed = {"position_ids": it.columns(mb.position_ids, seg), "doc_ids": mb.segment_ids[:, :it.bounds[seg][1]]}
    run = runner.segments.recompute_forward if recompute else runner.segments.forward
    with runner.store.saved_tensor_hooks():
        out = run(m, seg, x, targets, **packed)
    return normalised(out, it, runner.last)


def segment_backward(runner, key: Key, out: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor | None:
    """The backward of segment ``key[2]``: its output's gradient (on the last stage, the loss's:
    its root is the segment's summed loss, whose gradient through the normalisation is the loss
    scale over the targets) and the carried keys' the later segments left."""
    it = runner.it
    if runner.last:
        grad = torch.full_like(out, it.loss_scale) / it.num_targets
    return runner.segments.backward(key[1], key[2], grad)


def kv_bytes(inp: MemoryInputs, s: int, tokens: int) -> float:
    """Every layer's keys and values of stage ``s`` for ``tokens`` tokens."""
    return inp.stages[s].num_layers * 2 * inp.dtype_bytes * inp.shape.kv_dim * tokens


def kv_grads_change(inp: MemoryInputs, a: Action, per_mb: dict) -> float:
    """The backward of segment ``a.seg`` leaves the gradients of the earlier segments' carried
    keys/values (columns 0..start) until those segments' own backwards; the change of what is
    held, kept in ``per_mb`` under (stage, micro-batch, "kv")."""
    kv_grads = kv_bytes(inp, a.stage, inp.micro_batch * inp.span(a.seg)[0])
    change = kv_grads - per_mb.pop((a.stage, a.mb, "kv"), 0.0)
    per_mb[(a.stage, a.mb, "kv")] = kv_grads
    return change


def carried_grads(a: Action, ledger: "Ledger") -> None:
    ledger.saved += kv_grads_change(ledger.inp, a, ledger.per_mb)


__all__ = ["Segmented", "carried_grads", "kv_bytes", "kv_grads_change", "segment_backward", "segment_pass"]
