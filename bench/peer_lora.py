"""LoRA in the peers' scripts (bench/fsdp2_baseline.py, bench/roundpipe_baseline.py), added as a
careful peft user adds it: peft's LoRA layers injected into the Hugging Face model in place
(``peft.inject_adapter_in_model``), which keeps the model's class, so a system that recognises the
class (RoundPipe's sequential presets) still does; only the adapters are trainable. ``all-linear``
is peft's: every linear layer but the output head, on a Llama the same modules as this project's
``lora_target_modules: all-linear``. Standalone (torch and peft only, like host_clip.py), so the
peers' scripts stay independent of this project's code."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # peers.py reads the switches without importing torch
    from torch import nn

ALL_LINEAR = "all-linear"
ADAPTER_NAME = "default"  # peft's own


def add_args(p: argparse.ArgumentParser) -> None:
    """The ``--lora_*`` switches, with this project's defaults (``pipeline/config.py``)."""
    p.add_argument("--lora_rank", type=int, default=0, help="train peft LoRA adapters of this rank on the frozen "
                   "model (0: full fine-tuning)")
    p.add_argument("--lora_alpha", type=float, default=16.0, help="LoRA scaling numerator (update x alpha / rank)")
    p.add_argument("--lora_target_modules", default=ALL_LINEAR, help="peft module names, comma-separated "
                   "(q_proj,v_proj), or all-linear (every linear layer but the head)")


def check(args: argparse.Namespace) -> None:
    """The switches' values, before anything is built; a bad one exits with one line."""
    if args.lora_rank < 0:
        raise SystemExit(f"error: --lora_rank ({args.lora_rank}) must be >= 0 (0: full fine-tuning)")
    if args.lora_rank and args.lora_alpha <= 0:
        raise SystemExit(f"error: --lora_alpha ({args.lora_alpha}) must be > 0")
    if args.lora_rank:
        targets(args.lora_target_modules)


def targets(text: str) -> str | list[str]:
    """``--lora_target_modules`` as peft's ``target_modules``: ``"all-linear"`` or a list of names;
    a bad list exits with one line."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names or (ALL_LINEAR in names and len(names) > 1):
        raise SystemExit(f"error: --lora_target_modules {text!r}: give peft module names (q_proj,v_proj) or "
                         f"{ALL_LINEAR} alone")
    if "lm_head" in names or "embed_tokens" in names:
        # RoundPipe's Llama preset feeds lm_head.weight to its fused loss; this project keeps both frozen too
        raise SystemExit(f"error: --lora_target_modules {text!r}: the head and the embedding stay frozen here; "
                         "target the decoder layers' modules")
    return ALL_LINEAR if names == [ALL_LINEAR] else names


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def inject(model: nn.Module, rank: int, alpha: float, target_modules: str) -> int:
    """peft's LoRA layers into ``model`` (a ``PreTrainedModel``, on any device, meta included),
    every other parameter frozen; returns the adapters' element count. The adapters take the
    dtype of the layer they adapt (peft's rule)."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets(target_modules),
                        task_type="CAUSAL_LM")
    inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    # peft freezes the rest already; say so here, so the optimizer's set does not rest on that default
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def summary(args: argparse.Namespace, trainable: int | None) -> dict:
    """The JSON's LoRA fields (empty for full fine-tuning, so those tables stay as they were)."""
    if not args.lora_rank:
        return {}
    return {"lora_rank": args.lora_rank, "lora_alpha": args.lora_alpha,
            "lora_target_modules": args.lora_target_modules, "trainable_params": trainable}
