"""What a run settles before any process group exists: settings that need no file
(``check_config``), the files it reads (``check_files``: model, tokenizer, data), that its
save_dir is its own, and that its data gives training examples. ``main.py`` runs them on every
rank, and ``--check_only`` (``train.sh``) before any worker starts, so a bad setting or path is
one line.

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

import torch

from models import tied
from pipeline.config import ConfigError, TrainConfig, partition_counts, report_targets
from pipeline.plan.layout import check_replicas
from pipeline.plan.lora import check_lora, lora_settings
from pipeline.plan.source import build_generated_model, generated_model_dir, needs_generated, resolve_model
from pipeline.plan import saved

LOCK_FILE = ".lock"
# What a run leaves in save_dir; any of them means save_dir holds an earlier run.
RUN_OUTPUTS = ("model", "metrics.jsonl", "results.json", "params.pt", saved.CHECKPOINTS)
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
    newest = saved.find_latest(out, lambda line: None)
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


# --- settings and files ------------------------------------------------------------------------
def check_config(cfg: TrainConfig, world_size: int, need_devices: bool = True) -> None:
    """Checks that need no files: they run on every rank before anything is loaded.
    ``need_devices=False`` (``--plan``) allows planning a GPU run on a machine without one."""
    P = check_replicas(cfg, world_size)  # data_parallel: the ranks of one pipeline
    if cfg.num_stages != -1 and (cfg.num_stages < 1 or cfg.num_stages % P):
        per = f" per pipeline (world {world_size} / data_parallel {cfg.data_parallel})" if P != world_size else ""
        raise ConfigError(f"num_stages ({cfg.num_stages}) must be a positive multiple of the number of "
                          f"processes{per} ({P}), or -1 (auto); e.g. num_stages={P * 2}")
    if cfg.num_stages == -1 and partition_counts(cfg.partition) is not None:
        raise ConfigError(f"partition {cfg.partition!r} gives the layers of every stage, so num_stages must be their "
                          f"number, not -1 (auto)")
    if cfg.num_chunks < 1 or cfg.batch_size < 1 or cfg.batch_size % cfg.num_chunks:
        raise ConfigError(f"batch_size ({cfg.batch_size}) must be divisible by num_chunks ({cfg.num_chunks})")
    if cfg.seq_length < 2:
        raise ConfigError(f"seq_length ({cfg.seq_length}) must be at least 2")
    if cfg.seq_chunks != -1 and not 1 <= cfg.seq_chunks <= cfg.seq_length:
        raise ConfigError(f"seq_chunks ({cfg.seq_chunks}) must be between 1 (whole rows) and seq_length "
                          f"({cfg.seq_length}): each of a row's segments needs at least one token; or -1 (auto)")
    if cfg.receive_ahead < 0:
        raise ConfigError(f"receive_ahead ({cfg.receive_ahead}) must be >= 0 computes (0: each receive right before the "
                          f"compute that takes it)")
    if cfg.compile_layers == "true" and cfg.tiled_mlp == "true":
        # a tiled MLP checkpoints each tile inside the layer: not tried under torch.compile
        raise ConfigError("compile_layers true does not work with tiled_mlp true yet; use compile_layers auto "
                          "(eager with tiles) or false")
    if cfg.seq_chunks > 1 and cfg.compile_layers == "true":
        # The carried keys/values pass through a Python cache object the compiled layer cannot
        # capture, and a checkpointed layer then recomputes other tensors than its forward saved.
        raise ConfigError("compile_layers true does not work with seq_chunks > 1 yet; use compile_layers auto "
                          "(eager with segments) or false")
    if cfg.seq_chunks > 1 and cfg.fuse_last_stage == "true":
        # segment j's backward needs the gradients of its keys/values from the backwards of the
        # later segments, which have not run when its forward ends
        raise ConfigError("fuse_last_stage true does not work with seq_chunks > 1 (a segment's backward needs the "
                          "later segments'); use fuse_last_stage auto or false")
    if cfg.num_iterations < 1:
        raise ConfigError(f"num_iterations ({cfg.num_iterations}) must be at least 1")
    if need_devices and cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda was asked for but no CUDA GPU is visible "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); use device: auto or cpu")
    per_rank = cfg.num_stages // P if cfg.num_stages > 0 else 0
    if cfg.delayed_update:
        # Each of these would see or save the weights between the two that the delay keeps apart.
        clash = [name for name, on in (("use_offload off", not cfg.use_offload),
                                       (f"resident_stages {cfg.resident_stages}", cfg.resident_stages > 0),
                                       (f"eval_every {cfg.eval_every}", cfg.eval_every > 0),
                                       (f"checkpoint_every {cfg.checkpoint_every}", cfg.checkpoint_every > 0),
                                       (f"resume {cfg.resume!r}", bool(cfg.resume))) if on]
        if clash:
            raise ConfigError(f"delayed_update needs use_offload with every stage offloaded and no evaluation, "
                              f"checkpoints or resume; got {', '.join(clash)}")
    if not -1 <= cfg.resident_stages <= per_rank and cfg.num_stages != -1:
        raise ConfigError(f"resident_stages ({cfg.resident_stages}) must be -1 (auto) or 0..{per_rank} "
                          f"(the stages per process)")
    if cfg.keep_layers < -1:
        raise ConfigError(f"keep_layers ({cfg.keep_layers}) must be -1 (auto) or >= 0 (layers per stage)")
    if cfg.activation_offload and cfg.keep_layers > 0:
        # the backward recomputes each stage whole: there is no layer whose activations could be kept
        raise ConfigError(f"activation_offload recomputes every stage whole in its backward; keep_layers "
                          f"({cfg.keep_layers}) must be 0 or -1 with it")
    negative = [f"{k} ({getattr(cfg, k)})" for k in ("lr", "weight_decay", "grad_clip", "gpu_memory_gb",
                                                      "host_memory_gb") if getattr(cfg, k) < 0]
    if negative:
        raise ConfigError(f"{' and '.join(negative)} must be >= 0")
    if cfg.eval_every < 0 or cfg.eval_batches < 0 or cfg.max_skipped_steps < -1:
        raise ConfigError(f"eval_every ({cfg.eval_every}) and eval_batches ({cfg.eval_batches}) must be >= 0, "
                          f"max_skipped_steps ({cfg.max_skipped_steps}) >= -1")
    if not -cfg.num_iterations <= cfg.timeline_iteration < cfg.num_iterations:
        raise ConfigError(f"timeline_iteration ({cfg.timeline_iteration}) must be in [-{cfg.num_iterations}, "
                          f"{cfg.num_iterations}) for num_iterations={cfg.num_iterations}; -1 = the last")
    if cfg.checkpoint_every < 0 or cfg.keep_checkpoints < 1:
        raise ConfigError(f"checkpoint_every ({cfg.checkpoint_every}) must be >= 0 and keep_checkpoints "
                          f"({cfg.keep_checkpoints}) >= 1")
    check_lora(cfg)


# report_to's names -> the package each needs, and how to get it.
REPORT_PACKAGES = {"tensorboard": ("tensorboard", "python3 -m pip install tensorboard (requirements.txt lists it)"),
                   "wandb": ("wandb", "python3 -m pip install wandb (not a requirement)")}


def check_report_to(cfg: TrainConfig) -> None:
    """Every place ``report_to`` names can be written to: its package is installed (found, not
    imported: wandb imports in seconds)."""
    import importlib.util

    if not cfg.save_metrics:
        return
    for name in report_targets(cfg.report_to):
        package, install = REPORT_PACKAGES[name]
        if importlib.util.find_spec(package) is None:
            raise ConfigError(f"report_to {name} needs the {package} package, which is not installed: {install}; "
                              f"or drop it from report_to ({cfg.report_to!r}; none = metrics.jsonl only)")


def check_files(cfg: TrainConfig, rank0: bool = True) -> None:
    """Checks that read files (model, tokenizer, data, save_dir): run before any process group
    exists (``main.py``, on every rank alike, and ``--check_only``), so a bad path is one line.

    ``rank0``: this process also tests save_dir's lock (the other ranks would find their own
    run's), builds the generated model on first use (after every check its shape allows, so a
    refused run builds nothing) and checks the first records' examples with its tokenizer; the
    other ranks skip what needs the model until rank 0 has built it."""
    from data import SAMPLE_TRAIN, check_first_records, load_records

    check_report_to(cfg)
    source = resolve_model(cfg)  # a generated model not built yet: the shape it will have
    records = None
    if cfg.dataset != "synthetic":
        records = load_records(str(SAMPLE_TRAIN) if cfg.dataset == "sample" else cfg.dataset, cfg.dataset_split)
        check_first_records(records, cfg.dataset)
    check_save_dir(cfg, test_lock=rank0)
    if needs_generated(cfg) and not (generated_model_dir(cfg) / "config.json").is_file():
        if not rank0:
            return
        build_generated_model(cfg)
        source = resolve_model(cfg)
    lora_settings(cfg, source.config)  # the target modules against the model's layers, the saved adapter's
    if source.weights_dir is not None:
        from pipeline.plan.weight_files import check_tied_checkpoint, check_weight_files

        try:
            check_weight_files(source.weights_dir)
            if tied(source.config):  # the two tensors the checks read; the rest of the plan reads none
                check_tied_checkpoint(source.weights_dir)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"model {cfg.model!r}: {e}") from None
    if records is not None:
        if source.tokenizer_dir is None:
            raise ConfigError(f"model {cfg.model!r} has no tokenizer (no tokenizer.json or tokenizer_config.json "
                              f"in {cfg.tokenizer or cfg.model}); set tokenizer: <directory>")
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(source.tokenizer_dir)
        except Exception as e:  # noqa: BLE001 - transformers raises many types for a broken tokenizer
            raise ConfigError(f"tokenizer {str(source.tokenizer_dir)!r} cannot be loaded: "
                              f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}") from None
        check_examples(records, tokenizer, cfg.seq_length, cfg.dataset)
