"""One runner per way of running a stage's work, chosen once per stage from its
``Mode``: the executor calls its ``forward``/``backward`` and the memory plan sums its
``account``, so what a mode does and what the plan counts for it cannot drift apart.

``RUNNERS`` is the registry, in the order they are asked (``applies``); the first that takes a
mode runs it. A new way of running a stage is one module with one class and a line here.
"""
from __future__ import annotations

from typing import Sequence

import torch

from pipeline.spec.run_spec import RunSpec
from pipeline.spec.shapes import segment_bounds, segment_lengths
from pipeline.runners.base import Iteration, Mode, Runner
from pipeline.runners.fused_last import FusedLast
from pipeline.runners.offloaded import HostActivations, OffloadedRows
from pipeline.runners.offloaded_segments import OffloadedSegments
from pipeline.runners.segmented import Segmented
from pipeline.runners.whole_rows import WholeRows
from schedule.ir import Action

RUNNERS: tuple[type, ...] = (FusedLast, OffloadedSegments, OffloadedRows, Segmented, WholeRows)


def runner_for(mode: Mode) -> type:
    """The runner class that runs a stage in ``mode``: the first of ``RUNNERS`` that takes it."""
    return next(r for r in RUNNERS if r.applies(mode))


class RankRunners:
    """The runners of one rank's stages, made once when the stages are built: one per stage for
    training and one for forward-only passes (evaluation), and what they share.

    Args:
        stages, stores: this rank's stages and their parameter stores, by stage id.
        spec: the run's spec: each stage's mode (``RunSpec.mode``), and ``seq_chunks`` and the
            attention's cost per key, by which a row is cut into segments
            (``pipeline.spec.shapes.segment_lengths``).
    """

    def __init__(self, stages: dict, stores: dict, spec: RunSpec, *, device: torch.device):
        self.num_segments, self.key_cost = spec.cfg.seq_chunks, spec.key_cost
        # stage inputs (and carried keys/values) in host memory between forwards and backwards
        offloads = any(spec.mode(s).activation_offload for s in stages)
        self.host = HostActivations(device, self.num_segments > 1) if offloads else None

        def make(training: bool) -> dict[int, Runner]:
            return {s: runner_for(spec.mode(s, training))(stage, stores[s], self.host) for s, stage in stages.items()}

        self.training, self.forward_only = make(True), make(False)

    @property
    def stash(self):
        """Stage inputs waiting in host memory (``activation_offload``), else None."""
        return self.host.stash if self.host is not None else None

    def cut(self, width: int) -> tuple[Sequence[int], list[tuple[int, int]]]:
        """The segment lengths and [start, end) columns of rows ``width`` columns wide (one
        segment, the whole row, without ``seq_chunks``)."""
        lengths = segment_lengths(width, self.num_segments, self.key_cost)
        return lengths, segment_bounds(lengths)

    def begin(self, it: Iteration, actions: list[Action]) -> dict[int, Runner]:
        """Start an iteration of ``actions``: the runners it uses, with fresh per-iteration state."""
        runners = self.training if it.training else self.forward_only
        if self.host is not None:
            self.host.begin(actions)
        for r in runners.values():
            r.begin(it)
        return runners

    def end(self, runners: dict[int, Runner]) -> None:
        """End the iteration: every micro-batch's backward (or last forward) freed what its runner
        held; what a forward-only pass kept goes now."""
        for r in runners.values():
            r.end_iteration()


__all__ = ["RUNNERS", "RankRunners", "Mode", "Runner", "runner_for"]
