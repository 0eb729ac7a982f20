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
  so the host reads fp32 gradients without converting them.

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

Threads and streams (the table is in docs/design.md, "Who owns what"): every ``StageStore``
field is written by the thread that built the store (the main thread, which interprets the
action list) and only buffer contents are written elsewhere; the optimizer thread gets what it
reads (the gradients' event, the loads it must outwait) as arguments of the task, not from the
fields. Each stream has one producing thread: compute and offload the main thread, load the
``Loader`` thread when the rank has ``Workers`` (every LOAD's copy, also one that need not wait,
so that a chunk behind a step and another stage's copy never race for the stream or its
staging buffer), the main thread without. ``MMOC_DEBUG_THREADS=1`` (or ``CHECK_THREADS``)
asserts both rules at every stream use and field write.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Generator, NamedTuple, Protocol

import torch
from torch import nn


_WEIGHT_VIEW = object()  # tag of a packed weight view (see StageStore.saved_tensor_hooks)
# Elements (as in every *_NUMEL; micro-batches are chunks) converted to fp32 at a time on the
# device at OFFLOAD_GRADS (64 MiB).
GRAD_SLICE_NUMEL = 16 * 2**20
# Elements a CPU step updates, and a LOAD from the masters copies, at a time (128 MiB fp32). A
# multiple of the fused kernel's vector width, so the chunked step is bit for bit the whole one.
MASTER_SLICE_NUMEL = 32 * 2**20
# Debug: check the ownership rules (module docstring) at every stream use and every StageStore
# field write, and raise an AssertionError naming both threads. Read at each check, so a test can
# set it; off, a check costs one flag test (a StageStore field write, a Python-level __setattr__:
# a fraction of a microsecond, a few per action).
CHECK_THREADS = os.environ.get("MMOC_DEBUG_THREADS", "0") not in ("", "0")


def _assert_owner(owner: threading.Thread, what: str) -> None:
    """``CHECK_THREADS``: the calling thread must be ``owner``."""
    if threading.current_thread() is not owner:
        raise AssertionError(f"{what} belongs to {owner.name!r}, but {threading.current_thread().name!r} used it "
                             "(offload/store.py, 'Threads and streams')")


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised host tensor of ``numel`` elements, page-locked with ``pin``.

    torch's pinned allocator rounds every block up to a power of two: a 7B model's 16 stage masters
    of 1.6 GB take 2 GiB each, and the host memory of an offloaded run grows by a third over what
    the plan counts (enough to be killed on a 128 GiB host). So an ordinary allocation's pages are
    registered with CUDA instead, exactly, and unregistered when the tensor object goes; views of
    it (the optimizer's leaves) must not outlive it, which holds since the store keeps it.
    """
    t = torch.empty(numel, dtype=dtype)
    if pin and numel:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(t.data_ptr(), t.nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {t.nbytes / 2**30:.2f} GiB failed ({err}): host memory is "
                               "short or locked-memory limits are low (ulimit -l)")
        weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return t


@dataclass(frozen=True)
class OptimSettings:
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    fused: bool | None = None  # None: torch's default for the device


class Streams:
    """The compute stream plus side streams for loads and offloads (CUDA only), each with one
    producing host thread (``producer``): the thread that made them, until ``hand_to`` gives
    one to another. Every method that enqueues on a stream checks it under ``CHECK_THREADS``,
    on the CPU too, where the streams are no-ops."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            # Loads gate the next compute: give them priority over gradient offloads.
            self.load = torch.cuda.Stream(device, priority=-1)
            self.offload = torch.cuda.Stream(device, priority=0)
        self.device = device
        self._staging: torch.Tensor | None = None
        me = threading.current_thread()
        self.producer: dict[str, threading.Thread] = {"compute": me, "load": me, "offload": me}
        self._handed: set[str] = set()

    def hand_to(self, which: str, thread: threading.Thread) -> None:
        """From now on ``thread`` alone issues work on stream ``which`` (the loader takes the load
        stream). A second, different hand-off is an error: it would give the stream two producers."""
        if which in self._handed and self.producer[which] is not thread:
            raise RuntimeError(f"stream {which!r} already belongs to {self.producer[which].name!r}; "
                               f"{thread.name!r} cannot produce on it too (one Workers per Streams)")
        self.producer[which] = thread
        self._handed.add(which)

    def _use(self, which: str) -> None:
        if CHECK_THREADS:
            _assert_owner(self.producer[which], f"the {which} stream")

    def staging(self, numel: int) -> torch.Tensor:
        """The load stream's fp32 buffer (one per rank, ``min(MASTER_SLICE_NUMEL, numel)``
        elements for the largest stage it served): a master chunk lands here and is converted
        into the stage's device buffer. Made, used and replaced only by the load stream's
        producer, on the load stream, so stream order alone keeps one chunk's use before the next."""
        self._use("load")
        want = min(MASTER_SLICE_NUMEL, numel)
        if self._staging is None or self._staging.numel() < want:
            with self.on("load"):
                self._staging = torch.empty(want, dtype=torch.float32, device=self.device)
        return self._staging

    def on(self, which: str):
        """Context: torch work of the calling thread goes to ``which`` (its producer's only)."""
        self._use(which)
        return torch.cuda.stream(getattr(self, which)) if self.cuda else contextlib.nullcontext()

    def event(self, which: str, timing: bool = False):
        """An event recorded on ``which`` now (None on CPU)."""
        self._use(which)
        if not self.cuda:
            return None
        ev = torch.cuda.Event(enable_timing=timing)
        ev.record(getattr(self, which))
        return ev

    def wait(self, which: str, event) -> None:
        """Make stream ``which`` wait for ``event`` (device-side; the host does not block)."""
        self._use(which)
        if event is not None:
            getattr(self, which).wait_event(event)

    def mark(self, which: str = "compute"):
        """A point in time on ``which``: a timing event on CUDA, the wall clock on the CPU."""
        self._use(which)
        return time_point(getattr(self, which) if self.cuda else None)


def time_point(stream=None):
    """A point in time: a timing event recorded on CUDA ``stream``, or (None) the wall clock."""
    if stream is None:
        return time.perf_counter()
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(stream)
    return ev


class Clock(Protocol):
    """Where the store reports what a compute waited for (``pipeline.run.executor.StepClock``)."""

    def span(self, key: str, start, end) -> None: ...

    def add(self, key: str, seconds: float) -> None: ...


class ShardPeers(Protocol):
    """The D data-parallel peers of a stage that share its CPU optimizer step (``pipeline.run.replicas``)."""

    @property
    def index(self) -> int: ...

    def bounds(self, numel: int) -> list[tuple[int, int]]:
        """Each peer's range of the flat parameters, in peer order (this one's is ``[index]``)."""
        ...

    def exchange(self, flat: torch.Tensor) -> None:
        """Collective: every peer's range of ``flat`` from its owner to every peer, in place."""
        ...


class Loader:
    """The load stream's one producer, the ``param-loader`` thread: it issues every LOAD's copy,
    each chunk as soon as its source is written, in LOAD order, except that a load still waiting
    for a step never delays one whose source is ready: a job is a generator that issues what it
    can and yields where it must wait; ``poke`` says that something it waits for may have changed.

    One thread for all loads, also those that need not wait (the main thread could issue those
    itself): the staging buffer and the stream order of the chunks then need no lock, and the
    stream has one producer to reason about (STYLE.md, habit 13). The cost is one thread
    hand-off per LOAD (tens of microseconds): with prefetch it is hidden behind the compute
    before the stage's; without, the copy starts that much later."""

    def __init__(self, device: torch.device):
        self._cv = threading.Condition()
        self._jobs: list[tuple[Generator, Future]] = []  # guarded by _cv
        self._poked = False  # guarded by _cv: run the jobs again
        self._closing = False
        self.thread = threading.Thread(target=self._run, args=(device,), name="param-loader", daemon=True)
        self.thread.start()

    def submit(self, job: Generator) -> Future:
        """Queue ``job``; the future gets what it returns, or what it raised."""
        future: Future = Future()
        with self._cv:
            if self._closing:
                raise RuntimeError("the loader is shut down: no more loads")
            self._jobs.append((job, future))
            self._poked = True
            self._cv.notify()
        return future

    def poke(self, *_) -> None:
        """Something a queued job waits for changed (a step wrote a chunk or ended; a future is done)."""
        with self._cv:
            self._poked = True
            self._cv.notify()

    def shutdown(self, wait: bool = True) -> None:
        """No more jobs; the thread ends once the queued ones have (``wait``: join it)."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        if wait:
            self.thread.join()

    def _run(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._poked or (self._closing and not self._jobs))
                if not self._poked:
                    return
                self._poked = False
                jobs = list(self._jobs)
            finished = []
            for job, future in jobs:  # outside the lock: a step's progress may poke meanwhile
                try:
                    next(job)  # issues what it can; yields where it must wait
                    continue
                except StopIteration as stop:
                    future.set_result(stop.value)
                except Exception as e:  # noqa: BLE001 - the compute that needs the load re-raises it
                    future.set_exception(e)
                finished.append(job)
            if finished:
                with self._cv:
                    self._jobs = [(j, f) for j, f in self._jobs if all(j is not d for d in finished)]


def _run_through(job: Generator):
    """Drive a load job to its end on this thread (no loader: its sources are all written)."""
    try:
        next(job)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("a load waits for an optimizer step, but the store has no loader thread to wait on")


class Workers:
    """The host threads of an offloading rank: one runs the optimizer (its torch ops use the
    cores it was pinned to), one issues every load (``Loader``)."""

    def __init__(self, optimizer: ThreadPoolExecutor, device: torch.device):
        self.optimizer = optimizer
        self.loader = Loader(device)


class LoadSpan(NamedTuple):
    """When a LOAD's copy ran (``Streams.mark`` values) and, if it had to wait for the
    stage's optimizer step, the wall-clock time that step was done."""

    start: object
    end: object
    step_done: float | None = None


def _done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class StepProgress:
    """How far (in elements of the flat master) a running optimizer step has written. The
    optimizer thread writes it, then calls ``notify`` (the loader's ``poke``); a LOAD from
    the masters reads it chunk by chunk."""

    def __init__(self, notify: Callable[[], None] | None = None):
        self._lock = threading.Lock()
        self._upto = 0
        self._closed = False
        self._notify = notify

    def advance(self, upto: int) -> None:
        with self._lock:
            self._upto = upto
        if self._notify is not None:
            self._notify()

    def close(self) -> None:
        """The step returned or raised: nothing more will be written."""
        with self._lock:
            self._closed = True
        if self._notify is not None:
            self._notify()

    def written(self) -> tuple[int, bool]:
        """(elements ``[0, upto)`` written, whether the step has ended), read together."""
        with self._lock:
            return self._upto, self._closed


class BufferPool:
    """Reuses device buffers across stages and iterations instead of re-allocating them.

    A returned buffer carries the event after which its last user is done; whoever takes it
    next makes its own stream wait on that event before writing, so no host sync is needed."""

    def __init__(self, device: torch.device):
        self.device = device
        self._free: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, object]]] = {}

    def take(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, object]:
        free = self._free.get((numel, dtype))
        if free:
            return free.pop()
        return torch.empty(numel, dtype=dtype, device=self.device), None

    def give(self, buf: torch.Tensor, done_event) -> None:
        self._free.setdefault((buf.numel(), buf.dtype), []).append((buf, done_event))

    def clear(self) -> None:
        self._free.clear()


class StageStore:
    """Parameters, gradients and AdamW state of one stage; see the module docstring."""

    def __init__(self, module: nn.Module, *, device: torch.device, compute_dtype: torch.dtype, offload: bool,
                 optim: OptimSettings, streams: Streams, pool: BufferPool, workers: Workers | None = None,
                 delayed: bool = False, tied: str | None = None, tied_copy: bool = False,
                 shard: ShardPeers | None = None):
        """``tied`` names this stage's copy of a matrix tied across stages (the embedding of the
        first stage, the head of the last, ``tie_word_embeddings``): it goes first in the flat
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

        The calling thread owns the store: it alone writes its fields from now on (module
        docstring; checked under ``CHECK_THREADS``)."""
        self._owner = threading.current_thread()
        self.module, self.device, self.dtype, self.offload = module, device, compute_dtype, offload
        # delayed update (offload only): ``work`` keeps the weights from before the last step, so
        # the next iteration computes with them while that step runs (see ``step``)
        self.delayed = delayed and offload
        self.streams, self.pool = streams, pool
        self.workers = workers if offload else None
        if self.workers is not None:
            streams.hand_to("load", self.workers.loader.thread)  # the load stream's one producer
        named = list(module.named_parameters())
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

        pin = offload and device.type == "cuda"
        self.master = host_empty(self.numel, torch.float32, pin) if offload else torch.empty(
            self.numel, dtype=torch.float32, device=device)
        with torch.no_grad():
            for p, view in zip(self.params, self._views(self.master)):
                view.copy_(p.detach())  # the module's weights may live on another device than the master
        # pinned with offload: the gradients' D2H copy lands here directly
        self.master_grad = host_empty(self.numel, torch.float32, pin).zero_() if offload else torch.zeros(
            self.numel, dtype=torch.float32, device=device)
        self._group_bounds = [((0, self.tied_numel, n_decay), optim.weight_decay), ((n_decay, self.numel), 0.0)]
        self.shard = shard if offload else None
        self.shard_range = shard.bounds(self.numel)[shard.index] if self.shard is not None else (0, self.numel)
        groups = []
        for wd, ranges in self._leaf_ranges(*self.shard_range):
            leaves = []
            for lo, hi in ranges:
                leaf = self.master[lo:hi].requires_grad_()
                leaf.grad = self.master_grad[lo:hi]
                leaves.append(leaf)
            groups.append({"params": leaves, "weight_decay": wd})
        self.optimizer = torch.optim.AdamW(groups, lr=0.0, betas=optim.betas, eps=optim.eps, fused=optim.fused)
        if optim.fused:
            self._init_adam_state()

        same_dtype = compute_dtype == torch.float32
        if offload:
            own_copy = not same_dtype or self.delayed  # delayed: the masters move on while ``work`` stays
            self.work = host_empty(self.numel, compute_dtype, pin) if own_copy else self.master
            self.dev = self.grad = None
            self.work.copy_(self.master)
            # Until its first LOAD the stage holds nothing: the module's own fp32 weights would
            # otherwise stay alive beside the masters (a 7B model's 25 GiB of host memory at start-up).
            self._bind(None, None)
        else:  # resident: device copies live for the whole run
            self.work = None
            self.dev = self.master if same_dtype else self.master.to(compute_dtype)
            self.grad = self.master_grad if same_dtype else torch.zeros(self.numel, dtype=compute_dtype, device=device)
            self._bind(self.dev, self.grad)
        self._load_future: Future | None = None   # -> LoadSpan; its end is what compute waits for
        self._grads_event = None    # offload stream: gradients are in host memory
        self._norm_future: Future | None = None   # optimizer thread: squared norm of the offloaded grads
        self._step_future: Future | None = None
        # of a step not yet loaded from: it changed the masters since ``work`` was refreshed
        self._progress: StepProgress | None = None
        self._refresh_future: Future | None = None  # optimizer thread: ``work`` from the masters
        self._work_reads: list = []  # delayed: load-stream ends of this iteration's copies out of ``work``
        # data parallel: ``master_grad`` holds the replicas' sum (``reduce_grads``); a resident
        # stage's step must not copy its own device gradient over it again
        self._grads_summed = False
        self._gathered: dict | None = None  # sharded: the whole AdamW state, for the next save
        self.loaded = not offload
        # (h2d|d2h, bytes, start, end) on CUDA: h2d appended by the load stream's producer, d2h
        # by this thread, drained by this thread (a deque: append and popleft are thread-safe)
        self.transfers: deque[tuple[str, int, object, object]] = deque()

    def __setattr__(self, name: str, value) -> None:
        # ``CHECK_THREADS``: only the thread that built the store writes its fields (module docstring)
        if CHECK_THREADS and "_owner" in self.__dict__:
            _assert_owner(self._owner, f"StageStore.{name}")
        object.__setattr__(self, name, value)

    def _leaf_ranges(self, lo_s: int, hi_s: int) -> list[tuple[float, list[tuple[int, int]]]]:
        """The optimizer's groups (weight decay, leaf ranges of the flat master) within
        ``[lo_s, hi_s)``: the tied matrix, the decayed matrices, the undecayed 1-D weights;
        groups with no leaf there are left out."""
        out = []
        for bounds, wd in self._group_bounds:
            ranges = [(max(lo, lo_s), min(hi, hi_s)) for lo, hi in zip(bounds, bounds[1:])]
            ranges = [(lo, hi) for lo, hi in ranges if hi > lo]
            if ranges:
                out.append((wd, ranges))
        return out

    def _leaf_offset(self, leaf: torch.Tensor) -> int:
        """Where an optimizer leaf (a view of the flat master) starts in it."""
        return leaf.storage_offset() - self.master.storage_offset()

    def _init_adam_state(self) -> None:
        """AdamW's moments made (their pages touched) now, on this thread, instead of lazily in
        the first step on the optimizer thread: host memory is taken at start-up, not in the
        middle of training. torch's AdamW uses a state it finds (the fused kernel's step is a
        float32 tensor next to the parameter, as AdamW itself would make it)."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                self.optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                           "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}

    # --- views -------------------------------------------------------------------------
    def _views(self, flat: torch.Tensor):
        off = 0
        for shape in self.shapes:
            n = shape.numel()
            yield flat[off:off + n].view(shape)
            off += n

    def _bind(self, dev: torch.Tensor | None, grad: torch.Tensor | None) -> None:
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        views = self._views(dev) if dev is not None else (empty for _ in self.params)
        gviews = self._views(grad) if grad is not None else (None for _ in self.params)
        for p, v, g in zip(self.params, views, gviews):
            p.data = v
            p.grad = g

    # --- actions ------------------------------------------------------------------------
    def load(self) -> Future:
        """LOAD: host -> device copy of the weights on the load stream, issued by its producer
        (the loader thread with workers). Returns a future of its ``LoadSpan``; the host never
        blocks here (see the module docstring)."""
        if not self.offload:
            return _done(None)
        dev, ready = self.pool.take(self.numel, self.dtype)
        self.dev = dev
        self._bind(self.dev, self.grad)
        self.loaded = True
        progress, self._progress = self._progress, None
        if progress is not None:  # first load since a step: from the masters, chunk by chunk behind the step
            src, after = self.master, self._step_future
            if self.work is not self.master:
                self._refresh_future = self._run_on_optimizer(self._refresh_work)
        else:
            src, after = self.work, self._refresh_future
            if self.shard is not None and after is None:
                after = self._step_future  # sharded: ``work`` is written by the step, after the exchange
        behind = after is not None and not after.done()  # the optimizer still writes ``src``
        job = self._copy_in(src, dev, ready, after, progress, behind)
        if self.workers is None:
            self._load_future = _done(_run_through(job))
        else:
            if behind:
                after.add_done_callback(self.workers.loader.poke)
            self._load_future = self.workers.loader.submit(job)
        return self._load_future

    def _copy_in(self, src: torch.Tensor, dev: torch.Tensor, ready, after: Future | None,
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
        self.streams.wait("load", ready)  # the buffer's previous user is done with it
        start = self.streams.mark("load")
        for lo in range(0, self.numel, MASTER_SLICE_NUMEL):
            hi = min(self.numel, lo + MASTER_SLICE_NUMEL)
            while progress is not None:
                upto, ended = progress.written()
                if upto >= hi:
                    break
                if ended:
                    while not after.done():
                        yield
                    after.result()  # the step failed: re-raise its error at the compute that needs it
                    raise RuntimeError(f"optimizer step of the stage with {self.names[0]} ended early")
                yield
            # behind a step, each chunk is its own transfer: the gaps are the step's, not the link's
            self._copy_chunk(src, dev, lo, hi, timed=progress is not None)
        if progress is not None and behind:
            step_done = time.perf_counter()
        end = self.streams.mark("load")
        if progress is None:
            self._note_transfer("h2d", start, end, self.numel * src.element_size())
        return LoadSpan(start, end, step_done)

    def _copy_chunk(self, src: torch.Tensor, dev: torch.Tensor, lo: int, hi: int, timed: bool) -> None:
        """Elements ``[lo, hi)`` of ``src`` into ``dev`` on the load stream (its producer only).
        On CUDA an fp32 source is converted on the device, through the staging buffer, not by
        the host. ``timed``: a transfer of its own in ``transfers``."""
        with self.streams.on("load"):
            c_start = self.streams.event("load", timing=True) if timed else None
            if src.dtype != dev.dtype and self.streams.cuda:
                staged = self.streams.staging(self.numel)[:hi - lo]
                staged.copy_(src[lo:hi], non_blocking=True)
                dev[lo:hi].copy_(staged)
            else:
                dev[lo:hi].copy_(src[lo:hi], non_blocking=True)
            if c_start is not None:
                self._note_transfer("h2d", c_start, self.streams.event("load", timing=True),
                                    (hi - lo) * src.element_size())

    def before_compute(self, backward: bool, clock: Clock | None = None) -> None:
        """Called before every F/B of this stage: waits for its load (the host for the copy to be
        issued, the compute stream for the copy), and the first backward of the iteration binds a
        zeroed gradient buffer (autograd then accumulates every micro-batch into it in place).
        ``clock`` gets the waits: ``optimizer_wait`` (host, for the stage's step) and
        ``load_wait`` (the compute stream, or on the CPU the host, for the copy)."""
        if not self.loaded:
            raise RuntimeError(f"stage with {self.names[0]} computed while its parameters are not loaded")
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
            if self.streams.cuda:
                before = self.streams.mark()
                self.streams.wait("compute", span.end)
                if clock is not None:
                    clock.span("load_wait", before, self.streams.mark())
            elif clock is not None:
                clock.add("load_wait", max(0.0, (t1 - t0) - max(0.0, stepped)))
        if backward and self.grad is None:
            grad, ready = self.pool.take(self.numel, self.dtype)
            self.streams.wait("compute", ready)
            grad.zero_()
            self.grad = grad
            self._bind(self.dev, self.grad)

    def drop(self) -> None:
        """DROP: forget the device copy (weights did not change, nothing goes back)."""
        if not self.offload:
            return
        self.pool.give(self.dev, self.streams.event("compute"))
        self.dev = None
        self._bind(None, self.grad)
        self.loaded = False

    def offload_grads(self, norm: bool = False) -> None:
        """OFFLOAD_GRADS: fp32 gradients device -> host on the offload stream, then free device memory;
        with ``norm`` the optimizer thread takes their squared norm once they have landed."""
        if not self.offload:
            return
        if self.delayed and self._step_future is not None:
            # host wait: the last iteration's step may still read ``master_grad``, which this copy
            # overwrites (without the delay every load of this iteration already waited for it)
            self._step_future.result()
        done = self.streams.event("compute")
        with self.streams.on("offload"):
            self.streams.wait("offload", done)  # the backward that wrote the grads is done
            start = self.streams.event("offload", timing=True)
            self._copy_out()
        self._grads_event = self.streams.event("offload", timing=True)
        self._note_transfer("d2h", start, self._grads_event, self.numel * 4)
        self.pool.give(self.dev, done)
        self.pool.give(self.grad, self._grads_event)
        self.dev = self.grad = None
        self._bind(None, None)
        self.loaded = False
        if norm and self.workers is not None:
            self._norm_future = self.workers.optimizer.submit(self._squared_norm, self._grads_event)

    def _copy_out(self) -> None:
        """Slice by slice: to fp32 on the device (a transient of GRAD_SLICE_NUMEL floats on the
        offload stream, reused chunk after chunk in stream order), then into master_grad. Nothing else
        runs on the offload stream: under NCCL a squared norm taken here on the device (cuBLAS's
        dot or a reduction kernel) deadlocked the first backward of clipped runs, a peer's
        gradient send never received (cause unknown; docs/design.md, "Known limitations"), so
        ``_squared_norm`` takes the norm on the host."""
        for lo in range(0, self.numel, GRAD_SLICE_NUMEL):
            chunk = self.grad[lo:lo + GRAD_SLICE_NUMEL].float()  # a view when already fp32
            self.master_grad[lo:lo + GRAD_SLICE_NUMEL].copy_(chunk, non_blocking=True)

    def _squared_norm(self, grads_event=None) -> torch.Tensor:
        """On the optimizer thread (offload, the rank's share of the cores) or the main thread
        (resident, torchrun's one): ``vector_norm`` sums the same way for any thread count, where
        ``torch.dot`` (MKL) splits the sum by thread and offload and resident clip differently.
        ``grads_event``: the offloaded gradients' (``_grads_ready``)."""
        g = self._grads_ready(grads_event)
        if self.tied_copy:
            g = g[self.tied_numel:]  # the first stage's copy of the tied gradient counts it
        return torch.linalg.vector_norm(g).square()

    def _note_transfer(self, kind: str, start, end, nbytes: int | None = None) -> None:
        if self.streams.cuda:
            self.transfers.append((kind, nbytes or self.numel * self.work.element_size(), start, end))

    def pop_transfer_stats(self) -> dict[str, tuple[int, float]]:
        """{kind: (bytes, seconds)} of the transfers since the last call. Call after a device
        synchronize (reading event times needs the events to have completed)."""
        out: dict[str, tuple[int, float]] = {}
        while self.transfers:
            kind, nbytes, start, end = self.transfers.popleft()
            b, t = out.get(kind, (0, 0.0))
            out[kind] = (b + nbytes, t + start.elapsed_time(end) / 1e3)
        return out

    def _grads_ready(self, grads_event=None) -> torch.Tensor:
        """fp32 gradients next to the master weights; with offload, once ``grads_event`` (the
        OFFLOAD_GRADS copy's, taken from the field by the caller's thread, the main one) is done."""
        if self.offload:
            if grads_event is not None:
                grads_event.synchronize()  # host sync (optimizer or main thread): the CPU reads the D2H copy
        elif self.grad is not self.master_grad and not self._grads_summed:
            self.master_grad.copy_(self.grad)
        return self.master_grad

    def reduce_grads(self, reduce) -> None:
        """Data parallelism (main thread, before NORM or STEP): ``reduce(master_grad)`` replaces
        this iteration's fp32 gradient in place by its sum over the replicas. A squared norm the
        OFFLOAD_GRADS queued is of the local gradient: it is awaited (it also waited for the copy to
        land) and dropped, and ``grad_sq_norm`` takes the norm of the sum instead."""
        future, self._norm_future = self._norm_future, None
        if future is not None:
            future.result()  # host wait: the optimizer thread saw the gradients land
        reduce(self._grads_ready(self._grads_event))
        self._grads_summed = True

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
        future, self._norm_future = self._norm_future, None
        return future.result() if future is not None else self._squared_norm(self._grads_event)

    def step(self, lr: float, clip_coef: float | None) -> Future:
        """STEP: AdamW on the masters. With workers it runs on the optimizer thread while the GPU
        goes on; the stage's next LOAD copies the masters behind it (module docstring).
        ``clip_coef`` multiplies the gradients; the fused kernel applies it (as its
        ``grad_scale``, the inverse) instead of a separate pass over them. Returns a future of
        the step's wall-clock ``(start, end)``."""
        fused = self.optimizer.defaults.get("fused")
        # Delayed, no load follows the step: the next iteration's loads copy ``work``, refreshed
        # here to the masters as they are before this step (the last step's result), once this
        # iteration's loads have read the weights before that.
        # sharded: the masters are whole only after the peers' exchange, which ends the step
        progress = None
        if self.offload and fused and not self.delayed and self.shard is None:
            progress = StepProgress(self.workers.loader.poke if self.workers is not None else None)
        grads_event = self._grads_event  # handed to the optimizer thread with the task, not read there
        if self.delayed:
            reads, self._work_reads = self._work_reads, []
            self._refresh_future = self._run_on_optimizer(self._refresh_work, reads)

        def run() -> tuple[float, float]:
            start = time.perf_counter()
            try:
                g = self._grads_ready(grads_event)  # FIFO: after this stage's norm, if one was queued
                if clip_coef is not None and not fused:
                    g.mul_(clip_coef)
                # a fill kernel, not a copy: no host sync even where the masters are on the GPU
                scale = torch.full((), 1.0 / clip_coef, device=g.device) if clip_coef is not None and fused else None
                if progress is not None:
                    self._fused_step_chunks(lr, scale, progress)
                else:
                    self.optimizer.grad_scale = scale
                    for group in self.optimizer.param_groups:
                        group["lr"] = lr
                    self.optimizer.step()
                if self.shard is not None:
                    # collective, on the optimizer thread, which alone uses the group: the peers
                    # run the same steps in the same order
                    self.shard.exchange(self.master)
                if self.offload:
                    if progress is None and self.work is not self.master and not self.delayed:
                        self.work.copy_(self.master)  # not chunked: the next load copies ``work``
                else:
                    if self.dev is not self.master:
                        self.dev.copy_(self.master)
                    self.grad.zero_()
                    if self.master_grad is not self.grad:
                        self.master_grad.zero_()
            finally:
                if progress is not None:
                    progress.close()
            return start, time.perf_counter()

        self._progress = progress
        self._step_future = self._run_on_optimizer(run)
        # here, not in ``run``: the field is this thread's (only a resident stage's step reads it,
        # and that one ran already)
        self._grads_summed = False
        return self._step_future

    def _fused_step_chunks(self, lr: float, grad_scale: torch.Tensor | None, progress: StepProgress) -> None:
        """What ``optimizer.step()`` does with ``fused=True`` (the same kernel, arguments and
        state; elementwise, so the result is bit for bit the same), ``MASTER_SLICE_NUMEL``
        elements at a time, telling ``progress`` how far the flat master is written."""
        done = 0
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            beta1, beta2 = group["betas"]
            for leaf in group["params"]:
                state = self.optimizer.state[leaf]
                p, g = leaf.detach(), leaf.grad
                m, v = state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                for lo in range(0, p.numel(), MASTER_SLICE_NUMEL):
                    hi = min(p.numel(), lo + MASTER_SLICE_NUMEL)
                    torch._fused_adamw_([p[lo:hi]], [g[lo:hi]], [m[lo:hi]], [v[lo:hi]], [], [state["step"]],
                                        amsgrad=False, lr=lr, beta1=beta1, beta2=beta2,
                                        weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
                                        grad_scale=grad_scale, found_inf=None)
                    progress.advance(done + hi)
                done += p.numel()

    def _refresh_work(self, reads: tuple = ()) -> None:
        """``work`` from the masters (fp32 -> compute dtype), for the loads after the first;
        first the copies out of ``work`` that ``reads`` end (load-stream events) must be done."""
        for end in reads:
            if hasattr(end, "synchronize"):
                end.synchronize()  # host sync (optimizer thread): a load still reads the old ``work``
        self.work.copy_(self.master)

    def _run_on_optimizer(self, fn, *args) -> Future:
        """``fn(*args)`` on the optimizer thread (FIFO), or here and now without workers."""
        if self.workers is not None:
            return self.workers.optimizer.submit(fn, *args)
        return _done(fn(*args))

    def discard_grads(self) -> None:
        """STEP of a skipped iteration: weights and AdamW state stay as they are; the gradients
        are thrown away so the next iteration does not accumulate onto them."""
        if self.offload:
            # The device buffer went back to the pool at OFFLOAD_GRADS and is zeroed by the next first
            # backward; master_grad is overwritten by the next OFFLOAD_GRADS's copy.
            self._norm_future = None
            self._grads_summed = False
            return
        self.grad.zero_()
        if self.master_grad is not self.grad:
            self.master_grad.zero_()
        self._grads_summed = False

    def wait_step(self) -> None:
        """Host wait for this stage's optimizer step and ``work`` refresh; re-raises their errors here."""
        for attr in ("_step_future", "_refresh_future"):
            future = getattr(self, attr)
            if future is not None:
                future.result()
                setattr(self, attr, None)

    # --- autograd's saved tensors -----------------------------------------------------------
    def saved_tensor_hooks(self):
        """Context for a forward of this stage: autograd saves views of the weights as
        (offset, size, stride) into the device buffer instead of the tensors, and rebuilds them
        from whatever buffer holds the weights at backward time. Without this, a DROP could not
        free the buffer (autograd would keep it alive) and, pooled, it would be overwritten
        by another stage's weights before this stage's backward read it."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        dev = self.dev
        if (dev is not None and t.device == dev.device and t.dtype == dev.dtype
                and t.untyped_storage().data_ptr() == dev.untyped_storage().data_ptr()):
            return (_WEIGHT_VIEW, t.size(), t.stride(), t.storage_offset() - dev.storage_offset())
        return t

    def _unpack(self, packed):
        if isinstance(packed, tuple) and packed and packed[0] is _WEIGHT_VIEW:
            _, size, stride, offset = packed
            if self.dev is None:
                raise RuntimeError(f"backward of the stage with {self.names[0]} while its weights are not loaded")
            return self.dev.as_strided(size, stride, self.dev.storage_offset() + offset)
        return packed

    # --- checkpoints ----------------------------------------------------------------------
    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 weights under their Hugging Face names (views into the master buffer)."""
        self.wait_step()
        # The second copy of a tied matrix is not saved: the first stage's is (as Hugging Face saves it)
        return {n: v for n, v in zip(self.names, self._views(self.master.detach()))
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
        flat = {k: torch.zeros(self.numel, dtype=torch.float32) for k in ("exp_avg", "exp_avg_sq")}
        step = None
        for group in self.optimizer.param_groups:
            for leaf in group["params"]:
                lo, st = self._leaf_offset(leaf), self.optimizer.state[leaf]
                step = st["step"]
                for k in flat:
                    flat[k][lo:lo + leaf.numel()].copy_(st[k])
        for k in flat:
            self.shard.exchange(flat[k])
        template = {k: v for k, v in self.optimizer.state_dict()["param_groups"][0].items()
                    if k not in ("params", "weight_decay")}
        state, groups, i = {}, [], 0
        for wd, ranges in self._leaf_ranges(0, self.numel):
            ids = []
            for lo, hi in ranges:
                state[i] = {"step": step.clone(), **{k: v[lo:hi].clone() for k, v in flat.items()}}
                ids.append(i)
                i += 1
            groups.append({**template, "weight_decay": wd, "params": ids})
        self._gathered = {"state": state, "param_groups": groups}

    def load_optimizer_state_dict(self, state: dict) -> None:
        """Restore what ``optimizer_state_dict`` returned for the same stage (same leaf views);
        sharded, this peer's range of it."""
        self.wait_step()
        if self.shard is None:
            self.optimizer.load_state_dict(state)
            return
        flat = {k: torch.zeros(self.numel, dtype=torch.float32) for k in ("exp_avg", "exp_avg_sq")}
        i, step = 0, None
        for _, ranges in self._leaf_ranges(0, self.numel):
            for lo, hi in ranges:
                st = state["state"][i]
                step = st["step"]
                for k in flat:
                    flat[k][lo:hi].copy_(st[k])
                i += 1
        for group in self.optimizer.param_groups:
            for leaf in group["params"]:
                lo, st = self._leaf_offset(leaf), self.optimizer.state[leaf]
                st["step"] = step.clone().to(dtype=torch.float32, device=leaf.device)
                for k in flat:
                    st[k].copy_(flat[k][lo:lo + leaf.numel()])
