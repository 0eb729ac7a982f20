"""An offloaded stage (``use_offload``, every stage the program loads): its fp32 masters, their
gradient and AdamW state in host memory, a compute-dtype copy ``work`` in pinned host memory, and
on the device only between LOAD and DROP/OFFLOAD_GRADS its weights and gradients, in buffers of
the rank's pool. The host side runs on the rank's ``Workers`` (``offload.store``'s docstring:
loads streamed behind the optimizer step, the ``work`` refresh, the squared norm)."""
from __future__ import annotations

import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Generator

import torch

from offload import loader, slices
from offload.loader import LoadSpan, StepProgress
from offload.streams import host_empty

if TYPE_CHECKING:
    from offload.store import StageStore


class Offloaded:
    """The ``Residency`` of an offloaded stage (one per store: its methods take the store, whose
    fields they read and write on the store's own thread, except where marked)."""

    offload = True

    def __init__(self, delayed: bool = False):
        # delayed update: ``work`` keeps the weights from before the last step, so the next
        # iteration computes with them while that step runs (``before_step``)
        self.delayed = delayed

    def master(self, store: "StageStore") -> torch.Tensor:
        """The fp32 masters, in host memory (pinned on CUDA)."""
        return host_empty(store.numel, torch.float32, store.device.type == "cuda")

    def master_grad(self, store: "StageStore") -> torch.Tensor:
        # pinned on CUDA: the gradients' D2H copy lands here directly
        return host_empty(store.numel, torch.float32, store.device.type == "cuda").zero_()

    def place(self, store: "StageStore") -> None:
        same_dtype = store.dtype == torch.float32
        own_copy = not same_dtype or self.delayed  # delayed: the masters move on while ``work`` stays
        store.work = host_empty(store.numel, store.dtype, store.device.type == "cuda") if own_copy else store.master
        store.dev = store.grad = None
        store.work.copy_(store.master)
        # Until its first LOAD the stage holds nothing: the module's own fp32 weights would
        # otherwise stay alive beside the masters (a 7B model's 25 GiB of host memory at start-up).
        store._bind(None, None)
        store.loaded = False

    def load(self, store) -> Future:
        """LOAD: host -> device copy of the weights on the load stream, issued by its producer
        (the loader thread with workers). Returns a future of its ``LoadSpan``; the host never
        blocks here (see ``offload.store``'s docstring)."""
        dev, ready = store.pool.take(store.numel, store.dtype)
        store.dev = dev
        store._bind(store.dev, store.grad)
        store.loaded = True
        progress, store._progress = store._progress, None
        if progress is not None:  # first load since a step: from the masters, chunk by chunk behind the step
            src, after = store.master, store._step_future
            if store.work is not store.master:
                store._refresh_future = store._run_on_optimizer(self.refresh_work, store)
        else:
            src, after = store.work, store._refresh_future
            if store.shard is not None and after is None:
                after = store._step_future  # sharded: ``work`` is written by the step, after the exchange
        behind = after is not None and not after.done()  # the optimizer still writes ``src``
        job = self.copy_in(store, src, dev, ready, after, progress, behind)
        if store.workers is None:
            store._load_future = loader.done(loader.run_through(job))
        else:
            if behind:
                after.add_done_callback(store.workers.loader.poke)
            store._load_future = store.workers.loader.submit(job)
        return store._load_future

    def copy_in(self, store, src: torch.Tensor, dev: torch.Tensor, ready, after: Future | None,
                progress: StepProgress | None, behind: bool) -> Generator[None, None, LoadSpan]:
        """A job for the load stream's producer (``Loader``): the copy of ``src`` into ``dev``,
        chunk by chunk, each once the optimizer has written it (``after``, the step or refresh
        that writes ``src``, is done; with the step's ``progress``, its chunk is). It yields
        where it must wait and returns the ``LoadSpan``; ``behind`` (the optimizer still wrote
        ``src`` at LOAD time) puts in it when the wait was over."""
        step_done = None
        if progress is None and after is not None:
            while not after.done():
                yield
            after.result()  # re-raises an optimizer error at the compute that needs it
            step_done = time.perf_counter() if behind else None
        store.streams.wait("load", ready)  # the buffer's previous user is done with it
        start = store.streams.mark("load")
        for lo in range(0, store.numel, slices.MASTER_SLICE_NUMEL):
            hi = min(store.numel, lo + slices.MASTER_SLICE_NUMEL)
            while progress is not None:
                upto, ended = progress.written()
                if upto >= hi:
                    break
                if ended:
                    while not after.done():
                        yield
                    after.result()  # the step failed: re-raise its error at the compute that needs it
                    raise RuntimeError(f"optimizer step of the stage with {store.names[0]} ended early")
                yield
            # behind a step, each chunk is its own transfer: the gaps are the step's, not the link's
            self.copy_chunk(store, src, dev, lo, hi, timed=progress is not None)
        if progress is not None and behind:
            step_done = time.perf_counter()
        end = store.streams.mark("load")
        if progress is None:
            store._note_transfer("h2d", start, end, store.numel * src.element_size())
        return LoadSpan(start, end, step_done)

    def copy_chunk(self, store, src: torch.Tensor, dev: torch.Tensor, lo: int, hi: int, timed: bool) -> None:
        """Elements ``[lo, hi)`` of ``src`` into ``dev`` on the load stream (its producer only).
        On CUDA an fp32 source is converted on the device, through the staging buffer, not by
        the host. ``timed``: a transfer of its own in ``transfers``."""
        with store.streams.on("load"):
            c_start = store.streams.event("load", timing=True) if timed else None
            if src.dtype != dev.dtype and store.streams.cuda:
                staged = store.streams.staging(store.numel)[:hi - lo]
                staged.copy_(src[lo:hi], non_blocking=True)
                dev[lo:hi].copy_(staged)
            else:
                dev[lo:hi].copy_(src[lo:hi], non_blocking=True)
            if c_start is not None:
                store._note_transfer("h2d", c_start, store.streams.event("load", timing=True),
                                     (hi - lo) * src.element_size())

    def drop(self, store) -> None:
        """DROP: forget the device copy (weights did not change, nothing goes back)."""
        store.pool.give(store.dev, store.streams.event("compute"))
        store.dev = None
        store._bind(None, store.grad)
        store.loaded = False

    def offload_grads(self, store, norm: bool = False) -> None:
        """OFFLOAD_GRADS: fp32 gradients device -> host on the offload stream, then free device memory;
        with ``norm`` the optimizer thread takes their squared norm once they have landed."""
        if store.delayed and store._step_future is not None:
            # host wait: the last iteration's step may still read ``master_grad``, which this copy
            # overwrites (without the delay every load of this iteration already waited for it)
            store._step_future.result()
        done = store.streams.event("compute")
        with store.streams.on("offload"):
            store.streams.wait("offload", done)  # the backward that wrote the grads is done
            start = store.streams.event("offload", timing=True)
            self.copy_out(store)
        store._grads_event = store.streams.event("offload", timing=True)
        store._note_transfer("d2h", start, store._grads_event, store.numel * 4)
        store.pool.give(store.dev, done)
        store.pool.give(store.grad, store._grads_event)
        store.dev = store.grad = None
        store._bind(None, None)
        store.loaded = False
        if norm and store.workers is not None:
            store._norm_future = store.workers.optimizer.submit(store._squared_norm, store._grads_event)

    def copy_out(self, store) -> None:
        """Slice by slice: to fp32 on the device (a transient of slices.GRAD_SLICE_NUMEL floats on the
        offload stream, reused chunk after chunk in stream order), then into master_grad. Nothing else
        runs on the offload stream: under NCCL a squared norm taken here on the device (cuBLAS's
        dot or a reduction kernel) deadlocked the first backward of clipped runs, a peer's
        gradient send never received (cause unknown; docs/design.md, "Known limitations"), so
        ``_squared_norm`` takes the norm on the host."""
        for lo in range(0, store.numel, slices.GRAD_SLICE_NUMEL):
            chunk = store.grad[lo:lo + slices.GRAD_SLICE_NUMEL].float()  # a view when already fp32
            store.master_grad[lo:lo + slices.GRAD_SLICE_NUMEL].copy_(chunk, non_blocking=True)

    def grads_ready(self, store: "StageStore", grads_event=None) -> torch.Tensor:
        """fp32 gradients in host memory, once ``grads_event`` (the OFFLOAD_GRADS copy's, taken from
        the field by the caller's thread, the main one) is done."""
        if grads_event is not None:
            grads_event.synchronize()  # host sync (optimizer or main thread): the CPU reads the D2H copy
        return store.master_grad

    def progress(self, store: "StageStore", fused: bool) -> StepProgress | None:
        """How far the step has written, for the next LOAD to stream behind it: with the fused
        kernel (stepped chunk by chunk), not delayed (no load follows a delayed step), not
        sharded (the masters are whole only after the peers' exchange, which ends the step)."""
        if fused and not self.delayed and store.shard is None:
            return StepProgress(store.workers.loader.poke if store.workers is not None else None)
        return None

    def before_step(self, store: "StageStore") -> None:
        # Delayed, no load follows the step: the next iteration's loads copy ``work``, refreshed
        # here to the masters as they are before this step (the last step's result), once this
        # iteration's loads have read the weights before that.
        if self.delayed:
            reads, store._work_reads = store._work_reads, []
            store._refresh_future = store._run_on_optimizer(self.refresh_work, store, reads)

    def after_step(self, store: "StageStore", progress: StepProgress | None) -> None:
        """On the optimizer thread, after AdamW: the peers' exchange (sharded; collective, on this
        thread, which alone uses the group: the peers run the same steps in the same order) and,
        stepped whole, ``work`` (the next load copies it)."""
        if store.shard is not None:
            store.shard.exchange(store.master)
        if progress is None and store.work is not store.master and not self.delayed:
            store.work.copy_(store.master)  # not chunked: the next load copies ``work``

    def refresh_work(self, store, reads: tuple = ()) -> None:
        """``work`` from the masters (fp32 -> compute dtype), for the loads after the first;
        first the copies out of ``work`` that ``reads`` end (load-stream events) must be done."""
        for end in reads:
            if hasattr(end, "synchronize"):
                end.synchronize()  # host sync (optimizer thread): a load still reads the old ``work``
        store.work.copy_(store.master)

    def discard(self, store: "StageStore") -> None:
        # The device buffer went back to the pool at OFFLOAD_GRADS and is zeroed by the next first
        # backward; master_grad is overwritten by the next OFFLOAD_GRADS's copy.
        store._norm_future = None
        store._grads_summed = False


__all__ = ["Offloaded"]
