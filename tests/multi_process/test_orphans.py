"""pipeline/run/orphans.py: a worker whose launcher dies gets SIGTERM, from the kernel (parent-death
signal) or, where that is not to be had, from its watching thread, and says why once. The whole
run under torchrun: tests/multi_process/test_resume.py::test_workers_stop_when_their_launcher_is_killed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.launch import alive
from tests.helpers.paths import ROOT, env_without_dist

# The launcher: starts the worker, prints its pid, then waits to be killed.
LAUNCHER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=sys.stdout, stderr=sys.stderr)
print(child.pid, flush=True)
time.sleep(600)
"""
# The worker: watches its launcher; a SIGTERM outside a training step ends it (as it would a
# worker at start-up). ``kernel`` False: as on a system without prctl, the thread signals.
WORKER = """
import time
from pipeline.run import orphans
if not {kernel}:
    orphans._ask_kernel = lambda: False
orphans.watch(poll_s=0.1)
print("watching", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.parametrize("kernel", [True, False])
def test_a_worker_stops_when_its_launcher_is_killed(kernel):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, WORKER.format(kernel=kernel)], cwd=ROOT,
                                env=env_without_dist(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    worker = int(launcher.stdout.readline())
    try:
        assert launcher.stdout.readline() == "watching\n"
        launcher.kill()
        launcher.wait(timeout=30)
        t0 = time.monotonic()
        while alive(worker) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert not alive(worker), "the worker outlived its launcher"
    finally:
        if alive(worker):
            os.kill(worker, signal.SIGKILL)
    err = launcher.stderr.read()
    assert err == f"[rank 0] warning: the launcher (pid {launcher.pid}) has died; this worker stops: a training " \
                  "step in progress finishes and saves a checkpoint, anything else ends at once\n", err
