"""What a run prints before it starts: the settings that differ from the defaults and where
the processes meet; no GPU advice on a CPU machine; --plan without torchrun."""
from __future__ import annotations

import subprocess
import sys

import pytest

from main import start_line
from pipeline.config import make_config
from pipeline.dist import DistEnv
from schedule.mapping import choose_mapping
from schedule.spec import ProgramSpec
from tests.helpers.paths import ROOT, env_without_dist


def test_start_line_lists_only_changed_settings_and_the_port(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29611")
    cfg = make_config({"batch_size": 16, "schedule": "gpipe"})
    lines = start_line(cfg, "fine_tune.yaml", DistEnv(0, 2, 0, 2)).splitlines()
    assert lines[0].startswith("run: 2 processes, rendezvous 127.0.0.1:29611; config fine_tune.yaml + flags, "
                               "2 settings differ from the defaults:")
    assert lines[1:] == ["  batch_size: 16", "  schedule: 'gpipe'"]


def test_no_topology_advice_without_gpus():
    choice = choose_mapping("planned", 2, ProgramSpec("interleaved", 4, 1, offload=True, prefetch=True),
                            rank_groups=None, stage_bytes=None, has_gpus=False)
    assert choice.reason == "mapping planned -> round_robin: no GPUs"


@pytest.mark.slow
def test_plan_through_train_sh_runs_no_torchrun(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "train.sh"), "--plan", "--save_dir", str(tmp_path)], cwd=ROOT,
                          env={**env_without_dist(), "NPROC": "2"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("host:") == 1 and "torch.distributed" not in proc.stderr
    assert "rank 1 actions" in proc.stdout and "rank 2 actions" not in proc.stdout


def _ctrl_c_when(proc: subprocess.Popen, ready, poll_s: float, delay_s: float = 0.0) -> None:
    """Ctrl-C to ``proc``'s process group (as a terminal sends it) once ``ready()`` (or 120 s), after
    ``delay_s`` more; wait for it to end, killing the group if it has not in 90 s."""
    import os
    import signal
    import time

    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not ready():
        time.sleep(poll_s)
    time.sleep(delay_s)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


@pytest.mark.slow
def test_ctrl_c_through_train_sh_after_launch_is_two_lines(tmp_path):
    """Ctrl-C (to the whole process group, as a terminal sends it) once the workers are being
    started: rank 0's line and the launcher's, exit 130, no traceback, nothing left running;
    a rank still waiting in the rendezvous leaves at once instead of after comm_timeout_s."""
    out = tmp_path / "log"
    with open(out, "w") as log:
        proc = subprocess.Popen(["bash", str(ROOT / "train.sh"), "--save_dir", str(tmp_path / "run")], cwd=ROOT,
                                env={**env_without_dist(), "MASTER_PORT": "29611"}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        _ctrl_c_when(proc, lambda: "run: " in out.read_text(), poll_s=0.2)
    text = out.read_text()
    assert proc.returncode == 130, text[-2000:]
    assert "Traceback" not in text, text[-3000:]
    assert text.rstrip().endswith("launcher: stopped by SIGINT"), text[-2000:]


_BUSY_IN_DEL = """
import os, sys, time
from pipeline.run import faults

def leave():
    sys.stderr.write("left\\n")
    return 130

class Busy:  # as a tokenizer's regex objects: Python code run by the collector, a signal landing inside
    def __del__(self):
        end = time.perf_counter() + 0.02
        while time.perf_counter() < end:
            pass

faults.leave_at_once_outside_steps(leave)
print("ready", flush=True)
try:
    while True:
        Busy()
except BaseException:
    if not faults.stop_seen():
        raise
    os._exit(130)
"""


@pytest.mark.slow
def test_stop_outside_steps_prints_no_traceback_from_a_destructor():
    """Ctrl-C outside the steps while the main thread runs a ``__del__``: the process leaves with
    its one line and exit 130, with no "Exception ignored ... KeyboardInterrupt" traceback (what a
    KeyboardInterrupt raised inside a destructor prints, the run then going on until the watch
    thread ends it)."""
    import signal
    import time

    for _ in range(2):
        proc = subprocess.Popen([sys.executable, "-c", _BUSY_IN_DEL], cwd=ROOT, env=env_without_dist(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "ready\n"
        time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130 and err == "left\n", err


@pytest.mark.slow
def test_launcher_prints_no_omp_notice():
    """torchrun's four-line OMP_NUM_THREADS notice (several workers, the variable unset) is not
    printed: a launch of two trivial workers says nothing."""
    env = {k: v for k, v in env_without_dist().items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run([sys.executable, "-m", "pipeline.launch", "--standalone", "--nproc_per_node", "2",
                           "--no-python", "true"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr.strip() == "" and proc.stdout.strip() == "", proc.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [0.3, 3.0])
def test_ctrl_c_while_workers_start_is_at_most_two_lines(tmp_path, delay_s):
    """Ctrl-C to train.sh's process group once the launcher runs (while it imports torch, or while
    its workers start), with OMP_NUM_THREADS unset as on a user's shell: rank 0's line if a worker
    had its handler, and the launcher's; no torchrun notice (OMP_NUM_THREADS, forwarded signals),
    no traceback."""
    env = {k: v for k, v in env_without_dist().items() if k != "OMP_NUM_THREADS"}
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen(["bash", str(ROOT / "train.sh"), "--save_dir", str(tmp_path / "run"),
                                 "--master_port", "29612"], cwd=ROOT, env=env, stdout=out, stderr=err,
                                start_new_session=True)
        _ctrl_c_when(proc, lambda: bool(subprocess.run(["pgrep", "-g", str(proc.pid), "-f", "pipeline.launch"],
                                                       capture_output=True).stdout), poll_s=0.05, delay_s=delay_s)
    lines = [line for line in (tmp_path / "err").read_text().splitlines() if line.strip()]
    assert proc.returncode == 130, lines
    assert lines[-1] == "launcher: stopped by SIGINT" and len(lines) <= 2, lines
    assert lines[:-1] in ([], ["error: interrupted by Ctrl-C (SIGINT) outside the training steps; no checkpoint "
                               "was written by this stop"]), lines


def _port_in_time_wait() -> int:
    """A port whose only socket is in TIME-WAIT, as a run's rendezvous leaves it: the server side
    closed first, and its socket had SO_REUSEADDR (as torch's TCPStore sets it, so that the next
    store, which sets it too, may bind beside the TIME-WAIT socket; a plain bind may not)."""
    import socket

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()
    client.close()
    server.close()
    with socket.socket() as probe:
        with pytest.raises(OSError):  # what the old check tried: a plain bind, refused here
            probe.bind(("127.0.0.1", port))
    return port


@pytest.mark.slow
def test_train_sh_launch_flags_take_effect(tiny_model_dir, tmp_path):
    """--nproc and --master_port are train.sh's (over NPROC and MASTER_PORT), and a port in TIME-WAIT
    has no listener: the run starts on it."""
    port = _port_in_time_wait()
    proc = subprocess.run(["bash", str(ROOT / "train.sh"), "--nproc", "1", "--master_port", str(port), "--model",
                           str(tiny_model_dir), "--num_stages", "2", "--seq_length", "64", "--num_iterations", "1",
                           "--no_save_model", "--save_dir", str(tmp_path / "run")], cwd=ROOT,
                          env={**env_without_dist(), "NPROC": "2", "MASTER_PORT": "29999"}, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"run: 1 process, rendezvous 127.0.0.1:{port}; " in proc.stdout, proc.stdout[:2000]
    assert "nproc" not in proc.stdout.split("mapping")[0]  # train.sh's flags are not main.py's settings
