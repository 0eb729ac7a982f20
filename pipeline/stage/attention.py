"""The attention of every sdpa pass of a stage, without a score matrix where the GPU has a kernel.

A stage's decoder layers are Hugging Face's; they call the attention function their config names
(``ALL_ATTENTION_FUNCTIONS``) with ``(module, query, key, value, attention_mask, scaling=...,
dropout=..., **family extras)``. A stage built for sdpa names ``NAME``, registered here, and passes
as ``attention_mask`` an ``AttnMask``: which key columns each query may see, described, not
materialised. ``attention`` then picks the kernel:

* ``causal``: a whole row, plain causal: sdpa's causal kernel (``is_causal``; flash on a GPU),
  exactly what whole rows ran before (on the CPU as well).
* ``cudnn``: a whole plain causal row on a GPU whose cuDNN kernel takes the model's head shapes
  (``cudnn_takes``, probed once per shape outside compiled code): sdpa's cuDNN kernel, the head
  dimension zero-padded to a multiple of 8 where it is not one (Llama-3B's 100), which changes no
  score and no kept output column. On an H200 at head_dim 100 it runs forward and backward 1.7x
  (65,536 tokens) to 1.4x (16 x 512) faster than flash-2, with the same error against float32
  attention (``bench/attention_kernels.py``). ``use_backend("flash")`` keeps such rows on flash.
* ``lower_right``: a sequence segment's queries (columns ``q_start..kv_len-1``) against the
  carried keys and their own, plain causal: the causal triangle aligned to the bottom right of
  the [queries, keys] scores (``torch.nn.attention.bias.causal_lower_right``), which flash (and
  the memory-efficient kernel) compute without the scores. It is taken only after checking that
  one of those kernels accepts the inputs, so it never falls back silently to a materialised mask.
* ``flex``: windows (sliding layers) and packed rows (record ids) where they cut something:
  ``flex_attention`` (compiled) with a block mask, built once per pass and shared by its layers;
  a pass over fewer keys than one flex block (``FLEX_BLOCK``) takes ``reference``.
* ``reference``: the explicit boolean mask through Hugging Face's sdpa function. On the CPU every
  segment, window and packed row takes it (flex has no CPU backward): it is the reference the
  GPU kernels are checked against (``tests/gpu/test_gpu_long.py``).

``kernels(mode)`` forces ``reference`` everywhere, or the kernels' dispatch on the CPU as well
(``lower_right``'s CPU form is its materialised mask: the tests check its alignment there).
``KERNEL_CALLS`` counts the kernels taken (outside compiled code), for tests and the bench.

Eager attention (Gemma 2's soft-capped scores, gpt-oss's sinks: what sdpa cannot compute) is not
routed here: those layers get the additive mask as before, and the memory plan counts their
scores.
"""
from __future__ import annotations

import contextlib
import threading
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "mmoc_sdpa"
BACKENDS = ("auto", "flash")  # what a whole causal row takes on a GPU: cuDNN where it can, or flash
_BACKEND = ["auto"]
# (device, dtype, heads, kv heads, head dim) -> whether sdpa's cuDNN kernel takes such a row
_CUDNN: dict[tuple, bool] = {}
KERNEL_CALLS: Counter = Counter()
_MODE = ["auto"]  # auto | reference | kernels
# Flex works in blocks of this many keys. Over fewer keys the explicit mask is as small as one
# block, and torch 2.11's compiled flex finds no kernel for it (NoValidChoicesError, measured on
# H100 and H200: bench/results/2026-11-27_one_gpu_tests_and_structure_check).
FLEX_BLOCK = 128


class AttentionKernelError(RuntimeError):
    """No memory-efficient kernel takes a segment's attention (the message says why and what to change)."""


def attend_mask(seq_len: int, device: torch.device, window: int | None = None, q_start: int = 0) -> torch.Tensor:
    """Boolean [T - q_start, T], True where query i (of positions ``q_start..T-1``) may attend key
    j (of ``0..T-1``): j <= i, and j > i - window with a window (transformers'
    ``sliding_window_causal_mask_function``). ``q_start`` > 0: the queries of a sequence segment."""
    q = torch.arange(q_start, seq_len, device=device)[:, None]
    k = torch.arange(seq_len, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    return allowed


@dataclass(eq=False)
class AttnMask:
    """Which keys the queries of one pass may attend: the queries are columns ``q_start..kv_len-1``
    of their rows, the keys columns ``0..kv_len-1`` (a whole row: ``q_start`` 0); key <= query,
    within ``window`` columns on a sliding layer, and with packed rows (``doc_ids`` [B, kv_len],
    every column's record id) within the query's record. One object per pass and window, shared
    by the layers of that window."""

    q_start: int
    kv_len: int
    window: int | None = None
    doc_ids: torch.Tensor | None = None
    _block: dict = field(default_factory=dict, repr=False)  # flex block masks by device

    def __post_init__(self):
        if self.window is not None and self.window >= self.kv_len:
            self.window = None  # a window covering every key cuts nothing more than causality

    @property
    def plain(self) -> bool:
        """Causal and nothing else: no window or record cuts a key the triangle allows."""
        return self.window is None and self.doc_ids is None

    def dense(self, device: torch.device) -> torch.Tensor:
        """The explicit boolean mask [1 or B, 1, queries, keys] (True = attend): the reference."""
        allowed = attend_mask(self.kv_len, device, self.window, q_start=self.q_start)
        if self.doc_ids is None:
            return allowed[None, None]
        doc = self.doc_ids.to(device)
        same = doc[:, self.q_start:, None] == doc[:, None, :]
        return (allowed & same)[:, None]

    def prepare(self, device: torch.device) -> "AttnMask":
        """Build the flex block mask now (outside any compiled layer) where the pass will take flex."""
        if choose(self, device) == "flex":
            self.block_mask(device)
        return self

    def block_mask(self, device: torch.device):
        """The flex ``BlockMask`` of this pass (made once, shared by its layers)."""
        key = str(device)
        if key not in self._block:
            from torch.nn.attention.flex_attention import create_block_mask

            start, window, doc = self.q_start, self.window, self.doc_ids

            def mask_mod(b, h, q_idx, kv_idx):
                q_col = q_idx + start
                allowed = kv_idx <= q_col
                if window is not None:
                    allowed = allowed & (kv_idx > q_col - window)
                if doc is not None:
                    allowed = allowed & (doc[b, kv_idx] == doc[b, q_col])
                return allowed

            rows = None if doc is None else doc.shape[0]
            # compiled: the block mask is made block by block (uncompiled, create_block_mask
            # evaluates the mask over every (query, key) pair first: a score-sized tensor)
            self._block[key] = create_block_mask(mask_mod, rows, None, self.kv_len - start, self.kv_len,
                                                 device=device, _compile=device.type == "cuda")
        return self._block[key]


@contextlib.contextmanager
def kernels(mode: str):
    """``reference``: every AttnMask pass through the explicit mask; ``kernels``: the kernels'
    dispatch on the CPU too; ``auto``: kernels on CUDA, the reference on the CPU (the default)."""
    if mode not in ("auto", "reference", "kernels"):
        raise ValueError(f"attention mode must be auto, reference or kernels, got {mode!r}")
    before, _MODE[0] = _MODE[0], mode
    try:
        yield
    finally:
        _MODE[0] = before


def use_backend(name: str) -> None:
    """``auto``: whole causal rows on a GPU through cuDNN where it takes them; ``flash``: through
    sdpa's own choice (flash-2) always."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    _BACKEND[0] = name


def _padded(t: torch.Tensor) -> torch.Tensor:
    pad = -t.shape[-1] % 8
    return F.pad(t, (0, pad)) if pad else t


def padded_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None,
                  backend=None) -> torch.Tensor:
    """Causal attention [B, H, T, D] through sdpa's ``backend`` (default cuDNN), D zero-padded to a
    multiple of 8 and the scale kept at D's (a padded column adds 0 to every score; its output
    column, 0, is dropped)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    d = query.shape[-1]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION if backend is None else backend]):
        out = F.scaled_dot_product_attention(_padded(query), _padded(key), _padded(value), is_causal=True,
                                             scale=d ** -0.5 if scale is None else scale,
                                             enable_gqa=query.shape[1] != key.shape[1])
    return out[..., :d]


def cudnn_takes(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether whole causal rows of these head shapes take sdpa's cuDNN kernel here: on a GPU,
    with the ``auto`` backend, where a short row through it runs forward and backward. The
    answer is kept per shape; a compiled layer cannot probe, so ``Stage`` asks before its layers
    run (a shape not probed takes flash there)."""
    if device.type != "cuda" or _BACKEND[0] != "auto" or dtype not in (torch.bfloat16, torch.float16):
        return False
    if device.index is None:  # "cuda" and "cuda:0" are one GPU: one probe, one answer
        device = torch.device("cuda", torch.cuda.current_device())
    shape = (str(device), dtype, heads, kv_heads, head_dim)
    if shape not in _CUDNN and not torch.compiler.is_compiling():
        # on a thread of its own: none of the caller's saved-tensor hooks (checkpointing, the
        # offloaded weights'), no_grad or compile context reaches the probe's autograd
        probe = threading.Thread(target=_probe, args=(shape, device, dtype, heads, kv_heads, head_dim))
        probe.start()
        probe.join()
    return _CUDNN.get(shape, False)


def _probe(shape: tuple, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    _CUDNN[shape] = False  # also where the probe fails in a way not foreseen: asked once, flash then
    torch.cuda.set_device(device)
    with torch.cuda.stream(torch.cuda.Stream(device)):  # not the default stream another thread may compute on
        q = torch.randn(1, heads, 128, head_dim, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(1, kv_heads, 128, head_dim, device=device, dtype=dtype, requires_grad=True)
                for _ in range(2))
        try:
            padded_causal(q, k, v, None).sum().backward()
        except RuntimeError:  # no cuDNN kernel for these shapes (sdpa: "No available kernel")
            return
        torch.cuda.current_stream(device).synchronize()
    _CUDNN[shape] = True


def choose(mask: AttnMask, device: torch.device) -> str:
    """The kernel a pass described by ``mask`` takes on ``device`` (see the module docstring)."""
    mode = _MODE[0]
    if mode == "reference":
        return "reference"
    if mask.plain and mask.q_start == 0:
        return "causal"
    if device.type != "cuda" and mode == "auto":
        return "reference"
    if mask.plain:
        return "lower_right"
    if device.type != "cuda" or mask.kv_len < FLEX_BLOCK:
        return "reference"
    return "flex"


def attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
              dropout: float = 0.0, scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """The attention function a stage's layers call (registered as ``NAME``): query [B, H, Tq, D],
    key and value [B, Hkv, Tk, D] (after RoPE; the carried keys in front of a segment's own).
    Returns the output [B, Tq, H, D] and no weights, as Hugging Face's sdpa function does."""
    if attention_mask is None and _whole_causal(module, query, key, dropout, kwargs):
        if not torch.compiler.is_compiling():
            KERNEL_CALLS["cudnn"] += 1
        return padded_causal(query, key, value, scaling).transpose(1, 2).contiguous(), None
    if not isinstance(attention_mask, AttnMask):  # a tensor or None: what Hugging Face's sdpa does
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    extras = {k for k in ("softcap", "s_aux") if kwargs.get(k) is not None}
    if extras:
        raise ValueError(f"attention with {sorted(extras)} is eager only; the stage should not route it here")
    mask = attention_mask
    if query.shape[-2] != mask.kv_len - mask.q_start or key.shape[-2] != mask.kv_len:
        raise RuntimeError(f"attention mask for queries {mask.q_start}..{mask.kv_len - 1} over {mask.kv_len} keys, "
                           f"given {query.shape[-2]} queries and {key.shape[-2]} keys")
    kernel = choose(mask, query.device)
    if not torch.compiler.is_compiling():
        KERNEL_CALLS[kernel] += 1
    if kernel == "reference":
        return sdpa_attention_forward(module, query, key, value, mask.dense(query.device), dropout=dropout,
                                      scaling=scaling, **kwargs)
    if kernel == "causal":
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)
    gqa = query.shape[1] != key.shape[1]
    if kernel == "lower_right":
        out = lower_right(query, key, value, dropout, scaling, gqa)
    else:
        out = _flex(query, key, value, mask, scaling, gqa)
    return out.transpose(1, 2).contiguous(), None


def _whole_causal(module, query: torch.Tensor, key: torch.Tensor, dropout: float, kwargs: dict) -> bool:
    """A whole row that Hugging Face's sdpa would run as plain causal (no mask, no extras, as many
    queries as keys) and that the cuDNN kernel takes."""
    if query.device.type != "cuda" or dropout or query.shape[-2] != key.shape[-2] or query.shape[-2] < 2:
        return False
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        return False
    if any(kwargs.get(k) is not None for k in ("softcap", "s_aux", "position_bias")):
        return False
    return _MODE[0] != "reference" and cudnn_takes(query.device, query.dtype, query.shape[1], key.shape[1],
                                                   query.shape[-1])


def lower_right(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float, scale: float | None,
                gqa: bool) -> torch.Tensor:
    """Causal attention of the last ``Tq`` of ``Tk`` columns: query i sees keys 0..i + Tk - Tq.
    On CUDA only through flash or the memory-efficient kernel (checked first: the alternative,
    torch's materialised mask, is the score matrix this path exists to avoid)."""
    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(query.shape[-2], key.shape[-2])
    if query.device.type == "cuda":
        from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

        params = SDPAParams(query, key, value, None, dropout, False, gqa)
        if not can_use_flash_attention(params):
            if gqa:  # the memory-efficient kernel takes no grouped keys: repeat them
                groups = query.shape[1] // key.shape[1]
                key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
                gqa = False
                params = SDPAParams(query, key, value, None, dropout, False, False)
            if not can_use_efficient_attention(params):
                raise AttentionKernelError(
                    f"no flash or memory-efficient attention kernel takes a segment's attention here ({query.dtype}, "
                    f"head_dim {query.shape[-1]}, {query.shape[-2]} queries over {key.shape[-2]} keys); without one "
                    "the scores would be materialised: use dtype bfloat16 or float16, or seq_chunks 1")
    return F.scaled_dot_product_attention(query, key, value, attn_mask=bias, dropout_p=dropout, scale=scale,
                                          enable_gqa=gqa)


_FLEX: list = []


def _flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: AttnMask, scale: float | None,
          gqa: bool) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling():  # inside a compiled layer: that compile takes it in
        fn = flex_attention
    else:
        if not _FLEX:  # compiled once per process: uncompiled, flex runs a reference that keeps the scores
            _FLEX.append(torch.compile(flex_attention))
        fn = _FLEX[0]
    return fn(query, key, value, block_mask=mask.block_mask(query.device), scale=scale, enable_gqa=gqa)


def register() -> str:
    """Make ``NAME`` an attention function of transformers (idempotent); returns it."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)
    return NAME


__all__ = ["AttentionKernelError", "AttnMask", "BACKENDS", "FLEX_BLOCK", "KERNEL_CALLS", "NAME",
           "attend_mask", "attention", "choose", "cudnn_takes", "kernels", "lower_right", "padded_causal", "register",
           "use_backend"]
