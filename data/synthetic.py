"""Random-token examples for systems work (benchmarks with preset architectures, no data needed)."""
from __future__ import annotations

from typing import Sequence, overload

import numpy as np

from data.tokenization import Example


class SyntheticExamples(Sequence[Example]):
    """Rows of uniform random tokens, every token trained, held as one int32 array and made into
    ``Example``s when read: as Python lists the ids and labels of every row take about 44 bytes a
    token of host memory (0.75 GiB for the 64 rows of 256K tokens a long-row run draws), where the
    plan's allowance for a process (``footprint.PROCESS_HOST_BYTES``) has room for the array's 4."""

    def __init__(self, num_examples: int, seq_length: int, vocab_size: int, seed: int):
        rng = np.random.default_rng(seed)
        self.rows = rng.integers(1, vocab_size, size=(num_examples, seq_length)).astype(np.int32)

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, i: int) -> Example: ...

    @overload
    def __getitem__(self, i: slice) -> list[Example]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        row = self.rows[i].tolist()
        return Example(input_ids=row, labels=list(row))


def synthetic_examples(num_examples: int, seq_length: int, vocab_size: int, seed: int) -> SyntheticExamples:
    """``num_examples`` rows of ``seq_length`` uniform random tokens, every token trained."""
    return SyntheticExamples(num_examples, seq_length, vocab_size, seed)
