"""A Hugging Face decoder LM cut into pipeline stages.

Stage 0 holds the token embedding, the last stage the final norm and ``lm_head``; decoder
layers are spread evenly (``partition_layers``) or by cost (``pipeline.partition``). A stage's ``state_dict`` keys are exactly the Hugging Face keys
(``model.layers.7.mlp.up_proj.weight``), so loading reads only the owned tensors from the
safetensors (or ``.bin``) files and saving writes a shard a stage.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from models import counts, head_dim, logit_softcap, materialize_, skeleton, spec_for, tied
from models.moe import Routing
from pipeline import attention
from pipeline.attention import AttnMask, attend_mask
from pipeline.programs import tied_across_stages
from pipeline.tiled import tile_mlps

PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=2048, max_position_embeddings=2048),
    "llama-2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096),
    # OpenLLaMA-3B's shapes: a model whose peers (DeepSpeed, RoundPipe) fit one GPU machine's host memory
    "llama-3b": dict(hidden_size=3200, intermediate_size=8640, num_hidden_layers=26, num_attention_heads=32,
                     num_key_value_heads=32, vocab_size=32000, max_position_embeddings=2048),
    "llama-2-13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                        num_key_value_heads=40, vocab_size=32000, max_position_embeddings=4096),
    # Llama-3-8B's shapes (GQA, 128K vocabulary): what RoundPipe's long-sequence figures are for
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    # Qwen3-4B's shapes (per-head q/k norms, GQA 32/8, head_dim 128, a tied 152K vocabulary)
    "qwen3-4b": dict(model_type="qwen3", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=True),
    # A small Qwen3-MoE (Qwen3-30B-A3B's layer with 64 of its 128 experts, 12 layers): 4.3B
    # parameters, 1.0B active; the router loss on
    "qwen3-moe-small": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=12,
                            num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                            num_experts=64, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                            max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                            output_router_logits=True, router_aux_loss_coef=0.001, tie_word_embeddings=False),
}


def preset_config(name: str):
    """The Hugging Face config of preset ``name`` (random weights; Llama unless it names a family)."""
    from models import tiny_config

    settings = dict(PRESETS[name])
    family = settings.pop("model_type", "llama")
    if family == "llama":
        settings.update(rms_norm_eps=1e-5, tie_word_embeddings=False)
    return tiny_config(family, features=False, **settings, bos_token_id=1, eos_token_id=2, pad_token_id=0)


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


def causal_mask(seq_len: int, dtype: torch.dtype, device: torch.device, window: int | None = None) -> torch.Tensor:
    """Additive [1, 1, T, T] mask. Needed for eager attention, where ``None`` means *non-causal*.
    With ``window``, query i sees keys i - window + 1 .. i (Hugging Face's sliding window)."""
    return additive_mask(attend_mask(seq_len, device, window)[None, None], dtype)


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


def _cache_keyword(layers: nn.ModuleDict) -> str:
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
        self.attn_implementation = config._attn_implementation or "eager"
        # sdpa runs through pipeline.attention: the same sdpa for a plain causal row, and on a GPU
        # kernels without a score matrix for segments, windows and packed rows
        self.config._attn_implementation = attention.register() if self.attn_implementation == "sdpa" \
            else self.attn_implementation
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
        # A long row's MLP in tiles of tokens, each recomputed in the backward (pipeline.tiled)
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
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = b.to(device)

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
        torch.autograd.backward([h] + roots, [leaf.grad] + grads)
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
        backward. ``cache``: the carried keys/values of a sequence segment (``pipeline.segments``)."""
        extra = {} if cache is None else {_cache_keyword(self.model.layers): cache}
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
        sdpa with a window or packed rows (``pipeline.attention`` picks the kernel), the additive
        mask for eager (where None would mean no mask at all)."""
        if self.attn_implementation == "flash_attention_2":
            if segment_ids is not None:
                raise ValueError("packed rows need an explicit mask: use attn_implementation sdpa or eager")
            return None  # the layer hands its own sliding_window to the kernel
        if self.attn_implementation == "sdpa":
            mask = AttnMask(0, seq_len, window, segment_ids)
            return None if mask.plain else mask.prepare(h.device)
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


# fp32 logits of one loss chunk under checkpointing (its backward holds about three such tensors)
LOSS_CHUNK_BYTES = 256 * 2**20


def loss_chunk_tokens(vocab: int) -> int:
    """Tokens per chunk of the checkpointed loss: as many as keep a chunk's fp32 logits within
    ``LOSS_CHUNK_BYTES`` (Llama-2's 32000 vocabulary: 2097 tokens, Llama-3's 128256: 523)."""
    return max(1, LOSS_CHUNK_BYTES // (4 * vocab))


def init_weights_(stage: Stage, config, seed: int, device: torch.device | str = "cpu") -> None:
    """Random init as Hugging Face does (normal(0, initializer_range); norms as their module makes
    them: 1, or 0 for a (1 + w) norm; biases 0), seeded per tensor name so every partition of the
    model gets the same weights. Drawing on a GPU is much faster for 7B-class presets (the
    numbers then differ from a CPU draw)."""
    std = config.initializer_range
    for name, p in stage.named_parameters():
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + _stable_hash(stage.source_name(name)))
        with torch.no_grad():
            if name.endswith("bias"):
                p.zero_()
            elif p.ndim == 1 and hasattr(p, "constant_init"):
                p.fill_(p.constant_init)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32, device=device) * std)


def _stable_hash(text: str) -> int:
    h = 0
    for ch in text.encode():
        h = (h * 131 + ch) % 2_147_483_647
    return h


# Weight files a Hugging Face directory may hold, in the order transformers prefers them.
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SINGLES = ("model.safetensors", "pytorch_model.bin")


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file holding it, from an index (safetensors or ``.bin``) or a single file.

    Raises:
        FileNotFoundError: the directory holds no weights this reads.
        ValueError: an index that cannot be read.
    """
    model_dir = Path(model_dir)
    for name in _INDEXES:
        index = model_dir / name
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{index} is not a weight index ({type(e).__name__}: {e})") from None
            missing = sorted({v for v in weight_map.values() if not (model_dir / v).is_file()})
            if missing:
                raise FileNotFoundError(f"{index.name} names {len(missing)} missing file(s) in {model_dir}, "
                                        f"e.g. {missing[0]}")
            return {k: model_dir / v for k, v in weight_map.items()}
    for name in _SINGLES:
        single = model_dir / name
        if single.exists():
            return {k: single for k in _tensor_names(single)}
    raise FileNotFoundError(f"no weights in {model_dir}: expected model.safetensors, pytorch_model.bin or their "
                            f"sharded .index.json")


def _tensor_names(path: Path) -> list[str]:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    return list(_load_bin(path))


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    # mmap: only the tensors a stage copies are read from disk; weights_only: a pickle runs no code.
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)


def load_weights_(stage: Stage, model_dir: Path) -> None:
    """Read only this stage's tensors from the checkpoint (upcast to the stage's dtype); stacked
    experts from their per-expert weights where the checkpoint keeps them so (``ExpertLayout``)."""
    files = weight_files(model_dir)
    wanted = {stage.source_name(k): p for k, p in stage.named_parameters()}
    sources = {k: _sources(stage, k, files) for k in wanted}
    missing = [k for k, src in sources.items() if src is None]
    if missing:
        raise KeyError(f"{model_dir}: checkpoint lacks {len(missing)} tensors of stage {stage.index}, e.g. {missing[0]}")
    by_file: dict[Path, list[str]] = {}
    for src in sources.values():
        for name in (n for per_expert in src for n in per_expert):
            by_file.setdefault(files[name], []).append(name)
    read: dict[str, torch.Tensor] = {}
    for path, keys in by_file.items():
        read.update(_read(path, keys))
    with torch.no_grad():
        for k, src in sources.items():
            parts = [torch.cat([read.pop(n) for n in per_expert]) if len(per_expert) > 1 else read.pop(per_expert[0])
                     for per_expert in src]
            t = parts[0] if src == [[k]] else torch.stack(parts)
            if t.shape != wanted[k].shape:
                raise ValueError(f"{model_dir}: {k} has shape {tuple(t.shape)}, model expects {tuple(wanted[k].shape)}")
            wanted[k].copy_(t)


def _sources(stage: Stage, name: str, files: dict[str, Path]) -> list[list[str]] | None:
    """The checkpoint tensors parameter ``name`` is made of: itself, or (stacked experts) per
    expert the weights its slice concatenates; None when the checkpoint has neither."""
    if name in files:
        return [[name]]
    spec = spec_for(stage.config)
    if spec.experts is None or spec.moe is None:
        return None
    src = spec.experts.sources(name, spec.moe.experts(stage.config))
    return src if src is not None and all(n in files for per_expert in src for n in per_expert) else None


def checkpoint_tensors(config, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A stage's tensors under the names its family's checkpoints use (``ExpertLayout``)."""
    spec = spec_for(config)
    if spec.experts is None or spec.moe is None:
        return tensors
    return spec.experts.to_checkpoint(tensors, spec.moe.experts(config))


def check_tied_checkpoint(model_dir: Path) -> None:
    """Raise ValueError if ``model_dir``'s config ties the head to the embedding but its
    checkpoint stores an lm_head.weight that differs: transformers then loads the two apart
    (it ties only equal copies), which one shared matrix could not reproduce."""
    files = weight_files(model_dir)
    if "lm_head.weight" not in files:
        return
    names = ["model.embed_tokens.weight", "lm_head.weight"]
    tensors = {k: t for name in names for k, t in _read(files[name], [name])}
    if not torch.equal(*(tensors[k] for k in names)):
        raise ValueError("config.json says tie_word_embeddings but the checkpoint's lm_head.weight differs from "
                         "model.embed_tokens.weight (transformers would train them apart); set "
                         "tie_word_embeddings to false in config.json to train them as two matrices")


def _read(path: Path, keys: list[str]):
    """(name, tensor) for ``keys`` of one weight file, one tensor at a time."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            for k in keys:
                yield k, f.get_tensor(k)
    else:
        tensors = _load_bin(path)
        for k in keys:
            yield k, tensors[k]


def build_stage(config, index: int, num_stages: int, layer_ids: range, *, model_dir: Path | None,
                seed: int, checkpointing: bool = False, kept_layers: int = 0,
                init_device: torch.device | str = "cpu", mlp_tile_tokens: int = 0) -> Stage:
    """Materialise one stage in float32 on the CPU: from ``model_dir`` if given, else random;
    ``mlp_tile_tokens`` > 0: its MLPs run in tiles of that many tokens (``pipeline.tiled``)."""
    stage = Stage(config, index, num_stages, layer_ids, checkpointing, kept_layers, mlp_tile_tokens)
    materialize_(stage, "cpu")
    stage.tie_weights()
    if model_dir is None:
        init_weights_(stage, config, seed, init_device)
    else:
        load_weights_(stage, model_dir)
    return stage


def compile_layers(stage: Stage) -> None:
    """Regional compilation: each decoder layer's forward through torch.compile. The layers'
    parameters are graph inputs, so one graph serves every layer of the stage (and of the other
    stages of the process), and rebinding their storage at each LOAD recompiles nothing."""
    for layer in stage.model.layers.values():
        layer.compile()


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
    ``partition_layers``: a run's are ``pipeline.partition.stage_layers``)."""
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
    L = config.num_hidden_layers
    head = stage_num_params(config, range(0), False, True) if last else 0
    return 2 * (num_layers * _mean_active_layer(config) + head) + \
        num_layers * attention_flops_per_token(config, seq_len) / max(1, L)


def model_flops_per_token(config, num_layers: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), matmuls and attention scores."""
    return 3 * forward_flops_per_token(config, num_layers, True, seq_len)


__all__ = ["LOSS_CHUNK_BYTES", "PRESETS", "Stage", "additive_mask", "attend_mask", "build_stage", "causal_mask",
           "attention_flops_per_token", "check_tied_checkpoint", "checkpoint_tensors", "compile_layers", "forward_flops_per_token", "init_weights_", "layer_ranges",
           "load_weights_", "loss_chunk_tokens", "mean_keys", "model_flops_per_token", "model_key_cost",
           "partition_layers",
           "preset_config", "segment_attend_mask", "stage_num_params", "stage_param_counts"]
