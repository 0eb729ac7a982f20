"""Metrics, validation and non-finite steps.

L1 (one process holding several stages): the validation loss equals a single-process Hugging
Face computation on the same batches; a NaN step is reported and skipped (weights and AdamW
state unchanged), training goes on, and too many in a row stop it. The files a run writes
(metrics.jsonl, metrics.png) are checked here too. The same validation check over torchrun:
tests/multi_process/test_gloo_metrics.py.
"""
from __future__ import annotations

import math
import re

import pytest
import torch

from pipeline.run.metrics import SkipGuard, TrainingError, plot_size, write_plot_png
from tests.helpers.images import distinct_colours, png_size
from tests.helpers.metrics import EVAL_BATCHES, hf_eval_loss, metrics_cfg, read_rows
from tests.helpers.reference import in_process_trainer, trainer_masters


# --- validation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule,offload", [pytest.param("gpipe", False, marks=pytest.mark.slow), ("interleaved", True)])
def test_eval_loss_matches_hf(tiny_model_dir, tmp_path, capsys, schedule, offload):
    cfg = metrics_cfg(tiny_model_dir, tmp_path, schedule=schedule, use_offload=offload, eval_every=2,
                      eval_batches=EVAL_BATCHES)
    trainer = in_process_trainer(cfg)
    assert {a.op.value for a in trainer.eval_actions} <= {"F", "SEND_F", "RECV_F", "L", "D"}
    trainer.save(trainer.train())  # metrics.png is written there, after the model and results
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert [r["kind"] for r in rows] == ["train", "train", "eval", "summary"]
    ev = rows[2]
    assert ev["split"] == "validation" and ev["step"] == 2 and ev["num_batches"] == EVAL_BATCHES
    ref = hf_eval_loss(tiny_model_dir, trainer_masters(trainer), cfg)  # the weights after step 2
    assert ev["loss"] == pytest.approx(ref, rel=1e-5)
    assert ev["perplexity"] == pytest.approx(math.exp(ref), rel=1e-5)
    # Evaluation builds no graph and leaves no gradients behind.
    assert all(p.grad is None or not p.grad.any() for st in trainer.stages.values() for p in st.parameters())

    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(("step", "eval", "summary"))]
    assert re.fullmatch(r"step    1/2 loss \d+\.\d{4} grad_norm \d+\.\d{4} lr \d\.\d\de[-+]\d\d tok/s \d+ "
                        r"tflops \d+\.\d{3} mem \d+\.\d\dGiB time \d+\.\d{3}s", lines[0]), lines[0]
    assert lines[2].startswith("eval step    2 loss ") and " ppl " in lines[2]
    assert lines[3].startswith("summary: 2 steps in ") and "peak memory per rank (GiB): " in lines[3]
    summary = rows[3]
    assert summary["mean_step_time_s"] == pytest.approx(rows[1]["step_time_s"])  # the first step is left out
    assert len(summary["peak_mem_bytes_per_rank"]) == 1 and summary["peak_mem_bytes_per_rank"][0] > 0
    assert summary["eval_loss"] == ev["loss"]
    assert png_size(tmp_path / "metrics.png") == plot_size(rows[:2]) == (1200, 960)  # all six panels


@pytest.mark.slow
def test_eval_every_and_at_the_end(tiny_model_dir, tmp_path):
    cfg = metrics_cfg(tiny_model_dir, tmp_path, num_iterations=3, eval_every=2, eval_batches=1, num_stages=2)
    in_process_trainer(cfg).train()
    assert [(r["kind"], r.get("step")) for r in read_rows(tmp_path / "metrics.jsonl")] == [
        ("train", 1), ("train", 2), ("eval", 2), ("train", 3), ("eval", 3), ("summary", None)]


def test_eval_needs_a_validation_split(tiny_model_dir, tmp_path):
    """Refused before launch (check_files, on every rank before any process group)."""
    from data import SAMPLE_TRAIN
    from pipeline.config import ConfigError
    from pipeline.plan.preflight import check_files

    cfg = metrics_cfg(tiny_model_dir, tmp_path, dataset=str(SAMPLE_TRAIN), eval_every=1)
    with pytest.raises(ConfigError, match="has no validation split .* set eval_dataset"):
        check_files(cfg)


# --- non-finite steps ---------------------------------------------------------------------------
def _poison(monkeypatch, bad_iterations: set[int], num_chunks: int = 4) -> None:
    """The last stage's loss of micro-batch 0 is NaN in the given (0-based) iterations."""
    import pipeline.stage.model as ex  # the last stage computes the loss

    calls = {"n": 0}
    real = ex.F.cross_entropy

    def cross_entropy(*args, **kw):
        it, mb = divmod(calls["n"], num_chunks)
        calls["n"] += 1
        loss = real(*args, **kw)
        return loss * float("nan") if it in bad_iterations and mb == 0 else loss

    monkeypatch.setattr(ex.F, "cross_entropy", cross_entropy)


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.slow
def test_nan_step_is_skipped(tiny_model_dir, tmp_path, monkeypatch, capsys, offload):
    cfg = metrics_cfg(tiny_model_dir, tmp_path, num_iterations=3, use_offload=offload)
    trainer = in_process_trainer(cfg)
    _poison(monkeypatch, {1})
    snaps, steps = [], []
    real_run = trainer.executor.run

    def run(*args, **kw):  # the weights and AdamW step counts after every iteration
        res = real_run(*args, **kw)
        snaps.append(trainer_masters(trainer))
        steps.append([int(st["step"]) for store in trainer.stores.values()
                      for st in store.optimizer.state.values()])
        return res

    trainer.executor.run = run
    history = trainer.train()
    assert [h["skipped"] for h in history] == [False, True, False]
    assert math.isnan(history[1]["loss"]) and not math.isfinite(history[1]["grad_norm"])
    assert all(torch.equal(snaps[1][k], snaps[0][k]) for k in snaps[0])  # step 2 changed nothing
    assert steps[1] == steps[0] and steps[2] == [s + 1 for s in steps[1]]
    # Training goes on: the next step is finite (no NaN gradient left over) and moves the weights.
    assert math.isfinite(history[2]["loss"]) and math.isfinite(history[2]["grad_norm"])
    assert any(not torch.equal(snaps[2][k], snaps[1][k]) for k in snaps[1])
    assert all(torch.isfinite(v).all() for v in snaps[2].values())
    err = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(err) == 1 and err[0].startswith("[rank 0] warning: step 2: non-finite loss nan")
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert rows[1]["skipped"] is True and rows[1]["loss"] is None  # strict JSON: NaN -> null
    assert rows[-1]["skipped_steps"] == 1


@pytest.mark.slow
def test_too_many_nan_steps_stop(tiny_model_dir, tmp_path, monkeypatch):
    cfg = metrics_cfg(tiny_model_dir, tmp_path, num_iterations=6, max_skipped_steps=2, grad_clip=0.0, num_stages=2)
    trainer = in_process_trainer(cfg)
    assert any(a.op.value == "NORM" for a in trainer.actions)  # skipping needs the norm even without clipping
    _poison(monkeypatch, {1, 2, 3, 4, 5})
    with pytest.raises(TrainingError, match=r"^stopping at step 4: 3 steps in a row \(steps 2-4\) .* "
                                            r"max_skipped_steps=2"):
        trainer.train()
    assert len(read_rows(tmp_path / "metrics.jsonl")) == 4  # the rows up to the stop are kept


def test_skip_guard_counts_consecutive():
    guard = SkipGuard(1)
    for step, skipped in enumerate([True, False, True, False, True], start=1):
        guard.update(step, skipped)  # never two in a row
    guard.update(6, False)
    guard.update(7, True)
    with pytest.raises(TrainingError, match=r"stopping at step 8: 2 steps in a row \(steps 7-8\)"):
        guard.update(8, True)
    SkipGuard(-1).update(1, True)  # -1: no bound
    with pytest.raises(TrainingError):
        SkipGuard(0).update(1, True)


def test_a_peer_lost_at_the_end_of_a_step_is_named_in_one_line():
    """A collective outside the actions (the end-of-step agreement) that times out is named like a
    failed action; a TrainingError, raised on every rank alike, passes unchanged."""
    from pipeline.run.executor import ActionError
    from pipeline.run.trainer import waiting_for_peers

    with pytest.raises(ActionError) as e:
        with waiting_for_peers(1, 7, "agreeing whether a rank was asked to stop"):
            raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv\nmore")
    assert str(e.value) == ("rank 1: the end of step 7 (agreeing whether a rank was asked to stop) failed: "
                            "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv")
    with pytest.raises(TrainingError, match="^too many"):
        with waiting_for_peers(0, 7, "x"):
            raise TrainingError("too many non-finite steps")


def test_no_norm_without_clip_and_check(tiny_model_dir, tmp_path):
    from pipeline.spec.settings import needs_norm

    assert needs_norm(metrics_cfg(tiny_model_dir, tmp_path, grad_clip=0.0))
    assert not needs_norm(metrics_cfg(tiny_model_dir, tmp_path, grad_clip=0.0, max_skipped_steps=-1))


# --- the plot -----------------------------------------------------------------------------------
def _train_rows(n: int) -> list[dict]:
    return [{"kind": "train", "step": i, "loss": 3 / i, "grad_norm": 1 + 1 / i, "lr": 1e-4, "tokens": 512,
             "tokens_per_s": 500.0 + i, "tflops_per_gpu": 0.01, "step_time_s": 1.0, "peak_mem_bytes": 2**29,
             "skipped": False} for i in range(1, n + 1)]


@pytest.mark.slow  # matplotlib rendering, seconds each
def test_plot_is_a_valid_png(tmp_path):
    rows = _train_rows(12)
    rows[3].update(loss=math.nan, grad_norm=math.inf, skipped=True)  # a gap and a red band, not a crash
    evals = [{"step": 6, "loss": 0.6}, {"step": 12, "loss": 0.4}]
    path = tmp_path / "metrics.png"
    size = write_plot_png(path, rows, evals)
    # Loss, throughput, step time, gradient norm, memory, learning rate: two panels a row.
    assert size == plot_size(rows) == (1200, 960) == png_size(path)
    assert 30_000 < path.stat().st_size < 300_000
    assert distinct_colours(path) > 50  # lines, text and axes, not a blank canvas


@pytest.mark.slow  # matplotlib rendering, seconds each
def test_plot_edge_cases(tmp_path):
    # One iteration, no validation.
    assert write_plot_png(tmp_path / "one.png", _train_rows(1)) == png_size(tmp_path / "one.png") == (1200, 960)
    # Only the keys the plot needs: the panels of missing keys are left out.
    rows = [{"step": i, "loss": 3 / i, "tokens_per_s": 100.0 + i} for i in range(1, 9)]
    assert write_plot_png(tmp_path / "min.png", rows, width=800) == png_size(tmp_path / "min.png") == (800, 360)
    # A resumed run's rows start past step 1; every loss non-finite.
    rows = [{**r, "step": r["step"] + 40, "loss": math.nan} for r in _train_rows(3)]
    assert write_plot_png(tmp_path / "nan.png", rows, [{"step": 43, "loss": 2.0}]) == png_size(tmp_path / "nan.png")


def test_progress_bar_only_on_a_terminal(tmp_path, monkeypatch, capsys):
    import sys

    from pipeline.dist import Log
    from pipeline.run.metrics import Metrics

    row = {"step": 1, "loss": 2.5, "grad_norm": 1.0, "lr": 1e-4, "tokens": 64, "tokens_per_s": 640.0,
           "tflops_per_gpu": 0.001, "step_time_s": 0.1, "peak_mem_bytes": 2**30, "skipped": False}
    assert Metrics(Log(0), speaks=True, num_steps=2, save_dir=None, progress_bar=True).bar is None  # not a TTY
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert Metrics(Log(0), speaks=True, num_steps=2, save_dir=None, progress_bar=False).bar is None
    assert Metrics(Log(1), speaks=False, num_steps=2, save_dir=None, progress_bar=True).bar is None
    m = Metrics(Log(0), speaks=True, num_steps=2, save_dir=tmp_path, progress_bar=True)
    m.start()
    m.log_step(row)
    assert m.bar.n == 1 and "loss 2.5000" in m.bar.postfix
    summary = m.finish(123)
    assert summary["peak_mem_bytes_per_rank"] == [123] and m.bar is None
    out = capsys.readouterr().out
    assert "step    1/2 loss 2.5000" in out and "summary: 1 steps" in out


def test_summary_after_a_resume_counts_the_steps_this_run_ran(tmp_path, monkeypatch, capsys):
    """A run resumed after step 2 of 4 runs 2 steps: its summary says 2, and its means and skipped
    steps are over those two (the kept rows of steps 1-2 took the earlier run's time)."""
    import json

    import pipeline.run.metrics as metrics
    from pipeline.dist import Log

    monkeypatch.setattr(metrics, "write_plot_png", lambda *a, **k: None)  # matplotlib: seconds, not tested here
    rows = _train_rows(4)
    rows[0]["skipped"] = True
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))  # 3: abandoned
    m = metrics.Metrics(Log(0), speaks=True, num_steps=4, save_dir=tmp_path, progress_bar=False)
    m.start(2)
    for r in rows[2:]:
        m.log_step({**{k: v for k, v in r.items() if k != "kind"}, "step_time_s": 2.0, "tokens_per_s": 256.0})
    summary = m.finish(123)
    assert summary["num_steps"] == 2 and summary["skipped_steps"] == 0 and summary["resumed_after_step"] == 2
    assert summary["mean_step_time_s"] == 2.0 and summary["mean_tokens_per_s"] == 256.0
    assert [r["step"] for r in read_rows(tmp_path / "metrics.jsonl") if r["kind"] == "train"] == [1, 2, 3, 4]
    assert "summary: 2 steps (resumed after step 2) in " in capsys.readouterr().out


def test_an_output_that_fails_costs_a_warning_not_the_model(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """metrics.png is drawn once the model, results.json and finished.json are on disk (it was
    drawn first, and a missing matplotlib left save_dir with no model); a failure there, or in a
    sink (a full disk under the event files), is one warning line and the run ends as it would:
    the failed sink gets no more rows, metrics.jsonl has them all."""
    import pipeline.run.metrics as metrics
    from pipeline.run.sinks import TensorBoardSink

    seen = []

    def no_matplotlib(path, rows, evals=()):
        seen.append((tmp_path / "model" / "config.json").is_file() and (tmp_path / "finished.json").is_file())
        raise ModuleNotFoundError("No module named 'matplotlib'")

    def full_disk(self, row, step):
        if step == 2:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(metrics, "write_plot_png", no_matplotlib)
    monkeypatch.setattr(TensorBoardSink, "write", full_disk)
    trainer = in_process_trainer(metrics_cfg(tiny_model_dir, tmp_path, num_iterations=3, save_model=True))
    trainer.save(trainer.train())
    assert seen == [True]
    assert [r["step"] for r in read_rows(tmp_path / "metrics.jsonl") if r["kind"] == "train"] == [1, 2, 3]
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning:" in line]
    assert warnings == [
        "[rank 0] warning: report_to tensorboard: no more rows go to it (OSError: [Errno 28] No space left on device); "
        "the model, checkpoints and metrics.jsonl are not affected",
        f"[rank 0] warning: {tmp_path / 'metrics.png'} was not written (ModuleNotFoundError: No module named "
        "'matplotlib'); the model, checkpoints and metrics.jsonl are not affected"], warnings


# --- TensorBoard and Weights & Biases ------------------------------------------------------------
def _event_scalars(path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files under ``path``, read back as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _f32(value) -> float:
    """metrics.jsonl's value as the event file stores it (float32; null is NaN)."""
    import struct

    return math.nan if value is None else struct.unpack("f", struct.pack("f", float(value)))[0]


def test_tensorboard_event_files_hold_the_metrics_rows(tiny_model_dir, tmp_path):
    """report_to tensorboard (the default): save_dir/tensorboard holds every number of every row
    of metrics.jsonl (train, eval, summary, each rank's peak memory), at its step, and no other."""
    from pipeline.run.sinks import scalars

    cfg = metrics_cfg(tiny_model_dir, tmp_path, eval_every=2, eval_batches=1)
    assert cfg.report_to == "tensorboard"
    in_process_trainer(cfg).train()
    rows = read_rows(tmp_path / "metrics.jsonl")
    expected: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        step = row.get("step", rows[-2]["step"])  # the summary's: the last step
        for tag, value in scalars(row).items():
            expected.setdefault(tag, []).append((step, _f32(value)))
    events = _event_scalars(tmp_path / "tensorboard")
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/tflops_per_gpu",
            "train/peak_mem_bytes", "train/step_time_s", "train/skipped", "eval/loss", "eval/perplexity",
            "summary/peak_mem_bytes_rank0"} <= set(events)
    assert sorted(events) == sorted(expected)
    for tag, points in expected.items():
        assert [s for s, _ in events[tag]] == [s for s, _ in points], tag
        assert all(a == b or (math.isnan(a) and math.isnan(b)) for (_, a), (_, b) in zip(events[tag], points)), tag
    assert events["train/loss"][0][1] == _f32(rows[0]["loss"]) and events["eval/loss"] == [(2, _f32(rows[2]["loss"]))]


def test_report_to_none_and_lists(tiny_model_dir, tmp_path):
    from pipeline.config import ConfigError, make_config, report_targets

    assert report_targets(make_config({"report_to": ["tensorboard", "wandb"]}).report_to) == ("tensorboard", "wandb")
    assert report_targets("tensorboard, wandb") == ("tensorboard", "wandb") and report_targets("none") == ()
    with pytest.raises(ConfigError, match="report_to must be one of tensorboard, wandb, none"):
        make_config({"report_to": "comet"})
    with pytest.raises(ConfigError, match=r"\(none alone\); got 'none,wandb'"):
        make_config({"report_to": "none,wandb"})
    in_process_trainer(metrics_cfg(tiny_model_dir, tmp_path, num_iterations=1, report_to="none")).train()
    assert (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "tensorboard").exists()


def test_packages_not_installed_are_refused_before_launch(tiny_model_dir, tmp_path, monkeypatch):
    """wandb is optional, and peft (lora_rank) and tensorboard (report_to's default) can be missing
    where a user brought their own environment: each asked for and not installed, check_files
    (before any process group) refuses the run, all of them in one line."""
    import importlib.util

    from pipeline.config import ConfigError
    from pipeline.plan.preflight import check_packages

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "peft") else real(name, *a))
    with pytest.raises(ConfigError, match=r"^report_to wandb needs the wandb package, which is not installed: "
                                          r"python3 -m pip install wandb \(requirements-gpu.txt lists all but "
                                          r"wandb\); or drop it from report_to"):
        check_packages(metrics_cfg(tiny_model_dir, tmp_path, report_to="tensorboard,wandb"))
    check_packages(metrics_cfg(tiny_model_dir, tmp_path, report_to="tensorboard,wandb", save_metrics=False))
    with pytest.raises(ConfigError, match=r"^lora_rank 8 needs the peft package and report_to wandb needs the wandb "
                                          r"package, which are not installed: python3 -m pip install "
                                          r"'peft>=0.21,<0.22' wandb "):
        check_packages(metrics_cfg(tiny_model_dir, tmp_path, report_to="wandb", lora_rank=8))


def test_wandb_offline_logs_the_rows(tiny_model_dir, tmp_path, monkeypatch):
    """With wandb installed, WANDB_MODE=offline: a run under save_dir/wandb, no network."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    in_process_trainer(metrics_cfg(tiny_model_dir, tmp_path, num_iterations=1, report_to="wandb")).train()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


def test_tensorboard_after_a_resume_and_an_overwrite(tmp_path, monkeypatch):
    """A resumed run's event files replace the abandoned continuation's steps (TensorBoard reads
    step 3 as the new run wrote it); a fresh run (overwrite) leaves none of the old run's."""
    import pipeline.run.metrics as metrics
    from pipeline.dist import Log

    monkeypatch.setattr(metrics, "write_plot_png", lambda *a, **k: None)

    def run(first_step: int, rows: list[dict]) -> None:
        m = metrics.Metrics(Log(0), speaks=True, num_steps=4, save_dir=tmp_path, progress_bar=False,
                            report_to=("tensorboard",))
        m.start(first_step)
        for r in rows:
            m.log_step({k: v for k, v in r.items() if k != "kind"})
        m.finish(1)

    rows = _train_rows(4)
    run(0, rows[:3])  # stopped after step 3, its checkpoint at step 2
    run(2, [{**r, "loss": 10.0 + r["step"]} for r in rows[2:]])
    loss = _event_scalars(tmp_path / "tensorboard")["train/loss"]
    assert loss == [(1, _f32(3.0)), (2, _f32(1.5)), (3, 13.0), (4, 14.0)], loss
    run(0, rows[:1])
    assert _event_scalars(tmp_path / "tensorboard")["train/loss"] == [(1, _f32(3.0))]
