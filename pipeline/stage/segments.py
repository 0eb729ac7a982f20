"""Sequence segments through a stage, exactly (Seq1F1B, docs/seq_pipelining.md).

With ``seq_chunks: K`` every row of a micro-batch is cut into K contiguous segments and a stage
computes one (rows, segment) at a time. Causal attention makes the segments of one row depend on
each other:

* forward: segment j's queries attend to the keys and values of segments 0..j. Each layer's
  keys/values of a segment are kept after its forward (after RoPE, before the GQA repeat) as
  *carried* tensors: detached leaves that require grad. Segment j's attention concatenates the
  carried keys/values of segments < j in front of its own. Positions continue across segments
  (the rotary embedding sees the absolute positions), and the mask is explicit: query column
  ``start + i`` may see key columns ``<= start + i`` (and within the window, for sliding layers).
* backward: runs segment K-1 first, down to 0. Segment j's backward accumulates into the carried
  leaves of segments < j the gradients of their keys/values (``.grad``); when segment j's own
  backward runs, those accumulated gradients are fed in as extra output gradients of its keys
  and values, beside the gradient of its output. Every parameter gradient is then the unsplit
  sequence's, up to float summation order.

The keys/values go in and out through the ``past_key_values`` argument of the Hugging Face
attention modules (Llama, Mistral, Qwen2 on transformers 5.17 and 5.23 call
``past_key_values.update(key_states, value_states, layer_idx)`` after RoPE and attend to what it
returns); ``_KVCarry`` is a minimal object with that contract, so no attention code is copied.

``SegmentStage`` is the stage-level API an executor can call per action: ``forward(mb, seg, x)``
for ``sFm.j`` and ``backward(mb, seg, grad)`` for ``sBm.j``; it holds what the backward needs and
checks the segment order the schedule guarantees (``schedule.ir.kv_predecessor``).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from pipeline.spec.shapes import segment_bounds
from pipeline.stage.attention import AttnMask, attend_mask
from pipeline.stage.model import Stage, additive_mask, backward_where_needed, cache_keyword

KV = tuple[torch.Tensor, torch.Tensor]


class _KVCarry:
    """``past_key_values`` for one segment's pass through a stage.

    ``update`` is what a Hugging Face attention module calls with the segment's keys and values
    of a layer: it records them (``new``) and returns them behind the ``past`` keys/values of
    the earlier segments, which the module then attends to. ``past`` is a snapshot: a later
    segment appending to the stage's carry does not change what this segment attended to."""

    def __init__(self, past: dict[int, list[KV]]):
        self.past = {layer: list(kvs) for layer, kvs in past.items()}
        self.new: dict[int, KV] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs) -> KV:
        # A second call for a layer is activation checkpointing's recompute during the backward:
        # it attends to the same past again (the snapshot), and the keys/values recorded by the
        # first call stay the ones whose gradients the segment's backward feeds in.
        if layer_idx not in self.new:
            self.new[layer_idx] = (key_states, value_states)
        elif self.new[layer_idx][0].shape != key_states.shape:
            raise RuntimeError(f"layer {layer_idx}: a recompute brought keys of shape {tuple(key_states.shape)}, "
                               f"the forward {tuple(self.new[layer_idx][0].shape)}")
        past = self.past.get(layer_idx, [])
        if not past:
            return key_states, value_states
        keys = torch.cat([k for k, _ in past] + [key_states], dim=-2)
        values = torch.cat([v for _, v in past] + [value_states], dim=-2)
        return keys, values


class _KeysMade(Exception):
    """Raised by ``_KVCapture`` to leave a layer's forward once its keys/values are made."""

    def __init__(self, kv: KV):
        super().__init__()
        self.kv = kv


class _KVCapture:
    """``past_key_values`` that takes a layer's keys/values (after RoPE) and stops its forward there."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        raise _KeysMade((key_states, value_states))


def segment_allowed(start: int, end: int, window: int | None, device: torch.device,
                    doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean mask, True where a query of columns ``start..end-1`` may attend a key of columns
    ``0..end-1``: key column <= query column, within ``window`` columns for a sliding layer
    (as ``pipeline.stage.model.attend_mask``), and with packed rows (``doc_ids`` [B, end], the
    columns' record ids so far) within the query's record. Shape [1, 1, T, end] or [B, 1, T, end]."""
    allowed = attend_mask(end, device, window, q_start=start)
    if doc_ids is None:
        return allowed[None, None]
    same = doc_ids[:, start:end, None] == doc_ids[:, None, :end]
    return (allowed & same)[:, None]


class SegmentStage:
    """Runs a ``pipeline.stage.model.Stage`` one (rows, segment) at a time, exactly.

    Args:
        stage: the stage, as built (``stage.recomputed`` layers under activation checkpointing).
        lengths: the segment lengths of a row (``schedule.costmodel.balanced_segments``); every
            micro-batch is cut the same way.
        recompute: ``activation_offload``: ``forward`` (called without a graph) keeps only the
            carried keys/values, and ``recompute_forward`` runs the segment again with a graph
            right before its ``backward``.
        kv_host: with ``recompute``, where the carried keys/values wait between the micro-batch's
            last forward at this stage and its first backward (``offload.kv.CarriedKV``: pinned
            host memory; ``prefetch`` starts their copy back). None: they stay on the device
            until the micro-batch's backward of segment 0.

    Per micro-batch it keeps each layer's carried keys/values of the segments forwarded so far
    (leaves whose ``.grad`` collects the later segments' gradients), and per (micro-batch,
    segment) what the backward needs: the input leaf, the output and the segment's own
    keys/values in the graph. The backward of segment 0 frees the micro-batch's state. The last
    segment's keys/values are not carried: no later segment attends to them.
    """

    def __init__(self, stage: Stage, lengths: Sequence[int], *, recompute: bool = False, kv_host=None,
                 kv_source: Callable[[int, int], torch.Tensor] | None = None):
        if stage.attn_implementation not in ("eager", "sdpa"):
            raise ValueError(f"sequence segments need attn_implementation eager or sdpa (an explicit mask over "
                             f"the carried keys), got {stage.attn_implementation!r}")
        if kv_host is not None and not recompute:
            raise ValueError("carried keys/values go to host memory only with recompute (activation_offload): a "
                             "forward with a graph keeps them in its attention's saved tensors anyway")
        if kv_source is not None and kv_host is None:
            raise ValueError("kv_source makes the first layer's carried keys/values again instead of keeping them "
                             "in host memory: it needs kv_host")
        self.stage = stage
        self.recompute = recompute
        self.kv_host = kv_host
        self.kv_source = kv_source
        self.remade: dict[int, dict] = {}  # mb -> {seg: the packed rows' arguments} of dropped first-layer keys
        self.lengths = list(lengths)
        self.bounds = segment_bounds(self.lengths)
        self.carry: dict[int, dict[int, list[KV | None]]] = {}  # mb -> layer -> per segment
        self.saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor, dict[int, KV]]] = {}
        self.forwarded: dict[int, int] = {}   # mb -> segments forwarded
        self.backed: dict[int, int] = {}      # mb -> lowest segment backed up so far (K: none)

    @property
    def num_segments(self) -> int:
        return len(self.lengths)

    def forward(self, mb: int, seg: int, x: torch.Tensor, targets: torch.Tensor | None = None, *,
                position_ids: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Forward of (rows ``mb``, segment ``seg``) through the stage.

        Args:
            x: the segment's token ids [B, T] (first stage) or hidden states [B, T, H].
            targets: the last stage's targets of the segment's columns [B, T] (-100: none).
            position_ids: [B, T] or [1, T], default the segment's columns (``start..end-1``).
            doc_ids: packed rows: the record id of every column, at least up to the segment's end.

        Returns:
            The hidden states, or on the last stage the summed token loss with ``targets``
            (logits without).
        """
        done = self.forwarded.get(mb, 0)
        if seg != done:
            raise RuntimeError(f"forward of micro-batch {mb} segment {seg} out of order: segments 0..{done - 1} are "
                               f"done, so the next is {done} (its keys/values are attended to by later segments)")
        carry = self.carry.setdefault(mb, {})
        inp, out, new = self._pass(mb, seg, x, targets, position_ids, doc_ids)
        # Carried as leaves: later segments' graphs end here, and their backwards leave the
        # gradients of this segment's keys/values in .grad for this segment's backward. With
        # ``recompute`` the forward runs without a graph but the leaves still take gradients:
        # the later segments' backwards run (recomputed) before this segment's.
        grad = torch.is_grad_enabled() or self.recompute
        last = seg == self.num_segments - 1
        for layer, (k, v) in new.items():
            carry.setdefault(layer, []).append(
                None if last else (k.detach().requires_grad_(grad), v.detach().requires_grad_(grad)))
        self.forwarded[mb] = seg + 1
        if self.kv_source is not None and not last and new:  # a stage of no layers carries none to remake
            self.remade.setdefault(mb, {})[seg] = dict(position_ids=position_ids, doc_ids=doc_ids)
        if last and self.kv_host is not None:
            # Nothing reads them until this micro-batch's backwards here: to host memory meanwhile,
            # but the first layer's, which its input (in host memory already) makes again
            first = min(carry) if self.kv_source is not None and carry else None
            self.kv_host.offload(self._kv_key(mb), [t for layer, kvs in carry.items() if layer != first
                                                    for kv in kvs if kv for t in kv])
            if first is not None:
                for kv in carry[first]:
                    for t in kv or ():
                        t.data = t.data.new_empty(0)  # the memory goes back to the allocator
        if torch.is_grad_enabled() and not self.recompute:
            self.saved[(mb, seg)] = (inp, out, new)
        elif seg == self.num_segments - 1 and not self.recompute:
            self._free(mb)  # forward only (evaluation): nothing waits for a backward
        return out

    def recompute_forward(self, mb: int, seg: int, x: torch.Tensor, targets: torch.Tensor | None = None, *,
                          position_ids: torch.Tensor | None = None,
                          doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``recompute`` (activation_offload): the forward of (``mb``, ``seg``) again, with a
        graph, right before its ``backward``; ``x`` is the segment's input as its first forward
        got it (brought back from host memory). It attends to the carried keys/values of
        segments < ``seg`` as the first forward did (still held: their backwards come later)
        and makes its own keys/values in the graph, the roots of the gradients the later
        segments' backwards left on its carried leaves. Arguments as ``forward``."""
        if not self.recompute:
            raise RuntimeError("recompute_forward needs a SegmentStage made with recompute=True")
        self._check_backward_order(mb, seg)
        self._restore(mb)
        inp, out, new = self._pass(mb, seg, x, targets, position_ids, doc_ids)
        for layer, (k, _) in new.items():
            carried = self.carry[mb][layer][seg]
            leaf = carried[0] if carried is not None else k  # the last segment carries none
            if leaf.shape != k.shape:
                raise RuntimeError(f"recompute of micro-batch {mb} segment {seg}: layer {layer} made keys of shape "
                                   f"{tuple(k.shape)}, its first forward {tuple(leaf.shape)}")
        self.saved[(mb, seg)] = (inp, out, new)
        return out

    def _pass(self, mb: int, seg: int, x: torch.Tensor, targets: torch.Tensor | None,
              position_ids: torch.Tensor | None, doc_ids: torch.Tensor | None) -> tuple:
        """One pass of the segment through the stage, attending to the carried keys/values of
        segments < ``seg``: (input leaf or None, output, the segment's own keys/values by layer)."""
        stage = self.stage
        start, end = self.bounds[seg]
        if x.shape[1] != end - start:
            raise ValueError(f"segment {seg} of micro-batch {mb} has {x.shape[1]} columns; lengths {self.lengths} "
                             f"give it {end - start}")
        inp = None
        if stage.is_first:
            h = stage.embed(x)
        else:
            # A leaf of this segment's graph: its .grad is what the backward sends upstream.
            inp = x.detach().requires_grad_(torch.is_grad_enabled())
            h = inp
        carry = self.carry.get(mb, {})
        kv_cache = _KVCarry({layer: kvs[:seg] for layer, kvs in carry.items()})
        if len(stage.model.layers):
            if position_ids is None:
                position_ids = torch.arange(start, end, device=h.device)[None]
            masks = {w: self._mask(start, end, w, h, doc_ids) for w in set(stage.windows)}
            checkpointed = stage.recomputed if torch.is_grad_enabled() else 0  # as Stage.forward
            h = stage.run_layers(h, position_ids, self._rope(h, position_ids, start, end), masks,
                                 checkpointed=checkpointed, cache=kv_cache)
        if stage.is_last:
            out = stage.head_loss(h, targets) if targets is not None else stage.logits(h)
        else:
            out = h
        return inp, out, kv_cache.new

    def backward(self, mb: int, seg: int, grad_output: torch.Tensor | None = None) -> torch.Tensor | None:
        """Backward of (rows ``mb``, segment ``seg``): the gradient of its output (``grad_output``;
        None on the last stage's loss means d loss = 1) plus the gradients of its keys/values
        that the later segments' backwards accumulated. Accumulates the parameter gradients and
        the earlier segments' key/value gradients; returns the gradient of the segment's input
        (None on the first stage)."""
        self._check_backward_order(mb, seg)
        self._restore(mb)
        inp, out, new = self.saved.pop((mb, seg))
        roots, grads = [out], [grad_output if grad_output is not None else torch.ones_like(out)]
        roots_kv, grads_kv = kv_gradients(new, self.carry[mb], seg)
        backward_where_needed(roots + roots_kv, grads + grads_kv)
        for kvs in self.carry[mb].values():
            kvs[seg] = None  # its gradient is consumed; the graphs that read it are gone
        self.backed[mb] = seg
        if seg == 0:
            self._free(mb)
        return None if inp is None else inp.grad

    def _check_backward_order(self, mb: int, seg: int) -> None:
        expected = self.backed.get(mb, self.num_segments) - 1
        if seg != expected or self.forwarded.get(mb, 0) != self.num_segments:
            raise RuntimeError(f"backward of micro-batch {mb} segment {seg} out of order: it needs every segment "
                               f"forwarded ({self.forwarded.get(mb, 0)} of {self.num_segments}) and the backwards "
                               f"of segments {seg + 1}..{self.num_segments - 1} done; the next backward is "
                               f"segment {expected}")

    def prefetch(self, mb: int) -> None:
        """Start bringing micro-batch ``mb``'s carried keys/values back from host memory for its
        backwards here (nothing without ``kv_host``, or when they are back already)."""
        if self.kv_host is not None:
            self.kv_host.prefetch(self._kv_key(mb))

    def _restore(self, mb: int) -> None:
        if self.kv_host is not None:
            self.kv_host.restore(self._kv_key(mb))
        for seg, packed in sorted(self.remade.pop(mb, {}).items()):
            self._remake_first_kv(mb, seg, **packed)

    def _remake_first_kv(self, mb: int, seg: int, position_ids: torch.Tensor | None, doc_ids=None) -> None:
        """The carried keys/values of the stage's first layer for segment ``seg`` made again from the
        segment's input (``kv_source``), as its forward made them: the embedding on the first stage,
        the layer's norm, projections and rotary embedding, no graph. Only their data is set: the
        leaves (and the gradients later segments left in them) stay."""
        stage = self.stage
        start, end = self.bounds[seg]
        x = self.kv_source(mb, seg)
        layer, kind = next(iter(stage.model.layers.values())), stage.kinds[0]
        with torch.no_grad():
            h = stage.embed(x) if stage.is_first else x
            if position_ids is None:
                position_ids = torch.arange(start, end, device=h.device)[None]
            rope = self._rope(h, position_ids, start, end)[kind.layer_type]
            try:
                # the attention modules hand their keys/values to the cache before attending: no mask needed
                layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=rope,
                      **{cache_keyword(stage.model.layers): _KVCapture()})
                raise RuntimeError(f"layer {min(self.carry[mb])} made no keys/values to carry")
            except _KeysMade as made:
                k, v = made.kv
        for leaf, t in zip(self.carry[mb][min(self.carry[mb])][seg], (k, v)):
            leaf.data = t

    def _kv_key(self, mb: int) -> tuple[int, int]:
        return self.stage.index, mb

    def _free(self, mb: int) -> None:
        self.remade.pop(mb, None)
        if self.kv_host is not None:
            self.kv_host.forget(self._kv_key(mb))
        self.carry.pop(mb, None)
        self.forwarded.pop(mb, None)
        self.backed.pop(mb, None)

    def _rope(self, h: torch.Tensor, position_ids: torch.Tensor, start: int, end: int) -> dict:
        """The segment's rotary (cos, sin). Where the family's rotary embedding picks its
        frequencies from the largest position it is given (LongRoPE, dynamic NTK), the whole
        row's positions are embedded and the segment's columns taken, as the unsplit row has
        them (packed rows, whose positions restart, are refused with such embeddings)."""
        if not self.stage.rope_whole_row:
            return self.stage.rope(h, position_ids)
        whole = torch.arange(self.bounds[-1][1], device=h.device)[None]
        return {t: tuple(x[:, start:end] for x in pe) for t, pe in self.stage.rope(h, whole).items()}

    def _mask(self, start: int, end: int, window: int | None, h: torch.Tensor,
              doc_ids: torch.Tensor | None):
        """The mask of a segment: for sdpa an ``AttnMask`` (queries ``start..end-1`` over keys
        ``0..end-1``: ``pipeline.stage.attention`` runs it through a kernel with the causal triangle
        aligned to the bottom right on a GPU, the explicit mask on the CPU); for eager the
        explicit additive mask (eager reads None as no mask)."""
        if self.stage.attn_implementation == "sdpa":
            return AttnMask(start, end, window, None if doc_ids is None else doc_ids[:, :end]).prepare(h.device)
        return additive_mask(segment_allowed(start, end, window, h.device, doc_ids), h.dtype)


def kv_gradients(new: dict[int, KV], carry: dict[int, list[KV | None]], seg: int) -> tuple[list, list]:
    """The extra (root, gradient) pairs of segment ``seg``'s backward: each layer's keys/values
    of the segment in the graph, with the gradients the later segments accumulated in the
    carried leaves. None where nothing later attended to them (the last segment; keys outside
    every later query's window)."""
    roots, grads = [], []
    for layer, (k, v) in new.items():
        if carry[layer][seg] is None:  # the last segment: nothing later attended to it
            continue
        leaf_k, leaf_v = carry[layer][seg]
        for t, leaf in ((k, leaf_k), (v, leaf_v)):
            if leaf.grad is not None:
                roots.append(t)
                grads.append(leaf.grad)
    return roots, grads
