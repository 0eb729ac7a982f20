"""LoRA on a stage, through peft: adapters injected into the stage's own modules (peft's layer
classes, names and saved format), their initial values, a saved adapter read back, and the
tensors a saved adapter or a merged model is made of.

Initial values: peft's scheme (A kaiming-uniform with a = sqrt(5), B zeros), each A drawn from a
generator seeded by the run's seed and the adapter's saved name, not from the global generator
in module order: every partition of the model over stages and ranks then starts from the same
adapters, and so does the single-process reference (``init_adapters`` on a ``PeftModel``)."""
from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from offload.streams import flat_views
from pipeline.spec.lora import ADAPTER_WEIGHTS, PEFT_PREFIX, LoraSettings
from pipeline.stage.quantized import quiet_bitsandbytes
from pipeline.stage.weights import read_weights

quiet_bitsandbytes()  # before peft, which imports bitsandbytes wherever it is installed

ADAPTER_NAME = "default"  # peft's own adapter name; the saved keys leave it out


def peft_config(settings: LoraSettings, base_model: str | None = None):
    """peft's ``LoraConfig`` of ``settings`` (causal LM)."""
    from peft import LoraConfig

    return LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=list(settings.targets), task_type="CAUSAL_LM",
                      base_model_name_or_path=base_model)


def inject(stage: nn.Module, settings: LoraSettings) -> None:
    """peft's LoRA layers into ``stage``'s targeted linear modules; every other parameter is
    frozen (``requires_grad`` False: no gradient, master or optimizer state for it)."""
    from peft import inject_adapter_in_model

    layers = getattr(getattr(stage, "model", None), "layers", None)
    if layers is not None and len(layers) == 0:
        pass  # no decoder layer, nothing to adapt (peft refuses a model with no target)
    else:
        inject_adapter_in_model(peft_config(settings), stage, adapter_name=ADAPTER_NAME)
    for name, p in stage.named_parameters():
        p.requires_grad_(is_adapter(name))


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def saved_key(name: str) -> str:
    """An adapter parameter's key in peft's saved file, from its name in a stage or a PeftModel."""
    name = name.removeprefix(PEFT_PREFIX).replace(f".{ADAPTER_NAME}.", ".")
    return PEFT_PREFIX + name


def _seed(seed: int, key: str) -> int:
    h = 0
    for ch in key.encode():
        h = (h * 131 + ch) % 2_147_483_647
    return seed * 1_000_003 + h


def init_adapters(model: nn.Module, seed: int) -> None:
    """peft's initial values, each A seeded by (``seed``, its saved key): the same adapters for
    any partition, and for a ``PeftModel`` of the whole model (the reference)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name:
                gen = torch.Generator(device="cpu").manual_seed(_seed(seed, saved_key(name)))
                w = torch.empty(p.shape, dtype=torch.float32)
                nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=gen)
                p.copy_(w)
            elif ".lora_B." in name:
                p.zero_()


def load_adapter(stage: nn.Module, path: str | Path) -> None:
    """The stage's adapters from a saved peft adapter directory (only this stage's tensors are read)."""
    from safetensors import safe_open

    file = Path(path) / ADAPTER_WEIGHTS
    wanted = {saved_key(n): p for n, p in stage.named_parameters() if is_adapter(n)}
    with safe_open(str(file), framework="pt") as f:
        have = set(f.keys())
        missing = sorted(set(wanted) - have)
        if missing:
            raise KeyError(f"{file}: lacks {len(missing)} adapter tensors of stage {getattr(stage, 'index', '?')}, "
                           f"e.g. {missing[0]}")
        with torch.no_grad():
            for key, p in wanted.items():
                t = f.get_tensor(key)
                if t.shape != p.shape:
                    raise ValueError(f"{file}: {key} has shape {tuple(t.shape)}, the stage expects {tuple(p.shape)}")
                p.copy_(t)


def adapter_tensors(store) -> dict[str, torch.Tensor]:
    """A stage's adapters as peft saves them (fp32 masters, on the CPU), from its store."""
    return {saved_key(n): v.to("cpu", copy=True) for n, v in store.master_state_dict().items()}


def merged_tensors(stage: nn.Module, store, full_base: str | Path | None = None) -> dict[str, torch.Tensor]:
    """The stage's weights with its adapters merged in (W + scaling * B @ A, in float32, as
    peft's ``merge_and_unload``), under the Hugging Face names; a tied head's second copy left out.
    A 4-bit base's linear weights W are the full-precision ones of the Hugging Face directory
    ``full_base`` (``merge_lora_base``), read for this stage only, not the 4-bit values trained on."""
    frozen = {n: v.to("cpu", torch.float32, copy=True) for n, v in store.frozen.state_dict().items()}
    if store.frozen.packed:
        names = {id(p): n for n, p in stage.named_parameters()}
        packed = {names[id(w.param)]: w.module for w in store.frozen.packed}
        if full_base is None:
            raise ValueError(f"stage {stage.index}: a 4-bit base merges into its full-precision weights only; "
                             "give merge_lora_base")
        read = read_weights(stage, Path(full_base), {n.replace(".base_layer.", "."): torch.Size((m.out_features,
                            m.in_features)) for n, m in packed.items()})
        frozen.update({n: read[n.replace(".base_layer.", ".")].to(torch.float32) for n in packed})
    masters = dict(zip(store.names, flat_views(store.master.detach(), store.shapes)))
    out = {}
    for name, w in frozen.items():
        key = name.replace(".base_layer.", ".")
        if ".base_layer.weight" in name:
            module = stage.get_submodule(name.removesuffix(".base_layer.weight"))
            prefix = name.removesuffix("base_layer.weight")
            a = masters[f"{prefix}lora_A.{ADAPTER_NAME}.weight"].to("cpu", torch.float32)
            b = masters[f"{prefix}lora_B.{ADAPTER_NAME}.weight"].to("cpu", torch.float32)
            w = w + (b @ a) * module.scaling[ADAPTER_NAME]
        out[key] = w
    if getattr(stage, "tied_name", None) == "lm_head.weight":  # the first stage saves the tied matrix
        out.pop("lm_head.weight", None)
    return out


__all__ = ["ADAPTER_NAME", "PEFT_PREFIX", "adapter_tensors", "init_adapters", "inject", "is_adapter",
           "load_adapter", "merged_tensors", "peft_config", "saved_key"]
