"""Settings a run derives from its configuration and its device, the same for the plan and the run:
the compute dtype, whether the program needs the gradient norm, what ``auto`` means for
``compile_layers`` and ``fuse_last_stage``, and where the validation data comes from."""
from __future__ import annotations

from pathlib import Path

import torch

from pipeline.config import TrainConfig


def compute_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    """The dtype stages compute in (master weights are always float32)."""
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


def needs_norm(cfg: TrainConfig) -> bool:
    """Whether the schedule needs the global gradient norm (NORM): to clip, to skip a step
    whose gradients are not finite, or (float16) to find loss-scale overflows."""
    return cfg.grad_clip > 0 or cfg.max_skipped_steps >= 0 or cfg.dtype == "float16"


def compiles_layers(cfg: TrainConfig, device_type: str, routed: bool) -> bool:
    """``compile_layers`` resolved for a run on ``device_type`` (``routed``: a mixture-of-experts
    model). ``auto``: on a GPU, for whole rows with untiled MLPs and no routed layers (the
    carried keys/values of segments, the checkpointed tiles and the routing replay stay eager)."""
    if cfg.compile_layers != "auto":
        return cfg.compile_layers == "true"
    return device_type == "cuda" and cfg.seq_chunks == 1 and cfg.tiled_mlp != "true" and not routed


def fuses_last_stage(cfg: TrainConfig) -> bool:
    """``fuse_last_stage`` resolved. ``auto``: without seq_chunks, and not under gpipe with
    activation_offload, where every micro-batch's input gradient would wait on the device for
    the schedule's backward, while the recomputing last stage keeps nothing there."""
    if cfg.fuse_last_stage != "auto":
        return cfg.fuse_last_stage == "true"
    return cfg.seq_chunks == 1 and not (cfg.activation_offload and cfg.schedule == "gpipe")


VALIDATION_SPLIT = "validation"


def eval_source(cfg: TrainConfig) -> tuple[str, str]:
    """``(source, split)`` of the validation data; ``eval_dataset`` wins, else the training
    source's validation split. ``'synthetic'`` means fresh random rows (another seed)."""
    from data import SAMPLE_VALIDATION

    source = cfg.eval_dataset or cfg.dataset
    if source == "sample":
        return str(SAMPLE_VALIDATION), VALIDATION_SPLIT
    return source, VALIDATION_SPLIT


def lacks_validation_split(cfg: TrainConfig) -> bool:
    """The validation data would be the training data's validation split, and that data has no
    splits: a data file or a single saved Dataset (a DatasetDict directory or a cached dataset
    name has them); loading it as "validation" would evaluate on the training rows."""
    if cfg.eval_dataset or cfg.dataset in ("sample", "synthetic"):
        return False
    path = Path(cfg.dataset).expanduser()
    return path.exists() and not (path / "dataset_dict.json").is_file()


__all__ = ["VALIDATION_SPLIT", "compiles_layers", "compute_dtype", "eval_source", "fuses_last_stage",
           "lacks_validation_split", "needs_norm"]
