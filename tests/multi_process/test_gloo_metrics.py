"""L2: validation and non-finite steps over torchrun and gloo: the validation loss of two
processes equals a single-process Hugging Face computation on the same batches, and too many NaN
steps in a row stop every rank with one error line (in one process:
tests/one_process/test_metrics.py)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.images import png_size
from tests.helpers.metrics import EVAL_BATCHES, hf_eval_loss, metrics_cfg, read_rows


@pytest.mark.slow
def test_torchrun_eval_matches_hf(tiny_model_dir, tmp_path):
    from tests.helpers.runs import cli_flags, run_torchrun

    cfg = metrics_cfg(tiny_model_dir, tmp_path, schedule="1f1b", eval_every=2, eval_batches=EVAL_BATCHES,
                      save_params=True)
    proc = run_torchrun(2, cli_flags(cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_rows(tmp_path / "metrics.jsonl")
    ev = [r for r in rows if r["kind"] == "eval"]
    assert len(ev) == 1 and ev[0]["step"] == 2
    params = torch.load(tmp_path / "params.pt", weights_only=True)
    assert ev[0]["loss"] == pytest.approx(hf_eval_loss(tiny_model_dir, params, cfg), rel=1e-5)
    assert len(rows[-1]["peak_mem_bytes_per_rank"]) == 2  # gathered from both ranks
    assert png_size(tmp_path / "metrics.png") == (1200, 960)
    assert not [line for line in proc.stdout.splitlines() if line.startswith("[rank")]  # only the loss rank speaks


@pytest.mark.slow
def test_torchrun_stops_after_too_many_nan_steps(tiny_model_dir, tmp_path, monkeypatch):
    from tests.helpers.runs import cli_flags, run_torchrun

    # Every loss is NaN in the workers: a sitecustomize patches cross_entropy before main runs.
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "if 'RANK' in os.environ:\n"
        "    import torch.nn.functional as F\n"
        "    _ce = F.cross_entropy\n"
        "    F.cross_entropy = lambda *a, **k: _ce(*a, **k) * float('nan')\n")
    monkeypatch.setenv("PYTHONPATH", str(hook))  # env_without_dist puts the repo root first
    cfg = metrics_cfg(tiny_model_dir, tmp_path, num_iterations=5, max_skipped_steps=1)
    proc = run_torchrun(2, cli_flags(cfg))
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: stopping at step 2: 2 steps in a row (steps 1-2)")
    warnings = [line for line in proc.stderr.splitlines() if "warning:" in line]
    assert [w.split(":")[1] for w in warnings] == [" step 1", " step 2"], proc.stderr[-4000:]  # from the loss rank only
    assert [r["step"] for r in read_rows(tmp_path / "metrics.jsonl")] == [1, 2]
