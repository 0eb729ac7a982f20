"""What a stage's computes hold on the device, per token: the tensors autograd saves from a
layer's forward to its backward (``layer_saved_bytes_per_token``) and a stage's (``per_token``),
and the transients of one layer's passes (the MLP's, the attention kernel's, an RMSNorm's
backward, a weight's gradient). The runners' ``account`` reads them; the parameters, the host and
the ``Ledger`` they write to are ``pipeline.spec.footprint``'s. Numbers of bytes, no tensors."""
from __future__ import annotations

from pipeline.spec.footprint import MemoryInputs, ModelShape
from pipeline.spec.shapes import loss_chunk_tokens


def layer_saved_bytes_per_token(m: ModelShape, d: int, seq_len: int, attn: str = "sdpa", *, tiled: bool = False,
                                pad: float = 1.0, compiled: bool = False) -> float:
    """Bytes autograd keeps per token for one decoder layer (``d``: compute dtype size).

    The attention's and the MLP's projections save their inputs (2dh). An RMSNorm saves an fp32
    copy of its input, its rsqrt and the normalised input (4n + 4 + dn; a (1 + w) norm that
    multiplies in float32, Gemma's, 4n for the last), per head for per-head q/k norms. Attention
    keeps the rotated q and k, v, its output and the log-sum-exp (2dq + 2d*kv + 4*heads; ``pad``:
    flash pads the head dimension to a multiple of 8 and keeps the padded copies, and the output
    projection then keeps its own input, a contiguous copy of the unpadded output: dq); a gated MLP
    keeps gate, up, their activation and product (4df), tiled (``pipeline.stage.tiled``) only its input,
    which the projections' 2dh counts already. A routed token keeps, per expert it
    goes to, its gathered input and weighted output (2dh) and the expert's f-wide tensors, and the
    router its probabilities (twice: the routing and the router loss's). Eager attention keeps the
    fp32 softmax (heads * seq_len a token) and unscaled copies of its inputs instead of the
    log-sum-exp.

    ``compiled`` (``MemoryInputs.inductor``: ``compile_layers``, a dense layer under sdpa):
    inductor's partition of the layer's graph keeps each norm's input, output and fp32 rsqrt (it
    recomputes the rest of the norm; per head for q/k norms), the attention's q, k, v, output and
    log-sum-exp, and the MLP's gate, up and product (it recomputes the activation): measured on
    Llama and Qwen3 layers, ``tests/pure/test_memory.py``.
    """
    h, q, kv = m.hidden, m.q, m.kv_dim
    if compiled:
        norms = (m.pre_norms + m.post_norms) * (2 * d * h + 4)
        if m.qk_norm:
            norms += d * (q + kv) + 4 * (m.heads + (m.kv_heads or m.heads))
        return norms + (2 * d * q + 2 * d * kv) * pad + 4 * m.heads + (0 if tiled else 3 * d * m.intermediate)

    def norm(n: int, groups: int = 1) -> float:
        return 4 * n + 4 * groups + (4 * n if m.norm_fp32_out else d * n)

    saved = 2 * d * h + (m.pre_norms + m.post_norms) * norm(h)
    if m.qk_norm == "head":
        saved += norm(q, m.heads) + norm(kv, m.kv_heads or m.heads)
    elif m.qk_norm == "all":
        saved += norm(q) + norm(kv)
    saved += (2 * d * q + 2 * d * kv) * pad + 4 * m.heads + (d * q if pad > 1 else 0)
    if m.fused_qkv and attn != "eager":  # sdpa saves v, a view that keeps the fused q/k/v output alive
        saved += d * (q + kv)
    if m.experts_per_token:
        k, E = m.experts_per_token, m.num_experts
        saved += 2 * (4 + d) * E + k * (2 * d * h + m.expert_saved * d * m.expert_intermediate + 24)
    elif not tiled:
        saved += 4 * d * m.intermediate
    if attn == "eager":
        saved += 4 * m.heads * seq_len + 4 * q - 4 * m.heads + (d * q if d < 4 else 0)
        if m.attn_softcap:  # tanh(scores / c) * c keeps a score-sized tensor more
            saved += d * m.heads * seq_len
    return saved


def weight_grad_bytes(inp: MemoryInputs, s: int) -> int:
    """Autograd computes a weight's gradient as a new tensor, then adds it into ``.grad``: the
    largest weight of the stage is a transient of its backward."""
    m, st = inp.shape, inp.stages[s]
    if inp.lora_rank:  # frozen weights get no gradient: the largest is an adapter's (r x the widest side)
        return inp.lora_rank * max(m.hidden, m.intermediate, m.q) * inp.dtype_bytes if st.num_layers else 0
    largest = m.largest if st.num_layers else 0
    if st.first or st.last:
        largest = max(largest, m.vocab * m.hidden)
    return largest * inp.dtype_bytes


def per_token(inp: MemoryInputs, s: int, seg: int | None = None) -> tuple[float, float, float]:
    """(saved from F to B, transient during F, transient during B) per token of stage ``s``
    (of segment ``seg``'s tokens, which attend to ``end`` keys)."""
    m, d, st = inp.shape, inp.dtype_bytes, inp.stages[s]
    h, f, V = m.hidden, m.mlp_width, m.vocab
    start, end, tokens = inp.span(seg)
    tiled = inp.mlp_tile_tokens > 0 and not m.experts_per_token
    layer = layer_saved_bytes_per_token(m, d, end, inp.attn, tiled=tiled, pad=head_pad(inp), compiled=inp.inductor)
    kept = inp.kept_layers(s)
    # activation_offload: the backward's recompute of the stage checkpoints no layer again
    layer_ckpt = inp.checkpointing and not inp.activation_offload
    recomputed = st.num_layers - kept if layer_ckpt else 0  # layers that save only their input
    # LoRA: each adapted linear keeps its r-wide down-projection for B's gradient (its input is
    # the one the layer formula counts: a frozen weight's product saves the weight, not the input)
    layer += inp.lora_modules * inp.lora_rank * d
    saved = recomputed * d * h + (st.num_layers - recomputed) * layer
    if seg is not None:
        # A segment's own keys/values stay, carried for the later segments (a recomputed layer's
        # too). A layer that keeps its activations also has the attention kernel's saved keys/values,
        # which ``layer`` counted for the segment's own columns, padded: for a first segment whose
        # head dimension needs no padding they are the carried tensors themselves; else the kernel's
        # copies (padded where the head dimension is) of every earlier segment's and its own: end
        # columns (measured on an H200 with a 100-wide head: bench/results/2026-11-28_long_rows_plan_choices).
        carried, pad = 2 * d * m.kv_dim, head_pad(inp)
        kernel_kv = 0.0 if pad == 1 and start == 0 else carried * pad * end / (end - start)
        saved += recomputed * carried + (st.num_layers - recomputed) * (carried + kernel_kv - carried * pad)
    if st.first:
        saved += 8 + (d * h if recomputed else 0)  # token ids; the embedding output a recomputed layer saves
    elif recomputed:
        saved -= d * h  # the first recomputed layer saves the stage input itself, which the runner holds
    elif d == 4:
        saved -= 4 * h  # fp32: the first norm saves the stage input itself, which the runner holds
    fwd = bwd = 0.0
    if st.num_layers:
        mlp_fwd, mlp_bwd = mlp_work(inp, tokens)
        attn_fwd, attn_bwd = attention_work(inp, start, end)
        # backward of one layer: a few h-wide gradients and the worst of its two phases: the
        # MLP's (three f-wide gradients, one net compiled, or a tile's recompute and gradients) with all
        # still saved, then the attention kernel's workspace, by when the MLP side's saved
        # tensors (its input, the norm before it, untiled its intermediates) are freed; a
        # recomputed layer's saved tensors are made again first.
        if inp.inductor:  # the norm's input, output and rsqrt, and gate, up and product untiled
            mlp_side = 2 * d * h + 4 + (0 if tiled else 3 * d * f)
        else:
            mlp_side = d * h + 4 * h + 4 + (4 * h if m.norm_fp32_out else d * h) + \
                (0 if tiled or m.experts_per_token else 4 * d * f)
        bwd = max(4 * d * h + max(mlp_bwd, attn_bwd - mlp_side), norm_backward(inp)) + (layer if recomputed else 0)
        # forward of one layer: the MLP's intermediates where nothing keeps them (a checkpointed
        # layer, a tile), the attention kernel's padded copies (and a segment's keys concatenated)
        fwd = max(mlp_fwd if recomputed or tiled else 0, attn_fwd)
    if st.last:
        upcast = 4 * V if d < 4 else 0
        # checkpointed, the head runs in chunks of tokens: its logits exist for one chunk at a time
        share = min(1.0, loss_chunk_tokens(V) / tokens) if inp.checkpointing else 1.0
        fwd = max(fwd, (d * V + upcast) * share)       # the logits and their fp32 copy
        if inp.checkpointing:  # the head and loss are recomputed: only their input and the targets stay
            saved += d * h + 8
            bwd = max(bwd, (12 * V + (d * V if d < 4 else 0)) * share)
        else:
            saved += 4 * h + 4 + 2 * d * h + 4 * V + 8  # final norm, lm_head input, fp32 log-softmax, targets
            bwd = max(bwd, 8 * V + (d * V if d < 4 else 0))
    return saved, fwd, bwd


def norm_backward(inp: MemoryInputs) -> float:
    """Per token, what an eager RMSNorm's backward holds at once when it computes in float32 from
    a 16-bit input: the output gradient and five float32 temporaries of the hidden width (the
    cast gradient, the input's gradient in its parts, the weight's product). Measured on an H200 at
    the peak of a layer's backward with a tiled MLP, where it is the largest part: 22 bytes a
    token per hidden unit for Llama-3B (full fine-tuning, 128K tokens a row) and Llama-3-8B (LoRA,
    frozen norms, 64K), where the rest of the backward came to 12 and 14. Inductor fuses it."""
    d, h = inp.dtype_bytes, inp.shape.hidden
    if inp.inductor or d >= 4:
        return 0.0
    return (5 * 4 + d) * h


def head_pad(inp: MemoryInputs) -> float:
    """How much bigger flash keeps q, k, v and the output: the head dimension padded to a multiple
    of 8 (Llama-3B's 100 to 104); 1 where no flash kernel runs (the CPU, float32, eager)."""
    if not inp.kernels or inp.dtype_bytes >= 4:
        return 1.0
    hd = inp.shape.q // max(1, inp.shape.heads)
    return -(-hd // 8) * 8 / hd


def mlp_work(inp: MemoryInputs, tokens: int) -> tuple[float, float]:
    """Per token of a pass of ``tokens``: the MLP's intermediates while one layer's forward runs
    (gate, up, activation, product) and its backward's (three f-wide gradients); tiled, one
    tile's (a pass shorter than a tile is one tile, recomputed too): in the backward its
    recompute's gate, up and activation and three gradients, the product freed once the down
    projection's gradients are made (measured on an H200: bench/results/2026-11-28_long_rows_plan_choices).

    A compiled layer's backward adds one f-wide tensor net: inductor frees the saved product once
    the down projection's weight gradient is made and writes the gate's and up's gradients over
    buffers it no longer needs. Measured (a layer's saved tensors plus its backward's peak above
    them): 1.27x over with one f-wide gradient, 1.58x over with three, on the CPU
    (``tests/pure/test_memory.py``); on an H200 the plan with three was 37-50 KB a token over the
    peaks of whole rows in stages of one to three layers (bench/results/2026-11-28_gpu_tests_and_tables).

    LoRA on gate or up (``lora_mlp``): peft's ``base(x) + B(A(x)) * scaling`` makes the sum as a
    new tensor, one f-wide more in a forward; compiled, inductor's partition of such a layer saves
    less and its backward holds more: saved tensors plus backward came to 3.8-7.8 f-wide tensors a
    token over the layouts of adapters measured on the CPU (all-linear, gate, gate and up,
    attention, down), which 3.5 f-wide gradients beside the formula's saved tensors cover
    (``tests/pure/test_memory.py``); on an H200 a Llama-3-8B LoRA row of 32K tokens in stages of two
    compiled layers peaked with six f-wide tensors of inductor's backward beside the recomputed
    layers' saved ones, 0.4 GiB over the plan with 3.5 (bench/results/2026-12-01_plan_matrix): 4.5."""
    d, f = inp.dtype_bytes, inp.shape.mlp_width
    # peft adds an adapter's output to its base output as a new tensor: one MLP-wide tensor more
    # while gate or up is made; compiled, the backward keeps 4.5 where full fine-tuning keeps one
    lora = 1 if inp.lora_mlp else 0
    if inp.mlp_tile_tokens <= 0 or inp.shape.experts_per_token:
        return (4 + lora) * d * f, ((1 + 3.5 * lora) * d * f if inp.inductor else 3 * d * f)
    share = min(1.0, inp.mlp_tile_tokens / tokens)
    return (4 + lora) * d * f * share, 6 * d * f * share


def attention_work(inp: MemoryInputs, start: int, end: int) -> tuple[float, float]:
    """Per query token of a pass whose queries are columns ``start..end-1`` over keys
    ``0..end-1``: what a layer's attention allocates beyond the saved tensors, in the forward and
    in the backward. On a GPU (flash): the padded copies of q, k, v and the output (head dimension
    to a multiple of 8), and in the backward flash's fp32 query-gradient accumulator, the padded
    q, k, v gradients (keys expanded to the query heads with GQA) and the output gradient padded;
    a segment's keys/values concatenated with the carried ones (``end`` columns) in the forward
    and their gradient in the backward. A whole row through cuDNN (``inp.cudnn``) has no fp32
    accumulator (its peak measured 0.21 GiB under flash's at 16K, Llama-3B's heads: that term).
    The CPU's explicit-mask kernels are not modelled here (the layer formula and the CPU check
    cover them), nor the GPU's for windows and records over fewer than ``FLEX_BLOCK`` (128) keys:
    at most a 128 x 128 mask and scores a head, left to the plan's margin."""
    m, d = inp.shape, inp.dtype_bytes
    keys = end / max(1, end - start)  # keys per query token
    concat = 2 * d * m.kv_dim * keys if start > 0 else 0.0
    if not inp.kernels:
        return concat, concat
    pad = head_pad(inp)
    padded = pad > 1
    fwd = (d * pad * (2 * m.q + 2 * m.kv_dim * keys) if padded else 0.0) + concat
    accumulator = 0.0 if inp.cudnn and start == 0 else 4 * m.q * pad
    bwd = accumulator + d * pad * (2 * m.q + 2 * m.q * keys) + concat
    return fwd, bwd


__all__ = ["attention_work", "head_pad", "layer_saved_bytes_per_token", "mlp_work", "norm_backward", "per_token",
           "weight_grad_bytes"]
