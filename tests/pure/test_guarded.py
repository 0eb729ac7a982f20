"""bench/guarded.py: a bench row's process group ends at its time limit, or when the host's
available memory falls under the floor, and its log says which; a row that ends by itself keeps
its exit status and output."""
from __future__ import annotations

import sys

from tests.helpers.bench import load_bench

guarded = load_bench("guarded")


def test_a_row_that_ends_keeps_its_status_and_output(tmp_path):
    got = guarded.run_guarded([sys.executable, "-c", "print('hello'); raise SystemExit(3)"], {}, 30, tmp_path / "a.log",
                              header="$ cmd\n")
    assert (got.rc, got.timed_out, got.host_stopped) == (3, False, False)
    assert got.log == "$ cmd\nhello\n" == (tmp_path / "a.log").read_text()


def test_a_row_past_its_time_is_killed_with_its_children(tmp_path):
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
            "print('started', flush=True); time.sleep(60)"
    got = guarded.run_guarded([sys.executable, "-c", child], {}, 1.0, tmp_path / "b.log", poll_s=0.1)
    assert got.rc == -9 and got.timed_out and got.wall_s < 20
    assert got.log.startswith("started") and got.log.rstrip().endswith(f"{guarded.TIMED_OUT} of 1s]")


def test_a_row_is_stopped_when_the_host_runs_short(tmp_path, monkeypatch):
    """The floor is read against the host's memory: a floor above what is available stops the row."""
    got = guarded.run_guarded([sys.executable, "-c", "import time; time.sleep(60)"], {}, 30, tmp_path / "c.log",
                              floor=1.01, poll_s=0.1)
    assert got.rc == -9 and got.host_stopped and not got.timed_out
    assert got.log.rstrip().endswith(f"{guarded.HOST_STOPPED} 101% available]")
    assert not guarded.host_short(0.0)
