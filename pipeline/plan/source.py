"""Where a run's model comes from: a Hugging Face directory, a preset, or the small generated
model (``data/tiny_model.py``, made once on rank 0); its config read, truncated to ``num_layers``
and checked against the run's settings (``resolve_model``), before anything is loaded."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from models import UnsupportedModel, set_attn_implementation, supported_types, supports_sdpa
from pipeline.config import ConfigError, TrainConfig
from pipeline.dist import DistEnv, broadcast_object
from pipeline.plan.partition import given_counts
from pipeline.stage.selfcheck import family_spec

PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=2048, max_position_embeddings=2048),
    "llama-2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096),
    # OpenLLaMA-3B's shapes: a model whose peers (DeepSpeed, RoundPipe) fit one GPU machine's host memory
    "llama-3b": dict(hidden_size=3200, intermediate_size=8640, num_hidden_layers=26, num_attention_heads=32,
                     num_key_value_heads=32, vocab_size=32000, max_position_embeddings=2048),
    "llama-2-13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                        num_key_value_heads=40, vocab_size=32000, max_position_embeddings=4096),
    # Llama-3-8B's shapes (GQA, 128K vocabulary): what RoundPipe's long-sequence figures are for
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    # Llama-3-70B's shapes (GQA 64/8, 80 layers): LoRA's 70B-class target on two 24 GiB GPUs
    "llama-3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    # Qwen3-4B's shapes (per-head q/k norms, GQA 32/8, head_dim 128, a tied 152K vocabulary)
    "qwen3-4b": dict(model_type="qwen3", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=True),
    # A small Qwen3-MoE (Qwen3-30B-A3B's layer with 64 of its 128 experts, 12 layers): 4.3B
    # parameters, 1.0B active; the router loss on
    "qwen3-moe-small": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=12,
                            num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                            num_experts=64, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                            max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                            output_router_logits=True, router_aux_loss_coef=0.001, tie_word_embeddings=False),
}


def preset_config(name: str):
    """The Hugging Face config of preset ``name`` (random weights; Llama unless it names a family)."""
    from models import tiny_config

    settings = dict(PRESETS[name])
    family = settings.pop("model_type", "llama")
    if family == "llama":
        settings.update(rms_norm_eps=1e-5, tie_word_embeddings=False)
    return tiny_config(family, features=False, **settings, bos_token_id=1, eos_token_id=2, pad_token_id=0)


GENERATED_MODEL = "tiny-llama"


@dataclass
class ModelSource:
    config: object            # transformers config (already truncated to num_layers)
    weights_dir: Path | None  # None: random weights (preset)
    tokenizer_dir: Path | None


def generated_model_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.cache_dir) / GENERATED_MODEL


def needs_generated(cfg: TrainConfig) -> bool:
    """The run uses the generated model, or its tokenizer (a preset without one of its own)."""
    return cfg.model == "generated" or (cfg.model in PRESETS and not cfg.tokenizer)


def build_generated_model(cfg: TrainConfig) -> None:
    """Build the small local model on first use (no progress bars: the run's log shows nothing of it)."""
    from transformers.utils import logging as hf_logging

    from data import SAMPLE_TRAIN, ensure_tiny_model

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        ensure_tiny_model(generated_model_dir(cfg), data_files=[SAMPLE_TRAIN])
    except (OSError, ValueError, RuntimeError) as e:
        raise ConfigError(f"could not build the generated model in {generated_model_dir(cfg)}: {e}") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def ensure_generated_model(cfg: TrainConfig, env: DistEnv) -> None:
    """Rank 0 builds the small local model on first use (``check_files`` has, as a rule); the
    others wait for it."""
    if not needs_generated(cfg):
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
        tok = Path(cfg.tokenizer) if cfg.tokenizer else generated_model_dir(cfg)
    else:
        path = generated_model_dir(cfg) if cfg.model == "generated" else Path(cfg.model)
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
    set_attn_implementation(hf_config, attention_kernel(cfg, hf_config))
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


def generated_config():
    """The transformers config of the generated model before it exists: the shape
    ``ensure_tiny_model``'s defaults give it (what ``build_generated_model`` builds), so a
    run that the shape alone refuses (too many stages, too long a seq_length) is refused before
    the model is built."""
    import inspect

    from transformers import LlamaConfig

    from data import ensure_tiny_model

    d = {k: p.default for k, p in inspect.signature(ensure_tiny_model).parameters.items()}
    return LlamaConfig(vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                       intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_layers"],
                       num_attention_heads=d["num_heads"], num_key_value_heads=d["num_kv_heads"] or d["num_heads"],
                       max_position_embeddings=d["max_position_embeddings"], tie_word_embeddings=False)


__all__ = ["GENERATED_MODEL", "PRESETS", "preset_config", "ModelSource", "attention_kernel", "build_generated_model", "ensure_generated_model",
           "generated_config", "generated_model_dir", "needs_generated", "resolve_model"]
