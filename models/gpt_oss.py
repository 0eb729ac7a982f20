"""gpt-oss: attention sinks (a learned logit per head in the softmax's denominator: eager
attention only), alternating sliding and full layers, every layer's MLP routed (top-k of the
router's biased logits, softmax over the k) to experts with biases and a clamped SwiGLU."""
import torch

from models.spec import ArchSpec, LayerShape, MoeSpec, llama_layer_shape


def _scores(router, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.gather(-1, indices), dim=1, dtype=logits.dtype)


def _shape(config) -> LayerShape:
    return llama_layer_shape(config, experts_per_token=config.num_experts_per_tok,
                             num_experts=config.num_local_experts, expert_intermediate=config.intermediate_size,
                             expert_saved=7)  # clamped SwiGLU: the clamps, sigmoid and (up + 1) keep more


SPEC = ArchSpec(
    family="gpt-oss", model_types=("gpt_oss",), config_class="GptOssConfig",
    examples="gpt-oss-20b, gpt-oss-120b (bf16 weights: the MXFP4 checkpoints must be dequantized first)",
    tiny=dict(head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=32,
              layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
              output_router_logits=True, router_aux_loss_coef=0.02,
              rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                            "truncate": False, "original_max_position_embeddings": 64}),
    moe=MoeSpec(router="mlp.router", num_experts="num_local_experts", scores=_scores),
    layer_shape=_shape,
)
