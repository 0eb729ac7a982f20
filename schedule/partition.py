"""How many decoder layers each stage holds, balanced by modelled cost (pure, no torch).

A stage's cost is its decoder layers plus what else it holds (the embedding, the head and its
loss), so equal layer counts leave the stage with the head, and the rank that runs it, the
slowest. With virtual stages a rank runs every stage mapped to it one after another, so the
balance that matters first is the ranks' (the sum of their stages), then the stages' (a slow
stage stalls its neighbours in the pipeline).
"""
from __future__ import annotations

from typing import Callable, Sequence

# A change of partition must be predicted this much faster (relative): below it the cost model's
# error decides, and a change moves memory between stages and a checkpoint's AdamW state with it.
MIN_GAIN = 1e-3


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
                  step_time: Callable[[list[int]], float], budget: int | None = None) -> list[int]:
    """Counts with a small ``step_time`` (the cost model's prediction): the fastest of ``start``
    and its two balanced forms (``balance_layers`` ranks first, stages first), then improved one
    layer move at a time while a move is predicted faster by ``MIN_GAIN``, within ``budget`` predictions
    (default ``4 * stages + 16``). The loads do not see the pipeline's fill and drain (a light
    first stage starts the others sooner), the prediction does. Deterministic; never predicted
    slower than ``start``, which wins unless another is ``MIN_GAIN`` faster.

    Moves are tried from the most loaded stage to the least loaded first; a stage with no layer
    in ``start`` gets none, every other keeps at least one."""
    budget = 4 * len(start) + 16 if budget is None else budget
    candidates = [list(start)]
    for ranks_first in (True, False):
        c = balance_layers(start, layer, fixed, mapping, ranks_first)
        if c not in candidates:
            candidates.append(c)
    times = [step_time(c) for c in candidates]
    best = 0
    for i, t in enumerate(times):
        if t < times[best] * (1 - MIN_GAIN):
            best = i
    counts, best_t, spent = candidates[best], times[best], len(times)
    improved = True
    while improved and spent < budget:
        improved = False
        loads = [c * layer + f for c, f in zip(counts, fixed)]
        order = sorted(range(len(counts)), key=lambda s: (-loads[s], s))
        for i, j in ((i, j) for i in order for j in reversed(order)):
            if i == j or counts[i] <= 1 or counts[j] == 0:
                continue
            if spent >= budget:
                break
            trial = list(counts)
            trial[i], trial[j] = trial[i] - 1, trial[j] + 1
            t = step_time(trial)
            spent += 1
            if t < best_t * (1 - MIN_GAIN):
                counts, best_t, improved = trial, t, True
                break
    return counts


__all__ = ["MIN_GAIN", "balance_layers", "choose_counts"]
