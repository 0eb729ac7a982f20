"""Gemma 2 and Gemma 3 (text): the embedding scaled by sqrt(hidden) through a buffer of its
module, (1 + w) RMSNorms computed in float32, norms after the attention and the MLP as well as
before, ``query_pre_attn_scalar``, local (sliding) and global layers, a tied head over a large
vocabulary and soft-capped final logits where the config has them. Gemma 3 adds per-head q/k
norms and gives each layer type its own rotary embedding; Gemma 2 soft-caps its attention
scores, which only its eager attention does."""
from functools import partial

from models.spec import ArchSpec, llama_layer_shape

_GEMMA = dict(pre_norms=2, post_norms=2, norm_fp32_out=True)

GEMMA2 = ArchSpec(
    family="Gemma 2", model_types=("gemma2",), config_class="Gemma2Config",
    examples="Gemma-2 2B/9B/27B (eager attention: its scores are soft-capped)",
    tiny=dict(head_dim=24, sliding_window=32, query_pre_attn_scalar=20, final_logit_softcapping=30.0,
              attn_logit_softcapping=50.0, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh"),
    layer_shape=partial(llama_layer_shape, **_GEMMA),
)
GEMMA3 = ArchSpec(
    family="Gemma 3 (text)", model_types=("gemma3_text",), config_class="Gemma3TextConfig",
    examples="Gemma-3 1B (text only; the 4B-27B checkpoints' language model is gemma3_text too)",
    tiny=dict(head_dim=24, sliding_window=32, query_pre_attn_scalar=20, final_logit_softcapping=30.0,
              layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
              rope_local_base_freq=10000.0, tie_word_embeddings=True),
    rope_by_layer_type=True,
    layer_shape=partial(llama_layer_shape, qk_norm="head", **_GEMMA),
)
