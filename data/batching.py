"""Tokenized examples -> padded global batches, split into micro-batches on demand.

``BatchStream`` is a pure function of (examples, batch_size, seed, state): every rank that
builds it from the same examples gets the same batches in the same order, which is how the
pipeline's first stage (inputs) and last stage (targets) agree without communicating.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from data.dataset import DataError
from data.tokenization import IGNORE_INDEX, Example

PAD_MULTIPLE = 8


@dataclass
class Batch:
    """A padded batch of rows, all tensors ``[B, T]`` int64 on the same device.

    Attributes:
        input_ids: token ids, right-padded with the pad id.
        labels: Hugging Face labels, aligned with ``input_ids``; ``-100`` where not trained.
        targets: ``labels`` shifted left by one, ``-100`` appended: ``targets[:, t]`` is the
            token to predict at position ``t``, so it stays right when a sequence is sliced.
        num_targets: number of entries of ``targets`` that are not ``-100`` (this batch's own
            count; normalise a micro-batch's loss by the global batch's count).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    targets: torch.Tensor
    num_targets: int

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_length(self) -> int:
        return self.input_ids.shape[1]

    def microbatches(self, num_chunks: int) -> list[Batch]:
        """Split the rows into ``num_chunks`` contiguous micro-batches of equal size."""
        if num_chunks < 1 or self.batch_size % num_chunks:
            raise ValueError(
                f"batch size ({self.batch_size}) must be divisible by the number of "
                f"micro-batches ({num_chunks}); change batch_size or num_chunks"
            )
        rows = self.batch_size // num_chunks
        chunks = []
        for i in range(num_chunks):
            rows_slice = slice(i * rows, (i + 1) * rows)
            targets = self.targets[rows_slice]
            chunks.append(Batch(
                input_ids=self.input_ids[rows_slice],
                labels=self.labels[rows_slice],
                targets=targets,
                # note: a host sync if the batch was moved to an accelerator; split on CPU.
                num_targets=int((targets != IGNORE_INDEX).sum()),
            ))
        return chunks

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The same batch with its tensors on ``device``."""
        return Batch(
            input_ids=self.input_ids.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            targets=self.targets.to(device, non_blocking=non_blocking),
            num_targets=self.num_targets,
        )


def collate(examples: Sequence[Example], *, pad_id: int, seq_length: int) -> Batch:
    """Right-pad ``examples`` into a ``Batch``.

    The width is the longest row rounded up to a multiple of 8, capped at ``seq_length``;
    padding gets ``pad_id`` in ``input_ids`` and ``-100`` in ``labels`` and ``targets``.
    """
    if not examples:
        raise ValueError("cannot collate an empty list of examples")
    longest = max(len(e.input_ids) for e in examples)
    if longest > seq_length:
        raise ValueError(f"an example has {longest} tokens, more than seq_length ({seq_length})")
    width = min(-(-longest // PAD_MULTIPLE) * PAD_MULTIPLE, seq_length)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        input_ids[row, :n] = torch.tensor(example.input_ids, dtype=torch.long)
        labels[row, :n] = torch.tensor(example.labels, dtype=torch.long)
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    num_targets = int((targets != IGNORE_INDEX).sum())
    return Batch(input_ids=input_ids, labels=labels, targets=targets, num_targets=num_targets)


class BatchStream:
    """Endless, deterministic stream of global batches over ``examples``.

    Each epoch visits the examples in the order ``np.random.default_rng(seed + epoch)
    .permutation(n)`` in batches of ``batch_size`` rows; the last incomplete batch of an
    epoch is dropped. ``state_dict()`` captures (epoch, position), so a resumed stream
    yields exactly the batches the original would have.
    """

    def __init__(
        self,
        examples: Sequence[Example],
        batch_size: int,
        *,
        pad_id: int,
        seq_length: int,
        seed: int = 0,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size ({batch_size}) must be >= 1")
        if len(examples) < batch_size:
            raise DataError(
                f"the dataset has {len(examples)} usable examples, fewer than one batch "
                f"(batch_size={batch_size}); lower batch_size or add data"
            )
        self.examples = examples
        self.batch_size = batch_size
        self.pad_id = pad_id
        self.seq_length = seq_length
        self.seed = seed
        self.epoch = 0
        self.position = 0  # rows of this epoch's order already served
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, permutation) cache

    @property
    def batches_per_epoch(self) -> int:
        return len(self.examples) // self.batch_size

    def next_batch(self) -> Batch:
        """The next global batch; moves to the next epoch when this one has no full batch left."""
        if self.position + self.batch_size > len(self.examples):
            self.epoch += 1
            self.position = 0
        rows = self._epoch_order()[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return collate(
            [self.examples[i] for i in rows], pad_id=self.pad_id, seq_length=self.seq_length
        )

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_examples": len(self.examples),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; the stream must be built over the same data and settings."""
        mine = self.state_dict()
        for key in ("seed", "batch_size", "num_examples"):
            if key in state and int(state[key]) != mine[key]:
                raise ValueError(
                    f"cannot resume the batch stream: checkpoint has {key}={state[key]}, "
                    f"this run has {key}={mine[key]}; use the same data and settings"
                )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])

    def _epoch_order(self) -> np.ndarray:
        if self._order is None or self._order[0] != self.epoch:
            rng = np.random.default_rng(self.seed + self.epoch)
            self._order = (self.epoch, rng.permutation(len(self.examples)))
        return self._order[1]
