"""Phi-3 / Phi-4: fused ``qkv_proj`` and ``gate_up_proj``, partial rotary where the config has
``partial_rotary_factor``, LongRoPE scaling (its frequencies switch at
``original_max_position_embeddings``, from the positions of the whole row), a window on every
layer where ``sliding_window`` is set."""
from functools import partial

from models.spec import ArchSpec, llama_layer_shape

SPEC = ArchSpec(
    family="Phi-3 / Phi-4", model_types=("phi3",), config_class="Phi3Config", sliding="all",
    examples="Phi-3-mini/medium (4K and 128K LongRoPE), Phi-3.5-mini, Phi-4 (14B), Phi-4-mini",
    tiny=dict(partial_rotary_factor=0.75, sliding_window=32, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
    layer_shape=partial(llama_layer_shape, fused_qkv=True),
)
