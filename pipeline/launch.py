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


def main(argv: list[str]) -> int:
    try:
        from pipeline.run.orphans import LAUNCHER_PID_ENV

        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the workers stop when this process dies
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import main as torchrun

        for logger, words in _QUIET.items():
            _quiet(logger, words)
        try:
            torchrun(argv)
        except SignalException as e:
            sys.stderr.write(f"launcher: stopped by {signal.Signals(e.sigval).name}\n")
            return 128 + int(e.sigval)
        except ChildFailedError as e:
            rank, failure = e.get_first_failure()
            sys.stderr.write(f"launcher: rank {rank} exited with code {failure.exitcode} (its message is above)\n")
            return failure.exitcode if 0 < failure.exitcode < 256 else 1
    except KeyboardInterrupt:  # before torchrun's own handler was in place; any worker got the signal too
        sys.stderr.write("launcher: stopped by SIGINT\n")
        return 128 + signal.SIGINT
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
