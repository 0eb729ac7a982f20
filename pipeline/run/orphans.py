"""A torchrun worker stops when its launcher dies.

torchrun (and ``python -m pipeline.launch``, which runs torchrun in its own process) starts each
worker as its child, in a session of its own. Killed with SIGKILL, the launcher forwards no
signal: its workers would be reparented to PID 1 and train on, unsupervised, holding their GPUs.
So each worker asks the kernel for SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``,
Linux), and a thread watches the parent pid as a fallback (another system, or a launcher that
died before the request). SIGTERM then means what it means from torchrun: a training step in
progress finishes and saves a checkpoint (``faults.StopRequest``); anywhere else the worker exits
at once, and nothing it leaves half-written is taken for finished (every output and checkpoint
is renamed into place once complete). Each worker says why on stderr.

Only the standard library: ``watch`` runs before torch is imported.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# pipeline.launch exports its pid: a worker whose launcher died before the worker looked at its
# parent would otherwise take PID 1 (or a subreaper) for it.
LAUNCHER_PID_ENV = "MMOC_LAUNCHER_PID"

_launcher = 0         # the pid this worker's parent had at start; 0: not watching
_kernel_signals = False  # prctl took: the kernel sends the SIGTERM, the thread only reports
_report_lock = threading.Lock()
_reported = False


def watch(poll_s: float = 0.5) -> None:
    """Stop this process (SIGTERM) when its parent, the launcher, dies; say why on stderr.
    Call once, from the main thread, at the start of a worker."""
    global _launcher, _kernel_signals
    _launcher = int(os.environ.get(LAUNCHER_PID_ENV) or 0) or os.getppid()
    signal.signal(signal.SIGTERM, _on_sigterm)
    _kernel_signals = _ask_kernel()
    if launcher_gone():  # it died before the request, which then never fires
        _kernel_signals = False
    threading.Thread(target=_poll, args=(poll_s,), name="launcher-watch", daemon=True).start()


def launcher_pid() -> int | None:
    """The launcher's pid (None when not watching: no torchrun)."""
    return _launcher or None


def launcher_gone() -> bool:
    """Whether this worker's launcher has died (its parent is no longer the launcher)."""
    return bool(_launcher) and os.getppid() != _launcher


def _ask_kernel() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def report() -> None:
    """Say on stderr, once, that the launcher died, if it did (also at the worker's exit: a step
    may end, its checkpoint be saved and the worker exit before the watching thread looks)."""
    if launcher_gone():
        _report()


def _poll(poll_s: float) -> None:
    while not launcher_gone():
        time.sleep(poll_s)
    _report()
    if not _kernel_signals:
        os.kill(os.getpid(), signal.SIGTERM)


def _report() -> None:
    """One line on stderr, once per process (the thread and the handler may both get here)."""
    global _reported
    with _report_lock:
        if _reported:
            return
        _reported = True
    rank = os.environ.get("RANK", "0")
    # os.write: the handler may run while the main thread is inside sys.stderr's buffer
    os.write(2, f"[rank {rank}] warning: the launcher (pid {_launcher}) has died; this worker stops: a training "
                f"step in progress finishes and saves a checkpoint, anything else ends at once\n".encode())


def _on_sigterm(signum: int, frame) -> None:
    """SIGTERM outside the training steps (StopRequest handles it inside): say why when the
    launcher is gone, then end as SIGTERM ends a process."""
    report()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
