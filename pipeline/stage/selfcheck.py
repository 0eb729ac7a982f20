"""The start-up self-check of a family not in the registry.

Many families are Llama's layout under another name (Ministral, SmolLM, Granite-like models
with other multipliers are not). Instead of refusing every one, a family not registered is
tried as ``registry.generic_spec`` describes it: its Hugging Face model is built from its own
config, shrunk to two decoder layers and small widths, with random weights (norms and biases
moved off their initial values, so that each one matters), and one batch of random tokens runs
through two pipeline stages of the generic stage path and through the Hugging Face model in
float32. The family trains only if the loss and every parameter's gradient agree to 1e-5
(relative to the norm); otherwise it is refused with what differed. A family is therefore never
trained differently from its Hugging Face model in silence.
"""
from __future__ import annotations

import torch

from models.registry import REGISTRY, UnsupportedModel, accept, forget, generic_spec, known_spec, supported_types
from models.spec import (ArchSpec, causal_lm_class, kv_heads, materialize_, quiet_transformers, set_attn_implementation,
                         submodule, tied)

RTOL = 1e-5
BATCH, SEQ, WINDOW, VOCAB, LAYERS = 2, 24, 8, 128, 2  # the shrunk model and its batch


def family_spec(config) -> ArchSpec:
    """The spec ``config`` trains with: registered, or its family proved here (once a process).

    Raises:
        UnsupportedModel: one line naming the model_type, the supported list and what differed.
    """
    spec = known_spec(config.model_type)
    if spec is not None:
        return spec
    spec = generic_spec(config)
    failure = check(config, spec)
    if failure:
        raise UnsupportedModel(f"model_type {config.model_type!r} is not supported: it is not registered "
                               f"(supported: {', '.join(supported_types())}) and its self-check against "
                               f"Hugging Face failed: {failure}")
    accept(spec)
    return spec


def generic_path_line(config) -> str:
    """The log line of a family that trains on the self-checked generic path ("" for a
    registered one): a run of a family no one wrote a spec for says so, and on what evidence."""
    if config.model_type in REGISTRY:
        return ""
    windows = {"layer_types": "sliding windows where layer_types says", "all": "a sliding window on every layer",
               "none": "no sliding window"}[generic_spec(config).sliding]
    return (f"model: model_type {config.model_type!r} is not registered; it trains on the generic stage path "
            f"(its own Hugging Face modules in Llama's embedding, layers, norm and head layout, {windows}), which its start-up self-check accepted: two pipeline stages against "
            f"its Hugging Face model shrunk to {LAYERS} decoder layers, random weights, one batch of "
            f"{BATCH}x{SEQ} tokens in float32, the loss and every parameter's gradient equal to {RTOL:g} "
            f"(relative)")


def shrunk(config):
    """``config`` with two decoder layers, small widths and a short window (its own layer types:
    a sliding and a full layer where it has both)."""
    kv = 2 if kv_heads(config) < config.num_attention_heads else 4
    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=kv,
                 num_hidden_layers=LAYERS, vocab_size=VOCAB, tie_word_embeddings=tied(config), use_cache=False)
    if getattr(config, "head_dim", None):
        small["head_dim"] = 16
    if getattr(config, "sliding_window", None):
        small["sliding_window"] = WINDOW
    types = getattr(config, "layer_types", None)
    if types:
        first = types[0]
        other = next((t for t in types if t != first), first)
        small["layer_types"] = [first, other]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value >= VOCAB:
            small[key] = VOCAB - 1
    out = type(config)(**{**config.to_dict(), **small})
    set_attn_implementation(out, "eager")
    return out


def check(config, spec: ArchSpec) -> str:
    """"" when two stages of ``spec``'s generic path train ``config``'s family exactly as its
    Hugging Face model does (loss and gradients of one batch, float32), else what differed."""
    with quiet_transformers():  # the check's own models say nothing: the refusal is one line
        return _check(config, spec)


LAYOUT = ("model.embed_tokens", "model.layers", "model.norm", "lm_head")


def _check(config, spec: ArchSpec) -> str:
    # imported here: a stage brings the attention kernels (a quarter of a second of imports),
    # which a registered family's start never needs
    from pipeline.stage.model import Stage

    try:
        small = shrunk(config)
        torch.manual_seed(0)
        hf = causal_lm_class(small)(small).float()
        missing = [path for path in LAYOUT if submodule(hf, path) is None]
        if missing:
            return (f"its Hugging Face model lacks {', '.join(missing)} (a stage takes "
                    f"{', '.join(LAYOUT)} out of it)")
        with torch.no_grad():
            for p in hf.parameters():
                if p.ndim == 1:
                    p.add_(torch.randn_like(p) * 0.1)
        x = torch.randint(0, VOCAB, (BATCH, SEQ))
        hf.train()
        loss = hf(input_ids=x, labels=x).loss
        loss.backward()
        ref_loss = loss.detach()
        ref = {k: p.grad for k, p in hf.named_parameters() if p.grad is not None}
    except Exception as e:  # noqa: BLE001 - any failure of the family's own model refuses it
        return f"its Hugging Face model does not build or train from the shrunk config ({_first_line(e)})"
    accept(spec)  # the stages look their spec up in the registry
    try:
        loss, grads = _pipeline_step(Stage, small, hf.state_dict(), x)
    except Exception as e:  # noqa: BLE001 - the generic path cannot run this family
        return f"the generic stage path fails on it ({_first_line(e)})"
    finally:
        for t in spec.model_types:
            forget(t)
    if abs(float(loss) - float(ref_loss)) > RTOL * abs(float(ref_loss)):
        return f"loss {float(loss):.6g} against Hugging Face's {float(ref_loss):.6g}"
    for name, g in ref.items():
        mine = grads.get(name)
        if mine is None:
            return f"{name} gets no gradient in the stages"
        diff = float((mine - g).norm() / g.norm().clamp_min(1e-30))
        if diff > RTOL:
            return f"the gradient of {name} differs by {diff:.1e} (relative)"
    return ""


def _pipeline_step(stage_cls, config, state: dict, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Two stages (one layer each) of the generic path on ``x``: Hugging Face's mean token loss
    and the gradients by Hugging Face name (a tied head's summed into the embedding's)."""
    stages = [stage_cls(config, s, 2, range(s, s + 1)) for s in range(2)]
    for stage in stages:
        materialize_(stage)
        stage.tie_weights()
        with torch.no_grad():
            for name, p in stage.named_parameters():
                p.copy_(state[stage.source_name(name)])
    targets = torch.cat([x[:, 1:], torch.full((x.shape[0], 1), -100)], dim=1)
    h = stages[0](x)
    leaf = h.detach().requires_grad_()
    loss = stages[1](leaf, targets) / (targets != -100).sum()
    loss.backward()
    h.backward(leaf.grad)
    grads: dict[str, torch.Tensor] = {}
    for stage in stages:
        for name, p in stage.named_parameters():
            key = stage.source_name(name)
            grads[key] = p.grad if key not in grads else grads[key] + p.grad
    return loss.detach(), grads


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


__all__ = ["check", "family_spec", "shrunk"]
