"""The device side of a rank's stores: the compute stream with its load and offload side streams
(each with one producing thread, ``offload.owners``), points in time on them, the pool of device
buffers the offloaded stages share, and page-locked host buffers. On the CPU the streams are
no-ops and their checks still run."""
from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Protocol

import torch

from offload import owners, slices


def flat_views(flat: torch.Tensor, shapes) -> Iterator[torch.Tensor]:
    """Views of consecutive ranges of ``flat`` with ``shapes``: a stage's tensors in one buffer."""
    off = 0
    for shape in shapes:
        n = shape.numel()
        yield flat[off:off + n].view(shape)
        off += n


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised host tensor of ``numel`` elements, page-locked with ``pin``.

    torch's pinned allocator rounds every block up to a power of two: a 7B model's 16 stage masters
    of 1.6 GB take 2 GiB each, and the host memory of an offloaded run grows by a third over what
    the plan counts (enough to be killed on a 128 GiB host). So an ordinary allocation's pages are
    registered with CUDA instead, exactly, and unregistered when the tensor object goes; views of
    it (the optimizer's leaves) must not outlive it, which holds since the store keeps it.
    """
    return page_lock(torch.empty(numel, dtype=dtype), pin)


def page_lock(t: torch.Tensor, on: bool) -> torch.Tensor:
    """``t`` (a whole host allocation) with its pages registered with CUDA when ``on``, until the
    tensor object goes (``host_empty``; the mappings of ``offload.shared``)."""
    if on and t.numel():
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(t.data_ptr(), t.nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {t.nbytes / 2**30:.2f} GiB failed ({err}): host memory is "
                               "short or locked-memory limits are low (ulimit -l)")
        weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return t


class HostBuffers:
    """Page-locked host buffers of exact sizes (``host_empty``), reused: what one stream's copies to
    and from the device go through (the activation stash, the carried keys/values). torch's pinned
    allocator would round each block up to a power of two (a 3B layer's 131072-token input of 800
    MiB takes 1 GiB, and a host that holds every stage's input holds a quarter more).

    A request takes the smallest free buffer that holds it (a view of its first elements), else a
    new one, and then the smallest free buffer goes: batches of other widths reuse the buffers of
    the widest, and a width no longer asked for does not keep its buffers. A buffer given back is
    taken again only by a later copy issued on the same stream, which stream order puts after the
    copy that last read it: so it may be given back as soon as that copy is issued, with the
    copy's end event (``after``), which the host waits for before the buffer is let go. One
    instance per stream, used from one thread."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._free: dict[torch.dtype, list[tuple[torch.Tensor, object]]] = {}  # (buffer, its last copy's event)
        self._whole: dict[int, torch.Tensor] = {}  # data_ptr -> the registered allocation a view is of

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        numel = torch.Size(shape).numel()
        free = self._free.setdefault(dtype, [])
        # By index: ``list.remove`` would compare the entries' tensors with ``==``, elementwise.
        fits = [i for i, (buf, _) in enumerate(free) if buf.numel() >= numel]
        if fits:
            flat = free.pop(min(fits, key=lambda i: free[i][0].numel()))[0]
        else:
            if free:  # narrower than what is asked for now: let it go, once its last copy is done
                _, done = free.pop(min(range(len(free)), key=lambda i: free[i][0].numel()))
                if done is not None:
                    done.synchronize()  # host sync: only when the widest request grows
            flat = host_empty(numel, dtype, self.pin)
        self._whole[flat.data_ptr()] = flat
        return flat[:numel].view(shape)

    def give(self, t: torch.Tensor, after=None) -> None:
        """``t`` (from ``take``) back, to be taken by a later copy; ``after``: the end event of
        the copy that last read or wrote it (None on the CPU)."""
        flat = self._whole.pop(t.data_ptr())
        self._free.setdefault(flat.dtype, []).append((flat, after))

    def held_bytes(self) -> int:
        """Bytes of every buffer made and not let go, given back or not."""
        return sum(t.nbytes for t in self._whole.values()) + \
            sum(t.nbytes for free in self._free.values() for t, _ in free)


class Streams:
    """The compute stream plus side streams for loads, gradient offloads and device steps of
    offloaded stages (CUDA only), each with one producing host thread (``producer``): the thread
    that made them, until ``hand_to`` gives one to another. Every method that enqueues on a
    stream checks it under ``CHECK_THREADS``, on the CPU too, where the streams are no-ops."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            # Loads gate the next compute: give them priority over gradient offloads.
            self.load = torch.cuda.Stream(device, priority=-1)
            self.offload = torch.cuda.Stream(device, priority=0)
            # a device step's copies and kernels (``offload.offloaded``), apart from the offloads:
            # without clipping it runs during the backward, whose later offloads must not queue behind it
            self.step = torch.cuda.Stream(device, priority=0)
        self.device = device
        self._chunks: dict[str, list[torch.Tensor]] = {}  # stream -> its fp32 chunk buffers (``_chunk_buffers``)
        me = threading.current_thread()
        self.producer: dict[str, threading.Thread] = {"compute": me, "load": me, "offload": me, "step": me}
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
        if owners.CHECK_THREADS:
            owners.assert_owner(self.producer[which], f"the {which} stream")

    def staging(self, numel: int) -> torch.Tensor:
        """The load stream's fp32 buffer: a master chunk lands here and is converted into the
        stage's device buffer (``_chunk_buffers``)."""
        return self._chunk_buffers("load", numel, 1)[0]

    def step_buffers(self, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step stream's two fp32 buffers for a device-stepped stage: a chunk of its masters
        and of its gradient lands in them, AdamW updates the first, which goes back out
        (``_chunk_buffers``)."""
        first, second = self._chunk_buffers("step", numel, 2)
        return first, second

    def _chunk_buffers(self, which: str, numel: int, count: int) -> list[torch.Tensor]:
        """``count`` fp32 buffers of stream ``which`` (one set per rank, ``min(MASTER_SLICE_NUMEL,
        numel)`` elements for the largest stage served). Made, used and replaced only by the
        stream's producer, on the stream, so stream order alone keeps one chunk's use before the next."""
        self._use(which)
        want = min(slices.MASTER_SLICE_NUMEL, numel)
        have = self._chunks.get(which)
        if have is None or have[0].numel() < want:
            with self.on(which):
                have = self._chunks[which] = [torch.empty(want, dtype=torch.float32, device=self.device)
                                              for _ in range(count)]
        return have

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


class BufferPool:
    """Reuses device buffers across stages and iterations instead of re-allocating them.

    A returned buffer carries the event after which its last user is done; whoever takes it
    next makes its own stream wait on that event before writing, so no host sync is needed."""

    def __init__(self, device: torch.device):
        self.device = device
        self._free: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, object]]] = {}

    def take(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, object]:
        """A buffer and the event its writer must wait for. A new one is made on this thread's
        current stream, whose queued kernels may still use its memory: the caching allocator
        hands freed memory out at once, ordered by that stream alone. A LOAD writes the buffer on
        the load stream, so that write waits for this point of the allocating stream; else it
        could land under activations the compute stream's queued kernels still read and write."""
        free = self._free.get((numel, dtype))
        if free:
            return free.pop()
        buf = torch.empty(numel, dtype=dtype, device=self.device)
        ready = torch.cuda.current_stream(self.device).record_event() if self.device.type == "cuda" else None
        return buf, ready

    def give(self, buf: torch.Tensor, done_event) -> None:
        self._free.setdefault((buf.numel(), buf.dtype), []).append((buf, done_event))

    def clear(self) -> None:
        self._free.clear()


__all__ = ["BufferPool", "Clock", "Streams", "flat_views", "host_empty", "time_point"]
