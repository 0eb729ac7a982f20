"""A rank's parts of the job, each made by a small builder (``build_*``): device, placement, log,
weights, data, programs, stages and their stores, p2p and the executor, into a ``Rank``
(``build_rank``); the ``Trainer`` runs them. Nothing here decides an automatic choice or derives
a fact of the run: ``resolve`` made the choices, and each builder reads the run's spec
(``Resolved.spec``)."""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

import schedule as sched
from models import spec_for
from offload.cpus import intra_op_threads, node_cpus, optimizer_cpus, pin_current_thread
from offload.loader import Workers
from offload.store import make_store
from offload.streams import BufferPool, Streams
from pipeline.config import ConfigError, TrainConfig
from pipeline.dist import DistEnv, Log, broadcast_object, cap_gpu_memory, pick_device
from pipeline.plan.layout import Layout, layout, shards_step
from pipeline.spec.lora import LoraSettings
from pipeline.plan.placement import Placement, decide_placement, load_topology, local_gpus
from pipeline.spec.programs import build_programs
from pipeline.plan.resolve import Resolved, resolve_run
from pipeline.spec.run_spec import RunSpec
from pipeline.plan.source import ModelSource, resolve_model
from pipeline.run import checkpoint
from pipeline.run.comm import P2P
from pipeline.run.evaluate import build_eval_batches
from pipeline.run.executor import Executor
from pipeline.run.optim import LossScaler, optim_settings
from pipeline.run.replicas import GradSync, shard_peers
from pipeline.runners import RankRunners
from pipeline.stage import attention, lora
from pipeline.stage.model import build_stage, compile_layers
from pipeline.stage.quantized import packed_weights
from pipeline.stage.router_loss import RouterLoss

if TYPE_CHECKING:
    from data import BatchStream


def build_stream(cfg: TrainConfig, source: ModelSource):
    from data import SAMPLE_TRAIN, BatchStream, load_records, tokenize_records
    from data.synthetic import synthetic_examples

    if cfg.dataset == "synthetic":
        examples = synthetic_examples(max(cfg.batch_size * 4, 64), cfg.seq_length, source.config.vocab_size, cfg.seed)
        return BatchStream(examples, cfg.batch_size, pad_id=0, seq_length=cfg.seq_length, seed=cfg.seed,
                           packing=cfg.packing), ""
    # preflight.load_tokenizer checked before launch that it exists and fits the vocabulary
    assert source.tokenizer_dir is not None, "preflight.check_files refuses data without a tokenizer"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.tokenizer_dir)
    records = load_records(str(SAMPLE_TRAIN) if cfg.dataset == "sample" else cfg.dataset, cfg.dataset_split)
    stats: dict[str, int] = {}
    examples, skipped = tokenize_records(records, tokenizer, cfg.seq_length, stats=stats)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    no_target = skipped - stats["unusable"]
    summary = (f"data: {len(examples)} records, {stats['truncated']} truncated to seq_length={cfg.seq_length}"
               + (f" ({stats['summary_cut']} with the summary cut to keep a quarter of it for the document)"
                  if stats["summary_cut"] else "") + f", {skipped} skipped"
               + (f" ({stats['unusable']} with a missing or empty field, {no_target} with no trainable token left "
                  f"within seq_length={cfg.seq_length} or refused by the chat template)" if skipped else ""))
    return BatchStream(examples, cfg.batch_size, pad_id=pad, seq_length=cfg.seq_length, seed=cfg.seed,
                       packing=cfg.packing), summary


def token_line(stream, packing: bool) -> str:
    """What one epoch (the first) trains on: tokens of records against padding, and why records
    are left out of it or packing packed none."""
    c = stream.token_counts()
    total = c["tokens"] + c["padding"]
    line = (f"tokens: an epoch is {c['batches']} batches, {c['examples']} records in {c['rows']} rows "
            f"({'packed' if packing else 'one record a row'}): {c['tokens']} record tokens ({c['targets']} trained), "
            f"{c['padding']} padding ({100 * c['padding'] / max(total, 1):.1f}% of the rows' tokens)")
    if packing and c["rows"] == c["examples"]:
        line += (f"; nothing packed: no record fits beside the next within seq_length={stream.seq_length} (a record "
                 f"has {c['tokens'] // max(c['examples'], 1)} tokens on average; a longer seq_length packs some)")
    left = len(stream.examples) - c["examples"]
    if left:
        line += (f"; {left} records left out of this epoch: too few for a last full batch of {stream.batch_size} rows "
                 "(the next epoch's shuffle leaves out others)")
    return line


def rank_cpus(cfg: TrainConfig, env: DistEnv, device: torch.device) -> list[int]:
    """This rank's share of the host's cores: of its GPU's NUMA node where known (offload/cpus.py)."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        list(range(os.cpu_count() or 1))
    gpu_numa: list[int | None] = [None] * env.local_world_size
    if device.type == "cuda":  # the NUMA node of each local rank's GPU: topology file, else discovery
        topo = load_topology(cfg, discover_ok=True)
        gpus = local_gpus(topo, env.local_world_size) if topo is not None else None
        if gpus is not None:
            gpu_numa = [g.numa for g in gpus]
    return optimizer_cpus(env.local_rank, gpu_numa, node_cpus(), allowed)


def adamw_cpus(cfg: TrainConfig, share: list[int]) -> list[int]:
    """The cores of ``share`` the CPU optimizer's threads run on."""
    if cfg.optimizer_threads:
        return share[:cfg.optimizer_threads]
    # Two cores of the share stay free for this rank's main thread (it launches the GPU's
    # work: starved by busy optimizer threads, it left a GPU idle for half its compute time)
    # and its loader and communication threads.
    return share[2:] if len(share) >= 6 else share


@dataclass
class Rank:
    """One rank's parts of the job, made by ``build_rank``'s steps; the ``Trainer`` runs them.

    Attributes:
        cfg: the resolved configuration (``Resolved.cfg``: the global batch, all replicas).
        spec: one pipeline's run spec (``Resolved.spec``): each stage's layers and mode, the
            kernels, the programs' spec, the adapters, the compute dtype.
        placement: the stage -> rank mapping and why (``placement.choice``).
        loss_rank: the global rank whose loss and metrics are reported (replica 0's last stage).
        schedule: every rank's program; ``actions`` and ``eval_actions`` are this rank's.
        stages, stores: this rank's stages and their parameter stores, by stage id.
        replicas: the gradient sum over the replicas (``data_parallel`` > 1), else None.
    """

    cfg: TrainConfig
    spec: RunSpec
    env: DistEnv
    source: ModelSource
    device: torch.device
    layout: Layout
    placement: Placement
    loss_rank: int
    log: Log
    resume_point: checkpoint.ResumePoint | None
    stream: BatchStream
    eval_batches: list
    schedule: sched.Schedule
    actions: list
    eval_actions: list
    stages: dict
    stores: dict
    streams: Streams
    replicas: GradSync | None
    executor: Executor
    scaler: LossScaler | None

    @property
    def mapping(self) -> list[int]:
        return self.placement.choice.stage_to_rank

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype

    @property
    def parts(self) -> list[range]:
        """Each stage's decoder layers (``RunSpec.parts``)."""
        return list(self.spec.parts)

    @property
    def adapters(self) -> LoraSettings | None:
        """LoRA's settings (the stores train the adapters only), None for full fine-tuning."""
        return self.spec.adapters


def resolve_placement(spec: RunSpec, env: DistEnv, device: torch.device) -> Placement:
    """Rank 0 decides the mapping of one pipeline's stages, every rank gets the same
    ``Placement`` or rank 0's refusal (collective)."""
    size = spec.num_ranks
    result: Placement | ConfigError | None = None
    if env.rank == 0:
        try:
            result = decide_placement(spec, DistEnv(env.rank, size, env.local_rank, min(env.local_world_size, size)),
                                      device)
        except ConfigError as e:
            result = e
    result = broadcast_object(result)
    if isinstance(result, ConfigError):
        raise result
    return result


def build_device(cfg: TrainConfig, env: DistEnv) -> torch.device:
    """This rank's device, capped at ``gpu_memory_gb``."""
    device = pick_device(cfg.device, env)
    if device.type == "cuda" and cfg.gpu_memory_gb:
        cap_gpu_memory(device, cfg.gpu_memory_gb)
    return device


def build_log(cfg: TrainConfig, env: DistEnv, lay: Layout, placement: Placement) -> tuple[int, Log]:
    """The global rank whose loss is reported (replica 0's last stage) and this rank's logger,
    which speaks when that rank is this one; the placement's reason logged."""
    loss_rank = lay.global_rank(placement.choice.stage_to_rank[-1], replica=0)  # replica 0's speaks
    log = Log(env.rank, speaker=loss_rank)
    if cfg.data_parallel > 1 and env.rank == 0 and env.local_world_size % lay.pipeline_size:
        # torchrun numbers a node's processes consecutively: whole replicas per node need a multiple of P
        log.warn(f"{env.local_world_size} processes per node is not a multiple of the pipeline's "
                 f"{lay.pipeline_size} ranks: some replicas span nodes, and their activations cross the network")
    log.info(placement.choice.reason)
    return loss_rank, log


def build_weights(cfg: TrainConfig, spec: RunSpec, source: ModelSource, resume_point: checkpoint.ResumePoint | None,
                  log: Log) -> tuple:
    """(the directory the stages read their weights from, the saved adapter LoRA starts from or
    None). A checkpoint is a Hugging Face directory: its shards are the fp32 masters to resume
    from. LoRA: the base weights are the model's; a checkpoint holds only the adapters."""
    adapters = spec.adapters
    if adapters is None:
        return (resume_point.path if resume_point else source.weights_dir), None
    adapter_dir = checkpoint.adapter_dir(resume_point.path) if resume_point else (cfg.lora_adapter or None)
    log.info(f"lora: rank {adapters.rank}, alpha {adapters.alpha:g}, dropout {adapters.dropout:g} on "
             f"{','.join(adapters.targets)}; adapters "
             + (f"from {adapter_dir}" if adapter_dir else "initialised (peft's scheme, seeded)"))
    return source.weights_dir, adapter_dir


def build_data(cfg: TrainConfig, source: ModelSource, log: Log) -> tuple[BatchStream, list]:
    """The training batch stream and the validation batches (none without ``eval_every``)."""
    stream, data_line = build_stream(cfg, source)
    if data_line:
        log.info(data_line)
    log.info(token_line(stream, cfg.packing))
    return stream, build_eval_batches(cfg, source) if cfg.eval_every else []


def _log_layers(log: Log, cfg: TrainConfig, spec: RunSpec, device: torch.device) -> None:
    """How the stages' decoder layers hold their weights and compute: 4-bit, tiled, compiled."""
    base = spec.adapters.base if spec.adapters is not None else None
    if base is not None:
        log.info(f"load_in_4bit: the decoder layers' linear weights in {base.describe()} (bitsandbytes, blocks of "
                 f"{base.blocksize}, compute {str(spec.dtype).removeprefix('torch.')}), quantized on {device.type} "
                 "as each layer is read; the embedding, norms and head in the compute dtype")
    if spec.kernels.mlp_tile_tokens:
        log.info(f"tiled_mlp: each decoder layer's MLP runs in tiles of {spec.kernels.mlp_tile_tokens} tokens, each "
                 "recomputed in its backward")
    if spec.kernels.compiled:
        log.info(f"compile_layers {cfg.compile_layers}: decoder layers run through torch.compile (the first step "
                 "compiles them)")


def build_stages(cfg: TrainConfig, spec: RunSpec, env: DistEnv, stage_ids: list[int], offloaded: list[int],
                 weights_dir, device: torch.device, replicas: GradSync | None, log: Log,
                 adapter_dir=None, device_stepped: frozenset[int] = frozenset()) -> tuple[dict, dict, Streams]:
    """This rank's stages (only those are ever built) and their stores, as ``spec`` cuts and runs
    them (``cfg``: the whole run's settings, all replicas). LoRA (``spec.adapters``): peft's
    adapters go into every stage, from ``adapter_dir`` (a saved peft adapter) or their seeded
    initial values; the base weights are frozen. ``device_stepped``: the offloaded stages whose
    AdamW runs on the device (``ProgramSpec.device_stepped``)."""
    S, hf, dtype, adapters = spec.num_stages, spec.model, spec.dtype, spec.adapters
    streams, pool = Streams(device), BufferPool(device)
    workers, share = None, []
    if offloaded and adapters is None:  # LoRA: no CPU optimizer step, the adapters step on the device
        # torchrun sets OMP_NUM_THREADS=1; the optimizer thread gets this rank's share of the cores.
        share = rank_cpus(cfg, env, device)
        cpus = adamw_cpus(cfg, share)
        workers = Workers(ThreadPoolExecutor(1, thread_name_prefix="cpu-adamw", initializer=pin_current_thread,
                                             initargs=(cpus,)), device)
        log.info(f"optimizer: {len(cpus)} CPU threads per process (rank {env.rank}: cores {cpus[0]}-{cpus[-1]})")
    stages, stores = {}, {}
    base = adapters.base if adapters is not None else None
    attention.use_backend(cfg.attention_backend)
    _log_layers(log, cfg, spec, device)
    built = placed = 0.0  # seconds: weights made or read; weights, gradients and AdamW state placed
    # Start-up zeroes and copies tens of GB of host state: on the rank's share of the cores,
    # not torchrun's one thread.
    with intra_op_threads(len(share) or torch.get_num_threads()):
        for s in stage_ids:
            t0 = time.perf_counter()
            # activation_offload: the backward recomputes the stage whole, once, so no layer of it is
            # checkpointed (recomputed) a second time inside that recompute
            stage = build_stage(hf, s, S, spec.parts[s], model_dir=weights_dir, seed=cfg.seed,
                                checkpointing=cfg.activation_checkpointing,
                                kept_layers=len(spec.parts[s]) if cfg.activation_offload else spec.kept[s],
                                init_device=device, mlp_tile_tokens=spec.kernels.mlp_tile_tokens, base_4bit=base,
                                dtype=dtype)
            if adapters is not None:
                lora.inject(stage, adapters)
                if adapter_dir is not None:
                    lora.load_adapter(stage, adapter_dir)
                else:
                    lora.init_adapters(stage, cfg.seed)
            stage.buffers_to(device)
            if spec.kernels.compiled:
                compile_layers(stage)
            t1 = time.perf_counter()
            # Fused AdamW everywhere (CPU and CUDA kernels): one pass over the state, and the clip
            # coefficient rides in as its grad_scale, so every offload mode does the same arithmetic.
            # LoRA: the tied matrix is frozen, both copies as loaded; the adapters step on the device.
            numel = sum(p.numel() for p in stage.parameters())
            shard = shard_peers(replicas) if shards_step(cfg, s in offloaded, stage.tied_name is not None,
                                                         numel) else None
            stores[s] = make_store(stage, offload=s in offloaded, delayed=cfg.delayed_update,
                                   device_step=s in device_stepped, frozen=adapters is not None,
                                   packed=packed_weights(stage) if base else (), summed=replicas is not None,
                                   device=device, compute_dtype=dtype,
                                   optim=optim_settings(cfg, fused=True), streams=streams, pool=pool, workers=workers,
                                   tied=stage.tied_name if adapters is None else None, tied_copy=s == S - 1,
                                   shard=shard)
            stages[s] = stage
            built, placed = built + t1 - t0, placed + time.perf_counter() - t1
    _log_stores(log, cfg, env, stage_ids, stores, device_stepped, replicas)
    log.info(f"start-up (rank {env.rank}): stages built in {built:.1f}s, their weights, gradients "
             f"and AdamW state placed in {placed:.1f}s")
    return stages, stores, streams


def _log_stores(log: Log, cfg: TrainConfig, env: DistEnv, stage_ids: list[int], stores: dict,
                device_stepped: frozenset[int], replicas: GradSync | None) -> None:
    """Which of this rank's stages step on the GPU, and which share their CPU step with the replicas."""
    if device_stepped & set(stage_ids):
        log.info(f"optimizer: stages {sorted(device_stepped & set(stage_ids))} step on the GPU (device_steps "
                 f"{cfg.device_steps}), their AdamW moments there; the CPU steps the other offloaded stages")
    sharded = [s for s in stage_ids if stores[s].shard is not None]
    if sharded:
        mine = sum(hi - lo for lo, hi in (stores[s].shard_range for s in sharded))
        log.info(f"data_parallel: the CPU AdamW steps of stages {sharded} are sharded over "
                 f"{cfg.data_parallel} replicas (rank {env.rank} steps {mine} of "
                 f"{sum(stores[s].numel for s in sharded)} parameters; "
                 + ("the peers on this node share one copy of the masters and sum their gradients in host memory)"
                    if replicas.shared else "gradients summed and stepped ranges exchanged over gloo)"))


def build_router_loss(cfg: TrainConfig, hf, stages: dict, device: torch.device) -> RouterLoss | None:
    """A mixture-of-experts model's router loss, where its config asks for it (``models.moe``)."""
    moe = spec_for(hf).moe
    if moe is None or moe.aux_coef(hf) == 0:
        return None
    routed = sum(moe.sparse(hf, i) for i in range(hf.num_hidden_layers))
    return RouterLoss(stages, moe.experts(hf), moe.aux_coef(hf), routed, cfg.num_chunks, device)


def build_executor(cfg: TrainConfig, spec: RunSpec, lay: Layout, placement: Placement, stages: dict, stores: dict,
                   replicas: GradSync | None, device: torch.device) -> Executor:
    """This rank's executor: p2p to the other ranks, and each stage's runners, chosen once here
    from its mode (``pipeline.runners``)."""
    mapping, position = placement.choice.stage_to_rank, lay.position
    p2p = P2P(mapping, timeout_s=cfg.comm_timeout_s, tied=spec.program.tied, replicas=cfg.data_parallel)
    runners = RankRunners(stages, stores, spec, device=device)
    return Executor(position, stores, mapping, p2p, runners, device=device, dtype=spec.dtype,
                    hidden_size=spec.model.hidden_size, grad_clip=cfg.grad_clip, replicas=replicas,
                    start_offset_s=placement.choice.start_offset_s[position],
                    router_loss=build_router_loss(cfg, spec.model, stages, device))


def build_rank(cfg: TrainConfig, env: DistEnv, source: ModelSource | None = None,
               resolved: Resolved | None = None) -> Rank:
    """Build everything this rank runs: device, placement, data, programs, stages and stores,
    p2p and executor, each by its step from the run's spec, which none of them derives again.
    Collective (the placement's broadcast, the replicas' groups, the resume point): every rank
    calls it alike.

    Args:
        resolved: the automatic choices and the spec, made by ``train()`` on rank 0; without it
            (tests) this rank makes them.
    """
    device = build_device(cfg, env)
    source = source or resolve_model(cfg, env.world_size)
    resolved = resolved or resolve_run(cfg, env.world_size, source.config)
    cfg, spec = resolved.cfg, resolved.spec
    # rank 0 derived the spec (its dtype, kernels) for the device it saw; every rank computes on one alike
    assert spec.device == device.type, f"the run spec is for {spec.device}, this rank computes on {device.type}"
    # data_parallel: this process is pipeline rank ``position`` of replica ``lay.replica``;
    # schedules, placement and plans are of one replica's pipeline (pipeline.run.replicas)
    lay = layout(cfg, env.rank, env.world_size)
    # Collective: rank 0 picks the stage -> rank mapping (config `mapping`), every rank gets it.
    placement = resolve_placement(spec, env, device)
    mapping = placement.choice.stage_to_rank
    loss_rank, log = build_log(cfg, env, lay, placement)
    resume_point = checkpoint.find_resume(cfg.resume, cfg.save_dir, env, log)
    weights_dir, adapter_dir = build_weights(cfg, spec, source, resume_point, log)
    stream, eval_batches = build_data(cfg, source, log)
    schedule, actions, eval_actions = build_programs(spec.program, mapping, lay.position, evaluate=cfg.eval_every > 0,
                                                     show=cfg.debug_schedule and env.rank == 0)
    checkpoint.check_resume_partition(resume_point, spec.num_stages, list(spec.parts), cfg.partition)  # before loading
    stage_ids = sched.stages_of(lay.position, mapping)
    # With offload, the stages the program never loads stay on the GPU (resident_stages), AdamW
    # included: the program is the one record of which stages those are.
    loaded = sched.offloaded_stages(schedule)
    torch.manual_seed(cfg.seed)
    # Before the stores (their sharded steps use its groups), on every rank alike: group
    # creation is collective.
    replicas = GradSync(lay, cfg.comm_timeout_s, pin=device.type == "cuda") if cfg.data_parallel > 1 else None
    stages, stores, streams = build_stages(cfg, spec, env, stage_ids, [s for s in stage_ids if s in loaded],
                                           weights_dir, device, replicas, log, adapter_dir,
                                           spec.program.device_stepped(mapping))
    return Rank(cfg=cfg, spec=spec, env=env, source=source, device=device, layout=lay, placement=placement,
                loss_rank=loss_rank, log=log, resume_point=resume_point, stream=stream, eval_batches=eval_batches,
                schedule=schedule, actions=actions, eval_actions=eval_actions, stages=stages, stores=stores,
                streams=streams, replicas=replicas,
                executor=build_executor(cfg, spec, lay, placement, stages, stores, replicas, device),
                scaler=LossScaler(cfg.loss_scale, cfg.loss_scale_window) if spec.dtype == torch.float16 else None)


__all__ = ["Rank", "adamw_cpus", "build_data", "build_device", "build_executor", "build_log", "build_rank",
           "build_router_loss", "build_stages", "build_stream", "build_weights", "rank_cpus", "resolve_placement",
           "token_line"]
