"""LoRA's settings resolved once, before anything is built: which modules get adapters (peft's
names, ``all-linear`` expanded against the model the way peft expands it), how many adapter
elements each stage holds, and the combinations refused before launch. No weights, no peft:
the counts read the model's skeleton on the meta device, so ``--plan`` of a 70B-class model
runs on a laptop."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import ConfigError, TrainConfig

ALL_LINEAR = "all-linear"
# Modules outside the decoder layers: frozen always (peft's all-linear leaves the head out too).
NOT_ADAPTED = ("embed_tokens", "lm_head")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoraSettings:
    """One run's adapters: rank, alpha, dropout and the target modules' names (expanded)."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def requested_targets(cfg: TrainConfig) -> list[str]:
    return [t.strip() for t in cfg.lora_target_modules.split(",") if t.strip()]


def check_lora(cfg: TrainConfig) -> None:
    """The LoRA settings that need no model (``check_config``): one line each, before launch."""
    if cfg.lora_rank < 0:
        raise ConfigError(f"lora_rank ({cfg.lora_rank}) must be >= 0 (0 = full fine-tuning)")
    if not cfg.lora_rank:
        given = [k for k, on in (("lora_adapter", bool(cfg.lora_adapter)), ("merge_lora", cfg.merge_lora)) if on]
        if given:
            raise ConfigError(f"{' and '.join(given)} need lora_rank > 0 (the adapter's rank); got lora_rank 0")
        return
    if cfg.lora_alpha <= 0:
        raise ConfigError(f"lora_alpha ({cfg.lora_alpha}) must be > 0")
    if not 0 <= cfg.lora_dropout < 1:
        raise ConfigError(f"lora_dropout ({cfg.lora_dropout}) must be in [0, 1)")
    if cfg.lora_dropout and cfg.activation_offload:
        # the backward's recompute of a stage runs outside torch.utils.checkpoint: another mask
        raise ConfigError(f"lora_dropout ({cfg.lora_dropout}) does not work with activation_offload (its recompute "
                          "would draw other dropout masks than the forward); use lora_dropout 0")
    targets = requested_targets(cfg)
    if not targets:
        raise ConfigError("lora_target_modules is empty; give peft module names (q_proj,v_proj) or all-linear")
    if ALL_LINEAR in targets and len(targets) > 1:
        raise ConfigError(f"lora_target_modules {cfg.lora_target_modules!r}: all-linear stands alone")
    frozen = [t for t in targets if t in NOT_ADAPTED]
    if frozen:
        raise ConfigError(f"lora_target_modules: {', '.join(frozen)} cannot take adapters here (the embedding and "
                          "head stay frozen); target the decoder layers' modules")
    if cfg.delayed_update:
        raise ConfigError("delayed_update does not apply to lora_rank > 0: the adapters step on the GPU, no CPU "
                          "AdamW step is left to overlap; drop delayed_update")
    if cfg.lora_adapter:
        saved = adapter_config(cfg.lora_adapter)
        mine = {"r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha}
        theirs = {"r": saved.get("r"), "lora_alpha": saved.get("lora_alpha")}
        if any(float(theirs[k] or 0) != float(v) for k, v in mine.items()):
            raise ConfigError(f"lora_adapter {cfg.lora_adapter!r} has r {theirs['r']}, lora_alpha "
                              f"{theirs['lora_alpha']}; this run lora_rank {cfg.lora_rank}, lora_alpha "
                              f"{cfg.lora_alpha}: set them to the adapter's")


def adapter_config(path: str | Path) -> dict:
    """A saved peft adapter's ``adapter_config.json``; ConfigError if the directory lacks it or its weights."""
    d = Path(path)
    missing = [f for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (d / f).is_file()]
    if missing:
        raise ConfigError(f"lora_adapter {str(path)!r} is not a peft adapter directory: {', '.join(missing)} "
                          "missing")
    saved = json.loads((d / ADAPTER_CONFIG).read_text())
    if saved.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"lora_adapter {str(path)!r} is a {saved.get('peft_type')} adapter; only LORA trains here")
    return saved


# Per model config (its JSON): each decoder layer's linear modules as (name, in + out features).
# The memory plan asks for them many times while it resolves the automatic choices.
_LINEARS: dict[str, list[list[tuple[str, int]]]] = {}


def _layer_linears(hf_config) -> list[list[tuple[str, int]]]:
    key = hf_config.to_json_string(use_diff=False)
    if key not in _LINEARS:
        from torch import nn

        from models import skeleton

        sk = skeleton(hf_config)
        _LINEARS[key] = [[(n.rsplit(".", 1)[-1], m.in_features + m.out_features) for n, m in layer.named_modules()
                          if isinstance(m, nn.Linear)] for layer in sk.model.layers]
    return _LINEARS[key]


def linear_names(hf_config) -> list[str]:
    """The last names of the decoder layers' linear modules (what peft's all-linear targets: every
    linear layer but the output head; stacked experts are parameters, not linear layers)."""
    return sorted({name for layer in _layer_linears(hf_config) for name, _ in layer})


def lora_settings(cfg: TrainConfig, hf_config) -> LoraSettings | None:
    """The run's adapters (None for full fine-tuning); ConfigError when a target names no
    linear module of the model's decoder layers, or a saved adapter targets other modules."""
    if not cfg.lora_rank:
        return None
    available = linear_names(hf_config)
    targets = requested_targets(cfg)
    if targets == [ALL_LINEAR]:
        targets = available
    unknown = [t for t in targets if t not in available]
    if unknown:
        raise ConfigError(f"lora_target_modules: {', '.join(unknown)} is not a linear module of this model's "
                          f"decoder layers ({', '.join(available)}; or all-linear)")
    if cfg.lora_adapter:
        saved = adapter_config(cfg.lora_adapter).get("target_modules") or []
        saved = sorted([saved] if isinstance(saved, str) else saved)
        if saved != sorted(targets):
            raise ConfigError(f"lora_adapter {cfg.lora_adapter!r} targets {','.join(saved)}; this run "
                              f"{','.join(sorted(targets))}: set lora_target_modules to the adapter's")
    return LoraSettings(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, tuple(sorted(targets)))


def adapter_numel(hf_config, settings: LoraSettings | None, layer_ids) -> int:
    """Adapter elements of the decoder layers ``layer_ids``: r * (in + out) per targeted linear."""
    if settings is None:
        return 0
    per_layer = _adapter_per_layer(hf_config, settings)
    return sum(per_layer[i] for i in layer_ids)


def _adapter_per_layer(hf_config, settings: LoraSettings) -> list[int]:
    return [sum(settings.rank * width for name, width in layer if name in settings.targets)
            for layer in _layer_linears(hf_config)]


def adapted_per_layer(hf_config, settings: LoraSettings | None) -> int:
    """Targeted linear modules in one decoder layer (the most of any layer): each keeps an r-wide
    activation per token for its backward."""
    if settings is None:
        return 0
    return max((sum(name in settings.targets for name, _ in layer) for layer in _layer_linears(hf_config)),
               default=0)


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "ALL_LINEAR", "LoraSettings", "adapted_per_layer", "adapter_config",
           "adapter_numel", "check_lora", "linear_names", "lora_settings"]
