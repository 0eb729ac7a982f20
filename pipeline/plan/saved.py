"""What a save_dir holds from earlier runs, read before any process group: the layout of its
training checkpoints, which of them are complete, the newest, and the partition a resumed
checkpoint was saved with (``resolve`` keeps it). ``pipeline.run.checkpoint`` writes them."""
from __future__ import annotations

import json
from pathlib import Path


# A checkpoint is a Hugging Face model directory (the stage shards are the fp32 master weights)
# plus what exact continuation needs:
#   train_state/stage{s}.pt   AdamW state of stage s (written by the rank that owns s)
#   train_state/rank{r}.pt    RNG states of rank r
#   trainer_state.json        iteration, lr-scheduler state, data position, config, stage->rank map
#   COMPLETE                  written last, by rank 0: {"files": {relative path: bytes}, ...}
# It is written as step_N.partial/ and renamed once COMPLETE is in it, so a directory without the
# .partial suffix is complete unless a file was damaged later; validate_checkpoint checks that too.
CHECKPOINTS = "checkpoints"
MARKER = "COMPLETE"
TRAINER_STATE = "trainer_state.json"
STATE_DIR = "train_state"
# Beside a run's final outputs (model/, adapter/, params.pt, results.json), written once they are:
# {"step": N}, the step they are at. A checkpoint of an earlier step resumed into the same save_dir
# would train over them; the pre-launch checks refuse it.
FINISHED = "finished.json"


def checkpoint_dir(save_dir: Path, step: int) -> Path:
    return Path(save_dir) / CHECKPOINTS / f"step_{step:08d}"


def stage_file(stage: int) -> str:
    return f"{STATE_DIR}/stage{stage:05d}.pt"


def rank_file(rank: int) -> str:
    return f"{STATE_DIR}/rank{rank:05d}.pt"


def validate_checkpoint(path: Path) -> str | None:
    """None if ``path`` is a complete checkpoint, else why not (one line)."""
    path = Path(path)
    if path.name.endswith(".partial"):
        return "an interrupted save (still named .partial)"
    marker = path / MARKER
    if not marker.is_file():
        if (path / TRAINER_STATE).is_file() or path.parent.name == CHECKPOINTS:
            return f"no {MARKER} marker (the save did not finish)"
        return f"no {MARKER} marker: not a training checkpoint"
    try:
        manifest = json.loads(marker.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable {MARKER} marker ({e})"
    if TRAINER_STATE not in files:
        return f"{MARKER} does not list {TRAINER_STATE}"
    for rel, size in files.items():
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != size:
            return f"{rel} has {f.stat().st_size} bytes, {MARKER} says {size} (truncated or changed)"
    return None


def saved_at(path: Path) -> float:
    try:
        return float(json.loads((path / MARKER).read_text())["saved_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1.0


def saved_step(path: Path) -> int | None:
    """The step a checkpoint was saved after (its COMPLETE marker's), None without a readable one."""
    try:
        return int(json.loads((Path(path) / MARKER).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def candidates(save_dir: Path) -> list[Path]:
    """step_N and step_N.partial directories; a step_N.old (the previous save of the same step,
    left only if a replacement was cut short) is neither offered nor counted."""
    root = Path(save_dir) / CHECKPOINTS
    return sorted(p for p in root.glob("step_*") if not p.name.endswith(".old")) if root.is_dir() else []


def find_latest(save_dir: Path, warn) -> Path | None:
    """The most recently completed valid checkpoint in ``save_dir/checkpoints`` (by save time, so
    a run resumed from an older checkpoint supersedes the newer steps of the run it abandoned).
    Every directory skipped is reported through ``warn``."""
    valid = []
    for path in candidates(save_dir):
        reason = validate_checkpoint(path)
        if reason:
            warn(f"resume: skipping {path}: {reason}")
        else:
            valid.append(path)
    return max(valid, key=saved_at, default=None)


def resume_refusal(resume: str, save_dir: str) -> str | None:
    """Why the checkpoint directory ``resume`` names (not 'latest') cannot be resumed from, in one
    line; None when it can. A path that is not there is taken for a typo: the line names a real
    checkpoint of save_dir where it has one."""
    path = Path(resume)
    if not path.exists():
        where = "" if path.is_absolute() else f" ({path.absolute()})"
        example = find_latest(Path(save_dir), lambda line: None) or checkpoint_dir(Path(save_dir), 10)
        return (f"resume {resume!r}: no such checkpoint directory{where}; resume takes 'latest' or a checkpoint "
                f"directory such as {example}")
    what = _not_a_checkpoint(path)
    if what:
        return f"resume {resume!r} is {what}"
    reason = validate_checkpoint(path)
    if reason:
        return f"resume {resume!r} is not a complete checkpoint: {reason}; give a {CHECKPOINTS}/step_N directory or 'latest'"
    return None


def _not_a_checkpoint(path: Path) -> str | None:
    """What ``path`` is when it is a run's other output, not a checkpoint (a finished model, an
    adapter, a save_dir, its checkpoints directory), and what to give instead; None otherwise."""
    if (path / MARKER).is_file() or (path / TRAINER_STATE).is_file():
        return None
    newest = find_latest(path, lambda line: None) if (path / CHECKPOINTS).is_dir() else None
    if newest is not None:
        return (f"a save_dir, not one of its checkpoints: continue it with --save_dir {path} --resume latest (its "
                f"newest is {newest})")
    if any((path / name).exists() for name in (FINISHED, "results.json", "metrics.jsonl", CHECKPOINTS)):
        further = f"; to train its model further: --model {path / 'model'} and another --save_dir" \
            if (path / "model" / "config.json").is_file() else ""
        return f"a run's save_dir with no complete checkpoint, not a checkpoint{further}"
    if path.name == CHECKPOINTS:
        newest = find_latest(path.parent, lambda line: None)
        return (f"the directory of a run's checkpoints, not one of them: give one of its step_N directories "
                f"({newest or 'none is complete'}), or --resume latest with --save_dir {path.parent}")
    if (path / "adapter_config.json").is_file():
        return (f"a finished LoRA adapter, not a training checkpoint (no AdamW state or data position): to train "
                f"it further, start from it with --lora_adapter {path} and another --save_dir")
    if (path / "config.json").is_file():
        return (f"a finished Hugging Face model, not a training checkpoint (no AdamW state or data position): to "
                f"train it further, start from it with --model {path} and another --save_dir")
    return None


def read_trainer_state(path: Path) -> dict:
    return json.loads((Path(path) / TRAINER_STATE).read_text())


def saved_partition(resume: str, save_dir: str) -> list[int] | None:
    """The decoder layers per stage of the checkpoint ``resume`` names ('latest' or a path), read
    without collectives for ``resolve``; None without a readable one (``find_resume`` reports
    what is wrong with it later)."""
    if not resume:
        return None
    path = find_latest(Path(save_dir), lambda line: None) if resume == "latest" else Path(resume)
    if path is None or validate_checkpoint(path):
        return None
    try:
        return [b - a for a, b in read_trainer_state(path)["parts"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


__all__ = ["CHECKPOINTS", "FINISHED", "MARKER", "STATE_DIR", "TRAINER_STATE", "candidates", "checkpoint_dir",
           "find_latest", "rank_file", "read_trainer_state", "resume_refusal", "saved_at", "saved_partition", "saved_step",
           "stage_file", "validate_checkpoint"]
