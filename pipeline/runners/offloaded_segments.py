"""Long rows: sequence segments with activation offload, in training. A segment's forward runs
without a graph but keeps its keys/values as carried leaves (the later segments attend to them);
after a micro-batch's last forward at the stage they go to pinned host memory (``offload.kv``) and
come back before its first backward there, prefetched at the backward before; the first layer's
are not kept: that backward makes them again from the segments' inputs in the stash (a stage of
one layer keeps none). The backward (last segment first) restores the segment's input, recomputes
it against the earlier segments' carried keys/values and feeds in the dK/dV the later segments
left. The GPU then holds one segment's activations during a backward, plus the keys/values of the
stages in their backward sweep.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pipeline.runners.base import Arrival, Iteration, Key, Mode, forward_input, forward_result, routing
from pipeline.runners.offloaded import HostActivations, recomputed
from pipeline.runners.segmented import kv_bytes, kv_grads_change, segment_backward, segment_pass
from pipeline.stage.segments import SegmentStage
from schedule.ir import Action, Op

if TYPE_CHECKING:
    from pipeline.spec.footprint import Ledger


class OffloadedSegments:
    """A stage one (rows, segment) at a time, its inputs and carried keys/values in host memory
    between forwards and backwards, every backward recomputing its segment."""

    @staticmethod
    def applies(mode: Mode) -> bool:
        return mode.training and mode.activation_offload and mode.segmented

    def __init__(self, stage, store, host: HostActivations):
        self.stage, self.store, self.host = stage, store, host
        self.last = stage.is_last
        self.host.recomputing.add(stage.index)
        self.end_iteration()

    def begin(self, it: Iteration) -> None:
        self.it = it
        # a segment's forward keeps only its carried keys/values; its backward recomputes it. The
        # first layer's are made again from the segment's input, which waits in host memory anyway
        self.segments = SegmentStage(self.stage, it.lengths, recompute=True, kv_host=self.host.kv,
                                     kv_source=self._segment_input)

    def _segment_input(self, mb: int, seg: int) -> torch.Tensor:
        """Segment ``seg``'s input of micro-batch ``mb`` on the device (token ids on the first
        stage), leaving the stash's copy for the segment's own backward."""
        if self.stage.is_first:
            return self.it.columns(self.it.microbatches[mb].input_ids, seg)
        return self.host.stash.peek((self.stage.index, mb, seg))

    def end_iteration(self) -> None:
        self.it: Iteration | None = None
        self.segments: SegmentStage | None = None

    def forward(self, key: Key, x: Arrival) -> torch.Tensor | None:
        it = self.it
        x = forward_input(self, x)
        if not self.stage.is_first:
            self.host.stash.save(key, x)
        it.release_sent()
        start = it.clock.mark()
        with torch.no_grad(), routing(self.stage, key, it):
            out, loss = segment_pass(self, key, x)
        return forward_result(it, key, self.last, out, loss, start)

    def backward(self, key: Key, grad: Arrival) -> torch.Tensor | None:
        it = self.it
        with routing(self.stage, key, it):
            self.store.before_compute(backward=True, clock=it.clock)
            it.release_sent()
            # the recompute needs no gradient yet: it runs before the wait for the one sent back;
            # it attends to the keys/values its earlier segments carried (its SegmentStage holds them)
            x = self.host.input_back(key, it)
            start = it.clock.mark()
            out = segment_pass(self, key, x, recompute=True)[0]
            g = segment_backward(self, key, out, grad.take())
            it.clock.span("compute", start, it.clock.mark())
        self.stage.routing.release(key)
        return g

    @classmethod
    def account(cls, a: Action, ledger: "Ledger") -> None:
        """As a recomputing stage (``offloaded.recomputed``), and the carried keys/values: a
        forward keeps its segment's on the device for the later segments (the last segment's
        nothing attends to); a backward brings its micro-batch's back, frees its segment's and
        leaves the gradients of the earlier segments'. On a GPU they wait in host memory from the
        micro-batch's last forward here, but the first layer's, which the first backward makes
        again from the segments' inputs (on the CPU too, where the others stay where they are):
        the backward before prefetches those in host memory (``HostActivations.input_back``), not
        the first layer's, which only the micro-batch's own first backward here makes."""
        s, n, _ = ledger.compute(a)
        inp, key = ledger.inp, (s, a.mb, a.seg)
        last_segment = a.seg == len(inp.segments) - 1
        carried = 0.0  # this segment's carried keys/values, freed after its backward
        if a.op is Op.FORWARD:
            ledger.per_mb[key] = 0.0 if last_segment else kv_bytes(inp, s, n)
            ledger.saved += ledger.per_mb[key]
        else:
            back, remade, _ = ledger.kv_host.pop((s, a.mb), (0.0, 0.0, 0.0))
            ledger.saved += back + remade
            nxt = ledger.next_backward.get(key, (None, None))[:2]
            if nxt in ledger.kv_host:  # prefetched: back on the device from here
                back, remade, held = ledger.kv_host[nxt]
                ledger.saved += back
                ledger.kv_host[nxt] = (0.0, remade, held)
            carried = ledger.per_mb.pop(key)
            ledger.saved += kv_grads_change(inp, a, ledger.per_mb)
        recomputed(a, ledger)
        ledger.saved -= carried
        if a.op is Op.FORWARD and last_segment:
            carried_mb = sum(v for (st_, mb_, sg), v in ledger.per_mb.items() if (st_, mb_) == (s, a.mb) and sg != "kv")
            layers = inp.stages[s].num_layers
            first = carried_mb / layers if layers else 0.0  # let go on the CPU too: the backward remakes it
            in_host = carried_mb - first if inp.kv_offload else 0.0
            ledger.kv_host[(s, a.mb)] = (in_host, first, in_host)
            ledger.saved -= in_host + first
            ledger.kv_host_peak = max(ledger.kv_host_peak, sum(held for *_, held in ledger.kv_host.values()))


__all__ = ["OffloadedSegments"]
