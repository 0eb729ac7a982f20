"""Qwen3: per-head RMSNorms on queries and keys before RoPE, no q/k/v bias, optional sliding
layers (``layer_types``)."""
from functools import partial

from models.spec import ArchSpec, llama_layer_shape

SPEC = ArchSpec(
    family="Qwen3", model_types=("qwen3",), config_class="Qwen3Config",
    examples="Qwen3-0.6B to 32B (0.6B-4B tie their head)",
    tiny=dict(head_dim=24, use_sliding_window=True, sliding_window=32, max_window_layers=2, tie_word_embeddings=True),
    layer_shape=partial(llama_layer_shape, qk_norm="head"),
)
