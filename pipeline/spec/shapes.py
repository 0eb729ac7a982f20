"""What a model's stages hold and compute, from its config alone (no module is built): the decoder
layers of each stage, parameter counts, FLOPs per token, the attention's cost per key, the
segments a row is cut into, and the token counts of a loss chunk and an MLP tile. Every rank, the
memory plan, the partition and the built stages read the same numbers from here."""
from __future__ import annotations

import functools
from typing import Sequence

from models import counts, head_dim, spec_for, tied


def partition_layers(num_layers: int, num_stages: int) -> list[range]:
    """Decoder layers of each stage: as even as possible, extra layers to the middle stages
    (the first and last stages also carry the embedding and the head). With more stages than
    layers, the first (then the last) stage holds only the embedding (the head)."""
    if not 1 <= num_stages <= num_layers + 2:
        raise ValueError(f"num_stages ({num_stages}) must be between 1 and num_layers + 2 ({num_layers + 2})")
    counts = [0] * num_stages
    holders = list(range(num_stages))
    if num_stages > num_layers:  # some stage holds no layer: embedding-only first, then head-only last
        holders = holders[1:] if num_stages == num_layers + 1 else holders[1:-1]
    base, extra = divmod(num_layers, len(holders))
    for i, s in enumerate(holders):
        counts[s] = base
    # hand out the remainder from the middle outwards
    order = sorted(holders, key=lambda s: abs(s - (num_stages - 1) / 2))
    for s in order[:extra]:
        counts[s] += 1
    return layer_ranges(counts)


def layer_ranges(counts: list[int]) -> list[range]:
    """Consecutive decoder layers, ``counts[s]`` of them for stage s."""
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return ranges


# fp32 logits of one loss chunk under checkpointing (its backward holds about three such tensors)
LOSS_CHUNK_BYTES = 256 * 2**20


def loss_chunk_tokens(vocab: int) -> int:
    """Tokens per chunk of the checkpointed loss: as many as keep a chunk's fp32 logits within
    ``LOSS_CHUNK_BYTES`` (Llama-2's 32000 vocabulary: 2097 tokens, Llama-3's 128256: 523)."""
    return max(1, LOSS_CHUNK_BYTES // (4 * vocab))


def stage_num_params(config, layer_ids: range, first: bool, last: bool, active: bool = False) -> int:
    """Parameter count of a stage, from the config alone (for plans and memory estimates);
    ``active``: a routed layer's experts count only ``top_k / num_experts`` (FLOPs)."""
    c = counts(config)
    per_layer = c.active if active else c.layers
    own_head = last and not (tied(config) and first)  # one matrix for both uses
    return sum(per_layer[i] for i in layer_ids) + (c.embed if first else 0) + \
        ((c.head if own_head else 0) + c.norm if last else 0)


def stage_param_counts(config, num_stages: int, parts: list[range] | None = None) -> list[int]:
    """Parameter count of every stage when the model is cut into ``parts`` (default
    ``partition_layers``: a run's are ``pipeline.spec.partition.stage_layers``)."""
    parts = partition_layers(config.num_hidden_layers, num_stages) if parts is None else parts
    return [stage_num_params(config, parts[s], s == 0, s == num_stages - 1) for s in range(num_stages)]


def _mean_active_layer(config) -> float:
    c = counts(config)
    return sum(c.active) / max(1, len(c.active))


def model_key_cost(config) -> float:
    """A decoder layer's attention cost per (query, key) pair relative to its cost per token
    outside attention (``schedule.costmodel.balanced_segments``' ``key_cost``): 4 * q_dim FLOPs
    per pair against 2 per active parameter of a layer. What the sequence segments of
    ``seq_chunks`` are balanced by."""
    return 4 * config.num_attention_heads * head_dim(config) / (2 * _mean_active_layer(config))


def mean_keys(seq_len: int, window: int | None) -> float:
    """Keys a causal query attends to on average over a row of ``seq_len`` (within ``window``)."""
    if window is None or window >= seq_len:
        return (seq_len + 1) / 2
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def attention_flops_per_token(config, seq_len: int) -> float:
    """Forward FLOPs per token of the attention scores and weighted sums of every decoder layer
    (4 * q_dim per key attended: causal, and within the window on sliding layers)."""
    q = config.num_attention_heads * head_dim(config)
    return sum(4 * q * mean_keys(seq_len, k.window) for k in spec_for(config).layer_kinds(config))


def forward_flops_per_token(config, num_layers: int, last: bool, seq_len: int) -> float:
    """Forward FLOPs per token of ``num_layers`` (average) decoder layers, and of the head when
    ``last``: 2 per active parameter (matmuls; a routed layer's experts count top_k of them) and
    the attention over the keys each query sees. The embedding is a lookup (no FLOPs), and the
    loss's softmax is small beside the head's 2*V*h."""
    total_layers = config.num_hidden_layers
    head = stage_num_params(config, range(0), False, True) if last else 0
    return 2 * (num_layers * _mean_active_layer(config) + head) + \
        num_layers * attention_flops_per_token(config, seq_len) / max(1, total_layers)


def model_flops_per_token(config, num_layers: int, seq_len: int, adapters: int | None = None) -> float:
    """Training FLOPs per token, matmuls and attention scores: forward + backward = 3x forward.
    LoRA (``adapters``: the trained adapter parameters, None for full fine-tuning) computes no
    gradient of a frozen weight: its backward is the input gradients (2 per parameter) and
    attention's two passes, plus the adapters' own products (2 forward, 4 backward a parameter)."""
    forward = forward_flops_per_token(config, num_layers, True, seq_len)
    if adapters is None:
        return 3 * forward
    attention = num_layers * attention_flops_per_token(config, seq_len) / max(1, config.num_hidden_layers)
    return 2 * forward + attention + 6 * adapters


def mlp_tile_tokens(intermediate: int, dtype_bytes: int, tile_bytes: int) -> int:
    """Tokens per tile: as many as keep one intermediate tensor of a tile (tokens x ``intermediate``)
    within ``tile_bytes`` (``mlp_tile_mib``; Llama-3B in bf16 at 256 MiB: 15534 tokens)."""
    return max(1, tile_bytes // (dtype_bytes * intermediate))


@functools.lru_cache(maxsize=64)
def segment_lengths(width: int, num_segments: int, key_cost: float = 0.0) -> tuple[int, ...]:
    """The segment lengths of rows ``width`` columns wide (``balanced_segments``). A batch is as
    wide as its longest row (``data.batching.row_width``), so the cut is made per width, once:
    every rank computes the same lengths from the same batch, and its receive buffers take them."""
    from schedule.costmodel import balanced_segments

    return tuple(balanced_segments(width, num_segments, key_cost))


def segment_bounds(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, end)`` columns of each segment of a row cut into ``lengths``."""
    out, start = [], 0
    for n in lengths:
        if n < 1:
            raise ValueError(f"segment lengths must be >= 1, got {list(lengths)}")
        out.append((start, start + n))
        start += n
    return out


# The sizes that tell one model from another of its family (a copy, a fine-tune, a truncation to
# fewer layers shares them).
SIZE_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
             "vocab_size")


def size_differences(theirs: dict, config, keys: Sequence[str] = SIZE_KEYS) -> list[str]:
    """Where the config.json mapping ``theirs`` names another model than ``config`` (a transformers
    config): "hidden_size 32, this model 64" for each of ``keys`` both give and that differs."""
    if not isinstance(theirs, dict):
        return []
    return [f"{k} {theirs[k]!r}, this model {getattr(config, k)!r}" for k in keys
            if theirs.get(k) is not None and getattr(config, k, None) is not None and theirs[k] != getattr(config, k)]


__all__ = ["LOSS_CHUNK_BYTES", "MLP_TILE_BYTES", "attention_flops_per_token", "forward_flops_per_token", "layer_ranges",
           "loss_chunk_tokens", "mean_keys", "mlp_tile_tokens", "model_flops_per_token", "model_key_cost",
           "partition_layers", "segment_bounds", "segment_lengths", "size_differences", "stage_num_params",
           "stage_param_counts", "SIZE_KEYS"]
