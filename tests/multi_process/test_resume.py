"""Checkpoints, resume and clean stops: a run stopped and resumed trains exactly like one that
never stopped; incomplete checkpoints are never resumed from; SIGTERM under torchrun ends every
rank after the same step with a checkpoint."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sys
import time

import pytest
import torch

from pipeline.config import ConfigError
from pipeline.plan import saved
from pipeline.plan.save_dir import LOCK_FILE
from tests.helpers.launch import Launched, alive, launch, wait_for_line, worker_pids
from tests.helpers.paths import ROOT, env_without_dist
from tests.helpers.prelaunch import check_only, one_error, refused_before_launch, train_sh
from tests.helpers.reference import in_process_trainer
from tests.helpers.runs import cli_flags, run_torchrun, tiny_cfg

ITERS = 6


def _losses(history):
    return [h["loss"] for h in history]


def _signal_during(trainer, call: int, signum=signal.SIGTERM) -> None:
    """Deliver ``signum`` to this process in the middle of the ``call``-th iteration's actions."""
    original, calls = trainer.executor.run, [0]

    def run(*args, **kw):
        calls[0] += 1
        if calls[0] == call:
            signal.raise_signal(signum)  # the handler only sets a flag: this iteration still completes
        return original(*args, **kw)

    trainer.executor.run = run


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir):
    return _losses(in_process_trainer(tiny_cfg(tiny_model_dir, num_iterations=ITERS)).train())


@pytest.mark.slow
def test_stop_and_resume_in_process_is_exact(tiny_model_dir, tmp_path, uninterrupted, capsys):
    cfg = tiny_cfg(tiny_model_dir, num_iterations=ITERS, save_dir=str(tmp_path), use_offload=True)
    first = in_process_trainer(cfg)
    _signal_during(first, 3)
    first_rows = first.train()
    first.save(first_rows)  # its results.json: steps 1-3
    before = _losses(first_rows)
    assert first.stopped_by == signal.SIGTERM and len(before) == 3
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone after training
    ckpt = saved.checkpoint_dir(tmp_path, 3)
    assert saved.validate_checkpoint(ckpt) is None
    assert "stopped by SIGTERM after step 3" in capsys.readouterr().out

    state = saved.read_trainer_state(ckpt)
    assert state["iteration"] == 3 and state["lr_scheduler"]["iteration"] == 3
    assert state["num_stages"] == 4 and state["world_size"] == 1 and state["mapping"] == [0, 0, 0, 0]
    assert state["data"]["position"] == 3 * cfg.batch_size

    resumed = in_process_trainer(tiny_cfg(tiny_model_dir, num_iterations=ITERS, save_dir=str(tmp_path), resume="latest"))
    assert resumed.start_iteration == 3
    resumed_rows = resumed.train()
    after = _losses(resumed_rows)
    assert before + after == uninterrupted  # exact: same weights, AdamW state, data and lr
    resumed.save(resumed_rows)  # results.json keeps the steps before the checkpoint
    rows = json.loads((tmp_path / "results.json").read_text())["iterations"]
    assert [r["step"] for r in rows] == list(range(1, ITERS + 1)) and [r["loss"] for r in rows] == uninterrupted


@pytest.mark.slow
def test_checkpoint_every_keep_and_finished_run(tiny_model_dir, tmp_path, uninterrupted, capsys):
    cfg = tiny_cfg(tiny_model_dir, num_iterations=ITERS, save_dir=str(tmp_path), checkpoint_every=2, keep_checkpoints=2,
               schedule="1f1b")
    assert _losses(in_process_trainer(cfg).train()) == uninterrupted
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["step_00000004", "step_00000006"]

    # Resuming from an explicit path (not the newest) continues exactly too.
    from_4 = in_process_trainer(tiny_cfg(tiny_model_dir, num_iterations=ITERS, save_dir=str(tmp_path),
                           resume=str(saved.checkpoint_dir(tmp_path, 4))))
    assert _losses(from_4.train()) == uninterrupted[4:]

    capsys.readouterr()
    done = in_process_trainer(tiny_cfg(tiny_model_dir, num_iterations=ITERS, save_dir=str(tmp_path), resume="latest"))
    assert done.train() == []
    assert "nothing left to train" in capsys.readouterr().out

    # A checkpoint is a Hugging Face model directory.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(saved.checkpoint_dir(tmp_path, 6))
    assert sum(p.numel() for p in model.parameters()) == sum(s.numel for s in done.stores.values())


@pytest.mark.slow
def test_resume_with_other_stage_count_restarts_adam(tiny_model_dir, tmp_path, uninterrupted, capsys):
    first = in_process_trainer(tiny_cfg(tiny_model_dir, num_iterations=ITERS, save_dir=str(tmp_path)))
    _signal_during(first, 3, signal.SIGINT)
    first.train()
    capsys.readouterr()
    two = in_process_trainer(tiny_cfg(tiny_model_dir, num_iterations=ITERS, save_dir=str(tmp_path), resume="latest",
                        num_stages=2, schedule="interleaved"))
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "fresh AdamW state" in err and "4 stages" in err
    after = _losses(two.train())
    # Same weights and batch: the first loss is the uninterrupted run's; then Adam's restart shows.
    torch.testing.assert_close(after[0], uninterrupted[3], rtol=1e-6, atol=0)
    assert abs(after[1] - uninterrupted[4]) > 1e-4


@pytest.mark.slow
def test_incomplete_checkpoints_are_skipped(tiny_model_dir, tmp_path, capsys):
    cfg = tiny_cfg(tiny_model_dir, num_iterations=3, num_stages=2, save_dir=str(tmp_path), checkpoint_every=1)
    in_process_trainer(cfg).train()
    root = tmp_path / "checkpoints"
    assert saved.find_latest(tmp_path, print) == saved.checkpoint_dir(tmp_path, 3)

    # A kill in the middle of a save leaves step_N.partial without a marker.
    shutil.copytree(root / "step_00000003", root / "step_00000004.partial")
    (root / "step_00000004.partial" / saved.MARKER).unlink()
    # A file truncated after the save (disk full, a copy cut short).
    shard = root / "step_00000003" / "model-00002-of-00002.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    # A marker that never got written.
    (root / "step_00000002" / saved.MARKER).unlink()

    warnings = []
    assert saved.find_latest(tmp_path, warnings.append) == saved.checkpoint_dir(tmp_path, 1)
    text = "\n".join(warnings)
    assert "step_00000004.partial: an interrupted save" in text
    assert "model-00002-of-00002.safetensors has" in text and "truncated" in text
    assert "step_00000002: no COMPLETE marker" in text

    resumed = in_process_trainer(tiny_cfg(tiny_model_dir, num_iterations=3, num_stages=2, save_dir=str(tmp_path),
                            resume="latest", checkpoint_every=1, keep_checkpoints=1))
    assert resumed.start_iteration == 1
    assert "skipping" in capsys.readouterr().err
    resumed.train()
    # Once a new checkpoint is complete, older ones beyond keep and leftovers are deleted.
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003"]
    assert saved.validate_checkpoint(root / "step_00000003") is None

    # save_dir itself is no checkpoint: what it is, and the flags that resume it
    with pytest.raises(ConfigError, match=rf"is a save_dir, not one of its checkpoints: continue it with --save_dir "
                                          rf"{tmp_path} --resume latest \(its newest is {root / 'step_00000003'}\)"):
        in_process_trainer(tiny_cfg(tiny_model_dir, save_dir=str(tmp_path), resume=str(tmp_path)))


@pytest.mark.slow
def test_a_finished_run_is_not_resumed_from_an_older_checkpoint(tiny_model_dir, tmp_path):
    """The audit's steps: checkpoint_every 0, a stop after step 3 (its checkpoint), a resume to the
    end (model/ at step 6, no checkpoint there). train.sh --resume latest --num_iterations 8 would go
    back to step 3 and train over the finished model: it is refused before any worker starts, and so
    is a new start, without offering --resume latest; model/ stays byte for byte. With a
    checkpoint at the finished step (checkpoint_every > 0), more iterations continue the run."""
    out = tmp_path / "run"
    common = dict(num_stages=2, save_dir=str(out), save_model=True, save_metrics=True)
    first = in_process_trainer(tiny_cfg(tiny_model_dir, num_iterations=ITERS, **common))
    _signal_during(first, 3, signal.SIGINT)
    first.save(first.train())
    assert first.stopped_by and not (out / saved.FINISHED).exists()
    resumed = in_process_trainer(tiny_cfg(tiny_model_dir, num_iterations=ITERS, resume="latest", **common))
    resumed.save(resumed.train())
    assert json.loads((out / saved.FINISHED).read_text())["step"] == ITERS
    assert saved.find_latest(out, print) == saved.checkpoint_dir(out, 3)

    def files():
        return {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file() and p.name != LOCK_FILE}

    before = files()
    more = cli_flags(tiny_cfg(tiny_model_dir, num_iterations=ITERS + 2, **common))
    proc, _ = train_sh(more + ["--resume", "latest"], {"NPROC": "2"})
    refused_before_launch(proc, f"holds a finished run at step {ITERS} (model, results.json, metrics.jsonl) and its "
                                f"newest checkpoint is older (step 3, {saved.checkpoint_dir(out, 3)}): resuming "
                                f"would train steps 4.. again and replace it; to train further, start from its "
                                f"model with --model {out / 'model'} and another --save_dir")
    line = one_error(check_only(more), f"it finished at step {ITERS}, after its newest checkpoint (step 3), so there "
                                       "is nothing to resume")
    assert "--resume" not in line
    assert files() == before

    # checkpoint_every > 0 saves one at the end: a finished run continues with more iterations
    ends = tmp_path / "ends"
    every = dict(common, save_dir=str(ends), checkpoint_every=2)
    done = in_process_trainer(tiny_cfg(tiny_model_dir, num_iterations=4, **every))
    done.save(done.train())
    proc = run_torchrun(2, cli_flags(tiny_cfg(tiny_model_dir, num_iterations=6, resume="latest", **every)))
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-3000:]
    # results.json keeps the finished run's steps 1-4 and adds the continuation's
    assert [r["step"] for r in json.loads((ends / "results.json").read_text())["iterations"]] == [1, 2, 3, 4, 5, 6]
    assert json.loads((ends / saved.FINISHED).read_text())["step"] == 6


# --- torchrun: SIGTERM, agreement across ranks, resume -------------------------------------------
def test_wait_for_line_ends_at_its_deadline():
    """A process that prints half a line and then nothing: the wait fails after its timeout
    (a ``readline`` on the pipe would block until the process exits) and the process is killed."""
    proc = Launched([sys.executable, "-c", "import sys, time; print('step 1/9'); print('half', end=''); "
                      "sys.stdout.flush(); time.sleep(120)"], env_without_dist())
    assert proc.wait_for_line(r"^step 1/", timeout=30) == ["step 1/9\n"]
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="no line matching"):
        proc.wait_for_line(r"^step +2/", timeout=1.0)
    assert time.monotonic() - t0 < 10
    assert proc.returncode is not None  # killed, not left running


@pytest.mark.slow
@pytest.mark.parametrize("target", ["torchrun", "workers"])
def test_torchrun_sigterm_saves_and_resumes_exactly(tiny_model_dir, tmp_path, target):
    # A constant lr does not depend on num_iterations, so a long run that is stopped can be
    # compared with a short uninterrupted one.
    common = dict(num_stages=4, schedule="1f1b", use_offload=True, lr_schedule="constant", warmup_iterations=0)
    long_run = tiny_cfg(tiny_model_dir, num_iterations=10_000, save_dir=str(tmp_path / "run"), **common)
    proc = launch(cli_flags(long_run))
    wait_for_line(proc, r"^step +2/", timeout=240)
    # torchrun forwards SIGTERM to every worker; a batch system may signal the workers directly.
    for pid in ([proc.pid] if target == "torchrun" else worker_pids(proc.pid)):
        os.kill(pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    # torchrun itself exits 1 when it was signalled (it re-raises the signal as an exception)
    # even though its workers exited 0; signalled directly, the workers' 0 is torchrun's.
    assert proc.returncode == (0 if target == "workers" else 1), err[-3000:]
    assert "training failed" not in err, err[-3000:]
    stopped = [line for line in out.splitlines() if "stopped by SIGTERM after step" in line]
    assert len(stopped) == 1, out
    step = int(stopped[0].split("after step ")[1].split(",")[0])
    ckpt = saved.checkpoint_dir(tmp_path / "run", step)
    assert saved.validate_checkpoint(ckpt) is None
    state = saved.read_trainer_state(ckpt)
    assert state["world_size"] == 2 and state["mapping"] == [0, 1, 0, 1] and state["iteration"] == step
    assert sorted(p.name for p in (ckpt / "train_state").iterdir()) == \
        ["rank00000.pt", "rank00001.pt"] + [f"stage0000{s}.pt" for s in range(4)]
    assert not (tmp_path / "run" / "model").exists()  # the checkpoint is the stopped run's model
    if target == "torchrun":
        # The optimizer state is saved per stage: one process holding all 4 stages restores it too.
        one = in_process_trainer(tiny_cfg(tiny_model_dir, num_iterations=step + 2, resume=str(ckpt), **common))
        one_losses = _losses(one.train())

    total = step + 2
    resumed = tiny_cfg(tiny_model_dir, num_iterations=total, save_dir=str(tmp_path / "run"), resume="latest",
                   save_results=str(tmp_path / "resumed.json"), **common)
    ref = tiny_cfg(tiny_model_dir, num_iterations=total, save_dir=str(tmp_path / "ref"),
               save_results=str(tmp_path / "ref.json"), **common)
    for cfg in (resumed, ref):
        p = launch(cli_flags(cfg))
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
    rows = json.loads((tmp_path / "resumed.json").read_text())["iterations"]
    ref_rows = json.loads((tmp_path / "ref.json").read_text())["iterations"]
    assert [r["step"] for r in rows] == [step + 1, step + 2]
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref_rows[step:]]
    if target == "torchrun":
        torch.testing.assert_close(one_losses, [r["loss"] for r in ref_rows[step:]], rtol=1e-5, atol=0)


@pytest.mark.slow
def test_a_hung_peer_stops_the_run_with_the_stalled_action(tiny_model_dir, tmp_path):
    """A rank that stops responding (SIGSTOP) makes its peer's wait time out after
    comm_timeout_s, with a message naming the rank and the action (or the end of the step) it waited
    in; nobody waits forever."""
    cfg = tiny_cfg(tiny_model_dir, num_iterations=10_000, num_stages=4, schedule="1f1b", save_dir=str(tmp_path / "run"),
               comm_timeout_s=10.0)
    proc = launch(cli_flags(cfg), extra_env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "3"})
    wait_for_line(proc, r"^step +2/", timeout=240)
    t0 = time.monotonic()
    workers = worker_pids(proc.pid)
    os.kill(workers[-1], signal.SIGSTOP)  # the highest local rank: rank 1
    try:
        out, err = proc.communicate(timeout=150)
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 150
    # the peer stops inside an action or in the end-of-step agreement, whichever it reached
    assert re.search(r"rank 0: (action \S+|the end of step \d+) \(.*\) failed", err), err[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torch.distributed.run", "pipeline.launch"])
def test_workers_stop_when_their_launcher_is_killed(tiny_model_dir, tmp_path, launcher):
    """kill -9 of torchrun's agent (or of train.sh's launcher, torchrun in-process) forwards no
    signal: the workers see it themselves (parent-death signal), finish the step, save a whole
    checkpoint, say why and exit within seconds."""
    cfg = tiny_cfg(tiny_model_dir, num_iterations=10_000, num_stages=2, save_dir=str(tmp_path / "run"),
                   lr_schedule="constant", warmup_iterations=0)
    cmd = [sys.executable, "-m", launcher, "--standalone", "--nproc_per_node=2", str(ROOT / "main.py"),
           "--config", "", *cli_flags(cfg)]
    proc = Launched(cmd, env_without_dist())
    try:
        proc.wait_for_line(r"^step +2/", timeout=240)
        workers = worker_pids(proc.pid)
        assert len(workers) == 2
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        while any(alive(w) for w in workers) and time.monotonic() - t0 < 60:
            time.sleep(0.1)
        stopped_in = time.monotonic() - t0
    finally:
        for pid in worker_pids(proc.pid) + (workers if "workers" in dir() else []):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    assert stopped_in < 10, (stopped_in, err[-3000:])
    for rank in (0, 1):
        assert f"[rank {rank}] warning: the launcher (pid {proc.pid}) has died; this worker stops" in err, err[-3000:]
    step = int(re.search(r"stopped by SIGTERM \(its launcher died\) after step (\d+), checkpoint saved", out).group(1))
    root = tmp_path / "run" / saved.CHECKPOINTS
    assert sorted(p.name for p in root.iterdir()) == [f"step_{step:08d}"]  # nothing half-written beside it
    assert saved.validate_checkpoint(root / f"step_{step:08d}") is None
