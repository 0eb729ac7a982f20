"""The memory plan's terms and its ledger: the sizes it reads from a model config (``ModelShape``),
the inputs of one plan (``MemoryInputs``), what parameters cost on the device and in host memory,
and the ``Ledger`` of one rank that the walk (``pipeline.plan.memory``) and the runners' ``account``
write to. What a stage's computes save and allocate per token is ``pipeline.spec.compute_bytes``'s.
No weights, no tensors: numbers of bytes."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from models import LayerShape, counts, spec_for
from offload.slices import GRAD_SLICE_NUMEL, MASTER_SLICE_NUMEL
from pipeline.spec.lora import Quantized
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


__all__ = ["GiB", "Ledger", "MemoryInputs", "ModelShape", "RankMemory", "StagePlan", "dequantized_bytes", "gib",
           "offloaded_host_bytes", "stage_frozen_bytes", "startup_host_bytes"]
