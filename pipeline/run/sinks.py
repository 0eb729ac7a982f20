"""Where the rows of ``metrics.jsonl`` also go (``report_to``): TensorBoard event files and
Weights & Biases. ``Metrics`` hands every row it writes to ``metrics.jsonl`` to each sink as
well, so the values are the file's by construction; ``scalars`` is the one mapping from a row
to named scalars, shared by both sinks.

Tags: ``train/<key>`` per step (loss, grad_norm, lr, tokens, tokens_per_s, tflops_per_gpu,
step_time_s, peak_mem_bytes of the loss rank, skipped as 0/1), ``eval/<key>`` per evaluation
(loss, perplexity, num_tokens, num_batches, time_s), and the summary's figures at the last step
(``summary/<key>``, ``summary/peak_mem_bytes_rank<r>`` for every rank). A ``null`` of
metrics.jsonl (a non-finite loss or norm) is NaN here.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Protocol

TENSORBOARD_DIR = "tensorboard"
WANDB_PROJECT = "mmoc-pipe"
# A row's keys that are not scalars of a step.
_NOT_SCALARS = ("kind", "step", "split", "peak_mem_bytes_per_rank", "resumed_after_step")


def scalars(row: dict) -> dict[str, float]:
    """The row's numbers as ``{tag: value}`` under its kind (``train/loss``, ``eval/perplexity``,
    ``summary/mean_step_time_s``, ``summary/peak_mem_bytes_rank0``)."""
    out = {}
    for key, value in row.items():
        if key in _NOT_SCALARS:
            continue
        if value is None or isinstance(value, (bool, int, float)):
            out[f"{row['kind']}/{key}"] = math.nan if value is None else float(value)
    for rank, value in enumerate(row.get("peak_mem_bytes_per_rank") or ()):
        out[f"summary/peak_mem_bytes_rank{rank}"] = float(value)
    return out


class Sink(Protocol):
    name: str  # report_to's name of it

    def write(self, row: dict, step: int) -> None:
        """One row of metrics.jsonl; ``step``: its step (a summary's: the last step)."""

    def close(self) -> None: ...


class TensorBoardSink:
    """Event files in ``save_dir/tensorboard`` (``torch.utils.tensorboard``; float32 values,
    the event format's). A fresh run removes the event files of a run it replaces; a resumed
    one writes from ``first_step + 1`` on, and TensorBoard drops the events of those steps
    that the abandoned continuation wrote (``purge_step``)."""

    name = "tensorboard"

    def __init__(self, save_dir: str | Path, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        path = Path(save_dir) / TENSORBOARD_DIR
        if not first_step and path.is_dir():  # metrics.jsonl is truncated alike
            for old in path.glob("events.out.tfevents.*"):
                old.unlink()
        self.writer = SummaryWriter(log_dir=str(path), purge_step=first_step + 1 if first_step else None)

    def write(self, row: dict, step: int) -> None:
        for tag, value in scalars(row).items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # as metrics.jsonl: a run that dies keeps every row written so far

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run (``WANDB_MODE=offline`` writes it under ``save_dir/wandb`` with no
    network; ``WANDB_PROJECT`` names the project). wandb is imported only here: it is optional."""

    name = "wandb"

    def __init__(self, save_dir: str | Path, config: dict):
        import os

        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", WANDB_PROJECT), dir=str(save_dir),
                              name=Path(save_dir).resolve().name, config=config)

    def write(self, row: dict, step: int) -> None:
        values = scalars(row)
        if row["kind"] == "summary":
            self.run.summary.update(values)
        else:
            self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def open_sink(name: str, save_dir: str | Path, first_step: int, config: dict) -> Sink:
    """The sink ``name`` of ``report_to`` (``pipeline.config.report_targets``), on the writing rank."""
    return TensorBoardSink(save_dir, first_step) if name == "tensorboard" else WandbSink(save_dir, config)


__all__ = ["TENSORBOARD_DIR", "Sink", "TensorBoardSink", "WandbSink", "open_sink", "scalars"]
