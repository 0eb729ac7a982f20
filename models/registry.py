"""model_type -> ``ArchSpec``: the registered families, and families a start-up self-check
proved (``pipeline.stage.selfcheck``, which runs a family through the pipeline's stages)."""
from __future__ import annotations

from models import gemma, gpt_oss, llama, mistral, olmo2, phi3, qwen2, qwen3, qwen3_moe
from models.spec import ArchSpec

FAMILIES: tuple[ArchSpec, ...] = (llama.SPEC, mistral.SPEC, qwen2.SPEC, qwen3.SPEC, gemma.GEMMA2, gemma.GEMMA3,
                                  phi3.SPEC, olmo2.SPEC, qwen3_moe.SPEC, gpt_oss.SPEC)
REGISTRY: dict[str, ArchSpec] = {t: spec for spec in FAMILIES for t in spec.model_types}
# Families not registered whose self-check passed in this process.
_CHECKED: dict[str, ArchSpec] = {}


class UnsupportedModel(ValueError):
    """A model_type neither registered nor proved by the self-check; the message is one line."""


def supported_types() -> list[str]:
    return sorted(REGISTRY)


def known_spec(model_type: str) -> ArchSpec | None:
    """The spec of ``model_type`` if it is registered or its self-check passed in this process, else None."""
    return REGISTRY.get(model_type) or _CHECKED.get(model_type)


def spec_for(config) -> ArchSpec:
    """The spec of ``config.model_type``: registered, or proved by ``pipeline.stage.selfcheck.check``."""
    spec = known_spec(config.model_type)
    if spec is None:
        raise UnsupportedModel(f"model_type {config.model_type!r} is not supported (supported: "
                               f"{', '.join(supported_types())}; other Llama-shaped families are accepted after "
                               "a start-up self-check)")
    return spec


def tiny_config(model_type: str, *, features: bool = True, **sizes):
    """A small config of ``model_type``'s family: its spec's ``tiny`` settings (the features that
    make the family what it is, at small sizes; ``features=False``: the config class's defaults)
    under ``sizes`` (hidden_size, vocab_size, ...)."""
    spec = REGISTRY.get(model_type)
    if spec is None:
        raise UnsupportedModel(f"no tiny model for model_type {model_type!r} (registered: {', '.join(supported_types())})")
    from models.spec import import_class

    settings = {**(spec.tiny if features else {}), **sizes}
    pattern = settings.get("layer_types")
    if pattern and "num_hidden_layers" in settings:  # the pattern repeated over the layers asked for
        settings["layer_types"] = [pattern[i % len(pattern)] for i in range(settings["num_hidden_layers"])]
    return import_class(spec.config_class)(**settings)


def generic_spec(config) -> ArchSpec:
    """What an unregistered family is tried as: Llama's layout with the windows its config
    describes (``layer_types`` if it has them, else ``sliding_window`` on every layer)."""
    if getattr(config, "layer_types", None):
        sliding = "layer_types"
    elif getattr(config, "sliding_window", None):
        sliding = "all"
    else:
        sliding = "none"
    return ArchSpec(family=f"{config.model_type} (self-checked)", model_types=(config.model_type,),
                    examples="", config_class=type(config).__name__, sliding=sliding)


def accept(spec: ArchSpec) -> None:
    """Register a self-checked family for this process."""
    for t in spec.model_types:
        _CHECKED[t] = spec


def forget(model_type: str) -> None:
    """Unregister a self-checked family: the check itself registers it only while its stages run."""
    _CHECKED.pop(model_type, None)


__all__ = ["FAMILIES", "REGISTRY", "UnsupportedModel", "accept", "forget", "generic_spec", "known_spec", "spec_for",
           "supported_types", "tiny_config"]
