"""A Hugging Face decoder LM cut into pipeline stages.

Stage 0 holds the token embedding, the last stage the final norm and ``lm_head``; decoder
layers are spread evenly (``pipeline.spec.shapes.partition_layers``) or by cost
(``pipeline.spec.partition``). A stage's ``state_dict`` keys are exactly the Hugging Face keys
(``model.layers.7.mlp.up_proj.weight``), so loading reads only the owned tensors from the
safetensors (or ``.bin``) files (``pipeline.stage.weights``) and saving writes a shard a stage.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from models import (attn_implementation, head_dim, kv_heads, logit_softcap, materialize_, set_attn_implementation,
                    skeleton, spec_for, tied)
from models.moe import Routing
from pipeline.spec.lora import Base4bit
from pipeline.spec.programs import tied_across_stages
from pipeline.spec.shapes import loss_chunk_tokens
from pipeline.stage import attention, quantized
from pipeline.stage.attention import AttnMask, attend_mask
from pipeline.stage.tiled import tile_mlps
from pipeline.stage.weights import load_weights_, read_weights


def causal_mask(seq_len: int, dtype: torch.dtype, device: torch.device, window: int | None = None) -> torch.Tensor:
    """Additive [1, 1, T, T] mask. Needed for eager attention, where ``None`` means *non-causal*.
    With ``window``, query i sees keys i - window + 1 .. i (Hugging Face's sliding window)."""
    return additive_mask(attend_mask(seq_len, device, window)[None, None], dtype)


def backward_where_needed(roots: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """``torch.autograd.backward`` over the roots that have a graph. A stage with nothing trained
    whose input needs no gradient (LoRA: a first stage of the frozen embedding alone) has none:
    its backward has nothing to compute."""
    pairs = [(r, g) for r, g in zip(roots, grads) if r.requires_grad]
    if pairs:
        torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The eager form of a boolean mask: 0 where True (attend), the dtype's minimum elsewhere."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def segment_attend_mask(segment_ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Boolean [B, 1, T, T] for packed rows (``segment_ids`` [B, T]): ``attend_mask`` and, in
    addition, key j in the same segment as query i, so no example sees another. A window counts
    columns, which within a segment are positions."""
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (attend_mask(segment_ids.shape[1], segment_ids.device, window) & same)[:, None]


def cache_keyword(layers: nn.ModuleDict) -> str:
    """What a decoder layer calls its key/value cache argument: ``cache`` from transformers 5.24
    (where ``past_key_values`` is deprecated), ``past_key_values`` before."""
    import inspect

    forward = type(next(iter(layers.values()))).forward
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


class _Body(nn.Module):
    """Holds the ``model.*`` part so that parameter names match Hugging Face's."""


class Stage(nn.Module):
    """One pipeline stage. ``forward`` takes token ids (first stage) or hidden states and returns
    hidden states; the last stage returns logits, or with ``targets`` the summed token loss.

    Its modules are the Hugging Face model's own (``models.skeleton``): the embedding (first
    stage), the decoder layers ``layer_ids``, the final norm and head (last stage) and the
    rotary embedding; what the family's model does between them (per-layer windows and rotary
    embeddings, soft-capped logits, the routers' statistics) comes from its ``models`` spec.
    Parameters stay on the meta device until ``build_stage`` gives them storage."""

    def __init__(self, config, index: int, num_stages: int, layer_ids: range, checkpointing: bool = False,
                 kept_layers: int = 0, mlp_tile_tokens: int = 0):
        super().__init__()
        spec = spec_for(config)
        sk = skeleton(config)
        self.config = sk.config  # the modules' own copy: its attention kernel is what they run
        self.index, self.is_first, self.is_last = index, index == 0, index == num_stages - 1
        across = tied_across_stages(num_stages, config)
        self.tied = tied(config) and not across  # one stage: one Parameter under both modules
        # Tied over several stages: the first stage's embedding and the last stage's head are two
        # copies of one matrix (made equal from the embedding; the TIE action sums their gradients)
        self.tied_name = None
        if across and (self.is_first or self.is_last):
            self.tied_name = "model.embed_tokens.weight" if self.is_first else "lm_head.weight"
        self.attn_implementation = attn_implementation(config) or "eager"
        self.head_shapes = (config.num_attention_heads, kv_heads(config), head_dim(config))
        # sdpa runs through pipeline.stage.attention: the same sdpa for a plain causal row, and on a GPU
        # kernels without a score matrix for segments, windows and packed rows
        set_attn_implementation(self.config, attention.register() if self.attn_implementation == "sdpa"
                                else self.attn_implementation)
        self.checkpointing = checkpointing
        # With checkpointing, the stage's last ``kept_layers`` layers keep their activations for
        # backward (no recompute): the memory plan picks them where memory allows.
        self.recomputed = max(0, len(layer_ids) - kept_layers) if checkpointing else 0
        self.model = _Body()
        if self.is_first:
            self.model.embed_tokens = sk.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): sk.model.layers[i] for i in layer_ids})
        kinds = spec.layer_kinds(config)
        self.kinds = [kinds[i] for i in layer_ids]
        if self.is_last:
            self.model.norm = sk.model.norm
            self.lm_head = sk.lm_head
        self.tie_weights()
        self.rotary_emb = sk.model.rotary_emb  # buffers only, not persistent
        self.rope_by_layer_type = spec.rope_by_layer_type
        # LongRoPE and dynamic NTK pick their frequencies from the largest position they are given
        self.rope_whole_row = getattr(self.rotary_emb, "rope_type", "default") in ("longrope", "dynamic")
        self.softcap = logit_softcap(config) if self.is_last else None
        self.routing = Routing(spec, config, dict(zip(layer_ids, self.model.layers.values())))
        # A long row's MLP in tiles of tokens, each recomputed in the backward (pipeline.stage.tiled)
        self.mlp_tile_tokens = mlp_tile_tokens
        if mlp_tile_tokens:
            if self.routing.routers:
                raise ValueError("tiled MLPs of routed (mixture-of-experts) layers are not supported: the routing "
                                 "replay is recorded per pass, not per tile")
            tile_mlps(self.model.layers.values(), mlp_tile_tokens)

    def buffers_to(self, device: torch.device | str) -> None:
        """The modules' buffers (rotary frequencies, Gemma's embedding scale) to ``device``; the
        parameters are the store's to place."""
        for module in self.modules():
            for name, b in list(module.named_buffers(recurse=False, remove_duplicate=False)):
                setattr(module, name, b.to(device))  # a buffer keeps its persistence (nn.Module.__setattr__)

    @property
    def windows(self) -> list[int | None]:
        """Each layer's attention window (None: full causal)."""
        return [k.window for k in self.kinds]

    def tie_weights(self) -> None:
        """With ``tie_word_embeddings``, one Parameter under both modules: named_parameters() (and
        so the store, the optimizer and the saved shard) sees only model.embed_tokens.weight,
        as in Hugging Face. Called again after ``to_empty``, which gives each module a new one."""
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def source_name(self, name: str) -> str:
        """The checkpoint tensor (and init seed) that parameter ``name`` starts from: the head's
        copy of a tied matrix starts from the embedding, as the tied Hugging Face model does."""
        return "model.embed_tokens.weight" if self.tied_name == "lm_head.weight" == name else name

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, *,
                position_ids: torch.Tensor | None = None, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids`` [B, T] (default: the columns) feed the rotary embedding;
        ``segment_ids`` [B, T] (packed rows) keep attention within each segment."""
        h = self._body(x, position_ids, segment_ids, recompute=True)
        if not self.is_last:
            return h
        if targets is None:
            return self.logits(h)
        return self.head_loss(h, targets)

    def forward_backward(self, x: torch.Tensor, targets: torch.Tensor, grad_scale: float, *,
                         position_ids: torch.Tensor | None = None, segment_ids: torch.Tensor | None = None,
                         extra: Callable[[], tuple[list, list]] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The last stage's forward, loss and backward of one micro-batch, back to back (the
        fused last stage): no layer is checkpointed, since its backward follows at once, and the
        head and loss run in chunks of tokens, each differentiated as soon as it is computed, so
        the logits never exist for more than a chunk and nothing is recomputed. The gradients
        accumulate into the parameters' ``.grad`` as a backward's do, for the loss times
        ``grad_scale``. ``extra``: called after the forward, more (root, gradient) pairs of the
        body's backward (the routers' loss). Returns (the summed token loss, detached; the
        gradient w.r.t. ``x``, None when ``x`` is token ids)."""
        if not self.is_first:
            x = x.detach().requires_grad_()
        h = self._body(x, position_ids, segment_ids, recompute=False)
        leaf = h.detach().requires_grad_()
        n = loss_chunk_tokens(self.lm_head.out_features)
        loss = torch.zeros((), device=h.device)
        for hc, tc in zip(leaf.flatten(0, 1).split(n), targets.flatten().split(n)):
            chunk = self._loss(hc, tc)
            (chunk * grad_scale).backward()  # frees this chunk's logits before the next is made
            loss += chunk.detach()
        roots, grads = extra() if extra is not None else ([], [])
        # on a layerless stage h is x itself: its grad is leaf.grad
        backward_where_needed([h] + roots, [leaf.grad] + grads)
        return loss, None if self.is_first else x.grad

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """The first stage's input: the family's embedding module (Gemma's scales it)."""
        return self.model.embed_tokens(x)

    def rope(self, h: torch.Tensor, position_ids: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) of ``position_ids`` for each layer type of this stage (one rotary
        embedding for all of them, or one per type)."""
        types = {k.layer_type for k in self.kinds}
        if self.rope_by_layer_type:
            return {t: self.rotary_emb(h, position_ids, t) for t in types}
        pe = self.rotary_emb(h, position_ids)
        return dict.fromkeys(types, pe)

    def run_layers(self, h: torch.Tensor, position_ids: torch.Tensor, rope: dict, masks: dict, *,
                   checkpointed: int = 0, cache=None) -> torch.Tensor:
        """The stage's decoder layers on ``h``: layer i attends with ``masks[window]`` and the
        ``rope`` of its layer type; the first ``checkpointed`` layers are recomputed in the
        backward. ``cache``: the carried keys/values of a sequence segment (``pipeline.stage.segments``)."""
        extra = {} if cache is None else {cache_keyword(self.model.layers): cache}
        for i, (layer, kind) in enumerate(zip(self.model.layers.values(), self.kinds)):
            run = functools.partial(layer, attention_mask=masks[kind.window], position_ids=position_ids,
                                    position_embeddings=rope[kind.layer_type], **extra)
            h = checkpoint(run, h, use_reentrant=False) if i < checkpointed else run(h)
            if isinstance(h, tuple):  # older transformers return (hidden_states,)
                h = h[0]
        return h

    def _body(self, x: torch.Tensor, position_ids: torch.Tensor | None, segment_ids: torch.Tensor | None,
              recompute: bool) -> torch.Tensor:
        """Embedding (first stage) and decoder layers; with ``recompute`` the first
        ``self.recomputed`` layers are checkpointed."""
        h = self.embed(x) if self.is_first else x
        if len(self.model.layers):
            seq_len = h.shape[1]
            if position_ids is None:
                position_ids = torch.arange(seq_len, device=h.device)[None]
            masks = {w: self._mask(seq_len, w, h, segment_ids) for w in set(self.windows)}
            checkpointed = self.recomputed if recompute and torch.is_grad_enabled() else 0
            h = self.run_layers(h, position_ids, self.rope(h, position_ids), masks, checkpointed=checkpointed)
        return h

    def head_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last stage's summed token loss of the final hidden states ``h`` (a whole
        micro-batch, or a sequence segment of it)."""
        if self.checkpointing:
            # The head too: otherwise every micro-batch in flight keeps its fp32 log-softmax
            # (vocab floats a token, 32x the hidden state for Llama-2 7B) until its backward.
            # In chunks of tokens, each recomputed and differentiated on its own, so a large
            # vocabulary's logits never exist for the whole micro-batch at once; without a graph
            # (activation_offload's forward, evaluation) the same chunks bound the logits alike.
            n = loss_chunk_tokens(self.lm_head.out_features)
            chunks = zip(h.flatten(0, 1).split(n), targets.flatten().split(n))
            if not torch.is_grad_enabled():
                return sum(self._loss(hc, tc) for hc, tc in chunks)
            return sum(checkpoint(self._loss, hc, tc, use_reentrant=False) for hc, tc in chunks)
        return self._loss(h, targets)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head's logits of the final hidden states, soft-capped where the family does."""
        logits = self.lm_head(self.model.norm(h))
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _mask(self, seq_len: int, window: int | None, h: torch.Tensor,
              segment_ids: torch.Tensor | None = None):
        """The attention mask of layers with ``window`` (None: full causal), within segments if
        given: None for a plain causal row under sdpa (its causal kernel), an ``AttnMask`` for
        sdpa with a window or packed rows (``pipeline.stage.attention`` picks the kernel), the additive
        mask for eager (where None would mean no mask at all)."""
        if self.attn_implementation == "flash_attention_2":
            if segment_ids is not None:
                raise ValueError("packed rows need an explicit mask: use attn_implementation sdpa or eager")
            return None  # the layer hands its own sliding_window to the kernel
        if self.attn_implementation == "sdpa":
            mask = AttnMask(0, seq_len, window, segment_ids)
            if mask.plain:
                attention.cudnn_takes(h.device, h.dtype, *self.head_shapes)  # probed here, outside compiled layers
                return None
            return mask.prepare(h.device)
        if window is not None and window >= seq_len:
            window = None  # a window covering the sequence masks nothing more than causality
        if segment_ids is not None:
            return additive_mask(segment_attend_mask(segment_ids, window), h.dtype)
        return causal_mask(seq_len, h.dtype, h.device, window)

    def _loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Sum over predicted tokens of the cross-entropy (-100 targets predict nothing)."""
        logits = self.logits(h)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                               reduction="sum")


def init_weights_(stage: Stage, config, seed: int, device: torch.device | str = "cpu",
                  skip: frozenset[str] = frozenset()) -> None:
    """Random init as Hugging Face does (normal(0, initializer_range); norms as their module makes
    them: 1, or 0 for a (1 + w) norm; biases 0), seeded per tensor name so every partition of the
    model gets the same weights. Drawing on a GPU is much faster for 7B-class presets (the
    numbers then differ from a CPU draw). ``skip``: parameters drawn later (a 4-bit base's linear
    weights, layer by layer: ``build_stage``)."""
    with torch.no_grad():
        for name, p in stage.named_parameters():
            if name in skip:
                continue
            if name.endswith("bias"):
                p.zero_()
            elif p.ndim == 1 and hasattr(p, "constant_init"):
                p.fill_(p.constant_init)
            else:
                p.copy_(_drawn(stage, config, seed, name, p.shape, device))


def _drawn(stage: Stage, config, seed: int, name: str, shape: torch.Size, device: torch.device | str) -> torch.Tensor:
    """The random float32 value of matrix ``name`` (on ``device``), seeded by its source name."""
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + _stable_hash(stage.source_name(name)))
    return torch.randn(shape, generator=gen, dtype=torch.float32, device=device) * config.initializer_range


def _stable_hash(text: str) -> int:
    h = 0
    for ch in text.encode():
        h = (h * 131 + ch) % 2_147_483_647
    return h


def build_stage(config, index: int, num_stages: int, layer_ids: range, *, model_dir: Path | None,
                seed: int, checkpointing: bool = False, kept_layers: int = 0,
                init_device: torch.device | str = "cpu", mlp_tile_tokens: int = 0,
                base_4bit: Base4bit | None = None, dtype: torch.dtype = torch.float32) -> Stage:
    """Materialise one stage in float32 on the CPU: from ``model_dir`` if given, else random;
    ``mlp_tile_tokens`` > 0: its MLPs run in tiles of that many tokens (``pipeline.stage.tiled``).
    ``base_4bit`` (QLoRA): the decoder layers' linear weights are never materialised here; layer by
    layer they are read (or drawn on ``init_device``), cast to ``dtype`` and quantized on
    ``init_device`` (``pipeline.stage.quantized``), where their 4-bit parts stay."""
    stage = Stage(config, index, num_stages, layer_ids, checkpointing, kept_layers, mlp_tile_tokens)
    later = frozenset()
    if base_4bit is not None:
        later = frozenset(f"{name}.weight" for name, _ in quantized.quantized_modules(stage))
    materialize_(stage, "cpu", skip=later)
    stage.tie_weights()
    if model_dir is None:
        init_weights_(stage, config, seed, init_device, skip=later)
    else:
        load_weights_(stage, model_dir, skip=later)
    if base_4bit is not None:
        shapes = dict(stage.named_parameters())
        if model_dir is None:
            def weights(names):
                return {n: _drawn(stage, config, seed, n, shapes[n].shape, init_device) for n in names}
        else:
            def weights(names):
                return read_weights(stage, model_dir, {n: shapes[n].shape for n in names})
        quantized.quantize_layers_(stage, base_4bit, weights, init_device, dtype)
    return stage


def compile_layers(stage: Stage) -> None:
    """Regional compilation: each decoder layer's forward through torch.compile. The layers'
    parameters are graph inputs, so one graph serves every layer of the stage (and of the other
    stages of the process), and rebinding their storage at each LOAD recompiles nothing."""
    for layer in stage.model.layers.values():
        layer.compile()


__all__ = ["Stage", "additive_mask", "attend_mask", "backward_where_needed", "build_stage", "cache_keyword",
           "causal_mask", "compile_layers", "init_weights_",
           "segment_attend_mask"]
