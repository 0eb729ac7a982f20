"""Tiny models of the architectures people fine-tune today (tests/one_process/test_architectures.py
says which and why), generated once per directory, and the training configuration their tests share (arch_cfg)."""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from tests.helpers import runs

WINDOW = 32
SEQ = 96  # three windows: a mask that ignores the window shows in every layer past position 32

_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-6,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}
ARCHS = {
    # Llama-3.x: GQA, llama3 rope scaling, theta 500000; untied like 3.1-8B
    "llama3": ("LlamaConfig", dict(rope_scaling=_LLAMA3_ROPE, rope_theta=500000.0, tie_word_embeddings=False)),
    # Llama-3.2-1B: the same, with the head tied to the embedding
    "llama3_tied": ("LlamaConfig", dict(rope_scaling=_LLAMA3_ROPE, rope_theta=500000.0, tie_word_embeddings=True)),
    # Qwen2.5-0.5B: qkv bias, tied, no sliding window
    "qwen2_tied": ("Qwen2Config", dict(rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False)),
    # Qwen2 with sliding layers: the last two of four
    "qwen2_sliding": ("Qwen2Config", dict(tie_word_embeddings=False, use_sliding_window=True, sliding_window=WINDOW,
                                          max_window_layers=2)),
    # Mistral-7B-v0.1 style: every layer windowed
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW, tie_word_embeddings=False, rope_theta=10000.0)),
}


@functools.lru_cache(maxsize=None)
def make_model(arch: str, root: str) -> Path:
    """A randomly initialised tiny model of ``arch`` saved as a Hugging Face directory."""
    import transformers

    cls_name, extra = ARCHS[arch]
    path = Path(root) / arch
    if not (path / "config.json").is_file():
        config = getattr(transformers, cls_name)(**_BASE, **extra)
        torch.manual_seed(7)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # HF's init leaves the norms at 1 and biases at 0: make them matter
            for name, p in model.named_parameters():
                if p.ndim == 1:
                    p.add_(torch.randn_like(p) * 0.1)
        model.save_pretrained(path)
    return path


def arch_cfg(path: Path, **kw):
    """runs.tiny_cfg on a model of ARCHS: synthetic rows of SEQ tokens (three windows), two
    micro-batches of two."""
    return runs.tiny_cfg(path, **{"dataset": "synthetic", "seq_length": SEQ, "batch_size": 4, "num_chunks": 2, **kw})

