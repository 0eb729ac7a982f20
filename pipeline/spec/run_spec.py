"""A run's facts, derived from its settings once: the ``RunSpec`` that ``build_run_spec`` makes.

Each stage's decoder layers and mode (which runner runs it), the kernels, the programs and LoRA's
adapters follow from the settings and the model's config alone. ``build_run_spec`` is the one
function that derives them; the run (``pipeline.run.build``), the memory plan
(``pipeline.plan.fit``) and ``--plan`` read its answer and derive none of them again. ``resolve``
builds the run's spec once its automatic choices are made (``Resolved.spec``, broadcast from rank
0); the memory plan builds one for each configuration it weighs, with the same function. Pure: the
same settings, model config, ranks and device type give the same spec on every rank and on a
laptop. The one fact no setting gives, whether a GPU's cuDNN takes the rows' attention, is a probe
the caller passes (the plan's asks the GPU; None answers no).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from models import attn_implementation, head_dim, kv_heads, spec_for
from pipeline.config import TrainConfig
from pipeline.spec.footprint import ModelShape
from pipeline.spec.lora import LoraSettings, lora_settings, trained_adapters
from pipeline.spec.partition import stage_layers
from pipeline.spec.programs import ProgramSpec, program_spec
from pipeline.spec.settings import compiles_layers, compute_dtype, fuses_last_stage
from pipeline.spec.shapes import mlp_tile_tokens, model_key_cost, segment_lengths

# (compute dtype, attention heads, key/value heads, head dimension) -> whether cuDNN takes the rows
CudnnProbe = Callable[[torch.dtype, int, int, int], bool]


@dataclass(frozen=True)
class Mode:
    """What decides how a stage's work runs: the run's settings and the stage's place, in
    training or in a forward-only pass (evaluation). The runner is chosen from it once, when the
    stage is built (``pipeline.runners.runner_for``), by the executor and the memory plan alike;
    both take it from ``RunSpec.mode``."""

    training: bool
    last: bool                # the stage computes the loss
    fused_last: bool          # fuse_last_stage (resolved)
    activation_offload: bool  # stage inputs wait in host memory; backwards recompute
    segmented: bool           # seq_chunks > 1: actions name a segment of their micro-batch


@dataclass(frozen=True)
class Kernels:
    """How the decoder layers compute.

    Attributes:
        attention: the attention implementation, ``eager`` or ``sdpa`` (``attention_kernel``).
        compiled: ``compile_layers`` resolved for the device.
        mlp_tile_tokens: ``tiled_mlp``: tokens per MLP tile (0: untiled).
        cudnn: whole rows go through sdpa's cuDNN kernel (the probe's answer; the plan counts
            flash's buffers otherwise).
    """

    attention: str
    compiled: bool
    mlp_tile_tokens: int
    cudnn: bool


@dataclass(frozen=True)
class RunSpec:
    """One pipeline's run, every fact the settings imply derived.

    Attributes:
        cfg: the settings of one replica's pipeline (``replica_config``: its ``batch_size`` and
            ``num_chunks`` are one replica's), as resolved.
        model: the model's config (``num_layers`` kept).
        num_ranks: the ranks of one pipeline.
        data_parallel: how many such pipelines run (their gradients summed).
        device: ``cuda`` or ``cpu``: what the stages compute on.
        dtype: the compute dtype.
        parts: each stage's decoder layers (``partition``).
        modes: each stage's mode in training (``mode`` gives a forward-only pass's).
        kept: per stage, the decoder layers that keep their activations under checkpointing.
        segments: the segment lengths of a full-width row (``seq_chunks``); () for whole rows.
        key_cost: the attention's cost per key, by which rows are cut into segments.
        kernels: how the layers compute.
        program: the spec of every rank's program.
        adapters: LoRA's settings, None for full fine-tuning.
    """

    cfg: TrainConfig
    model: object = field(compare=False, repr=False)
    num_ranks: int
    data_parallel: int
    device: str
    dtype: torch.dtype
    parts: tuple[range, ...]
    modes: tuple[Mode, ...]
    kept: tuple[int, ...]
    segments: tuple[int, ...]
    key_cost: float
    kernels: Kernels
    program: ProgramSpec
    adapters: LoraSettings | None

    @property
    def num_stages(self) -> int:
        return len(self.parts)

    def mode(self, stage: int, training: bool = True) -> Mode:
        """Stage ``stage``'s mode in training, or in a forward-only pass."""
        return self.modes[stage] if training else replace(self.modes[stage], training=False)

    @property
    def trained_adapters(self) -> int | None:
        """The adapter parameters LoRA trains over every decoder layer; None for full fine-tuning."""
        return trained_adapters(self.model, self.adapters)


def attention_kernel(cfg: TrainConfig, hf_config) -> str:
    """The attention kernel the run uses (``source.attention_kernel`` resolved ``auto`` into the
    model config; a config not resolved yet counts as sdpa)."""
    if cfg.attn_implementation != "auto":
        return cfg.attn_implementation
    kernel = attn_implementation(hf_config)
    return kernel if kernel in ("eager", "sdpa") else "sdpa"


def build_kernels(cfg: TrainConfig, hf_config, device: str, dtype: torch.dtype,
                  cudnn_probe: CudnnProbe | None = None) -> Kernels:
    """The layers' kernels. cuDNN is asked about only where it could take the rows: plain causal
    rows of a model with no sliding window, sdpa, the ``auto`` backend, on a GPU."""
    family = spec_for(hf_config)
    attention = attention_kernel(cfg, hf_config)
    tile = mlp_tile_tokens(ModelShape.of(hf_config).intermediate, dtype.itemsize, int(cfg.mlp_tile_mib * 2**20)) \
        if cfg.tiled_mlp == "true" else 0
    candidate = (cudnn_probe is not None and device == "cuda" and cfg.attention_backend == "auto"
                 and not cfg.packing and attention == "sdpa"
                 and not any(k.window for k in family.layer_kinds(hf_config)))
    cudnn = candidate and cudnn_probe(dtype, hf_config.num_attention_heads, kv_heads(hf_config), head_dim(hf_config))
    return Kernels(attention, compiles_layers(cfg, device, family.moe is not None), tile, bool(cudnn))


def build_run_spec(cfg: TrainConfig, hf_config, num_ranks: int, device: str, *, kept: tuple[int, ...] | None = None,
                   data_parallel: int = 1, cudnn_probe: CudnnProbe | None = None) -> RunSpec:
    """The spec of ``cfg`` (one replica's pipeline, of ``data_parallel``) for the model
    ``hf_config`` on ``num_ranks`` ranks computing on ``device``. ``kept``: the layers that keep
    their activations, as ``resolve_kept`` chose them; None (a configuration not resolved yet)
    gives each stage ``keep_layers`` (-1 counts as 0)."""
    S = cfg.num_stages
    dtype = compute_dtype(cfg, torch.device(device))
    key_cost = model_key_cost(hf_config)
    segmented = cfg.seq_chunks > 1
    fused = fuses_last_stage(cfg)
    return RunSpec(
        cfg=cfg, model=hf_config, num_ranks=num_ranks, data_parallel=data_parallel, device=device, dtype=dtype,
        parts=tuple(stage_layers(cfg, hf_config, num_ranks)),
        modes=tuple(Mode(True, s == S - 1, fused, cfg.activation_offload, segmented) for s in range(S)),
        kept=kept if kept is not None else (max(cfg.keep_layers, 0),) * S,
        segments=segment_lengths(cfg.seq_length, cfg.seq_chunks, key_cost) if segmented else (),
        key_cost=key_cost, kernels=build_kernels(cfg, hf_config, device, dtype, cudnn_probe),
        program=program_spec(cfg, hf_config), adapters=lora_settings(cfg, hf_config))


__all__ = ["CudnnProbe", "Kernels", "Mode", "RunSpec", "attention_kernel", "build_kernels", "build_run_spec"]
