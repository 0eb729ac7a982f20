"""A save_dir has one writer and keeps a finished run: a live run's lock refuses a second run
whatever its flags (and dies with the run), a resume never trains a finished run again over its
outputs (from step 1, or from a checkpoint older than its last step), and save_dir must really be
writable. Before launch, the data must give
examples at seq_length (with the shortest one that does named)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from pipeline.config import ConfigError, make_config
from pipeline.plan import preflight, save_dir, saved
from tests.helpers.prelaunch import chat_file, refused_before_launch, train_sh


@pytest.fixture
def held(monkeypatch):
    """The lock files this test's process takes: released after the test."""
    monkeypatch.setattr(save_dir, "_held", {})
    yield
    save_dir.release_save_dir()


def _finished_run(out: Path, checkpoint_step: int = 0, finished_step: int = 0) -> Path:
    """What a finished run leaves: model/, results.json, metrics.jsonl ending in its summary row;
    with ``checkpoint_step``, a complete checkpoint of that step too; with ``finished_step``, the
    finished.json a run writes beside its outputs (without it: a run from before there was one)."""
    (out / "model").mkdir(parents=True)
    (out / "model" / "config.json").write_text("{}\n")
    (out / "results.json").write_text("{}\n")
    (out / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n{"kind": "summary", "num_steps": 1}\n')
    if finished_step:
        (out / saved.FINISHED).write_text(json.dumps({"step": finished_step}))
    if checkpoint_step:
        ckpt = saved.checkpoint_dir(out, checkpoint_step)
        ckpt.mkdir(parents=True)
        (ckpt / saved.TRAINER_STATE).write_text("{}\n")
        (ckpt / saved.MARKER).write_text(json.dumps({"step": checkpoint_step, "saved_at": time.time(),
                                                          "files": {saved.TRAINER_STATE: 3}}))
    return out


def _check(out: Path, **kw) -> None:
    save_dir.check_save_dir(make_config({"save_dir": str(out), **kw}), test_lock=True)


def test_a_finished_run_is_continued_or_replaced_only_as_asked(tmp_path):
    run = _finished_run(tmp_path / "run")
    with pytest.raises(ConfigError) as plain:
        _check(run)
    assert "holds an earlier run (model, metrics.jsonl, results.json); it has no checkpoint to continue from; " \
           "write elsewhere with --save_dir (--overwrite would discard it)" in str(plain.value)
    assert "--resume" not in str(plain.value)  # nothing to continue: not offered
    with pytest.raises(ConfigError, match=r"holds a finished run \(model, results.json, metrics.jsonl\) with no "
                                          r"checkpoint to continue from: --resume latest would train it again"):
        _check(run, resume="latest")
    _check(run, overwrite=True)  # asked for

    with_ckpt = _finished_run(tmp_path / "with_ckpt", checkpoint_step=5)
    with pytest.raises(ConfigError, match="continue it with --resume latest or write elsewhere"):
        _check(with_ckpt)
    _check(with_ckpt, resume="latest")

    crashed = tmp_path / "crashed"  # died before its first checkpoint: the restart starts afresh
    crashed.mkdir()
    (crashed / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    _check(crashed, resume="latest")


def test_a_resume_never_goes_back_behind_a_finished_run(tmp_path):
    """A run finished at step 6 whose newest checkpoint is step 3 (checkpoint_every 0 and a stop at
    step 3, then a resume to the end): neither --resume latest nor that checkpoint by path trains
    steps 4.. again over it, and the refusal of a new start does not offer --resume latest. A
    checkpoint at the finished step (checkpoint_every > 0 writes one at the end) continues."""
    run = _finished_run(tmp_path / "run", checkpoint_step=3, finished_step=6)
    ckpt = saved.checkpoint_dir(run, 3)
    with pytest.raises(ConfigError) as plain:
        _check(run)
    assert str(plain.value) == (
        f"save_dir '{run}' holds an earlier run (model, metrics.jsonl, results.json, checkpoints); it finished at "
        f"step 6, after its newest checkpoint (step 3), so there is nothing to resume; to train further, start "
        f"from its model with --model {run / 'model'} and another --save_dir (--overwrite would discard it)")
    for resume, which in (("latest", "its newest checkpoint"), (str(ckpt), "the checkpoint --resume names")):
        for more in ({}, {"num_iterations": 8}):
            with pytest.raises(ConfigError) as refused:
                _check(run, resume=resume, **more)
            assert str(refused.value) == (
                f"save_dir '{run}' holds a finished run at step 6 (model, results.json, metrics.jsonl) and {which} "
                f"is older (step 3, {ckpt}): resuming would train steps 4.. again and replace it; to train further, "
                f"start from its model with --model {run / 'model'} and another --save_dir (--overwrite would "
                f"discard the finished run)")
        _check(run, resume=resume, overwrite=True)  # asked for

    # A run from before finished.json: the last step its results.json records.
    old = _finished_run(tmp_path / "old", checkpoint_step=3)
    (old / "results.json").write_text(json.dumps({"iterations": [{"step": 5}, {"step": 6}]}))
    with pytest.raises(ConfigError, match=r"holds a finished run at step 6 .* is older \(step 3, "):
        _check(old, resume="latest")

    at_the_end = _finished_run(tmp_path / "at_the_end", checkpoint_step=6, finished_step=6)
    with pytest.raises(ConfigError, match="continue it with --resume latest or write elsewhere"):
        _check(at_the_end)
    _check(at_the_end, resume="latest", num_iterations=8)

    stopped = tmp_path / "stopped"  # stopped at step 3: results.json, no model, the stop's checkpoint
    _finished_run(stopped, checkpoint_step=3)
    shutil.rmtree(stopped / "model")
    (stopped / "results.json").write_text(json.dumps({"iterations": [{"step": 3}]}))
    _check(stopped, resume="latest")


def test_a_resume_path_must_be_a_complete_checkpoint(tmp_path):
    """A checkpoint directory --resume names is checked before launch: one that is not there (a
    typo of latest) names a real checkpoint of save_dir, or the form of one; an incomplete one says
    what is wrong with it."""
    run = _finished_run(tmp_path / "run", checkpoint_step=4, finished_step=4)

    def refusal(resume: str, where: Path = run) -> str:
        with pytest.raises(ConfigError) as info:
            save_dir.check_resume(make_config({"save_dir": str(where), "resume": resume}))
        return str(info.value)

    assert refusal("latset") == (f"resume 'latset': no such checkpoint directory ({Path('latset').absolute()}); "
                                 f"resume takes 'latest' or a checkpoint directory such as "
                                 f"{saved.checkpoint_dir(run, 4)}")
    gone = tmp_path / "gone"
    assert refusal(str(gone), tmp_path / "fresh") == (
        f"resume '{gone}': no such checkpoint directory; resume takes 'latest' or a checkpoint directory such as "
        f"{tmp_path / 'fresh' / 'checkpoints' / 'step_00000010'}")
    (run / saved.CHECKPOINTS / "step_00000002").mkdir()
    assert refusal(str(run / saved.CHECKPOINTS / "step_00000002")) == (
        f"resume '{run / saved.CHECKPOINTS / 'step_00000002'}' is not a complete checkpoint: no COMPLETE marker (the "
        "save did not finish); give a checkpoints/step_N directory or 'latest'")
    for resume in (str(saved.checkpoint_dir(run, 4)), "latest", ""):
        save_dir.check_resume(make_config({"save_dir": str(run), "resume": resume}))


def test_a_run_leaves_no_lock_file(tmp_path, held, monkeypatch):
    """A run removes its lock file as it ends, and the save_dir it made where nothing else is in
    it; the next run locks the file that is at the path, not one its holder removed as it left."""
    out = tmp_path / "run"
    save_dir.hold_save_dir(out)
    assert (out / save_dir.LOCK_FILE).is_file()
    save_dir.release_save_dir()
    assert not out.exists()  # made by this run, and nothing else in it
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    save_dir.hold_save_dir(out)
    save_dir.release_save_dir()
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]

    opened, real_open = [], os.open

    def holder_leaves_after_the_first_open(path, flags, mode=0o777):
        fd = real_open(path, flags, mode)
        if not opened:
            os.unlink(path)  # the holder removes its lock file as it leaves, right after this open
        opened.append(path)
        return fd

    monkeypatch.setattr(os, "open", holder_leaves_after_the_first_open)
    save_dir.hold_save_dir(out)
    monkeypatch.undo()
    assert len(opened) == 2 and save_dir.lock_holder(out)  # the lock is on the file at the path


def test_a_live_run_holds_its_save_dir(tmp_path, held):
    out = tmp_path / "run"
    assert save_dir.lock_holder(out) is None
    save_dir.hold_save_dir(out, launcher_pid=4321)
    holder = save_dir.lock_holder(out)
    assert re.fullmatch(rf"host \S+, rank 0 pid {os.getpid()}, launcher pid 4321, started \d{{4}}-.*", holder)
    # Another open of the lock file is another holder, in this process too: refused whatever the flags.
    for kw in ({}, {"overwrite": True}, {"resume": "latest"}):
        with pytest.raises(ConfigError, match=rf"save_dir '{out}' is in use by a run that is still going \(host "):
            _check(out, **kw)
    with pytest.raises(ConfigError, match="is in use by a run that is still going"):
        save_dir.hold_save_dir(out)
    save_dir.check_save_dir(make_config({"save_dir": str(out)}), test_lock=False)  # the holder's own re-check


@pytest.mark.parametrize("where", ["/proc/mmoc_run", "file/run"])
def test_save_dir_must_be_writable(tmp_path, where):
    (tmp_path / "file").write_text("")
    out = where if where.startswith("/") else str(tmp_path / where)
    with pytest.raises(ConfigError, match=rf"save_dir '{out}' is not writable \(.*\); give another --save_dir"):
        _check(Path(out))


def test_seq_length_without_a_trainable_token_names_the_minimum(tiny_model_dir):
    from transformers import AutoTokenizer

    from data import SAMPLE_TRAIN, DataError, load_records

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    records = load_records(str(SAMPLE_TRAIN))
    with pytest.raises(DataError) as info:
        preflight.check_examples(records, tok, 24, "sample")
    found = re.search(r"leaves no trainable token in any of the first 64 records of 'sample' \(their prompts fill "
                      r"it\); the shortest seq_length that trains one of them is (\d+)$", str(info.value))
    assert found, str(info.value)
    shortest = int(found.group(1))
    preflight.check_examples(records, tok, shortest, "sample")
    with pytest.raises(DataError):
        preflight.check_examples(records, tok, shortest - 1, "sample")


def test_chat_records_need_a_chat_template(tiny_model_dir, tmp_path):
    from data import DataError
    from pipeline.plan.preflight import check_files

    cfg = make_config({"model": str(tiny_model_dir), "dataset": str(chat_file(tmp_path / "chat.jsonl")),
                       "num_stages": 2, "save_dir": str(tmp_path / "run")})
    with pytest.raises(DataError, match="need a tokenizer with a chat template and this one has none"):
        check_files(cfg)


@pytest.mark.slow
def test_generated_config_is_the_generated_models(tmp_path):
    """The shape the checks assume before the model is built is the shape it gets."""
    from transformers import AutoConfig

    from data import SAMPLE_TRAIN, ensure_tiny_model
    from pipeline.plan.source import generated_config

    built = AutoConfig.from_pretrained(ensure_tiny_model(tmp_path / "gen", data_files=[SAMPLE_TRAIN]))
    assumed = generated_config()
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "model_type"):
        assert getattr(assumed, key) == getattr(built, key), key


# --- several processes -----------------------------------------------------------------------
def _metrics_rows(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert b"\0" not in data
    return [json.loads(line) for line in data.decode().splitlines()]  # every line whole


@pytest.mark.slow
def test_a_second_run_into_a_live_save_dir_is_refused(tiny_model_dir, tmp_path):
    """Two runs started a second apart into one save_dir: one trains, the other is refused with
    one line naming it; a third (train.sh, --overwrite) is refused before any worker starts; the
    first run's metrics and checkpoint are whole."""
    from tests.helpers.runs import cli_flags, tiny_cfg
    from tests.helpers.launch import launch

    out = tmp_path / "run"
    cfg = tiny_cfg(tiny_model_dir, num_iterations=10_000, num_stages=2, save_dir=str(out), save_metrics=True,
                   lr_schedule="constant", warmup_iterations=0)
    first = launch(cli_flags(cfg))
    time.sleep(1.0)
    second = launch(cli_flags(cfg))
    try:
        deadline = time.monotonic() + 240
        while first.proc.poll() is None and second.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        running, refused = (first, second) if second.proc.poll() is not None else (second, first)
        _, err = refused.communicate(timeout=60)
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert refused.returncode != 0 and len(errors) == 1, err[-3000:]
        assert re.search(rf"save_dir '{out}' is in use by a run that is still going \(host \S+, rank 0 pid \d+, "
                         r"launcher pid \d+, started ", errors[0]), errors[0]
        running.wait_for_line(r"^step +2/", timeout=240)

        proc, seconds = train_sh(cli_flags(cfg) + ["--overwrite"], {"NPROC": "2"})
        refused_before_launch(proc, "is in use by a run that is still going")
        assert seconds < 60

        os.kill(running.pid, signal.SIGTERM)  # stop the first run: it saves a checkpoint
        out_text, err_text = running.communicate(timeout=120)
    finally:
        for p in (first, second):
            if p.proc.poll() is None:
                p.kill()
    step = int(re.search(r"stopped by SIGTERM after step (\d+)", out_text).group(1))
    rows = _metrics_rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, step + 1))
    assert rows[-1]["kind"] == "summary"
    assert saved.validate_checkpoint(saved.checkpoint_dir(out, step)) is None
    assert save_dir.lock_holder(out) is None  # gone with the run


@pytest.mark.slow
def test_a_run_refused_after_the_lock_leaves_nothing(tiny_model_dir, tmp_path):
    """A refusal that only a started run can make (the memory plan of rank 0's choices), into a
    save_dir the run made: one error line, and no save_dir with a lock file in it left behind."""
    from tests.helpers.runs import cli_flags, run_torchrun, tiny_cfg

    out = tmp_path / "run"
    proc = run_torchrun(2, cli_flags(tiny_cfg(tiny_model_dir, num_stages=2, save_dir=str(out), host_memory_gb=0.01)))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1 and "does not fit" in errors[0], proc.stderr[-3000:]
    assert not out.exists()


@pytest.mark.slow
def test_resume_latest_on_a_finished_run_keeps_it(tiny_model_dir, tmp_path):
    """The quick start's situation: a finished run that saved no checkpoint. --resume latest is
    refused before any worker starts (with more iterations too) and model/ stays byte for byte."""
    from tests.helpers.runs import cli_flags, run_torchrun, tiny_cfg

    out = tmp_path / "run"
    cfg = tiny_cfg(tiny_model_dir, num_iterations=2, num_stages=2, save_dir=str(out), save_model=True,
                   save_metrics=True)
    proc = run_torchrun(2, cli_flags(cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file() and p.name != save_dir.LOCK_FILE}
    assert any(p.parent.name == "model" for p in before)
    for more in ([], ["--num_iterations", "4"]):
        proc, _ = train_sh(cli_flags(cfg) + ["--resume", "latest", *more], {"NPROC": "2"})
        refused_before_launch(proc, "holds a finished run (model, results.json, metrics.jsonl) with no checkpoint "
                                     "to continue from: --resume latest would train it again from step 1")
    # A direct torchrun launch (no --check_only first) is refused by rank 0, before the process group.
    proc = run_torchrun(2, cli_flags(cfg) + ["--resume", "latest"])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1 and "holds a finished run" in errors[0], proc.stderr[-3000:]
    after = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file() and p.name != save_dir.LOCK_FILE}
    assert after == before
