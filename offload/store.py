"""Where a stage's parameters, gradients and optimizer state live, and how they move.

Per stage, everything is kept in flat buffers so that a transfer is one large copy:

* ``master``  fp32 master weights (two leaf views: decayed matrices, then undecayed 1-D
  weights) and the AdamW state: in host memory with offload, on the device without.
* ``work``    the compute-dtype copy that crosses PCIe (pinned host memory). With fp32
  compute it *is* the master buffer (no second copy).
* ``dev``     the device copy the stage's modules compute with; its parameters are views
  into it. With offload it exists only between LOAD and DROP/OFFLOAD_GRADS.
* ``grad``    device gradient buffer (parameter ``.grad`` views into it, so autograd
  accumulates micro-batches in place); with offload its fp32 values are copied into
  ``master_grad`` (pinned) in chunks of ``GRAD_SLICE_NUMEL`` elements, converted on the device,
  so the host reads fp32 gradients without converting them. A resident stage in 16-bit compute
  has no ``master_grad``: its norm and step convert ``grad`` a chunk at a time.

One ``StageStore`` class is what the executor, the runners and the checkpoints talk to; where a
stage's state lives and how it moves is its ``Residency``, chosen when the store is made
(``make_store``): ``Resident`` (``offload/resident.py``: everything on the device, LOAD, DROP and
OFFLOAD_GRADS move nothing, the step is the device's) or ``Offloaded`` (``offload/offloaded.py``:
masters and AdamW state in host memory, the copies below). The parts they use have modules of
their own: AdamW over the flat masters and its shard exchange (``offload/adamw.py``), the streams,
the buffer pool and pinned host buffers (``offload/streams.py``), the loader and optimizer threads
(``offload/loader.py``), the ownership rules and their check (``offload/owners.py``).

Transfers run on their own CUDA streams and are ordered by events, never by host syncs,
except where marked. On the CPU the streams are no-ops and the copies run synchronously
(on the thread that issues them), so the CPU tests exercise the offload logic too.

With ``Workers`` (offload), the host side runs off the main thread:

* OFFLOAD_GRADS, when the schedule has a NORM, queues the squared norm of the stage's gradients
  on the optimizer thread (it waits there for the copy), so NORM finds it ready.
* STEP queues AdamW on the optimizer thread (FIFO: after that stage's norm). It updates the
  masters ``MASTER_SLICE_NUMEL`` elements at a time and says how far it got; it does not touch
  ``work``.
* The first LOAD after a step copies the fp32 masters themselves, ``MASTER_SLICE_NUMEL``
  elements at a time through a staging buffer, and converts them on the device: with the step still running, the
  loader thread copies each chunk as soon as the step has written it, so the copy streams
  behind the step instead of starting after it, and the host is spared the conversion pass
  on that path. The same LOAD queues the refresh of ``work`` (fp32 -> compute dtype) on the
  optimizer thread, after every step already queued; later LOADs of the stage copy ``work``
  once it is done. A LOAD never blocks the main thread on the optimizer: it blocks only at
  the stage's first compute (``before_compute``), where the weights are needed, so the step
  of one stage overlaps the next iteration's compute of the stages whose steps are done.

Threads and streams (the table is in docs/design.md, "Who owns what"): every field of a
``StageStore`` and of its residency is written by the thread that built them (the main thread,
which interprets the action list) and only buffer contents are written elsewhere; the optimizer
thread gets what it reads (the gradients' event, the loads it must outwait) as arguments of the
task, not from the fields. Each stream has one producing thread: compute and offload the main
thread, load the ``Loader`` thread when the rank has ``Workers`` (every LOAD's copy, also one
that need not wait, so that a chunk behind a step and another stage's copy never race for the
stream or its staging buffer), the main thread without. ``MMOC_DEBUG_THREADS=1`` (or
``owners.CHECK_THREADS``) asserts both rules at every stream use and field write.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Protocol, Sequence

import torch
from torch import nn

from offload import owners
from offload.adamw import ConvertedGrad, FlatAdamW, OptimSettings, ShardPeers, squared_norm
from offload.frozen import FrozenWeights, PackedWeight
from offload.loader import StepProgress, Workers, done
from offload.offloaded import Offloaded
from offload.resident import Resident
from offload.streams import BufferPool, Clock, Streams, flat_views

_WEIGHT_VIEW = object()  # tag of a packed weight view (see StageStore.saved_tensor_hooks)
_FROZEN_VIEW = object()  # tag of a packed view of the frozen weights' device buffer
_PACKED_VIEW = object()  # tag of a packed view of a 4-bit base's device bytes (offload.frozen)


class Residency(Protocol):
    """Where a stage's parameters, gradients and AdamW state live, and how LOAD, DROP,
    OFFLOAD_GRADS and STEP move them: ``Resident`` or ``Offloaded``, one per store. It owns the
    buffers whose life depends on that and the hand-offs of their copies (its fields, written by
    the store's thread only); the store reads the public ones and calls the methods. They take
    the store, whose flat buffers, streams and pool they use, and run on its thread, except
    ``grads_ready``, ``after_step`` and what they queue (the optimizer thread)."""

    offload: bool   # the state lives in host memory
    delayed: bool   # delayed update: the next iteration computes with the weights before this step
    work: torch.Tensor | None   # the compute-dtype copy later LOADs copy (pinned host); None resident
    dev: torch.Tensor | None    # the device copy the modules compute with; None while not loaded
    grad: torch.Tensor | None   # the device gradient; None between OFFLOAD_GRADS and the first backward
    loaded: bool
    grads_event: object | None  # offload stream: the last OFFLOAD_GRADS's copy is done; None resident

    def master(self, store: "StageStore") -> torch.Tensor: ...

    def master_grad(self, store: "StageStore") -> torch.Tensor | None:
        """The fp32 gradient AdamW steps from; None where the step converts ``grad`` itself."""

    def place(self, store: "StageStore") -> None:
        """``work``, ``dev``, ``grad`` and the module's parameter views, once the masters hold its weights."""

    def load(self, store: "StageStore") -> Future: ...

    def before_compute(self, store: "StageStore", backward: bool, clock: Clock | None) -> None:
        """The waits for the last LOAD; ``backward``: a gradient buffer bound, zeroed, if none is."""

    def drop(self, store: "StageStore") -> None: ...

    def offload_grads(self, store: "StageStore", norm: bool = False) -> None: ...

    def take_norm(self) -> Future | None:
        """The squared norm OFFLOAD_GRADS queued, once; None if none was."""

    def grads_ready(self, store: "StageStore", grads_event=None) -> torch.Tensor:
        """The flat gradient the norm and the step read, once it is complete (fp32, or without
        ``master_grad`` the compute-dtype ``grad``)."""

    def state_device(self, store: "StageStore") -> torch.device:
        """Where the stage's AdamW moments live."""

    def step_here(self, store: "StageStore", lr: float, clip_coef: float | None) -> Future | None:
        """At STEP: a step this residency issues itself, on the store's thread, and a future of its
        ``(start, end)``; None where the store's own step (on the optimizer thread) runs."""

    def before_step(self, store: "StageStore", fused: bool) -> StepProgress | None:
        """At STEP: the progress the step reports chunk by chunk, for a load to stream behind; or None."""

    def after_step(self, store: "StageStore", progress: StepProgress | None) -> None: ...

    def wait_refresh(self) -> None:
        """Host wait for a refresh of ``work`` queued on the optimizer thread."""

    def discard(self, store: "StageStore") -> None: ...


def make_store(module: nn.Module, *, offload: bool, delayed: bool = False, device_step: bool = False,
               frozen: bool = False, summed: bool = False, packed: Sequence[PackedWeight] = (), **kw) -> "StageStore":
    """A ``StageStore`` for ``module``: offloaded (``delayed``: delayed update; ``device_step``:
    stepped by the device, its AdamW moments there) or resident (``summed``: its gradient is
    summed over data-parallel replicas); the other arguments as ``StageStore``'s. ``frozen``
    (LoRA): the parameters that need no gradient are ``FrozenWeights``, in host memory when
    ``offload``, ``packed`` (a 4-bit base's weights) among them as their parts; the trainable ones
    (the adapters), their gradients and AdamW state stay on the device."""
    if frozen:
        return StageStore(module, Resident(summed), frozen_offload=offload, frozen_packed=packed, **kw)
    return StageStore(module, Offloaded(delayed, device_step) if offload else Resident(summed), **kw)


class StageStore:
    """Parameters, gradients and AdamW state of one stage; see the module docstring."""

    def __init__(self, module: nn.Module, residency: Residency, *, device: torch.device, compute_dtype: torch.dtype,
                 optim: OptimSettings, streams: Streams, pool: BufferPool, workers: Workers | None = None,
                 tied: str | None = None, tied_copy: bool = False, shard: ShardPeers | None = None,
                 frozen_offload: bool | None = None, frozen_packed: Sequence[PackedWeight] = ()):
        """``residency``: where the stage's state lives and how it moves (``Resident``,
        ``Offloaded``; ``make_store`` picks). ``tied`` names this stage's copy of a matrix tied
        across stages (the embedding of the first stage, the head of the last,
        ``tie_word_embeddings``): it goes first in the flat
        buffers and is an optimizer leaf of its own, so both copies take the same AdamW kernel over
        the same shape at the same offset and come out bit for bit alike whatever the kernel's
        vectorisation: torch promises nothing across offsets, so the layout, not the kernel,
        keeps the copies equal. ``tied_copy``: this is the second copy (the head),
        left out of the squared norm (the tied gradient counts once) and of the saved weights.

        ``shard`` (offload, data parallelism): this store's AdamW state and step cover only its
        peer's range of the flat parameters (ZeRO-1 on host state); after each step the peers
        exchange their updated fp32 ranges (``ShardPeers.exchange``, on the optimizer thread),
        so every peer again holds all the masters. The gradient it steps from is the replicas'
        sum (``reduce_grads``).

        ``frozen_offload`` (LoRA; None: every parameter trains): the parameters that do not
        require a gradient are left out of the flat buffers and kept as ``FrozenWeights`` (in host
        memory when True), which LOAD, DROP and OFFLOAD_GRADS move, ``frozen_packed`` (a 4-bit
        base's weights) as their parts; the rest is as above.

        The calling thread owns the store: it alone writes its fields from now on (module
        docstring; checked under ``owners.CHECK_THREADS``)."""
        self._owner = threading.current_thread()
        self.module, self.device, self.dtype, self.residency = module, device, compute_dtype, residency
        self.offload, self.delayed = residency.offload, residency.delayed
        self.streams, self.pool = streams, pool
        self.workers = workers if residency.offload else None
        if self.workers is not None:
            streams.hand_to("load", self.workers.loader.thread)  # the load stream's one producer
        named = list(module.named_parameters())
        self.frozen: FrozenWeights | None = None
        if frozen_offload is not None:
            packed = {id(w.param) for w in frozen_packed}
            self.frozen = FrozenWeights([(n, p) for n, p in named if not p.requires_grad and id(p) not in packed],
                                        offload=frozen_offload, device=device, dtype=compute_dtype, streams=streams,
                                        pool=pool, packed=frozen_packed)
            named = [(n, p) for n, p in named if p.requires_grad]
        if tied is not None:
            named.sort(key=lambda np_: np_[0] != tied)  # stable: the tied matrix first, the rest in order
            if named[0][0] != tied or named[0][1].ndim < 2:
                raise ValueError(f"tied parameter {tied!r} is not a matrix of this stage")
        decay = [(n, p) for n, p in named if p.ndim >= 2]
        no_decay = [(n, p) for n, p in named if p.ndim < 2]
        self.params = [p for _, p in decay + no_decay]
        self.names = [n for n, _ in decay + no_decay]
        self.shapes = [p.shape for p in self.params]
        self.numel = sum(p.numel() for p in self.params)
        n_decay = sum(p.numel() for _, p in decay)
        self.tied = tied
        self.tied_numel = self.shapes[0].numel() if tied is not None else 0  # elements [0, tied_numel)
        self.tied_copy = tied is not None and tied_copy

        self.shard = shard if residency.offload else None  # ZeRO-1 for offloaded stages only (their buffers too)
        self.fused = bool(optim.fused)  # the fused kernel, which the step can run a chunk at a time
        self.master = residency.master(self)
        with torch.no_grad():
            for p, view in zip(self.params, flat_views(self.master, self.shapes)):
                view.copy_(p.detach())  # the module's weights may live on another device than the master
        self.master_grad = residency.master_grad(self)
        self.adamw = FlatAdamW(self.master, self.master_grad,
                               [((0, self.tied_numel, n_decay), optim.weight_decay), ((n_decay, self.numel), 0.0)],
                               optim, self.shard, residency.state_device(self))
        self.optimizer, self.shard_range = self.adamw.optimizer, self.adamw.shard_range
        residency.place(self)  # work, dev, grad and the parameters' views
        self.step_future: Future | None = None  # the last STEP's; the residency's loads may wait for it
        # data parallel: ``master_grad`` holds the replicas' sum (``reduce_grads``); a resident
        # stage's step must not copy its own device gradient over it again
        self.grads_summed = False
        self._gathered: dict | None = None  # sharded: the whole AdamW state, for the next save
        # (h2d|d2h, bytes, start, end) on CUDA: h2d appended by the load stream's producer, d2h
        # by this thread, drained by this thread (a deque: append and popleft are thread-safe)
        self.transfers: deque[tuple[str, int, object, object]] = deque()

    def __setattr__(self, name: str, value) -> None:
        # only the thread that built the store writes its fields (module docstring)
        owners.check_field_write(self.__dict__.get("_owner"), "StageStore", name)
        object.__setattr__(self, name, value)

    # the buffers whose life the residency decides (``Residency``)
    @property
    def work(self) -> torch.Tensor | None:
        return self.residency.work

    @property
    def dev(self) -> torch.Tensor | None:
        return self.residency.dev

    @property
    def grad(self) -> torch.Tensor | None:
        return self.residency.grad

    @property
    def loaded(self) -> bool:
        return self.residency.loaded

    def _label(self) -> str:
        """The stage in messages: its index, else its first parameter (a LoRA stage may train none)."""
        index = getattr(self.module, "index", None)
        return f"stage {index}" if index is not None else f"stage with {self.names[0]}"

    def bind(self, dev: torch.Tensor | None, grad: torch.Tensor | None) -> None:
        """The parameters become views of ``dev`` (empty without it), their ``.grad`` views of ``grad``."""
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        views = flat_views(dev, self.shapes) if dev is not None else (empty for _ in self.params)
        gviews = flat_views(grad, self.shapes) if grad is not None else (None for _ in self.params)
        for p, v, g in zip(self.params, views, gviews):
            p.data = v
            p.grad = g

    # --- actions: where the state lives decides what they move -------------------------
    def load(self) -> Future:
        """LOAD: the weights to the device, issued by the load stream's producer; a future of the
        copy's ``LoadSpan``. The host never blocks here (module docstring)."""
        span = self.residency.load(self)
        frozen = self.frozen.load() if self.frozen is not None else None
        if frozen is not None:  # issued on this thread: its span is known now
            copy = frozen.result()
            self.note_transfer("h2d", copy.start, copy.end, self.frozen.nbytes)
        return frozen or span

    def before_compute(self, backward: bool, clock: Clock | None = None) -> None:
        """Called before every F/B of this stage: waits for its load (the host for the copy to be
        issued, the compute stream for the copy), and the first backward of the iteration binds a
        zeroed gradient buffer (autograd then accumulates every micro-batch into it in place).
        ``clock`` gets the waits: ``optimizer_wait`` (host, for the stage's step) and
        ``load_wait`` (the compute stream, or on the CPU the host, for the copy)."""
        if not self.loaded or (self.frozen is not None and not self.frozen.loaded):
            raise RuntimeError(f"{self._label()} computed while its parameters are not loaded")
        if self.frozen is not None:
            self.frozen.wait(clock)
        self.residency.before_compute(self, backward, clock)

    def drop(self) -> None:
        """DROP: forget the device copy (weights did not change, nothing goes back)."""
        self.residency.drop(self)
        if self.frozen is not None:
            self.frozen.drop()

    def offload_grads(self, norm: bool = False) -> None:
        """OFFLOAD_GRADS: fp32 gradients device -> host, then free device memory; with ``norm`` the
        optimizer thread takes their squared norm once they have landed. Frozen weights have no
        gradient: their device copy is dropped."""
        self.residency.offload_grads(self, norm)
        if self.frozen is not None:
            self.frozen.drop()

    def squared_grad_norm(self, grads_event=None) -> torch.Tensor:
        """The squared norm of this stage's gradient, in fp32 (the tied matrix's counted by its first
        copy). On the optimizer thread (offload, the rank's share of the cores) or the main thread
        (resident, torchrun's one): ``squared_norm`` sums the same way for any thread count, where
        ``torch.dot`` (MKL) splits the sum by thread and offload and resident clip differently.
        ``grads_event``: the offloaded gradients' (``Residency.grads_ready``)."""
        g = self.residency.grads_ready(self, grads_event)
        if self.tied_copy:
            g = g[self.tied_numel:]  # the first stage's copy of the tied gradient counts it
        return squared_norm(g)

    def note_transfer(self, kind: str, start, end, nbytes: int | None = None) -> None:
        """A copy between host and device (``h2d``/``d2h``) from event ``start`` to ``end``, for
        ``pop_transfer_stats`` (on CUDA; appended by the thread that issued it)."""
        if self.streams.cuda:
            self.transfers.append((kind, self.numel * self.work.element_size() if nbytes is None else nbytes, start, end))

    def pop_transfer_stats(self) -> dict[str, tuple[int, float]]:
        """{kind: (bytes, seconds)} of the transfers since the last call. Call after a device
        synchronize (reading event times needs the events to have completed)."""
        out: dict[str, tuple[int, float]] = {}
        while self.transfers:
            kind, nbytes, start, end = self.transfers.popleft()
            b, t = out.get(kind, (0, 0.0))
            out[kind] = (b + nbytes, t + start.elapsed_time(end) / 1e3)
        return out

    @property
    def partial_norm(self) -> bool:
        """``grad_sq_norm`` is of this peer's range of the stage only (sharded over peers that share
        its host buffers: each sums and steps its range alone; ``GradSync.sum_norms``)."""
        return self.shard is not None and self.shard.shared

    def sum_over_peers(self, grads_event, norm: bool) -> torch.Tensor | None:
        """Optimizer thread (sharded, shared host buffers; queued by OFFLOAD_GRADS): once this peer's
        gradient has landed, its range summed over the peers' in place, and that range's squared
        norm when ``norm``. Collective over the peers, who queue it in the same order."""
        self.residency.grads_ready(self, grads_event)
        summed = self.shard.sum_grads(*self.shard_range)
        return squared_norm(summed) if norm else None

    def reduce_grads(self, reduce) -> None:
        """Data parallelism (main thread, before NORM or STEP): ``reduce(master_grad)`` replaces
        this iteration's fp32 gradient in place by its sum over the replicas. A squared norm the
        OFFLOAD_GRADS queued is of the local gradient: it is awaited (it also waited for the copy to
        land) and dropped, and ``grad_sq_norm`` takes the norm of the sum instead. Shared buffers:
        OFFLOAD_GRADS queued the sum of this peer's range (``sum_over_peers``), nothing to do here."""
        if self.partial_norm:
            return
        future = self.residency.take_norm()
        if future is not None:
            future.result()  # host wait: the optimizer thread saw the gradients land
        reduce(self.residency.grads_ready(self, self.residency.grads_event))
        self.grads_summed = True

    def tied_grad(self) -> torch.Tensor:
        """The device gradient of the tied matrix (a view into ``grad``: the TIE action sums the
        two copies' in place, before OFFLOAD_GRADS copies them to the host)."""
        if self.tied is None or self.grad is None:
            raise RuntimeError(f"stage with {self.names[0]}: no tied gradient on the device (tied={self.tied!r}; "
                               "TIE must follow the stage's backward and precede its OFFLOAD_GRADS)")
        return self.grad[:self.tied_numel]

    def grad_sq_norm(self) -> torch.Tensor:
        """Squared L2 norm of this stage's gradient, fp32, on the master device (with offload a
        host wait for the optimizer thread, which takes it once the gradients are in host memory)."""
        future = self.residency.take_norm()
        return future.result() if future is not None else self.squared_grad_norm(self.residency.grads_event)

    def step(self, lr: float, clip_coef: float | None) -> Future:
        """STEP: AdamW on the masters. With workers it runs on the optimizer thread while the GPU
        goes on; the stage's next LOAD copies the masters behind it (module docstring).
        ``clip_coef`` multiplies the gradients; the fused kernel applies it (as its
        ``grad_scale``, the inverse) instead of a separate pass over them. Returns a future of
        the step's wall-clock ``(start, end)``, or of its points on a stream where the residency
        issues the step itself (``Residency.step_here``: a device-stepped offloaded stage)."""
        here = self.residency.step_here(self, lr, clip_coef)
        if here is not None:
            self.step_future = here
            return here
        fused = self.fused
        grads_event = self.residency.grads_event  # handed to the optimizer thread with the task, not read there
        # shared sharded, without a NORM to take it: the sum queued before, whose error is the step's
        summed = self.residency.take_norm() if self.partial_norm else None
        progress = self.residency.before_step(self, fused)  # chunk by chunk, for a load to stream behind

        def run() -> tuple[float, float]:
            start = time.perf_counter()
            try:
                if summed is not None:
                    summed.result()
                g = self.residency.grads_ready(self, grads_event)  # FIFO: after this stage's norm, if one was queued
                if clip_coef is not None and not fused:
                    g.mul_(clip_coef)
                # a fill kernel, not a copy: no host sync even where the masters are on the GPU
                scale = torch.full((), 1.0 / clip_coef, device=g.device) if clip_coef is not None and fused else None
                if progress is not None:
                    self.adamw.step_chunks(lr, scale, progress)
                elif self.master_grad is None:  # no fp32 copy: the kernel's gradient converted a chunk at a time
                    self.adamw.step_chunks(lr, scale, source=ConvertedGrad(self.master, g))
                else:
                    self.optimizer.grad_scale = scale
                    for group in self.optimizer.param_groups:
                        group["lr"] = lr
                    self.optimizer.step()
                self.residency.after_step(self, progress)
            finally:
                if progress is not None:
                    progress.close()
            return start, time.perf_counter()

        self.step_future = self.run_on_optimizer(run)
        # here, not in ``run``: the field is this thread's (only a resident stage's step reads it,
        # and that one ran already)
        self.grads_summed = False
        return self.step_future

    def run_on_optimizer(self, fn, *args) -> Future:
        """``fn(*args)`` on the optimizer thread (FIFO), or here and now without workers."""
        if self.workers is not None:
            return self.workers.optimizer.submit(fn, *args)
        return done(fn(*args))

    def discard_grads(self) -> None:
        """STEP of a skipped iteration: weights and AdamW state stay as they are; the gradients
        are thrown away so the next iteration does not accumulate onto them."""
        self.residency.discard(self)
        self.grads_summed = False

    def wait_step(self) -> None:
        """Host wait for this stage's optimizer step and ``work`` refresh; re-raises their errors here."""
        if self.step_future is not None:
            self.step_future.result()
            self.step_future = None
        self.residency.wait_refresh()

    # --- autograd's saved tensors -----------------------------------------------------------
    def saved_tensor_hooks(self):
        """Context for a forward of this stage: autograd saves views of the weights as
        (dtype, size, stride, offset) into the device buffer instead of the tensors, and rebuilds them
        from whatever buffer holds the weights at backward time. Without this, a DROP could not
        free the buffer (autograd would keep it alive) and, pooled, it would be overwritten
        by another stage's weights before this stage's backward read it."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _device_buffers(self) -> dict[object, torch.Tensor | None]:
        """The device buffers autograd's saved views are packed against, by tag: the trained
        weights', the frozen weights' and a 4-bit base's bytes (viewed as several dtypes)."""
        frozen = self.frozen
        return {_WEIGHT_VIEW: self.dev, _FROZEN_VIEW: frozen.dev if frozen else None,
                _PACKED_VIEW: frozen.dev_packed if frozen else None}

    def _pack(self, t: torch.Tensor):
        for tag, dev in self._device_buffers().items():
            if (dev is not None and t.device == dev.device
                    and t.untyped_storage().data_ptr() == dev.untyped_storage().data_ptr()):
                offset = t.storage_offset() * t.element_size() - dev.storage_offset() * dev.element_size()
                return (tag, t.dtype, t.size(), t.stride(), offset)  # the offset in bytes
        return t

    def _unpack(self, packed):
        if isinstance(packed, tuple) and packed and packed[0] in (_WEIGHT_VIEW, _FROZEN_VIEW, _PACKED_VIEW):
            tag, dtype, size, stride, offset = packed
            dev = self._device_buffers()[tag]
            if dev is None:
                raise RuntimeError(f"backward of the {self._label()} while its weights are not loaded")
            flat = dev if dtype == dev.dtype else dev.view(dtype)
            return flat.as_strided(size, stride, flat.storage_offset() + offset // flat.element_size())
        return packed

    # --- checkpoints ----------------------------------------------------------------------
    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 weights under their Hugging Face names (views into the master buffer)."""
        self.wait_step()
        # The second copy of a tied matrix is not saved: the first stage's is (as Hugging Face saves it)
        return {n: v for n, v in zip(self.names, flat_views(self.master.detach(), self.shapes))
                if not (self.tied_copy and n == self.tied)}

    def optimizer_state_dict(self) -> dict:
        """AdamW state (exp_avg, exp_avg_sq, step per leaf view) and hyper-parameters; references,
        not copies, so save it before the next step. Sharded: the whole stage's, as an unsharded
        store has it, from the last ``gather_optimizer_state``."""
        self.wait_step()  # host wait: a step on the optimizer thread may still be writing the state
        if self.shard is None:
            return self.optimizer.state_dict()
        if self._gathered is None:
            raise RuntimeError("sharded AdamW state: call gather_optimizer_state on every peer first")
        state, self._gathered = self._gathered, None
        return state

    def gather_optimizer_state(self) -> None:
        """Sharded stores, collective over the peers (main thread; the optimizer thread is idle
        after ``wait_step``): assemble the whole stage's AdamW state, in the layout of an
        unsharded store, for ``optimizer_state_dict``; a checkpoint then resumes with any D."""
        self.wait_step()
        if self.shard is None:
            return
        self._gathered = self.adamw.gather_state()

    def load_optimizer_state_dict(self, state: dict) -> None:
        """Restore what ``optimizer_state_dict`` returned for the same stage (same leaf views);
        sharded, this peer's range of it. Moments apart from the masters (a device-stepped
        stage's) are copied into where they live: torch's loader would move them to the masters."""
        self.wait_step()
        if self.shard is None and self.adamw.state_device == self.master.device:
            self.optimizer.load_state_dict(state)
            return
        self.adamw.load_state(state)


__all__ = ["Residency", "StageStore", "make_store"]
