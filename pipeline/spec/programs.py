"""A run's programs: the ``ProgramSpec`` its configuration defines, and the programs built from it.

The run, the memory plan, the cost partition and the placement all take the spec from
``program_spec``, so the program they reason about is the one that runs, TIE actions included.
"""
from __future__ import annotations

import schedule as sched
from models import tied
from pipeline.config import TrainConfig
from pipeline.spec.settings import needs_norm
from schedule.spec import ProgramSpec


def tied_across_stages(num_stages: int, hf_config) -> bool:
    """Whether the model's embedding and head are one matrix (``tie_word_embeddings``) held by
    two stages: the first stage's copy and the last stage's, whose gradients a TIE action sums.
    One stage holds it once, as one Parameter. The one place this is decided."""
    return tied(hf_config) and num_stages > 1


def trains_tied_copies(cfg: TrainConfig, hf_config) -> bool:
    """Two stages train copies of a tied matrix (TIE actions sum their gradients): tied across
    stages, and not LoRA, where both copies are frozen."""
    return tied_across_stages(cfg.num_stages, hf_config) and not cfg.lora_rank


def program_spec(cfg: TrainConfig, hf_config) -> ProgramSpec:
    """The spec of ``cfg``'s programs for the model ``hf_config``; ``cfg`` is one pipeline's
    (``Resolved.replica``: its ``num_chunks`` are one replica's micro-batches). An unresolved
    ``resident_stages`` (-1, the memory plan's candidates before ``resolve``) counts as 0."""
    return ProgramSpec(cfg.schedule, cfg.num_stages, cfg.num_chunks, offload=cfg.use_offload,
                       prefetch=cfg.use_prefetch, clip=needs_norm(cfg), resident=max(cfg.resident_stages, 0),
                       tied=trains_tied_copies(cfg, hf_config), num_segments=cfg.seq_chunks,
                       receive_ahead=cfg.receive_ahead, device_steps=cfg.device_steps)


def build_programs(spec: ProgramSpec, mapping: list[int], position: int, *, evaluate: bool,
                   show: bool = False) -> tuple[sched.Schedule, list, list]:
    """Every rank's training program, this rank's list of it, and this rank's forward-only list
    (validation runs the same stages with no B and no optimizer; empty unless ``evaluate``).
    ``show`` prints every rank's program (``debug_schedule``)."""
    schedule = spec.build(mapping)
    eval_actions = spec.build_forward(mapping)[position] if evaluate else []
    if show:
        print(sched.format_schedule(schedule), flush=True)
    return schedule, schedule[position], eval_actions


__all__ = ["ProgramSpec", "build_programs", "program_spec", "tied_across_stages", "trains_tied_copies"]
