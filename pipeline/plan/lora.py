"""LoRA's settings resolved once, before anything is built: which modules get adapters (peft's
names, ``all-linear`` expanded against the model the way peft expands it) and how many adapter
elements each stage holds. No weights, no peft: the counts read the model's skeleton on the meta
device, so ``--plan`` of a 70B-class model runs on a laptop. The combinations refused are
checked before launch: on the settings in ``pipeline.config``, against the model in
``pipeline.plan.model_rules``, the saved adapter's files in ``pipeline.plan.preflight``."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import ALL_LINEAR, TrainConfig, lora_targets

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


def adapter_config(path: str | Path) -> dict:
    """A saved peft adapter's ``adapter_config.json`` (``preflight.check_adapter`` checked the
    directory before launch)."""
    return json.loads((Path(path) / ADAPTER_CONFIG).read_text())


# Per model config (its JSON): each decoder layer's linear modules as (name, in features, out
# features). The memory plan asks for them many times while it resolves the automatic choices.
_LINEARS: dict[str, list[list[tuple[str, int, int]]]] = {}


def _layer_linears(hf_config) -> list[list[tuple[str, int, int]]]:
    key = hf_config.to_json_string(use_diff=False)
    if key not in _LINEARS:
        from torch import nn

        from models import skeleton

        sk = skeleton(hf_config)
        _LINEARS[key] = [[(n.rsplit(".", 1)[-1], m.in_features, m.out_features) for n, m in layer.named_modules()
                          if isinstance(m, nn.Linear)] for layer in sk.model.layers]
    return _LINEARS[key]


def linear_names(hf_config) -> list[str]:
    """The last names of the decoder layers' linear modules (what peft's all-linear targets: every
    linear layer but the output head; stacked experts are parameters, not linear layers)."""
    return sorted({name for layer in _layer_linears(hf_config) for name, _, _ in layer})


def lora_settings(cfg: TrainConfig, hf_config) -> LoraSettings | None:
    """The run's adapters (None for full fine-tuning), ``all-linear`` expanded to the model's
    decoder layers' linear modules (``model_rules.adapters_fit`` checked the targets)."""
    if not cfg.lora_rank:
        return None
    targets = lora_targets(cfg)
    if targets == [ALL_LINEAR]:
        targets = linear_names(hf_config)
    return LoraSettings(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, tuple(sorted(targets)))


def adapter_numel(hf_config, settings: LoraSettings | None, layer_ids) -> int:
    """Adapter elements of the decoder layers ``layer_ids``: r * (in + out) per targeted linear."""
    if settings is None:
        return 0
    per_layer = _adapter_per_layer(hf_config, settings)
    return sum(per_layer[i] for i in layer_ids)


def trained_adapters(cfg: TrainConfig, hf_config) -> int | None:
    """The adapter parameters a LoRA run trains over every decoder layer; None for full fine-tuning."""
    settings = lora_settings(cfg, hf_config)
    return None if settings is None else adapter_numel(hf_config, settings, range(hf_config.num_hidden_layers))


def _adapter_per_layer(hf_config, settings: LoraSettings) -> list[int]:
    return [sum(settings.rank * (fan_in + fan_out) for name, fan_in, fan_out in layer if name in settings.targets)
            for layer in _layer_linears(hf_config)]


def adapted_per_layer(hf_config, settings: LoraSettings | None) -> int:
    """Targeted linear modules in one decoder layer (the most of any layer): each keeps an r-wide
    activation per token for its backward."""
    if settings is None:
        return 0
    return max((sum(name in settings.targets for name, _, _ in layer) for layer in _layer_linears(hf_config)),
               default=0)


def adapts_mlp_width(hf_config, settings: LoraSettings | None) -> bool:
    """Whether an adapted linear of a decoder layer makes an MLP-wide output (gate, up): peft adds
    its adapter's output to the base output as a new tensor of that width, and a compiled layer's
    backward then holds more MLP-wide tensors (``pipeline.plan.footprint.mlp_work``)."""
    if settings is None:
        return False
    width = getattr(hf_config, "intermediate_size", 0)
    return any(name in settings.targets and fan_out > fan_in and fan_out >= width
               for layer in _layer_linears(hf_config) for name, fan_in, fan_out in layer)


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "ALL_LINEAR", "LoraSettings", "adapted_per_layer", "adapter_config",
           "adapter_numel", "adapts_mlp_width", "linear_names", "lora_settings",
           "trained_adapters"]
