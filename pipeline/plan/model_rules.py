"""The rules a run's settings must meet against its model: the one place they live.

Each rule is a small function of a ``ModelView`` (the settings, the model's config as its files
give it and as the run keeps it) that raises one ConfigError line: the values given, what the
model allows, what to change. ``check_model`` runs them all; ``resolve_model`` calls it right
after reading the model's config, once per process start and before any process group exists.
``check_choices`` runs the rules on what ``resolve`` decides (the stages and the resident stages
that ``-1`` left open) on its answer.

The rules on the settings alone are ``pipeline.plan.settings_rules``'s (each field's own beside
it, ``check=``), the rules on files and the machine ``pipeline.plan.preflight``'s: among them that a tied head is stored as the
embedding's copy, the one check that reads tensors; these rules read the model's config and no
weight, so ``--plan`` reads none.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from models import UnsupportedModel, spec_for, supports_sdpa
from pipeline.config import ALL_LINEAR, ConfigError, TrainConfig, lora_targets
from pipeline.spec.lora import adapter_config, adapter_flags, adapter_mismatches, linear_names, lora_settings
from pipeline.spec.partition import given_counts
from pipeline.spec.programs import trains_tied_copies
from pipeline.stage.selfcheck import family_spec


@dataclass(frozen=True)
class ModelView:
    """What the model's rules read.

    Attributes:
        cfg: the settings.
        whole: the model's config as its files (or preset) give it.
        kept: the config the run trains: ``num_layers`` decoder layers kept.
        pipeline_size: the processes of one pipeline, where known (the rules on stages per
            process need it); None skips those.
    """

    cfg: TrainConfig
    whole: Any
    kept: Any
    pipeline_size: int | None = None

    @property
    def name(self) -> str:
        return repr(self.cfg.model)


def family_supported(m: ModelView) -> None:
    try:
        family_spec(m.whole)  # registered, or its self-check passes (once a process)
    except UnsupportedModel as e:
        raise ConfigError(f"model {m.name}: {e}") from None


def sizes_agree(m: ModelView) -> None:
    for key, attr in (("embedding_dim", "hidden_size"), ("ff_dim", "intermediate_size"),
                      ("num_heads", "num_attention_heads")):
        given, actual = getattr(m.cfg, key), getattr(m.whole, attr)
        if given and given != actual:
            raise ConfigError(f"{key}={given} contradicts the model's {attr}={actual}; "
                              f"remove {key} or set it to {actual}")


def layers_exist(m: ModelView) -> None:
    total = m.whole.num_hidden_layers
    if m.cfg.num_layers > total:
        raise ConfigError(f"num_layers ({m.cfg.num_layers}) exceeds the model's {total} decoder layers")


def stages_hold_layers(m: ModelView) -> None:
    layers = m.kept.num_hidden_layers
    if m.cfg.num_stages > layers + 2:
        raise ConfigError(f"num_stages ({m.cfg.num_stages}) exceeds the model's decoder layers + 2 "
                          f"({layers} + 2); use fewer stages")
    try:
        given_counts(m.cfg, layers)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def layers_buildable(m: ModelView) -> None:
    """The family can build every kept layer. (That a tied model's checkpoint holds one matrix
    reads two tensors: ``preflight.check_model_weights`` checks it with the other weight files.)"""
    try:
        spec_for(m.kept).layer_kinds(m.kept)
    except ValueError as e:
        raise ConfigError(f"model {m.name}: {e}") from None


def experts_modes(m: ModelView) -> None:
    """What a mixture-of-experts layer does not run under: its routing is recorded per pass."""
    if spec_for(m.kept).moe is None:
        return
    cfg, kind = m.cfg, m.kept.model_type
    if cfg.tiled_mlp == "true":
        raise ConfigError(f"model {m.name} ({kind}) routes tokens to experts, whose routing "
                          "replay is recorded per pass, not per MLP tile; use tiled_mlp auto or false")
    if cfg.seq_chunks > 1:
        # the router loss and the routing replay are per micro-batch; segments are not carried yet
        raise ConfigError(f"model {m.name} ({kind}) routes tokens to experts; seq_chunks > 1 "
                          "does not work with mixture-of-experts models yet (use seq_chunks 1)")
    if cfg.compile_layers == "true":
        raise ConfigError(f"model {m.name} ({kind}) routes tokens to experts, whose routing "
                          "is recorded and replayed outside the compiled graph; use compile_layers auto or false")


def recompute_is_exact(m: ModelView) -> None:
    dropout = getattr(m.kept, "attention_dropout", 0.0) or 0.0
    if m.cfg.activation_offload and dropout > 0:
        # the backward's recompute would draw other dropout masks than the forward did
        raise ConfigError(f"activation_offload recomputes each stage's forward in its backward, which is exact only "
                          f"without dropout; model {m.name} has attention_dropout {dropout} (set it to 0 in "
                          f"config.json, or turn activation_offload off)")


def positions_cover_rows(m: ModelView) -> None:
    max_pos = getattr(m.kept, "max_position_embeddings", None)
    if max_pos and m.cfg.seq_length > max_pos and not m.cfg.allow_long_sequences:
        raise ConfigError(f"seq_length ({m.cfg.seq_length}) exceeds the model's max_position_embeddings ({max_pos}); "
                          f"use seq_length <= {max_pos}, or --allow_long_sequences to train past it anyway")


def attention_computable(m: ModelView) -> None:
    if m.cfg.attn_implementation == "sdpa" and not supports_sdpa(m.kept):
        raise ConfigError(f"model {m.name} ({m.kept.model_type}) soft-caps its attention scores or adds "
                          "attention sinks, which sdpa cannot compute; use attn_implementation eager (or auto)")


def rope_switch(hf_config) -> float:
    """The position above which the model's RoPE frequencies change with the longest position
    of a call (LongRoPE, dynamic NTK), infinity for every other rotary embedding."""
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    ropes = [r for r in rope.values() if isinstance(r, dict)] or [rope]  # Gemma 3: one per layer type
    switching = [r for r in ropes if r.get("rope_type", r.get("type")) in ("longrope", "dynamic")]
    if not switching:
        return float("inf")
    return switching[0].get("original_max_position_embeddings") or \
        getattr(hf_config, "original_max_position_embeddings", None) or hf_config.max_position_embeddings


def packed_positions(m: ModelView) -> None:
    switch = rope_switch(m.kept)
    if m.cfg.packing and m.cfg.seq_length > switch:
        # the frequencies of a packed row's records would follow the longest record of each call
        raise ConfigError(f"model {m.name} picks its RoPE frequencies from the longest position it sees "
                          f"(LongRoPE or dynamic scaling, above {switch} tokens); "
                          f"packing restarts positions per record, so use seq_length <= {switch} "
                          "or turn packing off")


def adapters_fit(m: ModelView) -> None:
    """LoRA's target modules are linear modules of the decoder layers, and a saved adapter
    (``lora_adapter``) is one of this run and this model: every difference in one line."""
    cfg = m.cfg
    if not cfg.lora_rank:
        return
    available = linear_names(m.kept)
    targets = lora_targets(cfg)
    if targets == [ALL_LINEAR]:
        targets = available
    unknown = [t for t in targets if t not in available]
    if unknown:
        raise ConfigError(f"lora_target_modules: {', '.join(unknown)} is not a linear module of this model's "
                          f"decoder layers ({', '.join(available)}; or all-linear)")
    if cfg.lora_adapter:
        try:
            settings, model = adapter_mismatches(cfg.lora_adapter, m.whole, m.kept, lora_settings(cfg, m.kept))
            advice = [f"train with its settings ({adapter_flags(adapter_config(cfg.lora_adapter))})"] if settings \
                else []
        except ValueError as e:  # its config or weights cannot be read
            raise ConfigError(f"lora_adapter {cfg.lora_adapter!r}: {e}") from None
        if model:
            advice.append(f"give a plain LoRA adapter of this model ({m.name})")
        if settings or model:
            raise ConfigError(f"lora_adapter {cfg.lora_adapter!r} does not fit this run: "
                              f"{'; '.join(settings + model)}; {', or '.join(advice)}")


def tied_copies_step_alike(m: ModelView) -> None:
    """Both copies of a tied matrix (first and last stage) step the same way: both on the GPU
    (resident) or both on the CPU optimizer thread. The two AdamW kernels would round
    differently and the copies drift apart. Resident stages are each process's first
    (``schedule.resident_stages``): stage 0 is resident from 1 on, the last stage only with all."""
    cfg, P = m.cfg, m.pipeline_size
    if P is None or cfg.num_stages < 1 or not cfg.use_offload or not trains_tied_copies(cfg, m.kept):
        return
    if cfg.device_steps:  # the last stage is its process's last offloaded one: it would step on the GPU
        raise ConfigError(f"tied embeddings: device_steps {cfg.device_steps} steps stage {cfg.num_stages - 1}'s "
                          f"copy of the tied matrix on the GPU and stage 0's elsewhere, with different AdamW "
                          f"kernels; use device_steps 0")
    per_rank, k = cfg.num_stages // P, cfg.resident_stages  # -1: resolve picks 0 or all
    if 0 < k < per_rank:
        raise ConfigError(f"tied embeddings: resident_stages {k} keeps stage 0 on the GPU "
                          f"but offloads stage {cfg.num_stages - 1}, so the two copies of the tied matrix would step "
                          f"with different AdamW kernels; use resident_stages 0 or {per_rank} (all)")


# In the order they are checked: the family first (the other rules ask its spec).
MODEL_RULES: tuple[Callable[[ModelView], None], ...] = (
    family_supported, sizes_agree, layers_exist, stages_hold_layers, layers_buildable, experts_modes,
    recompute_is_exact, positions_cover_rows, attention_computable, packed_positions, adapters_fit,
    tied_copies_step_alike)
# The rules on what ``resolve`` decides (num_stages, resident_stages from -1).
CHOICE_RULES: tuple[Callable[[ModelView], None], ...] = (stages_hold_layers, tied_copies_step_alike)


def check_model(view: ModelView) -> None:
    """Every rule of the settings against the model, in ``MODEL_RULES``' order."""
    for rule in MODEL_RULES:
        rule(view)


def check_choices(cfg: TrainConfig, hf_config, pipeline_size: int) -> None:
    """The model's rules on the automatic choices ``resolve`` made (``cfg``: its answer)."""
    view = ModelView(cfg, hf_config, hf_config, pipeline_size=pipeline_size)
    for rule in CHOICE_RULES:
        rule(view)


__all__ = ["CHOICE_RULES", "MODEL_RULES", "ModelView", "check_choices", "check_model", "rope_switch"]
