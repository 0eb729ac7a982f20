"""What the rest of the system asks about a model family, in one frozen value per family.

A family is trained through Hugging Face's own modules: a stage takes the embedding, its
decoder layers, the final norm and the head out of a skeleton of the family's
``*ForCausalLM`` (parameters on the meta device, buffers real), so no attention, MLP or norm
code is copied. What differs between families *outside* those modules is what the spec says:
which layers attend through a sliding window, whether the rotary embedding is per layer type,
soft-capped logits, where a mixture-of-experts layer's router is and how it scores a routing,
and the bytes a layer keeps for its backward (the memory plan's activation model).
"""
from __future__ import annotations

import contextlib
import copy
import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class LayerKind:
    """How one decoder layer attends: its Hugging Face layer type (the key of its rotary
    embedding where the family has one per type) and its window (None: full causal)."""

    layer_type: str
    window: int | None


@dataclass(frozen=True)
class MoeSpec:
    """A mixture-of-experts family.

    Attributes:
        router: the path of a sparse layer's router module (it returns logits, scores and
            the top-k expert indices of every token).
        num_experts: the config attribute with the experts per layer.
        scores: the routing weights the router gives ``indices`` from its ``logits``: a
            recompute replays the forward's routing through it (``models.moe``).
        sparse: whether decoder layer i routes (others are dense MLPs).
    """

    router: str
    num_experts: str
    scores: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    sparse: Callable[[object, int], bool] = lambda config, i: True

    def experts(self, config) -> int:
        return getattr(config, self.num_experts)

    def top_k(self, config) -> int:
        return config.num_experts_per_tok

    def aux_coef(self, config) -> float:
        """The router loss's weight, as the Hugging Face model adds it: only when the config
        asks for router logits (``output_router_logits``)."""
        return float(config.router_aux_loss_coef) if getattr(config, "output_router_logits", False) else 0.0


@dataclass(frozen=True)
class ExpertLayout:
    """How checkpoints store experts that a layer holds stacked in one 3-D parameter.

    ``fused`` maps a stacked parameter's name (``mlp.experts.gate_up_proj``) to the per-expert
    modules whose weights, concatenated along their first dimension, make one expert's slice
    (``("gate_proj", "up_proj")``: ``mlp.experts.{e}.gate_proj.weight``): Hugging Face converts
    them so when it loads and back when it saves, and so do the stage loader and the saved model.
    """

    fused: dict[str, tuple[str, ...]]

    def sources(self, name: str, num_experts: int) -> list[list[str]] | None:
        """Per expert, the checkpoint names whose concatenation is its slice of ``name``; None
        when ``name`` is not a stacked parameter."""
        for suffix, parts in self.fused.items():
            if name.endswith("." + suffix) or name == suffix:
                prefix = name.rsplit(".", 1)[0]  # ...mlp.experts
                return [[f"{prefix}.{e}.{part}.weight" for part in parts] for e in range(num_experts)]
        return None

    def to_checkpoint(self, tensors: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
        """``tensors`` with every stacked parameter split into its per-expert weights."""
        out = {}
        for name, t in tensors.items():
            sources = self.sources(name, num_experts)
            if sources is None:
                out[name] = t
                continue
            for e, names in enumerate(sources):
                for part_name, part in zip(names, t[e].chunk(len(names), dim=0)):
                    out[part_name] = part.contiguous()
        return out


@dataclass(frozen=True)
class LayerShape:
    """The sizes of a decoder layer that its saved activations depend on (bytes per token)."""

    hidden: int
    q_dim: int        # num_attention_heads * head_dim
    kv_dim: int       # num_key_value_heads * head_dim
    heads: int
    kv_heads: int
    intermediate: int
    pre_norms: int = 2        # norms whose output feeds a projection (Llama: input and post-attention)
    post_norms: int = 0       # norms of a sublayer's output before the residual add (Gemma, OLMo 2)
    norm_fp32_out: bool = False  # (1 + w) norms multiply in float32 (Gemma): their fp32 output is saved
    qk_norm: str = ""         # "head": per-head q/k norms (Qwen3, Gemma 3); "all": over all heads (OLMo 2)
    experts_per_token: int = 0  # MoE: top-k
    num_experts: int = 0
    expert_intermediate: int = 0
    expert_saved: int = 4     # MoE: f-wide tensors a (token, expert) pair keeps (gated SwiGLU: 4)
    attn_softcap: bool = False  # soft-capped scores (Gemma 2, eager): one more score-sized tensor
    fused_qkv: bool = False   # q, k, v are views of one projection's output: saving v keeps all of it


@dataclass(frozen=True)
class ArchSpec:
    """One model family (see the module docstring). ``model_types`` are the Hugging Face
    ``config.model_type`` values it covers; ``tiny`` is a small config of it for the model
    generator and the tests (``config_class`` keyword arguments)."""

    family: str
    model_types: tuple[str, ...]
    examples: str
    config_class: str
    tiny: dict = field(default_factory=dict)
    # "none": every layer full causal; "all": config.sliding_window on every layer (Mistral,
    # Phi-3); "layer_types": on the layers config.layer_types marks sliding_attention.
    sliding: str = "layer_types"
    rope_by_layer_type: bool = False   # rotary_emb(x, positions, layer_type) (Gemma 3)
    moe: MoeSpec | None = None
    experts: ExpertLayout | None = None   # how checkpoints store stacked experts (None: as the module)
    layer_shape: Callable[[object], LayerShape] | None = None  # None: Llama's layout
    notes: str = ""                     # what docs/models.md says beside the checks

    def layer_kinds(self, config) -> list[LayerKind]:
        """Every decoder layer's ``LayerKind``, as the Hugging Face model masks it."""
        n = config.num_hidden_layers
        window = getattr(config, "sliding_window", None)
        if self.sliding == "none":
            return [LayerKind(FULL, None)] * n
        if self.sliding == "all":
            return [LayerKind(FULL if window is None else SLIDING, window)] * n
        types = list(getattr(config, "layer_types", None) or [FULL] * n)[:n]
        unknown = sorted(set(types) - {FULL, SLIDING})
        if unknown:
            raise ValueError(f"layer_types {unknown} are not supported ({FULL}, {SLIDING})")
        if SLIDING in types and window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is None "
                             "(set use_sliding_window and sliding_window, or make every layer full_attention)")
        return [LayerKind(t, window if t == SLIDING else None) for t in types]

    def shape(self, config) -> LayerShape:
        return (self.layer_shape or llama_layer_shape)(config)


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def llama_layer_shape(config, **kw) -> LayerShape:
    d = head_dim(config)
    kw.setdefault("attn_softcap", bool(getattr(config, "attn_logit_softcapping", None)))
    return LayerShape(config.hidden_size, config.num_attention_heads * d, kv_heads(config) * d,
                      config.num_attention_heads, kv_heads(config), config.intermediate_size, **kw)


def tied(config) -> bool:
    """Whether the head is the embedding's matrix (``tie_word_embeddings``)."""
    return bool(getattr(config, "tie_word_embeddings", False))


def logit_softcap(config) -> float | None:
    """Gemma's final logit soft-capping (``tanh(logits / c) * c``), None without."""
    return getattr(config, "final_logit_softcapping", None) or None


# --- the Hugging Face classes ----------------------------------------------------------------------
def causal_lm_class(config) -> type:
    """The ``*ForCausalLM`` class transformers builds for ``config``."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def attn_implementation(config) -> str | None:
    """The attention kernel the modules built from ``config`` call (transformers reads it when it
    builds them and at each forward); None where the config names none. transformers' config has
    no public accessor for it: its own code uses this attribute."""
    return getattr(config, "_attn_implementation", None)


def set_attn_implementation(config, kernel: str) -> None:
    """Set ``attn_implementation``: the attribute's setter hands the value on to the sub-configs."""
    config._attn_implementation = kernel


def supports_sdpa(config) -> bool:
    """Whether sdpa computes the family's attention: not where the scores are soft-capped
    (Gemma 2) or a sink joins the softmax (gpt-oss), which only their eager attention does."""
    return bool(getattr(causal_lm_class(config), "_supports_sdpa", True)) and \
        not getattr(config, "attn_logit_softcapping", None)


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built inside get their parameters on the meta device (no memory, no init) and
    their buffers real: a rotary embedding's frequencies and Gemma's embedding scale are
    computed in ``__init__`` and kept as non-persistent buffers, which no checkpoint holds."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            # a norm's weight is made constant (1, or (1 + w)'s 0); another vector may be torch.empty's
            # memory (a bias, gpt-oss's sinks), zero or not by chance, which ``init_weights_`` draws
            if param.ndim == 1 and "Norm" in type(module).__name__ and \
                    (bool((param == 1).all()) or bool((param == 0).all())):
                meta.constant_init = float(param.detach()[0]) if param.numel() else 0.0
            # transformers' init functions skip a tensor so marked (as a loaded one): on the meta
            # device they change nothing and took 12 of a tiny model's 17 ms of building
            meta._is_hf_initialized = True
            register(module, name, meta)  # in place of the real one just registered

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def skeleton(config) -> nn.Module:
    """The family's ``*ForCausalLM`` for ``config``, parameters on the meta device: a stage takes
    the modules it holds out of it (``pipeline.stage.model.Stage``), the counts read its shapes."""
    config = copy.deepcopy(config)
    if attn_implementation(config) not in ("eager", "sdpa"):
        set_attn_implementation(config, "eager")  # building checks the kernel is installed; the stage sets its own
    with _parameters_on_meta(), quiet_transformers():
        return causal_lm_class(config)(config)


@contextlib.contextmanager
def quiet_transformers():
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def materialize_(module: nn.Module, device: torch.device | str = "cpu", skip: frozenset[str] = frozenset()) -> None:
    """Give every meta parameter of ``module`` uninitialised storage on ``device`` (loading or a
    seeded init fills it next); buffers stay as they are. A vector its module made constant (a
    norm's ones, a (1 + w) norm's zeros) keeps that value as ``constant_init``. ``skip``: names
    (in ``module``) of parameters left on the meta device."""
    for prefix, sub in module.named_modules():
        for name, p in list(sub.named_parameters(recurse=False, remove_duplicate=False)):
            if p.device.type == "meta" and f"{prefix}.{name}".lstrip(".") not in skip:
                new = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                if hasattr(p, "constant_init"):
                    new.constant_init = p.constant_init
                sub.register_parameter(name, new)


def submodule(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


# --- counts from the skeleton -------------------------------------------------------------------------
@dataclass(frozen=True)
class Counts:
    """Parameter counts of a model, read off its skeleton: every decoder layer's (all and active:
    a routed layer's experts count ``top_k / num_experts``), the embedding, final norm and head."""

    layers: tuple[int, ...]
    active: tuple[int, ...]
    embed: int
    norm: int
    head: int
    largest: int  # the largest parameter of a decoder layer (its gradient is a backward's transient)


_COUNTS: dict[str, Counts] = {}


def _counts(config) -> Counts:
    from models.registry import spec_for

    spec = spec_for(config)
    sk = skeleton(config)
    layers, active = [], []
    largest = max((p.numel() for p in sk.model.layers.parameters()), default=0)
    for i, layer in enumerate(sk.model.layers):
        total = sum(p.numel() for p in layer.parameters())
        experts = 0
        if spec.moe is not None and spec.moe.sparse(config, i):
            experts = sum(p.numel() for n, p in layer.named_parameters() if ".experts." in f".{n}")
            experts -= experts * spec.moe.top_k(config) // spec.moe.experts(config)
        layers.append(total)
        active.append(total - experts)
    norm = sum(p.numel() for p in sk.model.norm.parameters())
    return Counts(tuple(layers), tuple(active), sk.model.embed_tokens.weight.numel(), norm,
                  sk.lm_head.weight.numel() + (sk.lm_head.bias.numel() if sk.lm_head.bias is not None else 0), largest)


def counts(config) -> Counts:
    """``Counts`` of ``config`` (cached by the config's contents: plans ask for them many times)."""
    # its attributes' repr, not to_json_string: a sixth of the time, and a plan asks thousands of
    # times; configs equal but for a private field only take an entry each
    key = repr(sorted(vars(config).items()))
    if key not in _COUNTS:
        _COUNTS[key] = _counts(config)
    return _COUNTS[key]


def import_class(name: str):
    """A transformers class by name (a config class of a family module's ``config_class``)."""
    return getattr(importlib.import_module("transformers"), name)


__all__ = ["ArchSpec", "Counts", "ExpertLayout", "FULL", "LayerKind", "LayerShape", "MoeSpec", "SLIDING",
           "attn_implementation", "causal_lm_class", "counts", "head_dim", "import_class", "kv_heads",
           "llama_layer_shape", "logit_softcap", "materialize_", "quiet_transformers", "set_attn_implementation",
           "skeleton", "submodule", "supports_sdpa", "tied"]
