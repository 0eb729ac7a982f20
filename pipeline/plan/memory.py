"""How much GPU and host memory a run needs, from the model config and the action lists alone.

No weights are loaded and no tensor is made: the estimate walks each rank's action list and
keeps a ledger of what the executor and the stores hold at every action (``footprint.Ledger``).

* **Parameters.** Resident stages keep the compute copy, its gradient, the fp32 masters, their
  gradient and AdamW's two moments on the device. For offloaded stages (with offload, those
  the action list loads) the device holds only the buffer pool of ``offload/store.py``: the
  walk replays its take/give on LOAD, the first backward, DROP and OFFLOAD_GRADS, so prefetch and
  buffer reuse are counted as they happen, plus the load stream's fp32 staging buffer; their
  masters and AdamW state are host memory.
* **Activations.** What autograd saves per token of a decoder layer, for Hugging Face's Llama
  layer with sdpa attention (measured with saved-tensor hooks; ``tests/test_memory.py``
  checks the formula against autograd for float32 and bfloat16), held from a stage's forward
  to its backward; with activation checkpointing only each recomputed layer's input (the
  ``kept`` layers keep everything) and the head's: the last stage recomputes its logits and
  loss too.
* **In flight.** Stage inputs and outputs the executor keeps (sent tensors live until the end
  of the iteration), and the transient peak inside one forward/backward: the logits of the
  last stage, a layer's gradients, and a recomputed layer under checkpointing.
* **activation_offload.** Forwards save nothing on the device: each stage input (not stage 0's
  tokens) waits in host memory, counted at the walk's most inputs held at once. A backward
  recomputes its stage whole, so one stage's full activations of one micro-batch (segment) are
  its transient; sent tensors are released at the next compute (once their sends are done).
  With sequence segments the carried keys/values (and their gradients) stay on the device from
  a segment's forward to its backward; on a GPU they wait in host memory between a stage's
  forwards of a micro-batch and its backwards (``offload.kv``), the next backward's brought back
  during the one before.
* **Long rows** (issue 28). On a GPU sdpa computes every pass without a score matrix
  (``pipeline.stage.attention``): a layer's attention allocates flash's padded copies of q, k, v and
  the output (head dimension to a multiple of 8) and in its backward an fp32 query-gradient
  accumulator and the padded gradients; a segment concatenates its keys/values behind the carried
  ones. A tiled MLP (``pipeline.stage.tiled``) keeps no intermediate from forward to backward and
  allocates one tile's in either. A layer's backward peaks in its MLP phase (everything saved)
  or its attention phase (the MLP side's saved tensors freed by then), whichever is higher.
* **Not counted**: the CUDA context, NCCL and cuBLAS workspaces and the caching allocator's
  fragmentation, which the 10% of the GPU the fit check leaves free covers (``plan.USABLE_FRACTION``;
  main.py turns on expandable segments, where a freed block serves an allocation of any size).
"""
from __future__ import annotations

from offload.store import GRAD_SLICE_NUMEL, MASTER_SLICE_NUMEL
from pipeline.plan.footprint import (GiB, MemoryInputs, ModelShape, RankMemory, StagePlan, gib,
                                     layer_saved_bytes_per_token, param_bytes_host, param_bytes_resident, per_token,
                                     pinned, weight_grad_bytes)
from pipeline.runners.fused_last import fused_transient
from pipeline.runners.offloaded import offloaded_compute
from pipeline.runners.segmented import kv_bytes, kv_grads_change
from schedule.ir import Action, Op, crosses, offloaded_stages


def estimate_rank(inp: MemoryInputs, rank: int, actions: list[Action]) -> RankMemory:
    """Walk one rank's action list and return its peak device memory and its host memory."""
    d, tokens = inp.dtype_bytes, inp.micro_batch * inp.seq_len
    h = inp.shape.hidden
    mine = [s for s, r in enumerate(inp.mapping) if r == rank]
    out = RankMemory(rank)
    offloaded = offloaded_stages({rank: actions}) if inp.offload else frozenset()
    out.host = sum(param_bytes_host(inp.stages[s].numel, d) for s in mine if s in offloaded)
    out.host_parts = {"parameters": out.host}
    params_static = sum(param_bytes_resident(inp.stages[s].numel, d) for s in mine if s not in offloaded)
    if offloaded and d < 4 and not inp.cpu:  # the load stream's staging buffer (masters converted on the GPU)
        params_static += min(MASTER_SLICE_NUMEL, max(inp.stages[s].numel for s in offloaded)) * 4

    pool_free: dict[int, int] = {}   # numel -> free buffers
    pool_bytes = 0
    has_grad: set[int] = set()

    def take(numel: int) -> None:
        nonlocal pool_bytes
        if pool_free.get(numel):
            pool_free[numel] -= 1
        else:
            pool_bytes += numel * d

    def give(numel: int) -> None:
        pool_free[numel] = pool_free.get(numel, 0) + 1

    saved = 0.0           # autograd's saved tensors of forwards whose backward has not run
    held = 0.0            # executor-held inputs/outputs/sent tensors
    per_mb: dict[tuple[int, int, int | str | None], float] = {}  # by (stage, micro-batch, segment)
    stashed = stash_peak = 0.0  # activation_offload: stage inputs in host memory
    sent = 0.0                  # activation_offload: sent tensors, released at the next compute
    kv_host: dict[tuple[int, int], float] = {}  # kv_offload: carried keys/values in host memory by (stage, mb)
    kv_host_peak = 0.0
    # kv_offload: each backward starts bringing back the next backward's carried keys/values
    order = [(a.stage, a.mb, a.seg) for a in actions if a.op is Op.BACKWARD]
    next_backward = dict(zip(order, order[1:]))

    def note_peak(a: Action, transient: float) -> None:
        """What the device holds at action ``a``, plus its ``transient``: a new peak is kept with its parts."""
        now = params_static + pool_bytes + saved + held + (stashed if inp.cpu else 0)
        if now + transient > out.device_peak:
            out.device_peak, out.at = int(now + transient), str(a)
            out.parts = {"parameters": int(params_static + pool_bytes), "activations": int(saved),
                         "in_flight": int(held), "transient": int(transient)}

    for a in actions:
        s = a.stage
        n = inp.span(a.seg)[2] if a.op in (Op.FORWARD, Op.BACKWARD) else tokens  # tokens of this compute
        io = d * h * n   # one hidden-state tensor of a micro-batch (segment)
        fwd_t = bwd_t = 0.0
        if inp.fused_last and inp.stages[s].last and a.seg is None and a.op in (Op.FORWARD, Op.BACKWARD):
            # fuse_last_stage: the forward runs the backward; the backward only hands the gradient on
            crossing = s > 0 and crosses(inp.mapping, s, s - 1)
            if a.op is Op.FORWARD:
                if s in offloaded and s not in has_grad:
                    take(inp.stages[s].numel)
                    has_grad.add(s)
                if inp.activation_offload:
                    held, sent = held - sent, 0.0
                held += io if s > 0 else 0.0  # the input's gradient (a received input freed for it)
                note_peak(a, fused_transient(inp, s, n) + weight_grad_bytes(inp, s))
            elif inp.activation_offload and crossing:
                sent += io  # sent now, freed at the next compute
            continue
        if inp.activation_offload and a.op in (Op.FORWARD, Op.BACKWARD):
            held, sent = held - sent, 0.0
            extra, held_delta, sent = offloaded_compute(inp, a, io)
            held += held_delta + sent
            carried = 0.0  # seq_chunks: this segment's carried keys/values, freed after its backward
            if a.seg is not None:
                # The forward keeps its keys/values on the device for the later segments (the last
                # segment's nothing attends to); the backward adds the gradients of the earlier
                # segments' keys/values. kv_offload: after the micro-batch's last forward here
                # they wait in host memory; a backward brings them back (the one before it
                # started their copy) and they leave the device segment by segment.
                if a.op is Op.FORWARD:
                    last = a.seg == len(inp.segments) - 1
                    per_mb[(s, a.mb, a.seg)] = 0.0 if last else kv_bytes(inp, s, n)
                    saved += per_mb[(s, a.mb, a.seg)]
                else:
                    for key in {(s, a.mb), next_backward.get((s, a.mb, a.seg), (None, None))[:2]}:
                        saved += kv_host.pop(key, 0.0)  # back on the device (its own, or prefetched)
                    carried = per_mb.pop((s, a.mb, a.seg))
                    saved += kv_grads_change(inp, a, per_mb)
            if a.op is Op.BACKWARD and s in offloaded and s not in has_grad:
                take(inp.stages[s].numel)
                has_grad.add(s)
            if s > 0:
                stashed += io if a.op is Op.FORWARD else -io
                stash_peak = max(stash_peak, stashed)
            note_peak(a, extra + (weight_grad_bytes(inp, s) if a.op is Op.BACKWARD else 0))
            saved -= carried
            if inp.kv_offload and a.op is Op.FORWARD and a.seg == len(inp.segments) - 1:
                moved = sum(v for (st_, mb_, sg), v in per_mb.items() if (st_, mb_) == (s, a.mb) and sg != "kv")
                kv_host[(s, a.mb)] = moved
                saved -= moved
                kv_host_peak = max(kv_host_peak, sum(kv_host.values()))
            continue
        if a.op is Op.LOAD:
            take(inp.stages[s].numel)
        elif a.op is Op.DROP:
            give(inp.stages[s].numel)
        elif a.op is Op.OFFLOAD_GRADS:
            give(inp.stages[s].numel)
            give(inp.stages[s].numel)
            has_grad.discard(s)
            if d < 4:  # the fp32 chunk the gradients go through on their way to the host
                fwd_t = min(inp.stages[s].numel, GRAD_SLICE_NUMEL) * 4 / tokens
        elif a.op is Op.FORWARD:
            per_tok, fwd_t, _ = per_token(inp, s, a.seg)
            per_mb[(s, a.mb, a.seg)] = per_tok * n
            saved += per_tok * n
            if crosses(inp.mapping, s, s - 1):
                held += io  # the received input, kept for its gradient (a local one is counted as an output)
            if not inp.stages[s].last:
                held += io  # the output: kept for backward and, when sent, until the iteration ends
        elif a.op is Op.BACKWARD:
            _, _, bwd_t = per_token(inp, s, a.seg)
            if s in offloaded and s not in has_grad:
                take(inp.stages[s].numel)
                has_grad.add(s)
            saved -= per_mb.pop((s, a.mb, a.seg))
            if a.seg is not None:
                saved += kv_grads_change(inp, a, per_mb)
            if s > 0 and not crosses(inp.mapping, s, s - 1):
                held += io  # the input's gradient, handed to the previous stage of this rank
            # a received input is freed and its gradient, sent on, lives until the iteration ends
            if not inp.stages[s].last and not crosses(inp.mapping, s, s + 1):
                held -= 2 * io  # the output (the next stage's input) and the gradient it got back
        note_peak(a, (fwd_t + bwd_t) * n + (weight_grad_bytes(inp, s) if a.op is Op.BACKWARD else 0))
    if inp.cpu:  # one memory: the "device" tensors are host tensors (the stash's inputs counted in the walk)
        out.host += out.device_peak
        out.device_peak = 0
    else:
        # pinned host blocks are rounded up to a power of two by torch's caching host allocator
        out.host_parts.update(stash=int(stash_peak), carried_kv=int(pinned(kv_host_peak, inp) if kv_host_peak else 0))
        out.host += out.host_parts["stash"] + out.host_parts["carried_kv"]
    return out


def estimate(inp: MemoryInputs, schedule: dict[int, list[Action]]) -> list[RankMemory]:
    return [estimate_rank(inp, r, schedule[r]) for r in sorted(schedule)]


__all__ = ["GiB", "MemoryInputs", "ModelShape", "RankMemory", "StagePlan", "estimate", "estimate_rank", "gib",
           "layer_saved_bytes_per_token"]
