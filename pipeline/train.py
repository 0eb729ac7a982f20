"""Build a rank's part of the job (model stages, stores, data, schedule) and run the training loop."""
from __future__ import annotations

import copy
import gc
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import schedule as sched
from models import UnsupportedModel, spec_for, supported_types, supports_sdpa, tied
from models.selfcheck import family_spec
from offload.cpus import intra_op_threads, node_cpus, optimizer_cpus, pin_current_thread
from offload.store import BufferPool, StageStore, Streams, Workers
from pipeline import checkpoint, faults, orphans
from pipeline.comm import P2P
from pipeline.config import ConfigError, TrainConfig, compiles_layers, fuses_last_stage, partition_counts
from pipeline.dist import DistEnv, Log, broadcast_object, cap_gpu_memory, gather_objects, pick_device
from pipeline.evaluate import build_eval_batches, evaluate
from pipeline.executor import Executor, MicroBatch, OutOfMemory
from pipeline.metrics import STEP_KEYS, Metrics, SkipGuard, TrainingError, device_stats, peak_memory, write_results
from pipeline.model import (PRESETS, build_stage, check_tied_checkpoint, compile_layers,
                            model_flops_per_token, model_key_cost, preset_config)
from pipeline.optim import LossScaler, compute_dtype, lr_at, optim_settings
from pipeline.partition import given_counts, stage_layers
from pipeline.placement import Placement, load_topology, local_gpus, plan_text, resolve_placement
from pipeline.programs import build_programs, program_spec
from pipeline.replicas import GradSync, Layout, check_replicas, layout, replica_config, replica_share, shard_peers
from pipeline.resolve import Resolved, resolve
from pipeline.router_loss import RouterLoss
from pipeline.tiled import mlp_tile_tokens
from pipeline.timeline import Timeline, write_run_timeline

if TYPE_CHECKING:
    from data import BatchStream

GENERATED_MODEL = "tiny-llama"


# --- model resolution -----------------------------------------------------------------------
@dataclass
class ModelSource:
    config: object            # transformers config (already truncated to num_layers)
    weights_dir: Path | None  # None: random weights (preset)
    tokenizer_dir: Path | None


def _generated_model_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.cache_dir) / GENERATED_MODEL


def _needs_generated(cfg: TrainConfig) -> bool:
    """The run uses the generated model, or its tokenizer (a preset without one of its own)."""
    return cfg.model == "generated" or (cfg.model in PRESETS and not cfg.tokenizer)


def build_generated_model(cfg: TrainConfig) -> None:
    """Build the small local model on first use (no progress bars: the run's log shows nothing of it)."""
    from transformers.utils import logging as hf_logging

    from data import SAMPLE_TRAIN, ensure_tiny_model

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        ensure_tiny_model(_generated_model_dir(cfg), data_files=[SAMPLE_TRAIN])
    except (OSError, ValueError, RuntimeError) as e:
        raise ConfigError(f"could not build the generated model in {_generated_model_dir(cfg)}: {e}") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def ensure_generated_model(cfg: TrainConfig, env: DistEnv) -> None:
    """Rank 0 builds the small local model on first use (``check_files`` has, as a rule); the
    others wait for it."""
    if not _needs_generated(cfg):
        return
    error = None
    if env.rank == 0:
        try:
            build_generated_model(cfg)
        except ConfigError as e:
            error = str(e)
    error = broadcast_object(error)
    if error:
        raise ConfigError(error)


def resolve_model(cfg: TrainConfig) -> ModelSource:
    """The model's config, where its weights and tokenizer are; checks the config's claims."""
    if cfg.model in PRESETS:
        hf_config = preset_config(cfg.model)
        weights_dir = None
        tok = Path(cfg.tokenizer) if cfg.tokenizer else _generated_model_dir(cfg)
    else:
        path = _generated_model_dir(cfg) if cfg.model == "generated" else Path(cfg.model)
        hf_config = _read_model_config(cfg.model, path)
        weights_dir = path
        tok = Path(cfg.tokenizer) if cfg.tokenizer else path
    hf_config = copy.deepcopy(hf_config)
    try:
        spec = family_spec(hf_config)
    except UnsupportedModel as e:
        raise ConfigError(f"model {cfg.model!r}: {e}") from None
    for key, attr in (("embedding_dim", "hidden_size"), ("ff_dim", "intermediate_size"),
                      ("num_heads", "num_attention_heads")):
        given, actual = getattr(cfg, key), getattr(hf_config, attr)
        if given and given != actual:
            raise ConfigError(f"{key}={given} contradicts the model's {attr}={actual}; "
                              f"remove {key} or set it to {actual}")
    total = hf_config.num_hidden_layers
    if cfg.num_layers:
        if cfg.num_layers > total:
            raise ConfigError(f"num_layers ({cfg.num_layers}) exceeds the model's {total} decoder layers")
        hf_config.num_hidden_layers = cfg.num_layers
    if cfg.num_stages > hf_config.num_hidden_layers + 2:
        raise ConfigError(f"num_stages ({cfg.num_stages}) exceeds the model's decoder layers + 2 "
                          f"({hf_config.num_hidden_layers} + 2); use fewer stages")
    given_counts(cfg, hf_config.num_hidden_layers)
    types = getattr(hf_config, "layer_types", None)
    if isinstance(types, list) and len(types) > hf_config.num_hidden_layers:
        hf_config.layer_types = types[: hf_config.num_hidden_layers]  # the kept layers' types
    try:
        spec.layer_kinds(hf_config)
        if tied(hf_config) and weights_dir is not None:
            check_tied_checkpoint(weights_dir)
    except ValueError as e:
        raise ConfigError(f"model {cfg.model!r}: {e}") from None
    if spec.moe is not None and cfg.tiled_mlp == "true":
        raise ConfigError(f"model {cfg.model!r} ({hf_config.model_type}) routes tokens to experts, whose routing "
                          "replay is recorded per pass, not per MLP tile; use tiled_mlp auto or false")
    if spec.moe is not None and cfg.seq_chunks > 1:
        # the router loss and the routing replay are per micro-batch; segments are not carried yet
        raise ConfigError(f"model {cfg.model!r} ({hf_config.model_type}) routes tokens to experts; seq_chunks > 1 "
                          "does not work with mixture-of-experts models yet (use seq_chunks 1)")
    if spec.moe is not None and cfg.compile_layers == "true":
        raise ConfigError(f"model {cfg.model!r} ({hf_config.model_type}) routes tokens to experts, whose routing "
                          "is recorded and replayed outside the compiled graph; use compile_layers auto or false")
    dropout = getattr(hf_config, "attention_dropout", 0.0) or 0.0
    if cfg.activation_offload and dropout > 0:
        # the backward's recompute would draw other dropout masks than the forward did
        raise ConfigError(f"activation_offload recomputes each stage's forward in its backward, which is exact only "
                          f"without dropout; model {cfg.model!r} has attention_dropout {dropout} (set it to 0 in "
                          f"config.json, or turn activation_offload off)")
    max_pos = getattr(hf_config, "max_position_embeddings", None)
    if max_pos and cfg.seq_length > max_pos and not cfg.allow_long_sequences:
        raise ConfigError(f"seq_length ({cfg.seq_length}) exceeds the model's max_position_embeddings ({max_pos}); "
                          f"use seq_length <= {max_pos}, or --allow_long_sequences to train past it anyway")
    hf_config._attn_implementation = attention_kernel(cfg, hf_config)
    if cfg.packing and cfg.seq_length > _rope_switch(hf_config):
        # the frequencies of a packed row's records would follow the longest record of each call
        raise ConfigError(f"model {cfg.model!r} picks its RoPE frequencies from the longest position it sees "
                          f"(LongRoPE or dynamic scaling, above {_rope_switch(hf_config)} tokens); "
                          f"packing restarts positions per record, so use seq_length <= {_rope_switch(hf_config)} "
                          "or turn packing off")
    tok_dir = tok if (tok / "tokenizer_config.json").is_file() or (tok / "tokenizer.json").is_file() else None
    if cfg.tokenizer and tok_dir is None:
        raise ConfigError(f"tokenizer {cfg.tokenizer!r}: no tokenizer.json or tokenizer_config.json in {tok}")
    return ModelSource(hf_config, weights_dir, tok_dir)


def attention_kernel(cfg: TrainConfig, hf_config) -> str:
    """The attention implementation a run uses: ``auto`` is sdpa where it computes the family's
    attention, else eager; sdpa where it does not is refused."""
    if cfg.attn_implementation == "auto":
        return "sdpa" if supports_sdpa(hf_config) else "eager"
    if cfg.attn_implementation == "sdpa" and not supports_sdpa(hf_config):
        raise ConfigError(f"model {cfg.model!r} ({hf_config.model_type}) soft-caps its attention scores or adds "
                          "attention sinks, which sdpa cannot compute; use attn_implementation eager (or auto)")
    return cfg.attn_implementation


def _rope_switch(hf_config) -> float:
    """The position above which the model's RoPE frequencies change with the longest position
    of a call (LongRoPE, dynamic NTK), infinity for every other rotary embedding."""
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    ropes = [r for r in rope.values() if isinstance(r, dict)] or [rope]  # Gemma 3: one per layer type
    switching = [r for r in ropes if r.get("rope_type", r.get("type")) in ("longrope", "dynamic")]
    if not switching:
        return float("inf")
    return switching[0].get("original_max_position_embeddings") or \
        getattr(hf_config, "original_max_position_embeddings", None) or hf_config.max_position_embeddings


def _read_model_config(name: str, path: Path):
    """The transformers config of the model directory ``path``, or a ConfigError saying what is wrong."""
    if name == "generated" and not (path / "config.json").is_file():
        from pipeline.preflight import generated_config

        return generated_config()  # not built yet: the shape it will have
    if not path.exists():
        raise ConfigError(f"model {name!r}: {path} does not exist (give a Hugging Face model directory "
                          f"or a preset: {', '.join(PRESETS)}, generated)")
    if not (path / "config.json").is_file():
        raise ConfigError(f"model {name!r}: no config.json in {path} (give a Hugging Face model "
                          f"directory or a preset: {', '.join(PRESETS)}, generated)")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as e:  # an unknown model_type, or a broken config.json
        model_type = _json_field(path / "config.json", "model_type")
        if model_type is not None:
            raise ConfigError(f"model {name!r} has model_type {model_type!r}, which this transformers cannot "
                              f"read; supported: {', '.join(supported_types())}") from None
        raise ConfigError(f"model {name!r}: cannot read {path / 'config.json'}: "
                          f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None


def _json_field(path: Path, key: str):
    import json

    try:
        value = json.loads(path.read_text())
        return value.get(key) if isinstance(value, dict) else None
    except (OSError, ValueError):
        return None


def check_config(cfg: TrainConfig, world_size: int, need_devices: bool = True) -> None:
    """Checks that need no files: they run on every rank before anything is loaded.
    ``need_devices=False`` (``--plan``) allows planning a GPU run on a machine without one."""
    P = check_replicas(cfg, world_size)  # data_parallel: the ranks of one pipeline
    if cfg.num_stages != -1 and (cfg.num_stages < 1 or cfg.num_stages % P):
        per = f" per pipeline (world {world_size} / data_parallel {cfg.data_parallel})" if P != world_size else ""
        raise ConfigError(f"num_stages ({cfg.num_stages}) must be a positive multiple of the number of "
                          f"processes{per} ({P}), or -1 (auto); e.g. num_stages={P * 2}")
    if cfg.num_stages == -1 and partition_counts(cfg.partition) is not None:
        raise ConfigError(f"partition {cfg.partition!r} gives the layers of every stage, so num_stages must be their "
                          f"number, not -1 (auto)")
    if cfg.num_chunks < 1 or cfg.batch_size < 1 or cfg.batch_size % cfg.num_chunks:
        raise ConfigError(f"batch_size ({cfg.batch_size}) must be divisible by num_chunks ({cfg.num_chunks})")
    if cfg.seq_length < 2:
        raise ConfigError(f"seq_length ({cfg.seq_length}) must be at least 2")
    if cfg.seq_chunks != -1 and not 1 <= cfg.seq_chunks <= cfg.seq_length:
        raise ConfigError(f"seq_chunks ({cfg.seq_chunks}) must be between 1 (whole rows) and seq_length "
                          f"({cfg.seq_length}): each of a row's segments needs at least one token; or -1 (auto)")
    if cfg.compile_layers == "true" and cfg.tiled_mlp == "true":
        # a tiled MLP checkpoints each tile inside the layer: not tried under torch.compile
        raise ConfigError("compile_layers true does not work with tiled_mlp true yet; use compile_layers auto "
                          "(eager with tiles) or false")
    if cfg.seq_chunks > 1 and cfg.compile_layers == "true":
        # The carried keys/values pass through a Python cache object the compiled layer cannot
        # capture, and a checkpointed layer then recomputes other tensors than its forward saved.
        raise ConfigError("compile_layers true does not work with seq_chunks > 1 yet; use compile_layers auto "
                          "(eager with segments) or false")
    if cfg.seq_chunks > 1 and cfg.fuse_last_stage == "true":
        # segment j's backward needs the gradients of its keys/values from the backwards of the
        # later segments, which have not run when its forward ends
        raise ConfigError("fuse_last_stage true does not work with seq_chunks > 1 (a segment's backward needs the "
                          "later segments'); use fuse_last_stage auto or false")
    if cfg.num_iterations < 1:
        raise ConfigError(f"num_iterations ({cfg.num_iterations}) must be at least 1")
    if need_devices and cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda was asked for but no CUDA GPU is visible "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); use device: auto or cpu")
    per_rank = cfg.num_stages // P if cfg.num_stages > 0 else 0
    if cfg.delayed_update:
        # Each of these would see or save the weights between the two that the delay keeps apart.
        clash = [name for name, on in (("use_offload off", not cfg.use_offload),
                                       (f"resident_stages {cfg.resident_stages}", cfg.resident_stages > 0),
                                       (f"eval_every {cfg.eval_every}", cfg.eval_every > 0),
                                       (f"checkpoint_every {cfg.checkpoint_every}", cfg.checkpoint_every > 0),
                                       (f"resume {cfg.resume!r}", bool(cfg.resume))) if on]
        if clash:
            raise ConfigError(f"delayed_update needs use_offload with every stage offloaded and no evaluation, "
                              f"checkpoints or resume; got {', '.join(clash)}")
    if not -1 <= cfg.resident_stages <= per_rank and cfg.num_stages != -1:
        raise ConfigError(f"resident_stages ({cfg.resident_stages}) must be -1 (auto) or 0..{per_rank} "
                          f"(the stages per process)")
    if cfg.keep_layers < -1:
        raise ConfigError(f"keep_layers ({cfg.keep_layers}) must be -1 (auto) or >= 0 (layers per stage)")
    if cfg.activation_offload and cfg.keep_layers > 0:
        # the backward recomputes each stage whole: there is no layer whose activations could be kept
        raise ConfigError(f"activation_offload recomputes every stage whole in its backward; keep_layers "
                          f"({cfg.keep_layers}) must be 0 or -1 with it")
    negative = [f"{k} ({getattr(cfg, k)})" for k in ("lr", "weight_decay", "grad_clip") if getattr(cfg, k) < 0]
    if negative:
        raise ConfigError(f"{' and '.join(negative)} must be >= 0")
    if cfg.eval_every < 0 or cfg.eval_batches < 0 or cfg.max_skipped_steps < -1:
        raise ConfigError(f"eval_every ({cfg.eval_every}) and eval_batches ({cfg.eval_batches}) must be >= 0, "
                          f"max_skipped_steps ({cfg.max_skipped_steps}) >= -1")
    if not -cfg.num_iterations <= cfg.timeline_iteration < cfg.num_iterations:
        raise ConfigError(f"timeline_iteration ({cfg.timeline_iteration}) must be in [-{cfg.num_iterations}, "
                          f"{cfg.num_iterations}) for num_iterations={cfg.num_iterations}; -1 = the last")
    if cfg.checkpoint_every < 0 or cfg.keep_checkpoints < 1:
        raise ConfigError(f"checkpoint_every ({cfg.checkpoint_every}) must be >= 0 and keep_checkpoints "
                          f"({cfg.keep_checkpoints}) >= 1")


def check_files(cfg: TrainConfig, rank0: bool = True) -> None:
    """Checks that read files (model, tokenizer, data, save_dir): run before any process group
    exists (``main.py``, on every rank alike, and ``--check_only``), so a bad path is one line.

    ``rank0``: this process also tests save_dir's lock (the other ranks would find their own
    run's), builds the generated model on first use (after every check its shape allows, so a
    refused run builds nothing) and checks the first records' examples with its tokenizer; the
    other ranks skip what needs the model until rank 0 has built it."""
    from data import SAMPLE_TRAIN, check_first_records, load_records
    from pipeline.preflight import check_examples, check_save_dir

    source = resolve_model(cfg)  # a generated model not built yet: the shape it will have
    records = None
    if cfg.dataset != "synthetic":
        records = load_records(str(SAMPLE_TRAIN) if cfg.dataset == "sample" else cfg.dataset, cfg.dataset_split)
        check_first_records(records, cfg.dataset)
    check_save_dir(cfg, test_lock=rank0)
    if _needs_generated(cfg) and not (_generated_model_dir(cfg) / "config.json").is_file():
        if not rank0:
            return
        build_generated_model(cfg)
        source = resolve_model(cfg)
    if source.weights_dir is not None:
        from pipeline.model import weight_files

        try:
            weight_files(source.weights_dir)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"model {cfg.model!r}: {e}") from None
    if records is not None:
        if source.tokenizer_dir is None:
            raise ConfigError(f"model {cfg.model!r} has no tokenizer (no tokenizer.json or tokenizer_config.json "
                              f"in {cfg.tokenizer or cfg.model}); set tokenizer: <directory>")
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(source.tokenizer_dir)
        except Exception as e:  # noqa: BLE001 - transformers raises many types for a broken tokenizer
            raise ConfigError(f"tokenizer {str(source.tokenizer_dir)!r} cannot be loaded: "
                              f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}") from None
        check_examples(records, tokenizer, cfg.seq_length, cfg.dataset)


# --- data -------------------------------------------------------------------------------------
def build_stream(cfg: TrainConfig, source: ModelSource):
    from data import SAMPLE_TRAIN, BatchStream, load_records, tokenize_records
    from data.synthetic import synthetic_examples

    if cfg.dataset == "synthetic":
        examples = synthetic_examples(max(cfg.batch_size * 4, 64), cfg.seq_length, source.config.vocab_size, cfg.seed)
        return BatchStream(examples, cfg.batch_size, pad_id=0, seq_length=cfg.seq_length, seed=cfg.seed,
                           packing=cfg.packing), ""
    if source.tokenizer_dir is None:
        raise ConfigError(f"model {cfg.model!r} has no tokenizer; set tokenizer: <directory>")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.tokenizer_dir)
    records = load_records(str(SAMPLE_TRAIN) if cfg.dataset == "sample" else cfg.dataset, cfg.dataset_split)
    stats: dict[str, int] = {}
    examples, skipped = tokenize_records(records, tokenizer, cfg.seq_length, stats=stats)
    if max(tokenizer.vocab_size, len(tokenizer)) > source.config.vocab_size:
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary is "
                          f"{source.config.vocab_size}")
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


# --- the run ---------------------------------------------------------------------------------
class GcClock:
    """A ``gc.callbacks`` entry: seconds the cyclic garbage collector ran (every thread waits
    for it), summed until ``take``."""

    def __init__(self):
        self._seconds, self._start = 0.0, None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self._seconds += time.perf_counter() - self._start
            self._start = None

    def take(self) -> float:
        out, self._seconds = self._seconds, 0.0
        return out


def check_tied_steps(cfg: TrainConfig, schedule: sched.Schedule, mapping: list[int]) -> None:
    """Raise ConfigError unless both copies of a tied matrix (first and last stage) step the same
    way in ``schedule``: both on the GPU (resident, or no offload) or both on the CPU optimizer
    thread. The two AdamW kernels would round differently and the copies drift apart."""
    first, last = sched.tied_stages(len(mapping))
    offloaded = sched.offloaded_stages(schedule)  # the program is where resident_stages became stages
    if (first in offloaded) != (last in offloaded):
        on_gpu, on_cpu = (last, first) if first in offloaded else (first, last)
        per_rank = len(mapping) // (max(mapping) + 1)
        raise ConfigError(f"tied embeddings: resident_stages {cfg.resident_stages} keeps stage {on_gpu} on the GPU "
                          f"but offloads stage {on_cpu}, so the two copies of the tied matrix would step with "
                          f"different AdamW kernels; use resident_stages 0 or {per_rank} (all)")


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
    """One rank's parts of the job, made by ``build_rank``; the ``Trainer`` runs them.

    Attributes:
        cfg: the resolved configuration (``Resolved.cfg``).
        placement: the stage -> rank mapping and why (``placement.choice``).
        loss_rank: the global rank whose loss and metrics are reported (replica 0's last stage).
        schedule: every rank's program; ``actions`` and ``eval_actions`` are this rank's.
        parts: each stage's decoder layers (``pipeline.partition.stage_layers``).
        stages, stores: this rank's stages and their parameter stores, by stage id.
        replicas: the gradient sum over the replicas (``data_parallel`` > 1), else None.
    """

    cfg: TrainConfig
    env: DistEnv
    source: ModelSource
    device: torch.device
    dtype: torch.dtype
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
    parts: list
    stages: dict
    stores: dict
    streams: Streams
    replicas: GradSync | None
    executor: Executor
    scaler: LossScaler | None

    @property
    def mapping(self) -> list[int]:
        return self.placement.choice.stage_to_rank


def build_device(cfg: TrainConfig, env: DistEnv) -> tuple[torch.device, torch.dtype]:
    """This rank's device, capped at ``gpu_memory_gb``, and the compute dtype."""
    device = pick_device(cfg.device, env)
    if device.type == "cuda" and cfg.gpu_memory_gb:
        cap_gpu_memory(device, cfg.gpu_memory_gb)
    return device, compute_dtype(cfg, device)


def build_data(cfg: TrainConfig, source: ModelSource, log: Log) -> tuple[BatchStream, list]:
    """The training batch stream and the validation batches (none without ``eval_every``)."""
    stream, data_line = build_stream(cfg, source)
    if data_line:
        log.info(data_line)
    log.info(token_line(stream, cfg.packing))
    return stream, build_eval_batches(cfg, source) if cfg.eval_every else []


def build_stages(cfg: TrainConfig, env: DistEnv, hf, stage_ids: list[int], parts: list, kept: tuple[int, ...],
                 offloaded: list[int], weights_dir, device: torch.device, dtype: torch.dtype,
                 replicas: GradSync | None, log: Log) -> tuple[dict, dict, Streams]:
    """This rank's stages (only those are ever built) and their stores."""
    S = cfg.num_stages
    streams, pool = Streams(device), BufferPool(device)
    workers, share = None, []
    if offloaded:
        # torchrun sets OMP_NUM_THREADS=1; the optimizer thread gets this rank's share of the cores.
        share = rank_cpus(cfg, env, device)
        cpus = adamw_cpus(cfg, share)
        workers = Workers(ThreadPoolExecutor(1, thread_name_prefix="cpu-adamw", initializer=pin_current_thread,
                                             initargs=(cpus,)), device)
        log.info(f"optimizer: {len(cpus)} CPU threads per process (rank {env.rank}: cores {cpus[0]}-{cpus[-1]})")
    stages, stores = {}, {}
    compiled = compiles_layers(cfg, device.type, spec_for(hf).moe is not None)
    tile = mlp_tile_tokens(spec_for(hf).shape(hf).intermediate, dtype.itemsize) if cfg.tiled_mlp == "true" else 0
    if tile:
        log.info(f"tiled_mlp: each decoder layer's MLP runs in tiles of {tile} tokens, each recomputed in its backward")
    if compiled:
        log.info(f"compile_layers {cfg.compile_layers}: decoder layers run through torch.compile (the first step "
                 "compiles them)")
    built = placed = 0.0  # seconds: weights made or read; weights, gradients and AdamW state placed
    # Start-up zeroes and copies tens of GB of host state: on the rank's share of the cores,
    # not torchrun's one thread.
    with intra_op_threads(len(share) or torch.get_num_threads()):
        for s in stage_ids:
            t0 = time.perf_counter()
            # activation_offload: the backward recomputes the stage whole, once, so no layer of it is
            # checkpointed (recomputed) a second time inside that recompute
            stage = build_stage(hf, s, S, parts[s], model_dir=weights_dir, seed=cfg.seed,
                                checkpointing=cfg.activation_checkpointing,
                                kept_layers=len(parts[s]) if cfg.activation_offload else kept[s], init_device=device,
                                mlp_tile_tokens=tile)
            stage.buffers_to(device)
            if compiled:
                compile_layers(stage)
            t1 = time.perf_counter()
            # Fused AdamW everywhere (CPU and CUDA kernels): one pass over the state, and the clip
            # coefficient rides in as its grad_scale, so every offload mode does the same arithmetic.
            # Replicas split an offloaded stage's CPU step (ZeRO-1 on host state); not a tied
            # copy's (both copies must step alike) nor a delayed one's.
            sharded = s in offloaded and stage.tied_name is None and not cfg.delayed_update
            shard = shard_peers(replicas, sum(p.numel() for p in stage.parameters())) if sharded else None
            stores[s] = StageStore(stage, device=device, compute_dtype=dtype, offload=s in offloaded,
                                   optim=optim_settings(cfg, fused=True), streams=streams, pool=pool,
                                   workers=workers, delayed=cfg.delayed_update, tied=stage.tied_name,
                                   tied_copy=s == S - 1, shard=shard)
            stages[s] = stage
            built, placed = built + t1 - t0, placed + time.perf_counter() - t1
    sharded = [s for s in stage_ids if stores[s].shard is not None]
    if sharded:
        mine = sum(hi - lo for lo, hi in (stores[s].shard_range for s in sharded))
        log.info(f"data_parallel: the CPU AdamW steps of stages {sharded} are sharded over "
                 f"{cfg.data_parallel} replicas (rank {env.rank} steps {mine} of "
                 f"{sum(stores[s].numel for s in sharded)} parameters, then the peers exchange them)")
    log.info(f"start-up (rank {env.rank}): stages built in {built:.1f}s, their weights, gradients "
             f"and AdamW state placed in {placed:.1f}s")
    return stages, stores, streams


def build_router_loss(cfg: TrainConfig, hf, stages: dict, device: torch.device) -> RouterLoss | None:
    """A mixture-of-experts model's router loss, where its config asks for it (``models.moe``)."""
    moe = spec_for(hf).moe
    if moe is None or moe.aux_coef(hf) == 0:
        return None
    routed = sum(moe.sparse(hf, i) for i in range(hf.num_hidden_layers))
    return RouterLoss(stages, moe.experts(hf), moe.aux_coef(hf), routed, cfg.num_chunks, device)


def build_rank(cfg: TrainConfig, env: DistEnv, source: ModelSource | None = None,
               resolved: Resolved | None = None) -> Rank:
    """Build everything this rank runs: device, placement, data, programs, stages and stores,
    p2p and executor. Collective (the placement's broadcast, the replicas' groups, the resume
    point): every rank calls it alike.

    Args:
        resolved: the automatic choices, made by ``train()`` on rank 0; without it (tests) this
            rank makes them.
    """
    device, dtype = build_device(cfg, env)
    source = source or resolve_model(cfg)
    hf = source.config
    # data_parallel: this process is pipeline rank ``position`` of replica ``lay.replica``;
    # schedules, placement and plans are of one replica's pipeline (pipeline.replicas)
    lay = layout(cfg, env.rank, env.world_size)
    position, size = lay.position, lay.pipeline_size
    resolved = resolved or resolve(cfg, env.world_size, hf, checkpoint.saved_partition(cfg.resume, cfg.save_dir))
    cfg, one = resolved.cfg, resolved.replica
    S = cfg.num_stages
    # Collective: rank 0 picks the stage -> rank mapping (config `mapping`), every rank gets it.
    placement = resolve_placement(one, DistEnv(env.rank, size, env.local_rank, min(env.local_world_size, size)),
                                  hf, device, dtype)
    mapping = placement.choice.stage_to_rank
    loss_rank = lay.global_rank(mapping[-1], replica=0)  # replica 0's speaks
    log = Log(env.rank, speaker=loss_rank)
    if cfg.data_parallel > 1 and env.rank == 0 and env.local_world_size % size:
        # torchrun numbers a node's processes consecutively: whole replicas per node need a multiple of P
        log.warn(f"{env.local_world_size} processes per node is not a multiple of the pipeline's {size} "
                 "ranks: some replicas span nodes, and their activations cross the network")
    log.info(placement.choice.reason)
    # A checkpoint is a Hugging Face directory: its shards are the fp32 masters to resume from.
    resume_point = checkpoint.find_resume(cfg.resume, cfg.save_dir, env, log)
    weights_dir = resume_point.path if resume_point else source.weights_dir
    stream, eval_batches = build_data(cfg, source, log)
    spec = program_spec(one, hf)
    schedule, actions, eval_actions = build_programs(spec, mapping, position, evaluate=cfg.eval_every > 0,
                                                     show=cfg.debug_schedule and env.rank == 0)
    if spec.tied:  # two copies of the tied matrix, their gradients summed by a TIE action
        check_tied_steps(cfg, schedule, mapping)
    parts = stage_layers(one, hf, size)
    checkpoint.check_resume_partition(resume_point, S, parts, cfg.partition)  # before minutes of loading
    stage_ids = sched.stages_of(position, mapping)
    # With offload, the stages the program never loads stay on the GPU (resident_stages), AdamW
    # included: the program is the one record of which stages those are.
    loaded = sched.offloaded_stages(schedule)
    offloaded = [s for s in stage_ids if s in loaded]
    torch.manual_seed(cfg.seed)
    # Before the stores (their sharded steps use its groups), on every rank alike: group
    # creation is collective.
    replicas = GradSync(lay, cfg.comm_timeout_s) if cfg.data_parallel > 1 else None
    stages, stores, streams = build_stages(cfg, env, hf, stage_ids, parts, resolved.kept, offloaded, weights_dir,
                                           device, dtype, replicas, log)
    p2p = P2P(mapping, timeout_s=cfg.comm_timeout_s, tied=spec.tied, replicas=cfg.data_parallel)
    executor = Executor(position, stages, stores, mapping, p2p, device=device, dtype=dtype,
                        hidden_size=hf.hidden_size, grad_clip=cfg.grad_clip, replicas=replicas,
                        start_offset_s=placement.choice.start_offset_s[position], num_segments=cfg.seq_chunks,
                        key_cost=model_key_cost(hf), activation_offload=cfg.activation_offload,
                        fuse_last_stage=fuses_last_stage(cfg), router_loss=build_router_loss(cfg, hf, stages, device))
    scaler = LossScaler(cfg.loss_scale, cfg.loss_scale_window) if dtype == torch.float16 else None
    return Rank(cfg, env, source, device, dtype, lay, placement, loss_rank, log, resume_point, stream, eval_batches,
                schedule, actions, eval_actions, parts, stages, stores, streams, replicas, executor, scaler)


class Trainer:
    """One rank's training loop over the parts ``build_rank`` made; checkpoints go through a
    ``CheckpointManager``, step figures and results through ``pipeline.metrics``."""

    def __init__(self, cfg: TrainConfig, env: DistEnv, source: ModelSource | None = None,
                 resolved: Resolved | None = None):
        """``resolved``: the automatic choices, made by ``train()`` on rank 0; without it (tests)
        this rank makes them."""
        self.rank = r = build_rank(cfg, env, source, resolved)
        self.cfg, self.env = r.cfg, env
        self.start_iteration = r.resume_point.iteration if r.resume_point else 0
        self.stopped_by = 0  # the signal that ended the run early, if one did
        self.gc_clock = GcClock()
        self.flops_per_token = model_flops_per_token(r.source.config, r.source.config.num_hidden_layers,
                                                     r.cfg.seq_length)
        self.checkpoints = checkpoint.CheckpointManager(
            r.cfg, env, r.source, r.device, r.log, r.layout, stores=r.stores, stream=r.stream, scaler=r.scaler,
            parts=r.parts, mapping=r.mapping)
        if r.resume_point:
            self.checkpoints.restore(r.resume_point)

    # The parts tests and tools reach for.
    stages = property(lambda self: self.rank.stages)
    stores = property(lambda self: self.rank.stores)
    executor = property(lambda self: self.rank.executor)
    stream = property(lambda self: self.rank.stream)
    actions = property(lambda self: self.rank.actions)
    eval_actions = property(lambda self: self.rank.eval_actions)
    scaler = property(lambda self: self.rank.scaler)

    def microbatches(self, batch) -> list[MicroBatch]:
        from data.batching import to_device

        device, K = self.rank.device, self.cfg.seq_chunks
        mbs = [MicroBatch(*(to_device(t, device) for t in (mb.input_ids, mb.targets, mb.position_ids,
                                                             mb.segment_ids)))
               for mb in replica_share(batch.microbatches(self.cfg.num_chunks), self.rank.layout)]
        # A batch is as wide as its longest row: one narrower than seq_chunks gets padding
        # columns, one a segment (after every token, predicting nothing, so nothing changes).
        return [mb.widened(K) for mb in mbs]

    def sum_loss(self, loss: float | None) -> float | None:
        """The global batch's loss from this replica's share (the executor's loss is this
        replica's micro-batches' sum, each normalised by the global batch's target count)."""
        return self.rank.replicas.sum_loss(loss) if self.rank.replicas is not None else loss

    def evaluate(self) -> dict:
        """Validation loss over ``eval_batches`` (token-weighted mean; None off the loss rank)."""
        def run(batch):
            # num_targets=1: the executor's loss is then the plain sum of the batch's token losses.
            return self.sum_loss(self.executor.run(self.eval_actions, self.microbatches(batch), 1, 0.0,
                                                   train=False).loss)

        return evaluate(run, self.rank.eval_batches)

    def train(self) -> list[dict]:
        cfg, r = self.cfg, self.rank
        if self.start_iteration >= cfg.num_iterations:
            r.log.info(f"resume: {r.resume_point.path} is at iteration {self.start_iteration}, "
                       f"num_iterations is {cfg.num_iterations}: nothing left to train "
                       "(raise num_iterations to go on)")
            return []
        r.log.info(f"training {cfg.num_iterations} iterations: {cfg.num_stages} stages on "
                   f"{self.env.world_size} processes"
                   + (f" ({cfg.data_parallel} replicas of {r.layout.pipeline_size})" if cfg.data_parallel > 1
                      else "")
                   + f" ({r.device.type}, {r.dtype}), schedule {cfg.schedule}, "
                   f"offload={cfg.use_offload} prefetch={cfg.use_prefetch}")
        metrics = Metrics(r.log, speaks=self.env.rank == r.loss_rank, num_steps=cfg.num_iterations,
                          save_dir=cfg.save_dir if cfg.save_metrics else None, progress_bar=cfg.progress_bar)
        guard = SkipGuard(cfg.max_skipped_steps)
        # What exists now (modules, stores, torch's and transformers' own objects: some 400k for
        # 7B) lives for the whole run: frozen out of the cyclic GC, whose full collections would
        # otherwise walk it all, about 0.2 s each, in the middle of iterations.
        gc.collect()
        gc.freeze()
        gc.callbacks.append(self.gc_clock)
        try:
            # While training, SIGINT/SIGTERM only set a flag; the loop stops after a step all ranks agree on.
            with faults.StopRequest() as self.stop:
                metrics.start(self.start_iteration)
                history = self._train_loop(metrics, guard)
                metrics.finish(peak_memory(r.device))
        finally:
            metrics.close()
            gc.callbacks.remove(self.gc_clock)
            gc.unfreeze()  # a caller that goes on (tests, several runs in one process) collects as usual
        return history

    def _train_loop(self, metrics: Metrics, guard: SkipGuard) -> list[dict]:
        cfg, r, history = self.cfg, self.rank, []
        timeline_at = cfg.timeline_iteration % cfg.num_iterations if cfg.timeline else None
        recorded = None
        for it in range(self.start_iteration, cfg.num_iterations):
            batch = r.stream.next_batch()
            if it == timeline_at:
                recorded = r.executor.timeline = self.new_timeline()
            t0 = time.perf_counter()
            res = r.executor.run(r.actions, self.microbatches(batch), batch.num_targets, lr_at(it, cfg),
                                 loss_scale=r.scaler.scale if r.scaler else 1.0)
            r.executor.timeline = None
            res.loss = self.sum_loss(res.loss)
            if r.device.type == "cuda":
                torch.cuda.synchronize(r.device)  # host sync: end of iteration, for honest timing
            dt = time.perf_counter() - t0
            tokens = batch.input_ids.numel()
            # this rank's row of results.json; metrics.jsonl gets its STEP_KEYS, under the same names
            row = {"step": it + 1, "step_time_s": dt, "tokens": tokens, "tokens_per_s": tokens / dt, "loss": res.loss,
                   "grad_norm": res.grad_norm, "lr": lr_at(it, cfg), "peak_mem_bytes": peak_memory(r.device),
                   "tflops_per_gpu": self.flops_per_token * tokens / dt / self.env.world_size / 1e12,
                   "skipped": res.skipped, **res.clock.seconds(), "gc_seconds": self.gc_clock.take(),
                   **device_stats(r.device, r.stores)}
            history.append(row)
            metrics.log_step({k: row[k] for k in STEP_KEYS})
            overflow = r.scaler.update(res.skipped) if r.scaler is not None else False
            if overflow:  # float16: an overflow of the loss scale, which has just halved; not a fault
                r.log.info(f"step {it + 1}: gradients overflowed float16, loss scale now {r.scaler.scale:g}")
            # raises on every rank alike past max_skipped_steps
            guard.update(it + 1, res.skipped and not overflow)
            if cfg.eval_every and ((it + 1) % cfg.eval_every == 0 or it + 1 == cfg.num_iterations):
                metrics.log_eval({"step": it + 1, **self.evaluate()})
            self.stopped_by = self.stop.agreed(r.device)
            every = cfg.checkpoint_every
            if self.stopped_by or (every and ((it + 1) % every == 0 or it + 1 == cfg.num_iterations)):
                self.save_checkpoint(it + 1)
            if self.stopped_by:
                why = " (its launcher died)" if orphans.launcher_gone() else ""
                r.log.info(f"stopped by {faults.signal_name(self.stopped_by)}{why} after step {it + 1}, checkpoint "
                           f"saved; continue with --resume latest")
                break
        r.executor.finish()
        if recorded is not None:  # every rank alike: the stop step is agreed
            self.write_timeline(recorded)
        return history

    def new_timeline(self) -> Timeline:
        streams = self.rank.streams
        lanes = {"load": streams.load, "offload": streams.offload} if streams.cuda else None
        return Timeline(self.rank.layout.position, self.rank.device.type, streams=lanes)

    def write_timeline(self, recorded: Timeline) -> None:
        """Gather the recorded iteration to rank 0 and write the trace, Gantt and prediction (collective)."""
        r = self.rank
        # replica 0's ranks: the other replicas run the same lists
        events = [e for rank_events in gather_objects(recorded.events())[:r.layout.pipeline_size]
                  for e in rank_events]
        if self.env.rank == 0:
            _, line = write_run_timeline(self.cfg.save_dir, events, r.schedule, r.mapping,
                                         r.placement.stage_bytes, r.placement.rank_groups)
            print(line, flush=True)

    def save_checkpoint(self, step: int) -> Path:
        """Everything exact continuation needs after ``step`` completed steps (collective)."""
        # Every step done first: a sharded stage's gather (collective over its peers) uses the group
        # the optimizer thread's exchanges use, and one group is used by one thread at a time.
        self.executor.finish()
        return self.checkpoints.save(step)

    def save(self, history: list[dict]) -> None:
        """The run's outputs: the Hugging Face model and params.pt (not after a stop: its model is
        its last checkpoint), then results.json (collective)."""
        cfg, r = self.cfg, self.rank
        out = Path(cfg.save_dir)
        if cfg.save_model and not self.stopped_by:
            checkpoint.save_hf_model(out / "model", self.checkpoints.saved_stores, r.source, self.env,
                                     cfg.num_stages)
            r.log.info(f"saved Hugging Face model to {out / 'model'}")
        if cfg.save_params and not self.stopped_by:
            checkpoint.save_params(out / "params.pt", self.checkpoints.saved_stores, self.env)
            r.log.info(f"saved parameters to {out / 'params.pt'}")
        write_results(Path(cfg.results_path), cfg.to_dict(), self.env, cfg.data_parallel, history, r.loss_rank)


def plan(cfg: TrainConfig, world_size: int) -> str:
    """The ``--plan`` report (rank 0 alone, before any process group exists)."""
    from pipeline import plan as plan_mod

    if cfg.model == "generated":
        build_generated_model(cfg)
    source = resolve_model(cfg)
    whole, resolved = cfg, resolve(cfg, world_size, source.config, checkpoint.saved_partition(cfg.resume, cfg.save_dir))
    cfg, world_size = resolved.replica, resolved.pipeline_size  # data_parallel: one replica's pipeline
    text = plan_mod.report(cfg, source.config, sched.round_robin(cfg.num_stages, world_size), world_size,
                           resolved.kept)
    text += "".join(f"\n{line}" for line in resolved.lines)
    if plan_mod.device_type(cfg) == "cuda" and plan_mod.gpu_capacity(cfg) is not None:
        text += "\n" + plan_mod.longest_row_line(replica_config(whole), source.config, world_size)
    topo = load_topology(cfg, discover_ok=torch.cuda.is_available())
    if topo is not None:
        text += "\n" + plan_text(cfg, source.config, topo)
    if whole.data_parallel > 1:
        text += (f"\ndata_parallel: {whole.data_parallel} replicas of this {world_size}-rank pipeline, "
                 f"{whole.data_parallel * world_size} processes; each replica runs {cfg.num_chunks} of the "
                 f"{whole.num_chunks} micro-batches of the global batch of {whole.batch_size}; per-rank memory as "
                 f"above, host memory per node times the replicas it holds")
    return text


def train(cfg: TrainConfig, env: DistEnv) -> list[dict]:
    """Train ``cfg`` (checked by ``check_config`` and ``check_files`` before the process group
    existed) on this rank, then save what it asks for."""
    from pipeline.plan import check_fits

    ensure_generated_model(cfg, env)
    source = resolve_model(cfg)
    # Rank 0 makes the automatic choices (auto reads its GPU's size); every rank runs them.
    resolved = None
    if env.rank == 0:
        resolved = resolve(cfg, env.world_size, source.config, checkpoint.saved_partition(cfg.resume, cfg.save_dir))
        for line in resolved.lines:
            print(line, flush=True)
    resolved = broadcast_object(resolved)
    # Before any weight is read: a run that cannot fit stops here, with advice. What is checked
    # is one replica's pipeline; any mapping the placement picks gives each rank the stages of
    # some rank under round-robin, so the per-rank estimates are the same.
    one, size = resolved.replica, resolved.pipeline_size
    check_fits(one, source.config, sched.round_robin(one.num_stages, size), size, resolved.kept)
    trainer = Trainer(cfg, env, source, resolved)
    try:
        history = trainer.train()
    except OutOfMemory as e:  # one line with the plan's figure and what to change, not a traceback
        from pipeline.plan import out_of_memory_line

        raise TrainingError(out_of_memory_line(e, one, source.config, sched.round_robin(one.num_stages, size), size,
                                               resolved.kept)) from None
    cfg = trainer.cfg
    if trainer.start_iteration >= cfg.num_iterations:
        return history  # a finished run resumed: its outputs are there already
    trainer.save(history)
    return history


__all__ = ["Rank", "Trainer", "build_rank", "check_config", "check_files", "plan", "resolve_model", "train"]
