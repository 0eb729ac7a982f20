"""``main.py --plan`` as a user runs it, no torchrun: every rank's actions and the memory
verdict for a 13B run on four GPUs, and a GPU plan on a machine without one (one error line,
or with the choice given, a verdict that says it was not checked)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT, env_without_dist


@pytest.mark.slow
def test_plan_cli_prints_every_rank_and_the_verdict():
    cmd = [sys.executable, str(ROOT / "main.py"), "--config", "", "--plan", "--model", "llama-2-13b", "--nproc", "4",
           "--num_stages", "8", "--batch_size", "64", "--num_chunks", "16", "--seq_length", "512", "--device", "cuda",
           "--use_offload", "--activation_checkpointing", "--gpu_memory_gb", "24"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env_without_dist(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "stage -> rank: [0, 1, 2, 3, 0, 1, 2, 3]" in out
    assert "decoder layers per stage: [" in out and "(partition cost: predicted step " in out
    assert all(f"rank {r} actions:" in out for r in range(4))
    assert "GPU:" in out and "fits" in out


@pytest.mark.slow
def test_plan_for_a_gpu_on_a_machine_without_one():
    cmd = [sys.executable, str(ROOT / "main.py"), "--config", "", "--plan", "--device", "cuda", "--model",
           "llama-2-7b", "--nproc", "2", "--use_offload"]
    env = {**env_without_dist(), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and proc.stdout == "" and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: --plan --device cuda without a visible GPU needs gpu_memory_gb"), lines[0]
    # with the choice made, a plan whose GPU verdict says it was not checked
    proc = subprocess.run(cmd + ["--resident_stages", "0"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "not checked (no GPU visible; gpu_memory_gb sets the card's size)" in proc.stdout
