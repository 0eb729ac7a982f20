"""Stopping a run cleanly on SIGINT/SIGTERM.

The handler only records the signal: whatever the rank is doing (a forward, a send, an
optimizer step on a worker thread) runs to the end of the step. At the end of every step the
ranks agree on whether any of them was signalled (one tiny all-reduce), so every rank stops
after the same step, saves the same checkpoint and exits 0. torchrun forwards SIGTERM/SIGINT
to every worker, but not at the same instant, which is why the agreement is needed.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Callable

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Context manager: while inside, SIGINT/SIGTERM set a flag instead of ending the process.

    A repeated signal changes nothing (a terminal's Ctrl-C reaches the workers directly and
    again through torchrun); the previous handlers come back on exit."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopRequest":
        # Python delivers signals to the main thread only; elsewhere (a test runner's worker
        # thread) there is nothing to install and a signal keeps its old meaning.
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        # Only set a flag: no I/O here (a print could re-enter the stdout buffer the
        # interrupted code was writing to).
        if not self.signum:
            self.signum = signum

    def agreed(self, device: torch.device) -> int:
        """The signal number if any rank was signalled (the largest), else 0. Collective: every
        rank calls it once at the end of each step."""
        if not dist.is_initialized():
            return self.signum
        # NCCL reduces device tensors only; gloo host tensors.
        dev = device if dist.get_backend() == "nccl" else torch.device("cpu")
        flag = torch.tensor([self.signum], dtype=torch.int32, device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())  # host sync: once per step, after the step's own end-of-step sync


_seen: list[int] = []  # stop signals taken outside the steps, by _record


def _record(signum: int, frame) -> None:
    # The main thread raises nothing: a KeyboardInterrupt raised inside a ``__del__`` (a
    # tokenizer's regex, say) is printed as "Exception ignored" with a traceback, and the code it
    # interrupted goes on. The watch thread below ends the process instead.
    _seen.append(signum)


def stop_seen() -> bool:
    """Whether a stop signal came outside the steps: an error the main thread meets after it (a
    peer that left on the same Ctrl-C and broke the connection) is that stop, not a failure."""
    return bool(_seen)


def leave_at_once_outside_steps(leave: Callable[[], int]) -> None:
    """From now on a stop signal outside the training steps ends this process at once with
    ``leave()``'s exit code (after its line), from a thread the signal wakes
    (``signal.set_wakeup_fd``): the main thread may be waiting inside C++, in a start-up
    collective with a peer that has already left, where Python's handler would run only when the
    wait times out (``comm_timeout_s``). The main thread's handler only records the signal
    (``stop_seen``). Inside the steps a ``StopRequest`` takes the signal and the thread leaves it
    be. Call from the main thread, once."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    for sig in STOP_SIGNALS:
        signal.signal(sig, _record)

    def watch() -> None:
        while True:
            signum = os.read(read, 1)[0]
            taker = getattr(signal.getsignal(signum), "__self__", None)
            if signum in STOP_SIGNALS and not isinstance(taker, StopRequest):
                os._exit(leave())

    threading.Thread(target=watch, name="stop-signal-watch", daemon=True).start()


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
