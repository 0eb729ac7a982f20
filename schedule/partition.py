"""How many decoder layers each stage holds, balanced by modelled cost (pure, no torch).

A stage's cost is its decoder layers plus what else it holds (the embedding, the head and its
loss), so equal layer counts leave the stage with the head, and the rank that runs it, the
slowest. With virtual stages a rank runs every stage mapped to it one after another, so the
balance that matters first is the ranks' (the sum of their stages), then the stages' (a slow
stage stalls its neighbours in the pipeline).
"""
from __future__ import annotations

from typing import Callable, Sequence

_REL_TIE = 1e-9  # relative: predicted step times closer than this are equal


def _key(counts: Sequence[int], layer: float, fixed: Sequence[float], mapping: Sequence[int],
         ranks_first: bool) -> tuple:
    stage = [c * layer + f for c, f in zip(counts, fixed)]
    rank = [0.0] * (max(mapping) + 1)
    for s, r in enumerate(mapping):
        rank[r] += stage[s]
    # Loads sorted from the largest: a move that lowers the largest without raising anything to
    # its level improves, even where several ranks share the largest load.
    by_rank, by_stage = tuple(sorted(rank, reverse=True)), tuple(sorted(stage, reverse=True))
    return (by_rank, by_stage) if ranks_first else (by_stage, by_rank)


def balance_layers(start: Sequence[int], layer: float, fixed: Sequence[float], mapping: Sequence[int],
                   ranks_first: bool = True) -> list[int]:
    """Layer counts per stage that minimise the loads, largest first: the ranks' loads then the
    stages' (``ranks_first``) or the other way round. A stage's load is ``count * layer +
    fixed[stage]``; a rank's the sum of its stages' (``mapping[s]`` is stage s's rank). Local
    search from ``start``: the best move of one layer between two stages while one improves; a
    stage with no layer in ``start`` gets none, every other keeps at least one. Deterministic."""
    counts = list(start)
    holders = [s for s, c in enumerate(counts) if c > 0]
    best = _key(counts, layer, fixed, mapping, ranks_first)
    while True:
        move = None
        for i in holders:
            if counts[i] <= 1:
                continue
            for j in holders:
                if i == j:
                    continue
                counts[i], counts[j] = counts[i] - 1, counts[j] + 1
                k = _key(counts, layer, fixed, mapping, ranks_first)
                counts[i], counts[j] = counts[i] + 1, counts[j] - 1
                if k < best:
                    best, move = k, (i, j)
        if move is None:
            return counts
        counts[move[0]] -= 1
        counts[move[1]] += 1


def choose_counts(start: Sequence[int], layer: float, fixed: Sequence[float], mapping: Sequence[int],
                  step_time: Callable[[list[int]], float]) -> list[int]:
    """The counts with the smallest ``step_time`` (the cost model's prediction) among ``start``
    and its two balanced forms (``balance_layers`` ranks first, stages first); ``start`` unless
    another is predicted strictly faster, so the answer is never predicted slower than ``start``."""
    candidates = [list(start)]
    for ranks_first in (True, False):
        c = balance_layers(start, layer, fixed, mapping, ranks_first)
        if c not in candidates:
            candidates.append(c)
    if len(candidates) == 1:
        return candidates[0]
    times = [step_time(c) for c in candidates]
    best = 0
    for i, t in enumerate(times):
        if t < times[best] * (1 - _REL_TIE):
            best = i
    return candidates[best]


__all__ = ["balance_layers", "choose_counts"]
