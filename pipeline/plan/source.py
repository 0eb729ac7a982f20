"""Where a run's model comes from: a Hugging Face directory, a preset, or the small generated
model (``data/tiny_model.py``, made once on rank 0); its config read, truncated to ``num_layers``
and checked against the run's settings (``resolve_model``: the rules are
``pipeline.plan.model_rules``'s, the files were checked by ``pipeline.plan.preflight``), before
anything is loaded."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from models import set_attn_implementation, supports_sdpa
from pipeline.config import TrainConfig
from pipeline.plan.model_rules import ModelView, check_model

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
    # Qwen2.5-32B's shapes (q/k/v biases, GQA 40/8, 64 layers, a 152K vocabulary): a 32B-class LoRA base
    "qwen2.5-32b": dict(model_type="qwen2", hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                        tie_word_embeddings=False),
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
REPO_ROOT = Path(__file__).resolve().parents[2]  # where train.sh runs main.py


@dataclass
class ModelSource:
    config: object            # transformers config (already truncated to num_layers)
    weights_dir: Path | None  # None: random weights (preset)
    tokenizer_dir: Path | None


def generated_model_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.cache_dir) / GENERATED_MODEL


def saved_model_dir(name: str, cache_dir: str | None = None) -> Path:
    """The directory whose weights a run with ``model: name`` started from, to load them again
    (generate.py: a finished run's model, or the base model of its LoRA adapter). ``generated``
    is the generated model in ``cache_dir`` (default: a run's default) where the run read it: a
    relative ``cache_dir`` from the current directory, else from the repository root (train.sh
    runs there); any other name is that directory. Raises ValueError for a preset: its random
    weights were drawn on the run's device (a GPU draws other numbers than the CPU) and never
    saved, so nothing here can load them again."""
    if name in PRESETS:
        raise ValueError(f"{name!r} is a preset whose random weights were drawn when its run started (on "
                         "the run's device) and never saved, so they cannot be loaded again; give the run's "
                         "save_dir/model (a LoRA run writes it with --merge_lora)")
    if name != "generated":
        return Path(name)
    here = generated_model_dir(TrainConfig(**({"cache_dir": cache_dir} if cache_dir else {})))
    at_root = REPO_ROOT / here
    return at_root if not here.is_absolute() and not here.is_dir() and at_root.is_dir() else here


def needs_generated(cfg: TrainConfig) -> bool:
    """The run uses the generated model, or its tokenizer (a preset without one of its own)."""
    return cfg.model == "generated" or (cfg.model in PRESETS and not cfg.tokenizer)


def build_generated_model(cfg: TrainConfig) -> None:
    """Build the small local model on first use (no progress bars: the run's log shows nothing of
    it). ``preflight.build_model`` makes a failure one line."""
    from transformers.utils import logging as hf_logging

    from data import SAMPLE_TRAIN, ensure_tiny_model

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        ensure_tiny_model(generated_model_dir(cfg), data_files=[SAMPLE_TRAIN])
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def model_dir(cfg: TrainConfig) -> Path | None:
    """The directory the model's config and weights are read from; None for a preset (random weights)."""
    if cfg.model in PRESETS:
        return None
    return generated_model_dir(cfg) if cfg.model == "generated" else Path(cfg.model)


def tokenizer_dir(cfg: TrainConfig) -> Path | None:
    """The tokenizer's directory: ``tokenizer``, else the model's (a preset's: the generated
    model's); None where it holds no tokenizer."""
    tok = Path(cfg.tokenizer) if cfg.tokenizer else model_dir(cfg) or generated_model_dir(cfg)
    return tok if (tok / "tokenizer_config.json").is_file() or (tok / "tokenizer.json").is_file() else None


def kept_layers(hf_config, num_layers: int):
    """A copy of ``hf_config`` with its first ``num_layers`` decoder layers (0: all)."""
    kept = copy.deepcopy(hf_config)
    if num_layers:
        kept.num_hidden_layers = num_layers
    types = getattr(kept, "layer_types", None)
    if isinstance(types, list) and len(types) > kept.num_hidden_layers:
        kept.layer_types = types[: kept.num_hidden_layers]  # the kept layers' types
    return kept


def resolve_model(cfg: TrainConfig, world_size: int | None = None) -> ModelSource:
    """The model's config as the run trains it, where its weights and tokenizer are: read once
    per process start and passed on. The model's rules (``model_rules.check_model``) run on it
    here, before anything is loaded; with ``world_size`` (the processes) those on the stages
    per process too. ``preflight.check_model_files`` checked its files first."""
    path = model_dir(cfg)
    whole = preset_config(cfg.model) if path is None else _read_config(cfg, path)
    kept = kept_layers(whole, cfg.num_layers)
    size = world_size // cfg.data_parallel if world_size and cfg.data_parallel >= 1 else None
    check_model(ModelView(cfg, whole, kept, pipeline_size=size))
    set_attn_implementation(kept, attention_kernel(cfg, kept))
    return ModelSource(kept, path, tokenizer_dir(cfg))


def attention_kernel(cfg: TrainConfig, hf_config) -> str:
    """The attention implementation a run uses: ``auto`` is sdpa where it computes the family's
    attention, else eager (``model_rules.attention_computable`` refuses sdpa where it does not)."""
    if cfg.attn_implementation == "auto":
        return "sdpa" if supports_sdpa(hf_config) else "eager"
    return cfg.attn_implementation


def _read_config(cfg: TrainConfig, path: Path):
    """The transformers config in ``path`` (the generated model's planned shape before it is built)."""
    if cfg.model == "generated" and not (path / "config.json").is_file():
        return generated_config()  # not built yet: the shape it will have
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


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


__all__ = ["GENERATED_MODEL", "PRESETS", "ModelSource", "attention_kernel", "build_generated_model", "generated_config",
           "generated_model_dir", "kept_layers", "model_dir", "needs_generated", "preset_config", "resolve_model",
           "saved_model_dir", "tokenizer_dir"]
