"""Random-token examples for systems work (benchmarks with preset architectures, no data needed)."""
from __future__ import annotations

import numpy as np

from data.tokenization import Example


def synthetic_examples(num_examples: int, seq_length: int, vocab_size: int, seed: int) -> list[Example]:
    """``num_examples`` rows of ``seq_length`` uniform random tokens, every token trained."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(1, vocab_size, size=(num_examples, seq_length)).tolist()
    return [Example(input_ids=r, labels=list(r)) for r in rows]
