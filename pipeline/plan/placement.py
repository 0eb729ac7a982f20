"""Which rank runs which stage: the ``mapping`` setting, resolved once on rank 0 and broadcast.

The decision itself is pure (``schedule.mapping.choose_mapping``); this module only gathers
its inputs (the GPU topology, the stage sizes) and makes sure every rank uses the same answer.
Rank 0 decides and broadcasts, because discovery runs ``nvidia-smi`` and reads sysfs, and two
ranks reading a flaky tool could disagree (a mismatched stage -> rank mapping would deadlock).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pipeline.config import ConfigError, TrainConfig
from pipeline.dist import DistEnv
from pipeline.spec.run_spec import RunSpec, build_run_spec
from pipeline.spec.shapes import stage_param_counts
from pipeline.plan.topology import GpuLink, Topology, discover, load_topology_file
from schedule.mapping import MappingChoice, choose_mapping, describe_plan


@dataclass(frozen=True)
class Placement:
    """The chosen mapping and the facts it was chosen from.

    Attributes:
        choice: stage -> rank mapping, start offsets and the reason line.
        rank_groups: root group of each rank's GPU, None if unknown.
        rank_link_gbps: host link GB/s of each rank's GPU, None if unknown.
        stage_bytes: bytes one LOAD of each stage moves (compute dtype).
    """

    choice: MappingChoice
    rank_groups: list[int] | None
    rank_link_gbps: list[float] | None
    stage_bytes: list[int]


def visible_gpus() -> list[int] | None:
    """``CUDA_VISIBLE_DEVICES`` as GPU indices; None when unset or not plain indices (UUIDs, MIG)."""
    text = os.environ.get("CUDA_VISIBLE_DEVICES")
    if text is None or not text.strip():
        return None
    parts = [p.strip() for p in text.split(",")]
    return [int(p) for p in parts] if all(p.isdigit() for p in parts) else None


def local_gpus(topo: Topology, count: int) -> list[GpuLink] | None:
    """The topology's entry for the GPU of each of the first ``count`` local ranks (local rank r
    runs on the r-th visible GPU, ``pick_device``), or None when the topology lacks one of them."""
    by_index = {g.index: g for g in topo.gpus}
    order = (visible_gpus() or topo.indices())[:count]
    if len(order) < count or any(i not in by_index for i in order):
        return None
    return [by_index[i] for i in order]


def rank_topology(topo: Topology | None, env: DistEnv) -> tuple[list[int] | None, list[float] | None, str]:
    """Root group and link speed of the GPU each rank runs on, or (None, None, why not).

    Rank r runs on the ``local_rank``-th visible GPU (``pick_device``); visible GPUs are
    ``CUDA_VISIBLE_DEVICES`` in its order, else every GPU of the topology in index order.
    """
    if topo is None:
        return None, None, "topology unknown"
    if env.world_size != env.local_world_size:
        return None, None, f"{env.world_size} ranks over several hosts: topology is per host"
    gpus = local_gpus(topo, env.world_size)
    if gpus is None:
        return None, None, (f"topology ({topo.source}) has GPUs {topo.indices()}, ranks need "
                            f"{env.world_size} of visible GPUs {visible_gpus() or topo.indices()}")
    return [g.root for g in gpus], [g.bandwidth_gbps for g in gpus], ""


def load_topology(cfg: TrainConfig, discover_ok: bool) -> Topology | None:
    """The ``topology`` file when one is given (``preflight.check_config`` read it before
    launch), else this machine's (when ``discover_ok``)."""
    if cfg.topology:
        return load_topology_file(cfg.topology)
    return discover() if discover_ok else None


def decide_placement(spec: RunSpec, env: DistEnv, device: torch.device) -> Placement:
    """The mapping of ``spec``'s stages onto the ``env.world_size`` ranks of one pipeline."""
    cfg = spec.cfg
    elem = torch.empty(0, dtype=spec.dtype).element_size()
    stage_bytes = [n * elem for n in stage_param_counts(spec.model, spec.num_stages, list(spec.parts))]
    topo = load_topology(cfg, discover_ok=device.type == "cuda" and cfg.mapping == "planned")
    groups, links, why = rank_topology(topo, env)
    try:
        choice = choose_mapping(
            cfg.mapping, env.world_size, spec.program, rank_groups=groups, rank_link_gbps=links,
            stage_bytes=stage_bytes, tokens_per_microbatch=cfg.batch_size // cfg.num_chunks * cfg.seq_length,
            tflops=cfg.plan_tflops, has_gpus=device.type == "cuda", stagger=cfg.stagger_loads,
            visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            topology_source=topo.source if topo is not None else "")
    except ValueError as e:
        raise ConfigError(f"{e}{f' ({why})' if why else ''}") from None
    return Placement(choice, groups, links, stage_bytes)


def plan_text(spec: RunSpec, topology: Topology) -> str:
    """``schedule.mapping.describe_plan`` for a run's spec (for ``--plan``); assumes bf16
    parameters, ``cfg.plan_tflops``, and one rank per GPU of ``topology``: where those are
    another number than the spec's ranks, the stages are cut for them."""
    if len(topology.groups()) != spec.num_ranks:
        spec = build_run_spec(spec.cfg, spec.model, len(topology.groups()), spec.device)
    cfg = spec.cfg
    params = stage_param_counts(spec.model, cfg.num_stages, list(spec.parts))
    return describe_plan(topology.groups(), params, spec.program, cfg.seq_length,
                         cfg.batch_size // cfg.num_chunks, gpu_ids=topology.indices(),
                         link_gbps=topology.link_gbps(), tflops=cfg.plan_tflops)


__all__ = ["Placement", "load_topology", "local_gpus", "plan_text", "rank_topology", "visible_gpus"]
