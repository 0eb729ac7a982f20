"""main.py under torchrun as a user starts it, read line by line as it prints, and the state of
its workers: for the tests that stop, kill or resume a run."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.helpers.paths import ROOT, env_without_dist


class Launched:
    """A process whose stdout and stderr threads read as they come: a wait for a line ends at its
    deadline (a ``readline`` on the pipe blocks as long as the process prints nothing, past any
    deadline), and neither pipe fills up and stops the writer while the test waits on the other."""

    def __init__(self, cmd: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.pid = self.proc.pid
        self.out: list[str] = []
        self.err: list[str] = []
        self._cv = threading.Condition()
        self._out_done = False
        self._readers = [threading.Thread(target=self._read, args=(stream, buf), daemon=True)
                         for stream, buf in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self._readers:
            t.start()

    def _read(self, stream, buf: list[str]) -> None:
        for line in stream:
            with self._cv:
                buf.append(line)
                self._cv.notify_all()
        with self._cv:
            if buf is self.out:
                self._out_done = True
            self._cv.notify_all()

    @property
    def returncode(self):
        return self.proc.returncode

    def wait_for_line(self, pattern: str, timeout: float) -> list[str]:
        """stdout up to the first line matching ``pattern``; kills the run and fails if none comes
        within ``timeout`` seconds or stdout ends first."""
        deadline, seen = time.monotonic() + timeout, 0
        with self._cv:
            while True:
                for i in range(seen, len(self.out)):
                    if re.search(pattern, self.out[i]):
                        return self.out[:i + 1]
                seen = len(self.out)
                left = deadline - time.monotonic()
                if self._out_done or left <= 0:
                    break
                self._cv.wait(left)
        self.kill()
        for t in self._readers:
            t.join(timeout=10)  # what the process wrote before it ended, for the message
        with self._cv:
            out, err = "".join(self.out), "".join(self.err)
        raise AssertionError(f"no line matching {pattern!r} within {timeout:g}s (exit code {self.returncode}) in "
                             f"the output:\n{out}\n{err[-3000:]}")

    def communicate(self, timeout: float) -> tuple[str, str]:
        """Wait for the exit (killing the run after ``timeout`` seconds, which fails the test) and
        return all of stdout and stderr."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        joined_by = time.monotonic() + 30  # a worker left behind may hold the pipes open: not forever
        for t in self._readers:
            t.join(timeout=max(0.0, joined_by - time.monotonic()))
        with self._cv:
            return "".join(self.out), "".join(self.err)

    def kill(self) -> None:
        # torchrun's workers may sit in sessions of their own: kill them by pid, or they keep the pipes open
        for pid in worker_pids(self.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def launch(args: list[str], extra_env: dict[str, str] | None = None) -> Launched:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "main.py"), "--config", "", *args]
    return Launched(cmd, {**env_without_dist(), **(extra_env or {})})


def wait_for_line(proc: Launched, pattern: str, timeout: float) -> list[str]:
    return proc.wait_for_line(pattern, timeout)


def worker_pids(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, timeout=30).stdout
    return [int(p) for p in out.split()]


def alive(pid: int) -> bool:
    """Running, not a zombie (a reparented worker may wait for a PID 1 that does not reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
