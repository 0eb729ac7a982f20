"""Tokenized examples -> padded global batches, split into micro-batches on demand.

With packing, a row holds several examples (greedy, in data order) with ``position_ids``
restarting at 0 for each and ``segment_ids`` telling them apart: attention stays within a
segment (``pipeline.stage.model.segment_attend_mask``) and no target crosses a boundary.

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
        position_ids: packed rows only: each token's position in its own example (0, 1, ...
            restarting at every example; padding counts on as a segment of its own); None
            unpacked, where a token's position is its column.
        segment_ids: packed rows only: 1, 2, ... for the examples of a row, 0 for its padding;
            a token attends only to earlier tokens of its segment. None unpacked.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    targets: torch.Tensor
    num_targets: int
    position_ids: torch.Tensor | None = None
    segment_ids: torch.Tensor | None = None

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
                position_ids=None if self.position_ids is None else self.position_ids[rows_slice],
                segment_ids=None if self.segment_ids is None else self.segment_ids[rows_slice],
            ))
        return chunks

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The same batch with its tensors on ``device``."""
        return Batch(
            input_ids=self.input_ids.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            targets=self.targets.to(device, non_blocking=non_blocking),
            num_targets=self.num_targets,
            position_ids=to_device(self.position_ids, device, non_blocking),
            segment_ids=to_device(self.segment_ids, device, non_blocking),
        )


def to_device(t: torch.Tensor | None, device: torch.device | str, non_blocking: bool = False) -> torch.Tensor | None:
    """``t`` on ``device``; None (an unpacked batch's position or segment ids) stays None."""
    return None if t is None else t.to(device, non_blocking=non_blocking)


def row_width(longest: int, seq_length: int) -> int:
    """Columns of a batch whose longest row has ``longest`` tokens: rounded up to a multiple of 8,
    capped at ``seq_length``."""
    return min(-(-longest // PAD_MULTIPLE) * PAD_MULTIPLE, seq_length)


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
    width = row_width(longest, seq_length)
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


def collate_packed(rows: Sequence[Sequence[Example]], *, pad_id: int, seq_length: int) -> Batch:
    """Right-pad packed rows (each a list of examples laid end to end) into a ``Batch`` with
    ``position_ids`` and ``segment_ids``.

    Each example's targets are its own labels shifted by one, with ``-100`` at its last token:
    the last token of an example predicts nothing of the next (exactly the targets the example
    gets alone in a row). Padding gets ``pad_id``, ``-100``, segment 0 and positions 0, 1, ...
    """
    if not rows or not all(rows):
        raise ValueError("cannot collate an empty row or an empty list of rows")
    longest = max(sum(len(e) for e in row) for row in rows)
    if longest > seq_length:
        raise ValueError(f"a packed row has {longest} tokens, more than seq_length ({seq_length})")
    width = row_width(longest, seq_length)
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    targets = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    segment_ids = torch.zeros(shape, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    for r, row in enumerate(rows):
        start = 0
        for segment, example in enumerate(row, 1):
            n = len(example)
            cols = slice(start, start + n)
            input_ids[r, cols] = torch.tensor(example.input_ids, dtype=torch.long)
            labels[r, cols] = torch.tensor(example.labels, dtype=torch.long)
            targets[r, start:start + n - 1] = labels[r, start + 1:start + n]
            segment_ids[r, cols] = segment
            position_ids[r, cols] = torch.arange(n)
            start += n
        position_ids[r, start:] = torch.arange(width - start)
    num_targets = int((targets != IGNORE_INDEX).sum())
    return Batch(input_ids=input_ids, labels=labels, targets=targets, num_targets=num_targets,
                 position_ids=position_ids, segment_ids=segment_ids)


def pack_rows(lengths: Sequence[int], start: int, num_rows: int, seq_length: int) -> tuple[list[list[int]], int] | None:
    """Greedy packing in data order: ``num_rows`` rows of the items ``start, start + 1, ...``
    (their ``lengths``, each <= ``seq_length``), a row taking the next item while it fits and
    closing at the first that does not. Returns (rows of item indices, the next item), or None if
    the items run out before the last row is started."""
    rows: list[list[int]] = []
    used = seq_length  # tokens in the open row; seq_length: no row open yet
    i = start
    while i < len(lengths):
        if used + lengths[i] > seq_length:
            if len(rows) == num_rows:
                break
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += lengths[i]
        i += 1
    return (rows, i) if len(rows) == num_rows else None


# What a stream's saved position holds it to: a resumed stream must be built alike.
STREAM_KEYS = ("seed", "batch_size", "num_examples", "packing")


def stream_mismatches(saved: dict[str, Any], ours: dict[str, int]) -> list[str]:
    """How a checkpoint's saved stream ``saved`` (a ``state_dict``) differs from one whose state
    would be ``ours`` (the ``STREAM_KEYS`` known: before the data is tokenized, no
    ``num_examples``), one "key=theirs (this run key=ours)" each."""
    out = []
    for key in STREAM_KEYS:
        theirs, mine = int(saved.get(key, 0)), ours.get(key, 0)
        if (key in ours and key in saved or key == "packing") and theirs != mine:  # no packing key: 0
            out.append(f"{key}={theirs} (this run {key}={mine})")
    return out


class BatchStream:
    """Endless, deterministic stream of global batches over ``examples``.

    Each epoch visits the examples in the order ``np.random.default_rng(seed + epoch)
    .permutation(n)`` in batches of ``batch_size`` rows; the last incomplete batch of an
    epoch is dropped. With ``packing``, a row takes examples in that order while they fit in
    ``seq_length`` (``pack_rows``), so a batch holds ``batch_size`` rows of several examples.
    ``state_dict()`` captures (epoch, position), position counting examples, so a resumed
    stream yields exactly the batches the original would have.
    """

    def __init__(
        self,
        examples: Sequence[Example],
        batch_size: int,
        *,
        pad_id: int,
        seq_length: int,
        seed: int = 0,
        packing: bool = False,
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
        self.packing = packing
        self.epoch = 0
        self.position = 0  # examples of this epoch's order already served
        self._order: tuple[int, np.ndarray, list[int]] | None = None  # (epoch, permutation, lengths) cache
        if packing and self._plan(0, 0) is None:
            raise DataError(
                f"the dataset's {len(examples)} usable examples pack into fewer than one batch of "
                f"{batch_size} rows of seq_length={seq_length}; lower batch_size or add data"
            )

    def next_batch(self) -> Batch:
        """The next global batch; moves to the next epoch when this one has no full batch left."""
        plan = self._plan(self.epoch, self.position)
        if plan is None:
            self.epoch += 1
            self.position = 0
            plan = self._plan(self.epoch, 0)
            if plan is None:
                raise DataError(
                    f"epoch {self.epoch} of the dataset packs into fewer than one batch of {self.batch_size} "
                    f"rows of seq_length={self.seq_length}; lower batch_size or add data"
                )
        rows, self.position = plan
        if self.packing:
            return collate_packed([[self.examples[i] for i in row] for row in rows],
                                  pad_id=self.pad_id, seq_length=self.seq_length)
        return collate(
            [self.examples[row[0]] for row in rows], pad_id=self.pad_id, seq_length=self.seq_length
        )

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self.next_batch()

    def token_counts(self) -> dict[str, int]:
        """One epoch (the first) of batches counted from the examples' lengths, nothing collated:
        ``batches``, ``rows``, ``examples`` served, ``tokens`` of examples, of which ``targets``
        are trained (predicted), and ``padding`` tokens (the batches' columns no example covers)."""
        counts = dict(batches=0, rows=0, examples=0, tokens=0, targets=0, padding=0)
        order, lengths = self._order_and_lengths(0)
        for rows, _ in self._plan_epoch(0):
            for row in rows:
                for j in row:  # position 0 predicts nothing: its label is never a target
                    labels = self.examples[order[j]].labels
                    counts["targets"] += len(labels) - 1 - labels[1:].count(IGNORE_INDEX)
            row_tokens = [sum(lengths[j] for j in row) for row in rows]
            width = row_width(max(row_tokens), self.seq_length)
            counts["batches"] += 1
            counts["rows"] += len(rows)
            counts["examples"] += sum(len(row) for row in rows)
            counts["tokens"] += sum(row_tokens)
            counts["padding"] += width * len(rows) - sum(row_tokens)
        return counts

    def state_dict(self) -> dict[str, int]:
        state = {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_examples": len(self.examples),
        }
        # Only when packing: load_state_dict reads a missing key as unpacked, so an unpacked run's
        # state carries only the keys that every checkpoint of the stream has.
        if self.packing:
            state["packing"] = 1
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; the stream must be built over the same data and settings."""
        mine = self.state_dict()
        differ = stream_mismatches(state, mine)
        if differ:
            raise ValueError(f"cannot resume the batch stream: checkpoint has {', '.join(differ)}; use the same data "
                             "and settings")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])

    def _plan(self, epoch: int, position: int) -> tuple[list[list[int]], int] | None:
        """The rows (example indices) of the batch starting at ``position`` of ``epoch``'s order
        and the position after it, or None if the epoch has no full batch left there."""
        plan = self._rows_at(epoch, position)
        if plan is None:
            return None
        order = self._order_and_lengths(epoch)[0]
        return [[int(order[j]) for j in row] for row in plan[0]], plan[1]

    def _plan_epoch(self, epoch: int) -> list[tuple[list[list[int]], int]]:
        """Every batch of ``epoch``, rows as positions in its order (see ``_rows_at``)."""
        plans, position = [], 0
        while (plan := self._rows_at(epoch, position)) is not None:
            plans.append(plan)
            position = plan[1]
        return plans

    def _rows_at(self, epoch: int, position: int) -> tuple[list[list[int]], int] | None:
        """The rows, as positions in ``epoch``'s order, of the batch starting at ``position``, and
        the position after it; None if the epoch has no full batch left there."""
        order, lengths = self._order_and_lengths(epoch)
        if self.packing:
            return pack_rows(lengths, position, self.batch_size, self.seq_length)
        if position + self.batch_size > len(order):
            return None
        return [[j] for j in range(position, position + self.batch_size)], position + self.batch_size

    def _epoch_order(self) -> np.ndarray:
        return self._order_and_lengths(self.epoch)[0]

    def _order_and_lengths(self, epoch: int) -> tuple[np.ndarray, list[int]]:
        """``epoch``'s permutation of the examples and their lengths in that order."""
        if self._order is None or self._order[0] != epoch:
            rng = np.random.default_rng(self.seed + epoch)
            order = rng.permutation(len(self.examples))
            self._order = (epoch, order, [len(self.examples[i]) for i in order])
        return self._order[1], self._order[2]
