"""What a run settles before any process group exists: that its save_dir is its own, and that its
data gives training examples.

One writer per save_dir: rank 0 takes an ``flock`` on ``save_dir/.lock`` before the process
group exists and holds it until the process ends. The kernel drops the lock with the process
however it ends (a crash or ``kill -9`` leaves no stale lock), so a second run into the same
save_dir is refused, whatever its flags, with one line naming the holder. ``lock_holder`` (run
by ``train.sh``'s ``--check_only``) only looks, so the usual refusal comes before any worker
starts; two runs started together are told apart by the lock itself.

A save_dir that holds an earlier run is continued or replaced only when asked, and
``--resume latest`` never trains a finished run again from step 1 over its outputs.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import tempfile
import time
from pathlib import Path

from pipeline import checkpoint
from pipeline.config import ConfigError, TrainConfig

LOCK_FILE = ".lock"
# What a run leaves in save_dir; any of them means save_dir holds an earlier run.
RUN_OUTPUTS = ("model", "metrics.jsonl", "results.json", "params.pt", checkpoint.CHECKPOINTS)
# Written only once a run has ended (results.json too after a stop, which leaves a checkpoint).
FINISHED_OUTPUTS = ("model", "params.pt", "results.json")
# The lock files this process holds: open for its whole life (closing one would drop its lock).
_held: list[int] = []


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


def hold_save_dir(save_dir: str | Path, launcher_pid: int | None = None) -> None:
    """Create ``save_dir`` and hold its lock until this process ends (rank 0, before the
    process group exists); raises ConfigError naming the holder when another run has it."""
    out = Path(save_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        # Not inherited by programs this process starts (O_CLOEXEC): the lock dies with rank 0.
        fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(f"save_dir {str(out)!r} is not writable ({e.strerror}); give another --save_dir") from None
    for _ in range(20):  # a lock_holder test holds a shared lock for microseconds
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            time.sleep(0.05)
    else:
        os.close(fd)
        raise _busy(out, _describe(out / LOCK_FILE))
    info = {"host": socket.gethostname(), "pid": os.getpid(), "launcher_pid": launcher_pid, "started": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    _held.append(fd)


# --- what save_dir holds ----------------------------------------------------------------------
def _check_writable(out: Path) -> None:
    """A directory can be made where save_dir goes (``os.access`` says yes to /proc, where it cannot)."""
    probe = out
    while not probe.exists() and probe != probe.parent:  # the directory that will hold save_dir
        probe = probe.parent
    try:
        if not probe.is_dir():
            raise NotADirectoryError(f"{probe} is not a directory")
        os.rmdir(tempfile.mkdtemp(prefix=".write-test-", dir=probe))
    except OSError as e:
        raise ConfigError(f"save_dir {str(out)!r} is not writable (no directory can be made in {probe}: "
                          f"{e.strerror or e}); give another --save_dir") from None


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


def check_save_dir(cfg: TrainConfig, test_lock: bool) -> None:
    """save_dir can be written, no live run holds it (``test_lock``: rank 0 only, whose peers
    would see their own run's lock), and an earlier run in it is continued or replaced only as
    asked: ``resume`` continues from a checkpoint, ``overwrite`` replaces it; ``--resume latest``
    on a finished run with no checkpoint is refused (it would retrain and replace it)."""
    out = Path(cfg.save_dir)
    _check_writable(out)
    holder = lock_holder(out) if test_lock else None
    if holder:
        raise _busy(out, holder)
    found = [name for name in RUN_OUTPUTS if (out / name).exists()]
    if cfg.save_results and Path(cfg.save_results).exists() and not found:
        found = [cfg.save_results]
    if not found or cfg.overwrite:
        return
    newest = checkpoint.find_latest(out, lambda line: None)
    if not cfg.resume:
        advice = "continue it with --resume latest or " if newest else "it has no checkpoint to continue from; "
        raise ConfigError(f"save_dir {str(out)!r} holds an earlier run ({', '.join(found)}); {advice}write elsewhere "
                          "with --save_dir (--overwrite would discard it)")
    finished = _finished(out, Path(cfg.results_path))
    if cfg.resume == "latest" and newest is None and finished:
        raise ConfigError(f"save_dir {str(out)!r} holds a finished run ({', '.join(finished)}) with no checkpoint to "
                          "continue from: --resume latest would train it again from step 1 and replace it; write "
                          "elsewhere with --save_dir (--overwrite would discard it)")


# --- the data ---------------------------------------------------------------------------------
def check_examples(records, tokenizer, seq_length: int, source: str, count: int = 64) -> None:
    """The first ``count`` records tokenize to examples with a trainable token at ``seq_length``:
    a chat template the records need, and a seq_length long enough for the prompts, are found
    here, before launch. A seq_length too short names the shortest that trains a record."""
    from transformers.utils import logging as hf_logging

    from data import DataError, tokenize_records

    first = records.select(range(min(count, len(records))))
    # The tokenizer's one warning of a record longer than the model's positions is the run's to give.
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        try:
            tokenize_records(first, tokenizer, seq_length)
            return
        except DataError as e:
            error = e
        lo, hi = seq_length, 1 << 17  # lo fails; find the shortest that does not
        if not _trains(first, tokenizer, hi):
            raise error  # corrupt records, not their length
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if _trains(first, tokenizer, mid) else (mid, hi)
    finally:
        hf_logging.set_verbosity(level)
    raise DataError(f"seq_length ({seq_length}) leaves no trainable token in any of the first {len(first)} records "
                    f"of {source!r} (their prompts fill it); the shortest seq_length that trains one of them is {hi}")


def _trains(records, tokenizer, seq_length: int) -> bool:
    from data import DataError, tokenize_records

    try:
        tokenize_records(records, tokenizer, seq_length)
        return True
    except DataError:
        return False


def generated_config():
    """The transformers config of the generated model before it exists: the shape
    ``ensure_tiny_model``'s defaults give it (what ``train.build_generated_model`` builds), so a
    run that the shape alone refuses (too many stages, too long a seq_length) is refused before
    the model is built."""
    import inspect

    from transformers import LlamaConfig

    from data import ensure_tiny_model

    d = {k: p.default for k, p in inspect.signature(ensure_tiny_model).parameters.items()}
    return LlamaConfig(vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                       intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_layers"],
                       num_attention_heads=d["num_heads"], num_key_value_heads=d["num_kv_heads"] or d["num_heads"],
                       max_position_embeddings=d["max_position_embeddings"], tie_word_embeddings=False)
