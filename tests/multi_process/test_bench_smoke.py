"""The benchmark scripts run end to end on the CPU, as subprocesses (bench/long_rows.py through
main.py and FSDP2 on gloo; bench/profile_step.py): their plumbing, JSON, tables and traces (their
pure parts: tests/pure/test_bench.py)."""
from __future__ import annotations

import sys

import pytest

from tests.helpers.paths import ROOT


@pytest.mark.slow
def test_long_rows_smoke_runs_on_the_cpu(tmp_path):
    """The bench's plumbing end to end on a CPU: this project's rows through main.py (whole rows
    and segments), FSDP2 on gloo, RoundPipe skipped; the JSON and the table written."""
    import json
    import subprocess

    from tests.helpers.paths import env_without_dist

    proc = subprocess.run([sys.executable, str(ROOT / "bench/long_rows.py"), "--smoke", "--out", str(tmp_path),
                           "--rows", "ours@128,ours@256/seg4,fsdp2@128,roundpipe@128"], cwd=ROOT,
                          env=env_without_dist(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {r["row"]: r for r in json.loads((tmp_path / "long_rows.json").read_text())["rows"]}
    assert [rows[r]["status"] for r in ("ours@128", "ours@256/seg4", "fsdp2@128")] == ["ok"] * 3, rows
    assert rows["ours@256/seg4"]["seq_chunks"] == 4 and rows["ours@128"]["step_time_s"] > 0
    assert rows["roundpipe@128"]["status"] == "skipped (needs CUDA)"
    assert "| ours@256/seg4 | ok |" in (tmp_path / "long_rows.md").read_text()


@pytest.mark.slow
def test_profile_step_smoke_runs_on_the_cpu(tmp_path):
    """The profiler's plumbing on a CPU: warm-up steps, one recorded step, its table and trace."""
    import json
    import subprocess

    from tests.helpers.paths import env_without_dist

    proc = subprocess.run([sys.executable, str(ROOT / "bench/profile_step.py"), "--smoke", "--warmup", "1",
                           "--out", str(tmp_path)], cwd=ROOT, env=env_without_dist(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "profile.json").read_text())
    assert result["step_s"] > 0 and result["model_flops"] > 0 and result["kinds"]["matmul"] > 0
    assert sum(v for k, v in result["kinds"].items() if k != "idle") > 0.5 * result["step_s"]
    assert (tmp_path / "trace.json").stat().st_size > 0 and "| **step (wall)** |" in (tmp_path / "profile.md").read_text()
