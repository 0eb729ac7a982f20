"""train.sh's launcher: torchrun itself, with its two tracebacks turned into one line each and
its notices that ask nothing of the user left out.

torchrun answers a Ctrl-C (or SIGTERM) by raising ``SignalException`` and a worker that exited
non-zero by raising ``ChildFailedError``; both reach the terminal as tracebacks of the launcher,
below the line the workers already printed. The workers stop on their own: a signal during
training ends the step and saves a checkpoint, one before it leaves with one line (main.py).
"""
from __future__ import annotations

import os
import signal
import sys

# The rest is imported inside main's try: a Ctrl-C while it imports (torch: seconds) is one line.

# torchrun's warnings that say nothing to act on: the OMP_NUM_THREADS=1 it sets for several
# workers (four lines on every run; the workers size their own thread pools, see offload/cpus.py),
# and the three lines of a signal forwarded to the workers (the launcher's own line says it).
_QUIET = {"torch.distributed.run": "Setting OMP_NUM_THREADS",
          "torch.distributed.elastic.agent.server.api": "death signal",
          "torch.distributed.elastic.multiprocessing.api": "closing signal"}


def _quiet(logger: str, words: str) -> None:
    import logging

    logging.getLogger(logger).addFilter(lambda record: words not in str(record.msg))


_signals: list[int] = []  # SIGINT/SIGTERM that came while the launcher imported torch
_stopped: list[int] = []  # the signal the launcher stopped on, once its line is written


def _remember(signum: int, frame) -> None:
    # While importing, a KeyboardInterrupt can be raised inside importlib's own callbacks, which
    # print it as "Exception ignored" and go on: the Ctrl-C was lost and training started.
    _signals.append(signum)


def _stop(sig: int) -> int:
    """The launcher stops on ``sig``: its one line (once), and no later signal can end it by the
    signal (exit -2) instead of 128 + the signal's number: SIGINT and SIGTERM are ignored from here
    (the workers have theirs; a terminal's second Ctrl-C or a signal tripped twice would land while
    it exits)."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    if not _stopped:
        _stopped.append(sig)
        sys.stderr.write(f"launcher: stopped by {signal.Signals(sig).name}\n")
    return 128 + int(_stopped[0])


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, _remember)
    signal.signal(signal.SIGTERM, _remember)
    try:
        from pipeline.run.orphans import LAUNCHER_PID_ENV

        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the workers stop when this process dies
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import main as torchrun

        for logger, words in _QUIET.items():
            _quiet(logger, words)
    finally:
        # as Python starts: a Ctrl-C raises KeyboardInterrupt, SIGTERM ends the process, until torchrun's own
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if _signals:  # before any worker was started
        return _stop(_signals[0])
    try:
        torchrun(argv)
    except SignalException as e:
        return _stop(e.sigval)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        sys.stderr.write(f"launcher: rank {rank} exited with code {failure.exitcode} (its message is above)\n")
        return failure.exitcode if 0 < failure.exitcode < 256 else 1
    except KeyboardInterrupt:  # before torchrun's own handler was in place; any worker got the signal too
        return _stop(signal.SIGINT)
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except KeyboardInterrupt:  # a signal tripped while the launcher was already stopping on one
        code = _stop(signal.SIGINT)
    sys.exit(code)
