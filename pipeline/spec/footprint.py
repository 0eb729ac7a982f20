"""The memory plan's arithmetic: the sizes it reads from a model config (``ModelShape``), what a
stage saves and allocates per token (``per_token`` and its parts), what parameters cost, and the
``Ledger`` of one rank that the walk (``pipeline.plan.memory``) and the runners' ``account``
write to. No weights, no tensors: numbers of bytes."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from models import LayerShape, counts, spec_for
from offload.slices import GRAD_SLICE_NUMEL, MASTER_SLICE_NUMEL
from pipeline.spec.lora import Quantized
from pipeline.spec.shapes import loss_chunk_tokens
from schedule.ir import RECV_OPS, Action, Op, crosses, offloaded_stages, recv_for


GiB = 2**30


@dataclass(frozen=True)
class ModelShape(LayerShape):
    """The sizes the estimate needs from a Hugging Face config (``of``): the family's layer
    (``models.LayerShape``'s fields), the vocabulary and the largest layer parameter."""

    vocab: int = 0
    largest_layer_param: int = 0  # 0: hidden * intermediate

    @staticmethod
    def of(config) -> "ModelShape":
        layer = spec_for(config).shape(config)
        return ModelShape(**{f.name: getattr(layer, f.name) for f in fields(LayerShape)},
                          vocab=config.vocab_size, largest_layer_param=counts(config).largest)

    @property
    def q(self) -> int:
        return self.q_dim or self.hidden

    @property
    def mlp_width(self) -> int:
        """The MLP's intermediate width a token passes through (a routed token: its experts')."""
        return self.experts_per_token * self.expert_intermediate if self.experts_per_token else self.intermediate

    @property
    def largest(self) -> int:
        return self.largest_layer_param or self.hidden * self.intermediate


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


@dataclass(frozen=True)
class StagePlan:
    numel: int
    num_layers: int
    first: bool
    last: bool
    adapter: int = 0  # LoRA: adapter elements (trained); ``numel`` is then the frozen base weights
    quantized: Quantized = Quantized()  # load_in_4bit: the part of ``numel`` held in 4 bits


@dataclass
class RankMemory:
    """Peak bytes of one rank, and what the peak is made of."""

    rank: int
    device_peak: int = 0
    host: int = 0
    at: str = ""                                   # the action during which the peak occurs
    parts: dict[str, int] = field(default_factory=dict)
    host_parts: dict[str, int] = field(default_factory=dict)  # parameters; GPU runs: stash, carried_kv, process


@dataclass(frozen=True)
class MemoryInputs:
    shape: ModelShape
    stages: list[StagePlan]
    mapping: list[int]
    micro_batch: int
    seq_len: int
    dtype_bytes: int
    offload: bool
    checkpointing: bool
    attn: str = "sdpa"
    cpu: bool = False  # device memory is host memory: count everything once
    # With checkpointing: per stage, how many of its (last) layers keep their activations
    # instead of recomputing them; () = none.
    kept: tuple[int, ...] = ()
    # seq_chunks: the lengths of a row's sequence segments (their sum is seq_len); () = whole rows.
    segments: tuple[int, ...] = ()
    activation_offload: bool = False
    mlp_tile_tokens: int = 0  # tiled_mlp: tokens per MLP tile (0: untiled)
    compiled: bool = False    # compile_layers: inductor's graphs keep less than eager autograd
    cudnn: bool = False       # whole rows through cuDNN's attention (no fp32 query-gradient accumulator)
    # LoRA: the adapters' rank (0: full fine-tuning) and the adapted linear modules of a layer
    lora_rank: int = 0
    lora_modules: int = 0
    lora_mlp: bool = False    # an adapter on a linear with an MLP-wide output (gate, up: ``adapts_mlp_width``)
    delayed: bool = False     # delayed_update: an offloaded stage's compute copy is its own buffer in fp32 too
    # data_parallel: a resident stage keeps an fp32 copy of its gradient, which the replicas sum
    summed: bool = False
    # device_steps: offloaded stages whose AdamW moments live on the device, which steps them
    device_stepped: frozenset[int] = frozenset()

    @property
    def inductor(self) -> bool:
        """The layers' graphs are inductor's (``compile_layers`` on a dense layer under sdpa): its
        partition saves less than eager autograd, and its backward reuses buffers."""
        return self.compiled and not self.shape.experts_per_token and self.attn != "eager"

    @property
    def kernels(self) -> bool:
        """Attention through kernels without a score matrix (``pipeline.stage.attention`` on a GPU):
        sdpa on a GPU; the CPU runs segments, windows and packed rows through explicit masks."""
        return self.attn == "sdpa" and not self.cpu

    @property
    def kv_offload(self) -> bool:
        """seq_chunks with activation_offload on a GPU: the carried keys/values wait in host
        memory between a stage's forwards of a micro-batch and its backwards (``offload.kv``)."""
        return self.activation_offload and bool(self.segments) and not self.cpu

    def span(self, seg: int | None) -> tuple[int, int, int]:
        """(start, end) columns of segment ``seg`` of a row (the whole row for None), and the
        tokens of a micro-batch's segment."""
        if seg is None or not self.segments:
            return 0, self.seq_len, self.micro_batch * self.seq_len
        start = sum(self.segments[:seg])
        return start, start + self.segments[seg], self.micro_batch * self.segments[seg]

    def kept_layers(self, s: int) -> int:
        return min(self.kept[s], self.stages[s].num_layers) if self.checkpointing and self.kept else 0


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


def param_bytes_resident(numel: int, d: int, summed: bool = False) -> int:
    # compute copy + its grad + fp32 master + AdamW moments; fp32 compute: the compute copy is the
    # master and the grad fp32. In 16-bit an fp32 copy of the grad only to sum it over replicas
    # (``summed``): else the norm and the step convert it a chunk at a time (``offload/resident.py``)
    if d == 4:
        return numel * 16
    return numel * (d + d + 4 + 8 + (4 if summed else 0))


def resident_step_transient(numel: int, inp: "MemoryInputs") -> int:
    """Device bytes a resident stage's norm or step holds for a moment: one chunk of its gradient
    converted to fp32 (16-bit compute, no fp32 copy kept; ``offload/resident.py``)."""
    return 0 if inp.dtype_bytes == 4 or inp.summed else min(numel, MASTER_SLICE_NUMEL) * 4


# device_steps: a stage's AdamW moments on the device, out of host memory
DEVICE_MOMENT_BYTES = 8


def device_step_buffers(numel: int) -> int:
    """Device bytes of the buffers a device-stepped offloaded stage's masters and gradient cross
    in, a chunk at a time (``offload.streams.Streams.step_buffers``: one pair per rank, the largest
    such stage's)."""
    return 2 * min(numel, MASTER_SLICE_NUMEL) * 4


def frozen_bytes(numel: int, d: int) -> int:
    # LoRA's base weights: one compute-dtype copy (host or device), no gradient, master or AdamW state
    return numel * d


def stage_frozen_bytes(st: StagePlan, d: int) -> int:
    """LoRA's base weights of a stage as its store holds them (host or device, and what a LOAD
    copies): the compute-dtype copy, and for a 4-bit base (``load_in_4bit``) its linear weights'
    packed bytes and scales instead of their compute-dtype copy (``offload.frozen``)."""
    return frozen_bytes(st.numel - st.quantized.numel, d) + st.quantized.nbytes


def dequantized_bytes(stages: list[StagePlan], d: int) -> int:
    """A 4-bit base's transient while a stage computes: bitsandbytes dequantizes a weight whole
    to the compute dtype for each product (forward and backward), one at a time, so the largest
    linear weight of the rank's stages."""
    return max((st.quantized.largest for st in stages), default=0) * d


def param_bytes_host(numel: int, d: int, delayed: bool = False) -> int:
    # fp32 master + master grad (the offload's destination) + AdamW moments, and the pinned
    # compute copy of the weights: the master itself in fp32, except with a delayed update, whose
    # compute copy keeps the weights from before the step while the masters move on
    return numel * (4 + 4 + 8 + (d if d < 4 or delayed else 0))


# Host memory a process on a GPU holds besides its stores and activations: the CUDA context,
# the libraries' code and workspaces, the interpreter and the loaded modules (the peak resident set
# less the stores' buffers and the stash: 2.1-2.3 GiB on an H200, torch 2.11), and compiled layers'
# inductor and Triton state (2.9 GiB more with Llama-3-8B's layers). Page-locked buffers are part
# of the resident set.
# Compiling a layer's graph (the first step), inductor benchmarks kernel choices on the GPU after
# flushing its L2 cache with a buffer of the cache's size: 60 MiB on an H200 (Qwen2.5-32B LoRA's
# first backward peaked with it), 72 MiB on an RTX 4090, 96 MiB on an RTX 5090.
AUTOTUNE_BYTES = 128 * 2**20
# cuBLAS's workspace, from the caching allocator, one for each (handle, stream) that runs a matmul:
# handles are per thread, so the forward's thread and autograd's backward thread hold one each on
# the compute stream, 32 MiB apiece on Hopper (torch's default; 8 MiB before it). LoRA of the tiny
# preset in 10 uncompiled stages peaked 62-63 MiB above the plan that left them out.
BLAS_WORKSPACE_BYTES = 2 * 32 * 2**20
PROCESS_HOST_BYTES = int(2.5 * GiB)
COMPILED_HOST_BYTES = int(3.0 * GiB)
# The same while the stages are built: the CUDA context and the libraries, before any workspace or
# compiled graph (1.6-1.75 GiB on an H200, torch 2.11: Llama-3-8B LoRA rows' peak resident set
# during start-up less what ``startup_host_bytes`` counts).
BUILD_PROCESS_BYTES = int(1.75 * GiB)


def offloaded_host_bytes(inp: "MemoryInputs", s: int) -> int:
    """What the store of offloaded stage ``s`` holds in host memory: LoRA's frozen base as stored,
    else the masters, their gradient, AdamW's moments (on the device with ``device_steps``) and
    the compute copy."""
    st, d = inp.stages[s], inp.dtype_bytes
    if inp.lora_rank:
        return stage_frozen_bytes(st, d)
    moved = st.numel * DEVICE_MOMENT_BYTES if s in inp.device_stepped else 0
    return param_bytes_host(st.numel, d, inp.delayed) - moved


def startup_host_bytes(inp: "MemoryInputs", mine: list[int], offloaded: frozenset[int]) -> int:
    """The host's peak while a rank builds its stages (``pipeline.run.build``, in stage order): a
    stage is made (read or drawn) in float32 on the CPU and its store then copies it, into host
    buffers for an offloaded stage (beside those of the stages built before it), onto the device
    for a resident one, a tensor at a time through a compute-dtype copy. A 4-bit base's linear
    weights are never whole in float32 (``build_stage``: layer by layer). Where a stage of
    Llama-3-8B holds the embedding, this is above the training's peak: all stages resident, 11.18
    GiB measured against 5.56 for training."""
    d, shape = inp.dtype_bytes, inp.shape
    held = peak = 0
    for s in sorted(mine):
        st = inp.stages[s]
        store = offloaded_host_bytes(inp, s) if s in offloaded else 0
        made = 4 * (st.numel + st.adapter - st.quantized.numel + st.quantized.numel // max(st.num_layers, 1))
        convert = 0 if s in offloaded else max(shape.largest, shape.vocab * shape.hidden if st.first or st.last
                                               else 0) * d
        peak = max(peak, held + store + made + convert)
        held += store
    return BUILD_PROCESS_BYTES + peak


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


class Ledger:
    """What one rank holds while the memory plan walks its action list, and its peak so far.

    The walk (``estimate_rank``) counts the parameter actions here (``parameters``); every
    FORWARD and BACKWARD is its stage's runner's to count (``Runner.account``), through these
    fields and methods. Bytes, as floats where formulas per token make them:

    * ``saved``: autograd's saved tensors of forwards whose backward has not run, by
      (stage, micro-batch, segment) in ``per_mb`` (segments add (stage, micro-batch, "kv") for
      the carried keys' gradients);
    * ``held``: stage inputs, outputs and gradients the executor or a runner keeps, and the
      buffers of receives posted ahead of their compute (``posted``, by RECV action), until
      the compute that takes one, whose runner counts what it keeps of it;
    * ``sent``: activation_offload's sent tensors, released at the next compute;
    * ``stashed`` (peak ``stash_peak``): stage inputs in host memory;
    * ``kv_host``: carried keys/values off the device, by (stage, micro-batch), as (bytes in host
      memory not yet prefetched back, bytes of the first layer's that the micro-batch's first
      backward there makes again, bytes in host memory); the peak of the last in ``kv_host_peak``;
    * the parameter buffers: resident stages' (``params_static``) and the offload pool's
      (``pool_bytes``, replayed take by take as ``offload/streams.py``'s ``BufferPool``; ``pool``:
      the buffers an earlier iteration made, ``pool_made`` after its walk).
    """

    def __init__(self, inp: MemoryInputs, rank: int, actions: list[Action], pool: dict[int, int] | None = None):
        d = inp.dtype_bytes
        self.inp, self.rank = inp, rank
        self.tokens = inp.micro_batch * inp.seq_len
        self.mine = mine = [s for s, r in enumerate(inp.mapping) if r == rank]
        self.out = out = RankMemory(rank)
        self.offloaded = offloaded = offloaded_stages({rank: actions}) if inp.offload else frozenset()
        self.lora = bool(inp.lora_rank)
        out.host = sum(offloaded_host_bytes(inp, s) for s in mine if s in offloaded)
        if self.lora:  # frozen base weights in host memory (offloaded) or on the device; adapters on the device
            self.params_static = sum(param_bytes_resident(inp.stages[s].adapter, d, inp.summed)
                                     + (0 if s in offloaded else stage_frozen_bytes(inp.stages[s], d)) for s in mine)
            # counted throughout: the peaks are in the computes, where it exists
            self.params_static += dequantized_bytes([inp.stages[s] for s in mine], d)
        else:
            self.params_static = sum(param_bytes_resident(inp.stages[s].numel, d, inp.summed)
                                     for s in mine if s not in offloaded)
        # the trained parameters of the stages that step on the device (LoRA: every stage's adapters)
        self.device_stepped = {s: inp.stages[s].adapter if self.lora else inp.stages[s].numel
                               for s in mine if self.lora or s not in offloaded}
        moved = [inp.stages[s].numel for s in mine if s in inp.device_stepped and s in offloaded]
        if moved:  # device_steps: the moments on the device (offloaded_host_bytes), the step's buffers made once
            self.params_static += sum(moved) * DEVICE_MOMENT_BYTES
            if not inp.cpu:  # as the staging buffer below: the streams', not a store's
                self.params_static += device_step_buffers(max(moved))
        out.host_parts = {"parameters": out.host}
        if not inp.cpu:
            self.params_static += BLAS_WORKSPACE_BYTES
        if offloaded and d < 4 and not inp.cpu and not self.lora:  # the load stream's staging buffer (masters converted on the GPU)
            self.params_static += min(MASTER_SLICE_NUMEL, max(inp.stages[s].numel for s in offloaded)) * 4
        # numel -> buffers: free now, and made (``pool``: what an earlier iteration left, all free)
        # (elements, bytes each) -> buffers, as the pool keys them by (numel, dtype)
        self.pool_free: dict[tuple[int, int], int] = dict(pool or {})
        self.pool_made: dict[tuple[int, int], int] = dict(pool or {})
        self.pool_bytes = sum(numel * size * n for (numel, size), n in self.pool_made.items())
        self.has_grad: set[int] = set()
        self.saved = 0.0
        self.held = 0.0
        self.posted: dict[Action, float] = {}
        self.per_mb: dict[tuple[int, int, int | str | None], float] = {}
        self.stashed = self.stash_peak = 0.0
        self.sent = 0.0
        self.kv_host: dict[tuple[int, int], tuple[float, float, float]] = {}
        self.kv_host_peak = 0.0
        # each backward that recomputes starts bringing back the next backward's inputs
        order = [(a.stage, a.mb, a.seg) for a in actions if a.op is Op.BACKWARD]
        self.next_backward = dict(zip(order, order[1:]))

    # --- what the runners use ---------------------------------------------------------------
    def compute(self, a: Action) -> tuple[int, int, float]:
        """(stage, tokens, bytes of one hidden state) of an action on a micro-batch (of its segment)."""
        n = self.inp.span(a.seg)[2]
        return a.stage, n, self.inp.dtype_bytes * self.inp.shape.hidden * n

    def crosses(self, s: int, t: int) -> bool:
        """The tensor between stage ``s`` and its neighbour ``t`` goes to another rank."""
        return crosses(self.inp.mapping, s, t)

    def arrive(self, a: Action) -> None:
        """A FORWARD or BACKWARD takes the receive posted for it: its buffer is the runner's to
        count from here (as the input it keeps, or not at all)."""
        self.held -= self.posted.pop(recv_for(a), 0.0)

    def release_sent(self) -> None:
        """activation_offload: the sent tensors are dropped at the next compute."""
        self.held, self.sent = self.held - self.sent, 0.0

    def grad_buffer(self, s: int) -> None:
        """An offloaded stage's first gradient-making compute of the iteration takes its device
        gradient buffer from the pool (``StageStore.before_compute(backward=True)``)."""
        if s in self.offloaded and s not in self.has_grad and not self.lora:  # LoRA: adapters' grads are static
            self.take((self.inp.stages[s].numel, self.inp.dtype_bytes))
            self.has_grad.add(s)

    def note_peak(self, a: Action, transient: float) -> None:
        """What the device holds at action ``a``, plus its ``transient``: a new peak is kept with its parts."""
        if self.inp.compiled and not self.inp.cpu and a.op in (Op.FORWARD, Op.BACKWARD):
            transient += AUTOTUNE_BYTES  # the first step compiles each graph where it first runs
        now = self.params_static + self.pool_bytes + self.saved + self.held + (self.stashed if self.inp.cpu else 0)
        if now + transient > self.out.device_peak:
            self.out.device_peak, self.out.at = int(now + transient), str(a)
            self.out.parts = {"parameters": int(self.params_static + self.pool_bytes), "activations": int(self.saved),
                              "in_flight": int(self.held), "transient": int(transient)}

    # --- the parameter actions --------------------------------------------------------------
    def take(self, key: tuple[int, int]) -> None:
        if self.pool_free.get(key):
            self.pool_free[key] -= 1
        else:
            self.pool_made[key] = self.pool_made.get(key, 0) + 1
            self.pool_bytes += key[0] * key[1]

    def give(self, key: tuple[int, int]) -> None:
        self.pool_free[key] = self.pool_free.get(key, 0) + 1

    def loads(self, s: int) -> list[tuple[int, int]]:
        """The pool buffers, as (elements, bytes each), that a LOAD of stage ``s`` takes
        (``offload.frozen``): the weights in the compute dtype, and a 4-bit base's packed bytes and
        scales in a buffer of their own. So a last stage's 4-bit layers share the other stages'
        buffers and only its head's copy is a buffer of its own size (Llama-3-70B QLoRA in 16
        stages: 2295, 2295 and 2004 MiB measured, not one buffer of 4299 MiB for the last)."""
        st, d = self.inp.stages[s], self.inp.dtype_bytes
        if not self.lora:
            return [(st.numel, d)]
        plain = (st.numel - st.quantized.numel, d)
        return [plain, (st.quantized.nbytes, 1)] if st.quantized.numel else [plain]

    def parameters(self, a: Action) -> None:
        """Any action but a FORWARD or BACKWARD: a RECV's buffer is held until its compute
        (``arrive``), LOAD takes a buffer of the pool, DROP gives it back, OFFLOAD_GRADS gives back the weights' and the gradients' (through an fp32 chunk on
        its way to the host); NORM and STEP convert a device-stepped stage's gradient a chunk at
        a time; the rest move no parameter."""
        transient = 0.0
        if a.op in RECV_OPS:  # its buffer exists from the post on (the executor allocates it there)
            self.posted[a] = self.compute(a)[2]
            self.held += self.posted[a]
        elif a.op is Op.LOAD:
            for key in self.loads(a.stage):
                self.take(key)
        elif a.op is Op.DROP or (a.op is Op.OFFLOAD_GRADS and self.lora):  # LoRA: no gradient goes back
            for key in self.loads(a.stage):
                self.give(key)
        elif a.op is Op.OFFLOAD_GRADS:
            numel = self.inp.stages[a.stage].numel
            self.give((numel, self.inp.dtype_bytes))
            self.give((numel, self.inp.dtype_bytes))
            self.has_grad.discard(a.stage)
            if self.inp.dtype_bytes < 4:  # the fp32 chunk the gradients go through on their way to the host
                transient = min(numel, GRAD_SLICE_NUMEL) * 4 / self.tokens
        elif a.op in (Op.NORM, Op.STEP):  # a device-stepped stage's gradient chunk in fp32
            numel = [self.device_stepped.get(a.stage, 0)] if a.op is Op.STEP else self.device_stepped.values()
            transient = max((resident_step_transient(n, self.inp) for n in numel), default=0) / self.tokens
        self.note_peak(a, transient * self.tokens)

    def finish(self) -> RankMemory:
        out, inp = self.out, self.inp
        if inp.cpu:  # one memory: the "device" tensors are host tensors (the stash's inputs counted in the walk)
            out.host += out.device_peak
            out.device_peak = 0
        else:
            # page-locked buffers of exact sizes (``offload.streams.HostBuffers``)
            out.host_parts.update(stash=int(self.stash_peak), carried_kv=int(self.kv_host_peak),
                                  process=PROCESS_HOST_BYTES + (COMPILED_HOST_BYTES if inp.compiled else 0))
            out.host += out.host_parts["stash"] + out.host_parts["carried_kv"] + out.host_parts["process"]
            # the start-up's peak, when above the training's: the resident set keeps its high-water mark
            out.host_parts["startup"] = startup_host_bytes(inp, self.mine, self.offloaded)
            out.host = max(out.host, out.host_parts["startup"])
        return out


__all__ = ["GiB", "Ledger", "MemoryInputs", "ModelShape", "RankMemory", "StagePlan", "attention_work",
           "dequantized_bytes", "gib", "layer_saved_bytes_per_token", "mlp_work", "norm_backward", "per_token",
           "offloaded_host_bytes", "stage_frozen_bytes", "startup_host_bytes", "weight_grad_bytes"]
