"""Decoder layers per stage as counts, for the partition tests (tests/pure/test_partition.py,
tests/multi_process/test_gloo_partition.py)."""
from __future__ import annotations

from pipeline.spec.partition import stage_layers


def stage_counts(cfg, hf, ranks: int) -> list[int]:
    return [len(p) for p in stage_layers(cfg, hf, ranks)]
