"""Bad input through main.py and train.sh as a user launches them (two processes under torchrun,
one process, train.sh with a port in use): one error line from one rank, a non-zero exit, no
traceback, before any training (the configuration itself: tests/one_process/test_config.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT, env_without_dist, scratch_save_dir


def _main(args, nproc: int = 1):
    args = ["--save_dir", scratch_save_dir(), *args]
    if nproc == 1:
        cmd = [sys.executable, str(ROOT / "main.py"), "--config", "", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(ROOT / "main.py"), "--config", "", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env_without_dist(), capture_output=True, text=True, timeout=180)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("args,needle", [
    (["--num_stages", "3"], "num_stages (3) must be a positive multiple of the number of processes (2)"),
    (["--batch_size", "6", "--num_chunks", "4"], "batch_size (6) must be divisible by num_chunks (4)"),
    (["--seq_length", "1"], "seq_length (1) must be at least 2"),
    (["--device", "cuda"], "no CUDA GPU is visible"),
    (["--model", "/nonexistent/model"], "/nonexistent/model does not exist"),
    (["--dataset", "/nonexistent/data.jsonl"], "/nonexistent/data.jsonl': no such file or directory"),
    (["--num_stages", "12"], "exceeds the model's decoder layers + 2"),
    (["--embedding_dim", "99"], "embedding_dim=99 contradicts the model's hidden_size=64"),
    (["--resident_stages", "2"], "resident_stages (2) must be -1 (auto) or 0..1 (the stages per process)"),
])
@pytest.mark.slow
def test_bad_input_one_line_from_one_rank(tiny_model_dir, args, needle):
    base = ["--model", str(tiny_model_dir), "--num_stages", "2", "--device", "cpu", "--num_iterations", "1",
            "--no_save_model", "--seq_length", "32"]
    proc = _main(base + args, nproc=2)
    assert proc.returncode != 0
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr[-2000:]
    assert needle in lines[0], lines[0]
    assert "Traceback" not in proc.stdout


@pytest.mark.slow
def test_missing_columns(tiny_model_dir, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"article": "a", "highlights": "b"}\n' * 20)
    proc = _main(["--model", str(tiny_model_dir), "--dataset", str(data), "--num_stages", "2",
                  "--device", "cpu", "--no_save_model"])
    assert proc.returncode == 2
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and "document" in lines[0], proc.stderr[-2000:]


@pytest.mark.slow
def test_port_in_use_is_reported_by_train_sh(tiny_model_dir):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {**env_without_dist(), "MASTER_PORT": str(port), "NPROC": "2"}
        proc = subprocess.run(["bash", str(ROOT / "train.sh"), "--model", str(tiny_model_dir),
                               "--save_dir", scratch_save_dir()], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2
    assert _error_lines(proc.stderr) == [f"error: master_port {port} is in use; set master_port in fine_tune.yaml, "
                                         f"--master_port <port> or MASTER_PORT=<free port>"], proc.stderr[-2000:]
