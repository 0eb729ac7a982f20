"""The two ways through a run: ``train`` (resolve the automatic choices on rank 0, check that the
run fits, build this rank's parts, run the ``Trainer``, save) and ``plan_report`` (``--plan``: the
same path up to the programs, on rank 0 alone, with no weight loaded)."""
from __future__ import annotations

import torch

import schedule as sched
from pipeline.config import TrainConfig
from pipeline.dist import DistEnv, broadcast_object
from pipeline.plan.fit import assess_spec, assessment_report, gpu_capacity, machine_line
from pipeline.plan.layout import replica_config
from pipeline.plan.long_rows import longest_row_line
from pipeline.plan.placement import load_topology, plan_text
from pipeline.plan.preflight import build_model, read_model
from pipeline.plan.resolve import resolve_run
from pipeline.plan.source import ModelSource, needs_generated
from pipeline.run.executor import OutOfMemory
from pipeline.run.metrics import TrainingError
from pipeline.run.trainer import Trainer


def plan_report(cfg: TrainConfig, world_size: int) -> tuple[str, bool]:
    """The ``--plan`` report (rank 0 alone, before any process group exists) and whether the run
    fits (GPU and host memory, as training's check would find it)."""
    if cfg.model == "generated":
        build_model(cfg)
    source = read_model(cfg, world_size)
    whole, resolved = cfg, resolve_run(cfg, world_size, source.config)
    spec = resolved.spec
    cfg, world_size = spec.cfg, spec.num_ranks  # data_parallel: one replica's pipeline
    mapping = sched.round_robin(cfg.num_stages, world_size)
    a = assess_spec(spec, mapping, here=whole.data_parallel)
    first, *rest = assessment_report(a, spec, mapping).split("\n")
    text = "\n".join([first, machine_line(whole, whole.data_parallel * world_size), *rest])
    text += "".join(f"\n{line}" for line in resolved.lines)
    if spec.device == "cuda" and gpu_capacity(cfg) is not None:
        text += "\n" + longest_row_line(replica_config(whole), source.config, world_size)
    topo = load_topology(cfg, discover_ok=torch.cuda.is_available())
    if topo is not None:
        text += "\n" + plan_text(spec, topo)
    if whole.data_parallel > 1:
        text += (f"\ndata_parallel: {whole.data_parallel} replicas of this {world_size}-rank pipeline, "
                 f"{whole.data_parallel * world_size} processes; each replica runs {cfg.num_chunks} of the "
                 f"{whole.num_chunks} micro-batches of the global batch of {whole.batch_size}; per-rank memory as "
                 f"above; the host line counts every replica on one host, each holding 1/{whole.data_parallel} of "
                 f"the sharded stages' AdamW state")
    return text, a.fits


def shared_model(cfg: TrainConfig, env: DistEnv, source: ModelSource | None) -> ModelSource:
    """The model every rank trains: ``source``, what ``check_files`` read before the process group
    existed. A generated model not built then was built by rank 0's ``check_files``; the other
    ranks wait for it here (collective) and read it now."""
    if needs_generated(cfg):
        if env.rank == 0:
            build_model(cfg)  # nothing to do after check_files; train() called without it builds here
        broadcast_object(None)  # the others pass once rank 0 has the model
    return source or read_model(cfg, env.world_size)


def train(cfg: TrainConfig, env: DistEnv, source: ModelSource | None = None) -> list[dict]:
    """Train ``cfg`` (checked by ``check_config`` and ``check_files`` before the process group
    existed; ``source``: the model ``check_files`` read) on this rank, then save what it asks for."""
    from pipeline.plan.fit import check_fits

    source = shared_model(cfg, env, source)
    # Rank 0 makes the automatic choices (auto reads its GPU's size); every rank runs them.
    resolved = None
    if env.rank == 0:
        resolved = resolve_run(cfg, env.world_size, source.config)
        for line in resolved.lines:
            print(line, flush=True)
    resolved = broadcast_object(resolved)
    # Before any weight is read: a run that cannot fit stops here, with advice. What is checked
    # is one replica's pipeline; any mapping the placement picks gives each rank the stages of
    # some rank under round-robin, so the per-rank estimates are the same.
    spec = resolved.spec
    here = max(1, min(cfg.data_parallel, env.local_world_size // spec.num_ranks))  # the replicas on this node
    mapping = sched.round_robin(spec.num_stages, spec.num_ranks)
    check_fits(spec, mapping, here)
    trainer = Trainer(cfg, env, source, resolved)
    try:
        history = trainer.train()
    except OutOfMemory as e:  # one line with the plan's figure and what to change, not a traceback
        from pipeline.plan.fit import out_of_memory_line

        raise TrainingError(out_of_memory_line(e, spec, mapping, here)) from None
    cfg = trainer.cfg
    if trainer.start_iteration >= cfg.num_iterations:
        return history  # a finished run resumed: its outputs are there already
    trainer.save(history)
    return history


__all__ = ["plan_report", "shared_model", "train"]
