"""The host threads of an offloading rank (``Workers``): the optimizer thread and the loader thread,
which issues every LOAD's copy (``Loader``), and what passes between them: a step's progress
chunk by chunk (``StepProgress``), a load's span (``LoadSpan``)."""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Generator, NamedTuple

import torch


class Loader:
    """The load stream's one producer, the ``param-loader`` thread: it issues every LOAD's copy,
    each chunk as soon as its source is written, in LOAD order, except that a load still waiting
    for a step never delays one whose source is ready: a job is a generator that issues what it
    can and yields where it must wait; ``poke`` says that something it waits for may have changed.

    One thread for all loads, also those that need not wait (the main thread could issue those
    itself): the staging buffer and the stream order of the chunks then need no lock, and the
    stream has one producer to reason about. The cost is one thread hand-off per LOAD (tens of
    microseconds): with prefetch it is hidden behind the compute before the stage's; without, the
    copy starts that much later."""

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


def run_through(job: Generator):
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


def done(value) -> Future:
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


__all__ = ["LoadSpan", "Loader", "StepProgress", "Workers", "done", "run_through"]
