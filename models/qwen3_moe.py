"""Qwen3-MoE: Qwen3's attention; the MLP of every ``decoder_sparse_step``-th layer (except
``mlp_only_layers``) routes each token to ``num_experts_per_tok`` of ``num_experts`` experts
(softmax over the router's logits, top-k, renormalised if ``norm_topk_prob``)."""
import torch

from models.spec import ArchSpec, ExpertLayout, LayerShape, MoeSpec, llama_layer_shape


def _scores(router, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, dtype=torch.float, dim=-1).gather(-1, indices)
    if router.norm_topk_prob:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs.to(logits.dtype)


def _sparse(config, i: int) -> bool:
    return i not in config.mlp_only_layers and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0


def _shape(config) -> LayerShape:
    return llama_layer_shape(config, qk_norm="head", experts_per_token=config.num_experts_per_tok,
                             num_experts=config.num_experts, expert_intermediate=config.moe_intermediate_size)


SPEC = ArchSpec(
    family="Qwen3-MoE", model_types=("qwen3_moe",), config_class="Qwen3MoeConfig", sliding="all",
    examples="Qwen3-30B-A3B, Qwen3-235B-A22B",
    tiny=dict(head_dim=24, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
              output_router_logits=True, router_aux_loss_coef=0.02, mlp_only_layers=[1], decoder_sparse_step=1),
    moe=MoeSpec(router="mlp.gate", num_experts="num_experts", scores=_scores, sparse=_sparse),
    # Qwen3-MoE checkpoints keep one gate/up/down Linear per expert (transformers fuses them on load)
    experts=ExpertLayout({"mlp.experts.gate_up_proj": ("gate_proj", "up_proj"), "mlp.experts.down_proj": ("down_proj",)}),
    layer_shape=_shape,
)
