"""One home per model architecture: a registry from ``config.model_type`` to an ``ArchSpec``
(``models/spec.py``), one small module per family, the mixture-of-experts routing taps
(``models/moe.py``) and the registry of families not registered whose start-up self-check
passed (``pipeline/stage/selfcheck.py``, which runs them through the pipeline's stages). Nothing
outside this package names a family."""
from models.registry import FAMILIES, REGISTRY, UnsupportedModel, spec_for, supported_types, tiny_config
from models.spec import (ArchSpec, LayerKind, LayerShape, MoeSpec, attn_implementation, counts, head_dim, kv_heads,
                         logit_softcap, materialize_, set_attn_implementation, skeleton, supports_sdpa, tied)

__all__ = ["ArchSpec", "FAMILIES", "LayerKind", "LayerShape", "MoeSpec", "REGISTRY", "UnsupportedModel",
           "attn_implementation", "counts", "head_dim", "kv_heads", "logit_softcap", "materialize_",
           "set_attn_implementation", "skeleton", "spec_for", "supported_types", "supports_sdpa", "tied", "tiny_config"]
