"""A save_dir and the runs in it, settled before any process group exists: one writer at a time,
an earlier run continued or replaced only when asked, and a resume that continues this run.

One writer per save_dir: rank 0 takes an ``flock`` on ``save_dir/.lock`` before the process
group exists and holds it until the process ends. The kernel drops the lock with the process
however it ends (a crash or ``kill -9`` leaves no stale lock), so a second run into the same
save_dir is refused, whatever its flags, with one line naming the holder. ``lock_holder`` (run
by ``train.sh``'s ``--check_only``) only looks, so the usual refusal comes before any worker
starts; two runs started together are told apart by the lock itself. A run that ends removes the
lock file (``release_save_dir``), and the save_dir it made when nothing else is in it.

A save_dir that holds an earlier run is continued or replaced only when asked, and a resume never
trains a finished run again over its outputs: not from step 1 (``--resume latest`` without a
checkpoint), nor from a checkpoint older than the step it finished at (``save_dir/finished.json``).
The checkpoint a resume names must be complete, of this run's model and saved under the settings
its data position and AdamW state hold for (``check_resume``, ``check_resume_model``).
``preflight.check_files`` runs these checks with the others.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import tempfile
import time
from pathlib import Path

from inputs import InputError, read_json
from pipeline.config import ConfigError, TrainConfig
from pipeline.plan import saved
from pipeline.plan.source import ModelSource
from pipeline.spec.shapes import size_differences

LOCK_FILE = ".lock"
# What a run leaves in save_dir; any of them means save_dir holds an earlier run.
RUN_OUTPUTS = ("model", "adapter", "metrics.jsonl", "results.json", "params.pt", saved.CHECKPOINTS)
# The trained weights a run writes once it has finished (a stop writes a checkpoint instead).
MODEL_OUTPUTS = ("model", "adapter", "params.pt")
# Written only once a run has ended (results.json too after a stop, which leaves a checkpoint).
FINISHED_OUTPUTS = (*MODEL_OUTPUTS, "results.json")
# The lock files this process holds, open until it ends (closing one would drop its lock): fd ->
# (the lock file, the save_dir this process made, or None).
_held: dict[int, tuple[Path, Path | None]] = {}


# --- the lock ---------------------------------------------------------------------------------
def _describe(path: Path) -> str:
    """The holder a lock file names, as "host h, rank 0 pid p, launcher pid q, started t"."""
    for _ in range(20):  # the holder writes its line right after taking the lock
        try:
            info = json.loads(path.read_text() or "null")
        except (OSError, ValueError):
            info = None
        if isinstance(info, dict):
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
            launcher = f", launcher pid {info['launcher_pid']}" if info.get("launcher_pid") else ""
            return f"host {info.get('host')}, rank 0 pid {info.get('pid')}{launcher}, started {started}"
        time.sleep(0.05)
    return "a process that has not written its details"


def _busy(save_dir: Path, holder: str) -> ConfigError:
    return ConfigError(f"save_dir {str(save_dir)!r} is in use by a run that is still going ({holder}); wait for "
                       "it to end or stop it, or give another --save_dir")


def lock_holder(save_dir: str | Path) -> str | None:
    """Who holds ``save_dir``'s lock, or None when no live run does. Takes no lock for longer
    than the test (a shared lock, dropped at once)."""
    path = Path(save_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # no lock file (or no save_dir): no run has held it
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _describe(path)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _take_lock(path: Path) -> int | None:
    """An fd of the lock file at ``path`` holding its exclusive lock, or None while another run
    holds it. The lock must be on the file that is at ``path`` now: a holder removes its file as it
    leaves (``release_save_dir``), and a lock taken on that removed file would not keep out the next
    run, which opens a new one."""
    for _ in range(20):  # a lock_holder test holds a shared lock for microseconds
        # Not inherited by programs this process starts (O_CLOEXEC): the lock dies with rank 0.
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            time.sleep(0.05)
            continue
        try:
            now, mine = os.stat(path), os.fstat(fd)
            if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # removed by the holder that just left: take the file at path now
    return None


def hold_save_dir(save_dir: str | Path, launcher_pid: int | None = None) -> None:
    """Create ``save_dir`` and hold its lock until this process ends (rank 0, before the
    process group exists); raises ConfigError naming the holder when another run has it."""
    out = Path(save_dir)
    made = None if out.exists() else out
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = _take_lock(out / LOCK_FILE)
    except OSError as e:
        raise ConfigError(f"save_dir {str(out)!r} is not writable ({e.strerror}); give another --save_dir") from None
    if fd is None:
        raise _busy(out, _describe(out / LOCK_FILE))
    info = {"host": socket.gethostname(), "pid": os.getpid(), "launcher_pid": launcher_pid, "started": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    _held[fd] = (out / LOCK_FILE, made)


def release_save_dir() -> None:
    """As this process ends, however it ends (``main.py``): remove each lock file it holds while
    still holding it, then drop the lock; and a save_dir it made, where nothing else is in it (a
    run refused after it took the lock leaves nothing behind). Safe to call again, and from the
    signal-watching thread."""
    while _held:
        fd, (path, made) = _held.popitem()
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)
        if made is not None:
            with contextlib.suppress(OSError):
                made.rmdir()  # only an empty directory


# --- what save_dir holds ----------------------------------------------------------------------
def _check_writable(out: Path, what: str = "save_dir", flag: str = "--save_dir") -> None:
    """A directory can be made where ``out`` (save_dir, or save_results' directory) goes
    (``os.access`` says yes to /proc, where it cannot)."""
    probe = out
    while not probe.exists() and probe != probe.parent:  # the directory that will hold save_dir
        probe = probe.parent
    try:
        if not probe.is_dir():
            raise NotADirectoryError(f"{probe} is not a directory")
        os.rmdir(tempfile.mkdtemp(prefix=".write-test-", dir=probe))
    except OSError as e:
        raise ConfigError(f"{what} {str(out)!r} is not writable (no directory can be made in {probe}: "
                          f"{e.strerror or e}); give another {flag}") from None


def _finished(out: Path, results_path: Path) -> list[str]:
    """The outputs in ``out`` that only a run that ended writes (a summary row in metrics.jsonl too)."""
    found = [name for name in FINISHED_OUTPUTS if (out / name).exists()]
    if results_path.exists() and results_path != out / "results.json":
        found.append(str(results_path))
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
        if lines and json.loads(lines[-1]).get("kind") == "summary":
            found.append("metrics.jsonl")
    except (OSError, ValueError, AttributeError):
        pass
    return found


def _finished_step(out: Path, results_path: Path) -> int | None:
    """The step the finished run in ``out`` ended at: its ``finished.json``; for a run written
    before there was one, where its weights are there, the last step its results.json or
    metrics.jsonl records. None when no finished run's step is known."""
    try:
        return int(json.loads((out / saved.FINISHED).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if not any((out / name).exists() for name in MODEL_OUTPUTS):
        return None
    steps = []
    try:
        steps.append(int(json.loads(results_path.read_text())["iterations"][-1]["step"]))
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        pass
    try:
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        steps += [int(row["step"]) for row in rows if row.get("kind") == "train"][-1:]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return max(steps, default=None)


def _train_further(out: Path) -> str:
    """How to go on from the finished run in ``out`` without replacing it."""
    if (out / "adapter").is_dir():
        return f"to train further, start from its adapter with --lora_adapter {out / 'adapter'} and another --save_dir"
    if (out / "model").is_dir():
        return f"to train further, start from its model with --model {out / 'model'} and another --save_dir"
    return "write elsewhere with --save_dir"


def check_save_dir(cfg: TrainConfig, test_lock: bool) -> None:
    """save_dir can be written, no live run holds it (``test_lock``: rank 0 only, whose peers
    would see their own run's lock), and an earlier run in it is continued or replaced only as
    asked: ``resume`` continues from a checkpoint, ``overwrite`` replaces it. A resume that would
    train a finished run again over its outputs is refused: ``--resume latest`` with no
    checkpoint (from step 1), and any checkpoint older than the step the run finished at."""
    out = Path(cfg.save_dir)
    _check_writable(out)
    if cfg.save_results:  # written at the end, after the model: a path that cannot be would fail the run there
        _check_writable(Path(cfg.save_results).parent, "save_results' directory", "--save_results")
    holder = lock_holder(out) if test_lock else None
    if holder:
        raise _busy(out, holder)
    found = [name for name in RUN_OUTPUTS if (out / name).exists()]
    if cfg.save_results and Path(cfg.save_results).exists() and not found:
        found = [cfg.save_results]
    if not found or cfg.overwrite:
        return
    newest = saved.find_latest(out, lambda line: None)
    finished = _finished(out, Path(cfg.results_path))
    ended = _finished_step(out, Path(cfg.results_path)) if finished else None
    if not cfg.resume:
        newest_step = saved.saved_step(newest) if newest is not None else None
        if ended is not None and newest_step is not None and newest_step < ended:  # resuming would go back
            advice = (f"it finished at step {ended}, after its newest checkpoint (step {newest_step}), so there is "
                      f"nothing to resume; {_train_further(out)}")
        else:
            advice = ("continue it with --resume latest or " if newest else
                      "it has no checkpoint to continue from; ") + "write elsewhere with --save_dir"
        raise ConfigError(f"save_dir {str(out)!r} holds an earlier run ({', '.join(found)}); {advice} (--overwrite "
                          "would discard it)")
    if cfg.resume == "latest" and newest is None and finished:
        raise ConfigError(f"save_dir {str(out)!r} holds a finished run ({', '.join(finished)}) with no checkpoint to "
                          "continue from: --resume latest would train it again from step 1 and replace it; write "
                          "elsewhere with --save_dir (--overwrite would discard it)")
    point = newest if cfg.resume == "latest" else Path(cfg.resume)
    step = saved.saved_step(point) if point is not None else None
    if ended is not None and step is not None and step < ended:
        which = "its newest checkpoint" if cfg.resume == "latest" else "the checkpoint --resume names"
        raise ConfigError(f"save_dir {str(out)!r} holds a finished run at step {ended} ({', '.join(finished)}) and "
                          f"{which} is older (step {step}, {point}): resuming would train steps {step + 1}.. again "
                          f"and replace it; {_train_further(out)} (--overwrite would discard the finished run)")


# --- the checkpoint a resume continues from ------------------------------------------------
def check_resume(cfg: TrainConfig) -> None:
    """The checkpoint directory ``resume`` names is there and complete ('latest', save_dir's
    newest, is weighed by ``check_save_dir``), and was saved by a run this one can continue."""
    if cfg.resume and cfg.resume != "latest":
        refusal = saved.resume_refusal(cfg.resume, cfg.save_dir)
        if refusal:
            raise ConfigError(refusal)
    point = resume_point(cfg)
    if point is not None:
        check_resume_settings(cfg, point)


def resume_point(cfg: TrainConfig) -> Path | None:
    """The checkpoint ``resume`` continues from: save_dir's newest complete one for 'latest' (None
    when there is none), else the path it names; None without resume."""
    if cfg.resume == "latest":
        return saved.find_latest(Path(cfg.save_dir), lambda line: None)
    return Path(cfg.resume) if cfg.resume else None


def check_resume_model(cfg: TrainConfig, source: ModelSource) -> None:
    """The checkpoint a resume continues from holds weights of this run's model (its config.json
    against the model's sizes): another model's fail to load after launch."""
    point = resume_point(cfg)
    if point is None or not (point / "config.json").is_file():  # none, or a LoRA checkpoint (adapters only)
        return
    try:
        differ = size_differences(read_json(point / "config.json", "checkpoint model config"), source.config)
    except InputError as e:
        raise ConfigError(f"resume: {e}; the checkpoint is damaged: resume from another") from None
    if differ:
        raise ConfigError(f"resume: {point} holds the weights of another model than {cfg.model!r} "
                          f"({'; '.join(differ)}); give --model the model its run trained, or start afresh with "
                          "--overwrite")


def check_resume_settings(cfg: TrainConfig, point: Path) -> None:
    """The checkpoint ``point`` continues under this run's settings: its batch stream's (seed,
    batch_size, packing: the position it saved counts their batches) and its adapters' (LoRA's
    rank and targets: the AdamW state it saved is theirs). Every difference in one line."""
    from data.batching import stream_mismatches

    try:
        state = read_json(Path(point) / saved.TRAINER_STATE, "checkpoint state")
        then = state["config"]
        differ = stream_mismatches(state["data"], {"seed": cfg.seed, "batch_size": cfg.batch_size,
                                                    "packing": int(cfg.packing)})
    except InputError as e:
        raise ConfigError(f"resume: {e}; the checkpoint is damaged: resume from another") from None
    except (KeyError, TypeError, AttributeError):
        return  # a state without the stream or settings (not one a run writes): nothing here to compare
    defaults = TrainConfig()
    lora = ("lora_rank", "lora_target_modules") if cfg.lora_rank or then.get("lora_rank") else ()
    for key in lora:
        if then.get(key, getattr(defaults, key)) != getattr(cfg, key):
            differ.append(f"{key}={then.get(key, getattr(defaults, key))!r} (this run {key}={getattr(cfg, key)!r})")
    if differ:
        keys = [d.split("=")[0] for d in differ]
        flags = " ".join(_flag(k, then.get(k, getattr(defaults, k))) for k in keys)
        raise ConfigError(f"resume: {point} was saved by a run with {', '.join(differ)}; its data position and "
                          f"AdamW state hold only for those: resume with {flags}, or start afresh with --overwrite")


def _flag(key: str, value) -> str:
    """The command line's words that set ``key`` to ``value``."""
    if isinstance(value, bool):
        return f"--{key}" if value else f"--no_{key}"
    return f"--{key} {value}"
