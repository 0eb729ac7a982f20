"""The tiny model of each registered family with its norms and biases moved off their init, the
training configuration of the families' tests and its cached single-process reference
(tests/one_process/test_families.py, tests/multi_process/test_gloo_families.py)."""
from __future__ import annotations

import functools
import shutil
from pathlib import Path

import torch

from models import FAMILIES
from tests.helpers.reference import reference_train
from tests.helpers.runs import tiny_cfg

FAMILY_TYPES = [spec.model_types[0] for spec in FAMILIES]
SIZES = dict(hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=512,
             max_position_embeddings=256, seed=1)
SEQ = 64  # two of the tiny configs' 32-token windows


@functools.lru_cache(maxsize=None)
def family_model(family: str, root: str) -> Path:
    """The generator's tiny ``family`` model with its norms and biases moved off their init."""
    from transformers import AutoModelForCausalLM

    from data import SAMPLE_TRAIN, ensure_tiny_model

    made = ensure_tiny_model(Path(root) / "made" / family, data_files=[SAMPLE_TRAIN], family=family, **SIZES)
    path = Path(root) / family
    if not (path / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(made, dtype=torch.float32)
        torch.manual_seed(5)
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 1:
                    p.add_(torch.randn_like(p) * 0.1)
        model.save_pretrained(path)
        for f in made.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, path / f.name)
    return path


def family_cfg(path: Path, **kw):
    return tiny_cfg(path, seq_length=SEQ, attn_implementation="auto", **kw)


@functools.lru_cache(maxsize=None)
def family_reference(path: str):
    return reference_train(family_cfg(Path(path)), Path(path))


# offload: parameters in host memory and every layer recomputed (routing replays, checkpoints)
MODES = {"plain": {}, "offload": dict(use_offload=True, activation_checkpointing=True, keep_layers=0)}
