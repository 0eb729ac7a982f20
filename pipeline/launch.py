"""train.sh's launcher: torchrun itself, with its two tracebacks turned into one line each.

torchrun answers a Ctrl-C (or SIGTERM) by raising ``SignalException`` and a worker that exited
non-zero by raising ``ChildFailedError``; both reach the terminal as tracebacks of the launcher,
below the line the workers already printed. The workers stop on their own: a signal during
training ends the step and saves a checkpoint, one before it leaves with one line (main.py).
"""
from __future__ import annotations

import os
import signal
import sys

from pipeline.run.orphans import LAUNCHER_PID_ENV


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the workers stop when this process dies
    try:
        torchrun(argv)
    except SignalException as e:
        sys.stderr.write(f"launcher: stopped by {signal.Signals(e.sigval).name}\n")
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        sys.stderr.write(f"launcher: rank {rank} exited with code {failure.exitcode} (its message is above)\n")
        return failure.exitcode if 0 < failure.exitcode < 256 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
