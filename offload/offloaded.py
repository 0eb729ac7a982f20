"""An offloaded stage (``use_offload``, every stage the program loads): its fp32 masters, their
gradient and AdamW state in host memory, a compute-dtype copy ``work`` in pinned host memory, and
on the device only between LOAD and DROP/OFFLOAD_GRADS its weights and gradients, in buffers of
the rank's pool. The host side runs on the rank's ``Workers`` (``offload.store``'s docstring:
loads streamed behind the optimizer step, the ``work`` refresh, the squared norm).

A device-stepped one (``device_steps``) keeps its AdamW moments on the device instead, and its
STEP runs there: on the step stream, once its gradient's copy to the host has landed, each
chunk of the pinned fp32 masters and gradient comes in, the fused CUDA AdamW updates it against
the moments, the masters go back out (``ThroughDevice``). Nothing waits on the host for it: the
next LOAD's copy waits on the load stream for the step's end, the next OFFLOAD_GRADS's on the
offload stream (it overwrites the gradient the step read), the ``work`` refresh (optimizer
thread) and the checkpoints (``wait_refresh``) on the host. With clipping the CPU then has fewer
steps to finish between the norm and the next forward's need of them, while the GPU's copy
engines do this one."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Generator

import torch

from offload import loader, owners, slices
from offload.loader import LoadSpan, StepProgress
from offload.streams import host_empty

if TYPE_CHECKING:
    from offload.store import StageStore
    from offload.streams import Clock


class Offloaded:
    """The ``Residency`` of an offloaded stage, one per store: the buffers that come and go
    (``work``, ``dev``, ``grad``) and the hand-offs of their copies are its fields. Its methods take
    the store, whose buffers and streams they use, and run on the store's thread, which alone
    writes these fields, except where marked."""

    offload = True

    def __init__(self, delayed: bool = False, device_step: bool = False):
        self._owner = threading.current_thread()
        # delayed update: ``work`` keeps the weights from before the last step, so the next
        # iteration computes with them while that step runs (``before_step``)
        self.delayed = delayed
        self.device_step = device_step  # AdamW on the device, its moments there (module docstring)
        self._fresh_masters = False  # a device step changed the masters since ``work`` was refreshed
        self._device_end = None  # step stream: the last device step's end (CUDA), not yet waited for on the host
        self.work: torch.Tensor | None = None  # from ``place`` on: the copy a later LOAD copies
        self.dev: torch.Tensor | None = None   # between LOAD and DROP/OFFLOAD_GRADS: the weights
        self.grad: torch.Tensor | None = None  # from the first backward to OFFLOAD_GRADS
        self.loaded = False
        self.grads_event = None  # offload stream: the gradients are in host memory
        self._load_future: Future | None = None  # -> LoadSpan; its end is what compute waits for
        self._norm_future: Future | None = None  # optimizer thread: squared norm of the offloaded grads
        # of a step not yet loaded from: it changed the masters since ``work`` was refreshed
        self._progress: StepProgress | None = None
        self._refresh_future: Future | None = None  # optimizer thread: ``work`` from the masters
        self._work_reads: list = []  # delayed: load-stream ends of this iteration's copies out of ``work``

    def __setattr__(self, name: str, value) -> None:
        owners.check_field_write(self.__dict__.get("_owner"), "Offloaded", name)
        object.__setattr__(self, name, value)

    @staticmethod
    def _host(store: "StageStore", dtype: torch.dtype) -> torch.Tensor:
        """A host buffer of the stage's size (pinned on CUDA): sharded over peers that share host
        buffers, the one copy they all map, else this process's own."""
        shared = store.shard.host_buffer(store.numel, dtype) if store.shard is not None else None
        return shared if shared is not None else host_empty(store.numel, dtype, store.device.type == "cuda")

    def master(self, store: "StageStore") -> torch.Tensor:
        """The fp32 masters, in host memory (``_host``)."""
        return self._host(store, torch.float32)

    def master_grad(self, store: "StageStore") -> torch.Tensor:
        # pinned on CUDA: the gradients' D2H copy lands here directly
        shared = store.shard.grad_buffer(store.numel) if store.shard is not None else None
        return shared if shared is not None else host_empty(store.numel, torch.float32,
                                                            store.device.type == "cuda").zero_()

    def state_device(self, store: "StageStore") -> torch.device:
        return store.device if self.device_step else store.master.device

    def place(self, store: "StageStore") -> None:
        same_dtype = store.dtype == torch.float32
        own_copy = not same_dtype or self.delayed  # delayed: the masters move on while ``work`` stays
        self.work = self._host(store, store.dtype) if own_copy else store.master
        self.work.copy_(store.master)  # shared: every peer writes the same values
        # Until its first LOAD the stage holds nothing: the module's own fp32 weights would
        # otherwise stay alive beside the masters (a 7B model's 25 GiB of host memory at start-up).
        store.bind(None, None)

    def load(self, store: "StageStore") -> Future:
        """LOAD: host -> device copy of the weights on the load stream, issued by its producer
        (the loader thread with workers). Returns a future of its ``LoadSpan``; the host never
        blocks here (see ``offload.store``'s docstring)."""
        dev, ready = store.pool.take(store.numel, store.dtype)
        self.dev = dev
        store.bind(self.dev, self.grad)
        self.loaded = True
        progress, self._progress = self._progress, None
        fresh, self._fresh_masters = self._fresh_masters, False
        stepped = self._device_end if fresh else None  # the load stream waits for the device step's end
        if progress is not None or fresh:  # first load since a step: from the masters (behind a CPU step, by chunks)
            src, after = store.master, store.step_future if progress is not None else None
            if self.work is not store.master:
                self._refresh_future = store.run_on_optimizer(self.refresh_work, store,
                                                              (stepped,) if stepped is not None else ())
        else:
            src, after = self.work, self._refresh_future
            if store.shard is not None and after is None:
                after = store.step_future  # sharded: ``work`` is written by the step, after the exchange
        behind = after is not None and not after.done()  # the optimizer still writes ``src``
        job = self.copy_in(store, src, dev, ready, after, progress, behind, stepped)
        if store.workers is None:
            self._load_future = loader.done(loader.run_through(job))
        else:
            if behind:
                after.add_done_callback(store.workers.loader.poke)
            self._load_future = store.workers.loader.submit(job)
        return self._load_future

    def copy_in(self, store: "StageStore", src: torch.Tensor, dev: torch.Tensor, ready, after: Future | None,
                progress: StepProgress | None, behind: bool, stepped=None) -> Generator[None, None, LoadSpan]:
        """A job for the load stream's producer (``Loader``): the copy of ``src`` into ``dev``,
        chunk by chunk, each once the optimizer has written it (``after``, the step or refresh
        that writes ``src``, is done; with the step's ``progress``, its chunk is; ``stepped``, a
        device step's end event, the load stream waits for). It yields where it must wait and
        returns the ``LoadSpan``; ``behind`` (the optimizer still wrote ``src`` at LOAD time)
        puts in it when the wait was over."""
        step_done = None
        if progress is None and after is not None:
            while not after.done():
                yield
            after.result()  # re-raises an optimizer error at the compute that needs it
            step_done = time.perf_counter() if behind else None
        store.streams.wait("load", ready)  # the buffer's previous user is done with it
        store.streams.wait("load", stepped)  # a device step's copies of the masters back have landed
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
            store.note_transfer("h2d", start, end, store.numel * src.element_size())
        return LoadSpan(start, end, step_done)

    def copy_chunk(self, store: "StageStore", src: torch.Tensor, dev: torch.Tensor, lo: int, hi: int,
                   timed: bool) -> None:
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
                store.note_transfer("h2d", c_start, store.streams.event("load", timing=True),
                                    (hi - lo) * src.element_size())

    def before_compute(self, store: "StageStore", backward: bool, clock: "Clock | None") -> None:
        """Before an F/B of the stage: the host waits for the last LOAD's copy to be issued, the
        compute stream for the copy itself; the first backward of the iteration takes a zeroed
        gradient buffer from the pool (``StageStore.before_compute`` says what ``clock`` gets)."""
        if self._load_future is not None:
            t0 = time.perf_counter()
            span = self._load_future.result()  # host wait: only when the copy is not issued yet
            t1 = time.perf_counter()
            self._load_future = None
            if self.delayed:
                self._work_reads.append(span.end)
            stepped = min(t1, span.step_done) - t0 if span.step_done is not None else 0.0
            if clock is not None:
                clock.add("optimizer_wait", max(0.0, stepped))
            if store.streams.cuda:
                before = store.streams.mark()
                store.streams.wait("compute", span.end)
                if clock is not None:
                    clock.span("load_wait", before, store.streams.mark())
            elif clock is not None:
                clock.add("load_wait", max(0.0, (t1 - t0) - max(0.0, stepped)))
        if backward and self.grad is None:
            grad, ready = store.pool.take(store.numel, store.dtype)
            store.streams.wait("compute", ready)
            grad.zero_()
            self.grad = grad
            store.bind(self.dev, self.grad)

    def drop(self, store: "StageStore") -> None:
        """DROP: forget the device copy (weights did not change, nothing goes back)."""
        store.pool.give(self.dev, store.streams.event("compute"))
        self.dev = None
        store.bind(None, self.grad)
        self.loaded = False

    def offload_grads(self, store: "StageStore", norm: bool = False) -> None:
        """OFFLOAD_GRADS: fp32 gradients device -> host on the offload stream, then free device memory;
        with ``norm`` the optimizer thread takes their squared norm once they have landed."""
        if self.delayed and store.step_future is not None:
            # host wait: the last iteration's step may still read ``master_grad``, which this copy
            # overwrites (without the delay every load of this iteration already waited for it)
            store.step_future.result()
        done = store.streams.event("compute")
        with store.streams.on("offload"):
            store.streams.wait("offload", done)  # the backward that wrote the grads is done
            store.streams.wait("offload", self._device_end)  # the last device step read the old ones
            start = store.streams.event("offload", timing=True)
            self.copy_out(store)
        self.grads_event = store.streams.event("offload", timing=True)
        store.note_transfer("d2h", start, self.grads_event, store.numel * 4)
        store.pool.give(self.dev, done)
        store.pool.give(self.grad, self.grads_event)
        self.dev = self.grad = None
        store.bind(None, None)
        self.loaded = False
        if store.partial_norm:  # the peers' sum of this peer's range, FIFO before the step
            self._norm_future = store.run_on_optimizer(store.sum_over_peers, self.grads_event, norm)
        elif norm and store.workers is not None:
            self._norm_future = store.workers.optimizer.submit(store.squared_grad_norm, self.grads_event)

    def copy_out(self, store: "StageStore") -> None:
        """Slice by slice: to fp32 on the device (a transient of slices.GRAD_SLICE_NUMEL floats on the
        offload stream, reused chunk after chunk in stream order), then into master_grad. Only these
        copies run on the offload stream: a squared norm taken on the device there is known to hang
        clipped runs under NCCL (docs/design.md, "Known limitations"), so the optimizer thread takes
        it from the host copy (``StageStore.squared_grad_norm``)."""
        for lo in range(0, store.numel, slices.GRAD_SLICE_NUMEL):
            chunk = self.grad[lo:lo + slices.GRAD_SLICE_NUMEL].float()  # a view when already fp32
            store.master_grad[lo:lo + slices.GRAD_SLICE_NUMEL].copy_(chunk, non_blocking=True)

    def take_norm(self) -> Future | None:
        """The squared norm the last OFFLOAD_GRADS queued on the optimizer thread, handed over once
        (None when none is queued)."""
        future, self._norm_future = self._norm_future, None
        return future

    def grads_ready(self, store: "StageStore", grads_event=None) -> torch.Tensor:
        """fp32 gradients in host memory, once ``grads_event`` (the OFFLOAD_GRADS copy's, read from
        ``self.grads_event`` by the caller's thread, the main one) is done."""
        if grads_event is not None:
            grads_event.synchronize()  # host sync (optimizer or main thread): the CPU reads the D2H copy
        return store.master_grad

    def step_here(self, store: "StageStore", lr: float, clip_coef: float | None) -> Future | None:
        """A device-stepped stage's STEP, issued by this thread (the step stream's producer) on the
        step stream (module docstring); None for the others, whose step the optimizer thread runs."""
        if not self.device_step:
            return None
        with store.streams.on("step"):
            store.streams.wait("step", self.grads_event)  # the gradient's copy to the host has landed
            start = store.streams.mark("step")
            # a fill kernel, not a copy: no host sync
            scale = torch.full((), 1.0 / clip_coef, device=store.device) if clip_coef is not None else None
            store.adamw.step_chunks(lr, scale, source=ThroughDevice(store))
            end = store.streams.mark("step")
        self._fresh_masters = True
        self._device_end = end if store.streams.cuda else None  # on the CPU the copies are done
        return loader.done((start, end))

    def before_step(self, store: "StageStore", fused: bool) -> StepProgress | None:
        """At STEP, on the store's thread: how far the step will have written, for the next LOAD to
        stream behind it (returned for the step's task, kept for that LOAD): with the fused kernel
        (stepped chunk by chunk), not delayed (no load follows a delayed step), not sharded (the
        masters are whole only after the peers' exchange, which ends the step); else None."""
        chunked = fused and not self.delayed and store.shard is None
        poke = store.workers.loader.poke if store.workers is not None else None
        self._progress = StepProgress(poke) if chunked else None
        # Delayed, no load follows the step: the next iteration's loads copy ``work``, refreshed
        # here to the masters as they are before this step (the last step's result), once this
        # iteration's loads have read the weights before that.
        if self.delayed:
            reads, self._work_reads = self._work_reads, []
            self._refresh_future = store.run_on_optimizer(self.refresh_work, store, reads)
        return self._progress

    def after_step(self, store: "StageStore", progress: StepProgress | None) -> None:
        """On the optimizer thread, after AdamW: sharded, the peers' exchange, or with shared buffers
        this peer's range of ``work`` and a barrier (collective, on this thread, which alone uses the
        group: the peers run the same steps in the same order); stepped whole, ``work`` (the next
        load copies it)."""
        own_work = self.work is not store.master
        if store.partial_norm and own_work:  # one copy of ``work``: each peer refreshes its range before the barrier
            lo, hi = store.shard_range
            self.work[lo:hi].copy_(store.master[lo:hi])
        if store.shard is not None:
            store.shard.stepped(store.master)
        if progress is None and own_work and not self.delayed and not store.partial_norm:
            self.work.copy_(store.master)  # not chunked: the next load copies ``work``

    def refresh_work(self, store: "StageStore", reads: tuple = ()) -> None:
        """``work`` from the masters (fp32 -> compute dtype), for the loads after the first;
        first what the events ``reads`` end must be done: the copies out of ``work`` (load
        stream; delayed update), or a device step's copies into the masters (step stream)."""
        for end in reads:
            if hasattr(end, "synchronize"):
                end.synchronize()  # host sync (optimizer thread): ``work`` or the masters are still in use
        self.work.copy_(store.master)

    def wait_refresh(self) -> None:
        """Host wait for the queued refresh of ``work`` (re-raising its error here) and for the
        last device step's copies of the masters back."""
        if self._device_end is not None:
            self._device_end.synchronize()  # host sync: the masters are read next (a checkpoint)
            self._device_end = None
        if self._refresh_future is not None:
            self._refresh_future.result()
            self._refresh_future = None

    def discard(self, store: "StageStore") -> None:
        # The device buffer went back to the pool at OFFLOAD_GRADS and is zeroed by the next first
        # backward; master_grad is overwritten by the next OFFLOAD_GRADS's copy.
        self._norm_future = None


class ThroughDevice:
    """The ``ChunkSource`` of a device step (``Offloaded.step_here``), used on the step stream:
    each chunk of the pinned fp32 masters and gradient copied into the rank's two step buffers
    (``Streams.step_buffers``), which the kernel updates; the masters' chunk copied back. One
    stream, so a chunk's copies in wait for the last one's copy out of the same buffers."""

    def __init__(self, store: "StageStore"):
        self.store = store
        self.master, self.grad = store.streams.step_buffers(store.numel)

    def take(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        master, grad = self.master[:hi - lo], self.grad[:hi - lo]
        master.copy_(self.store.master[lo:hi], non_blocking=True)
        grad.copy_(self.store.master_grad[lo:hi], non_blocking=True)
        return master, grad

    def put(self, lo: int, hi: int, master: torch.Tensor) -> None:
        self.store.master[lo:hi].copy_(master, non_blocking=True)


__all__ = ["Offloaded", "ThroughDevice"]
