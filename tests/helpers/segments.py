"""The segment harness the segment tests share (tests/one_process/test_segments.py,
test_long_rows.py): tiny configurations of each architecture, a stage run whole and segment by
segment, the comparison with its tolerance (the docstring of test_segments.py says why), and the
long-row settings of the trainer's runs (there and in tests/multi_process/test_gloo_long_rows.py), and
the stand-in for a Hugging Face attention module that the GPU attention tests call the kernels with."""
from __future__ import annotations

import contextlib

import torch

from pipeline.spec.shapes import segment_bounds
from pipeline.stage.model import build_stage
from pipeline.stage.segments import SegmentStage
from schedule.costmodel import balanced_segments
from tests.helpers.tolerance import rel_err as rel


class AttentionModule:
    """What ``pipeline.stage.attention.attention`` reads of a Hugging Face attention module."""

    def __init__(self, groups: int):
        self.num_key_value_groups, self.is_causal, self.training = groups, True, True


SEQ = 96
WINDOW = 32  # sliding layers: a window shorter than the sequence, crossing segment boundaries
_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-6,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
ARCHS = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW, tie_word_embeddings=False)),
    "qwen2_sliding": ("Qwen2Config", dict(tie_word_embeddings=False, use_sliding_window=True, sliding_window=WINDOW,
                                          max_window_layers=2)),
    "qwen2_tied": ("Qwen2Config", dict(tie_word_embeddings=True, use_sliding_window=False)),
}
LENGTHS = {"equal": [24, 24, 24, 24], "balanced": balanced_segments(SEQ, 3, key_cost=0.02), "two": [50, 46]}
TOL = 2e-6  # relative error (norm) of the loss and of each parameter's gradient
# every long-row path of the trainer at once: segments, activation offload, recompute, tiled MLPs
# tiles of 10 tokens of the tiny model's MLP (float32, intermediate 128), whose rows never reach 256 MiB
TINY_TILE_MIB = 10 * 4 * 128 / 2**20
LONG = dict(seq_chunks=3, activation_offload=True, activation_checkpointing=True, tiled_mlp="true",
            mlp_tile_mib=TINY_TILE_MIB)


def make_config(arch: str, impl: str):
    import transformers

    cls_name, extra = ARCHS[arch]
    config = getattr(transformers, cls_name)(**_BASE, **extra)
    config._attn_implementation = impl
    return config


def make_stages(config, num_stages: int = 1) -> list:
    """The model as ``num_stages`` stages with random weights; the 1-D ones (norms, biases)
    moved off their init so that they matter. Tied over several stages, the head copies the
    embedding (what the TIE action keeps equal)."""
    from pipeline.spec.shapes import partition_layers

    parts = partition_layers(config.num_hidden_layers, num_stages)
    stages = [build_stage(config, s, num_stages, parts[s], model_dir=None, seed=3) for s in range(num_stages)]
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for stage in stages:
            for p in stage.parameters():
                if p.ndim == 1:
                    p.add_(torch.randn(p.shape, generator=gen) * 0.1)
        if num_stages > 1 and stages[0].tied_name:
            stages[-1].lm_head.weight.copy_(stages[0].model.embed_tokens.weight)
    return stages


def make_batch(vocab: int, rows_len=(SEQ, 50, 20), seed: int = 0):
    """Right-padded rows of different lengths, as wide as the longest; targets are the next token,
    -100 on padding and on a prompt of 5 tokens (as the data side makes them)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.zeros(len(rows_len), max(rows_len), dtype=torch.long)
    targets = torch.full(x.shape, -100, dtype=torch.long)
    for i, n in enumerate(rows_len):
        x[i, :n] = torch.randint(3, vocab, (n,), generator=gen)
        targets[i, 5:n - 1] = x[i, 6:n]
    return x, targets


def grads_of(stage) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}


def reference(stage, x, targets):
    stage.zero_grad(set_to_none=True)
    loss = stage(x, targets)
    loss.backward()
    return loss.detach(), grads_of(stage)


def run_segments(stage, x, targets, lengths, *, positions=None, shift_labels=False, recompute=False):
    """Forward every segment in order, then backward from the last; optional mutations:
    ``positions`` restart at 0 in every segment, ``shift_labels`` gives segment 1 the labels
    of segment 0's columns. ``recompute`` (activation_offload): the forwards build no graph and
    each backward first recomputes its segment."""
    stage.zero_grad(set_to_none=True)
    runner = SegmentStage(stage, lengths, recompute=recompute)
    bounds = segment_bounds(lengths)
    loss, cols = 0, []
    for j, (a, b) in enumerate(bounds):
        t = targets[:, a:b]
        if shift_labels and j == 1:
            t = targets[:, :b - a]
        pos = torch.arange(0, b - a)[None] if positions == "restart" else None
        cols.append((x[:, a:b], t, pos))
        with torch.no_grad() if recompute else contextlib.nullcontext():
            loss = loss + runner.forward(0, j, x[:, a:b], t, position_ids=pos).detach()
    assert not runner.saved if recompute else len(runner.saved) == len(bounds)
    for j in reversed(range(len(bounds))):
        if recompute:
            xj, tj, pos = cols[j]
            runner.recompute_forward(0, j, xj, tj, position_ids=pos)
        assert runner.backward(0, j) is None  # the first stage sends no input gradient
    assert not runner.carry and not runner.saved  # segment 0's backward freed the micro-batch
    return loss, grads_of(stage)


def noise_floor(stage, x, targets, ref) -> dict[str, float]:
    """Per parameter, 4x the relative distance of the float32 unsplit gradient from the float64
    one (at least ``TOL``): how far two correct float32 summation orders may differ."""
    stage.double()
    try:
        _, exact = reference(stage, x, targets)
    finally:
        stage.float()
    return {n: max(TOL, 4 * rel(g.double(), exact[n])) for n, g in ref[1].items()}


def mismatch(ref, got, tol: float | dict[str, float] = TOL, loss_tol: float = TOL) -> list[str]:
    """What differs between two (loss, grads) results beyond ``loss_tol`` and ``tol`` (one
    value, or one per parameter); empty when they agree."""
    (loss_r, g_r), (loss_g, g_g) = ref, got
    limit = tol if isinstance(tol, dict) else dict.fromkeys(g_r, tol)
    out = [] if rel(loss_g, loss_r) < loss_tol else [f"loss {loss_g.item():.10g} vs {loss_r.item():.10g}"]
    if sorted(g_r) != sorted(g_g):
        out.append(f"parameters with a gradient differ: {sorted(set(g_r) ^ set(g_g))}")
    out += [f"{n}: relative error {rel(g_g[n], g_r[n]):.2e} (limit {limit[n]:.1e})" for n in sorted(g_r)
            if n in g_g and rel(g_g[n], g_r[n]) >= limit[n]]
    return out


def fused_and_plain(arch: str, num_stages: int, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """The last stage of ``arch`` split in ``num_stages``: its loss and every gradient (the
    input's too) from ``Stage.forward_backward`` and from the checkpointed forward then backward,
    both for the loss over 1/37 (a batch's normalisation)."""
    stage = make_stages(make_config(arch, "sdpa"), num_stages)[-1].to(device, dtype)
    stage.checkpointing, stage.recomputed = True, len(stage.model.layers)
    ids, targets = (t.to(device) for t in make_batch(stage.lm_head.out_features))
    x = ids if stage.is_first else torch.randn(*ids.shape, stage.lm_head.in_features, generator=torch.Generator()
                                               .manual_seed(1)).to(device, dtype)
    results = []
    for fused in (False, True):
        stage.zero_grad(set_to_none=True)
        if fused:
            loss, gx = stage.forward_backward(x, targets, 1 / 37)
        else:
            xin = x if stage.is_first else x.clone().requires_grad_()
            loss = stage(xin, targets)
            (loss / 37).backward()
            gx = None if stage.is_first else xin.grad
        results.append((loss.detach(), gx, {n: p.grad.clone() for n, p in stage.named_parameters()}))
    return results
