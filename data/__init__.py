"""Data: raw records -> tokenized examples with labels -> deterministic padded batches.

Also the bundled sample data (``data/sample/``), the tiny-model generator and the data section of
the settings (``data/settings.py``). Nothing here knows about pipelines or ``torch.distributed``.

The names below are imported from their modules on first use (PEP 562): ``pipeline.config``
imports ``data.settings``, and train.sh's launch settings read the config before torch loads,
which ``data.batching`` and ``data.tokenization`` import.
"""
from __future__ import annotations

import importlib
from typing import Any

from data.make_sample import SAMPLE_DIR, TRAIN_FILE, VALIDATION_FILE

SAMPLE_TRAIN = SAMPLE_DIR / TRAIN_FILE
SAMPLE_VALIDATION = SAMPLE_DIR / VALIDATION_FILE

# name -> the module that defines it
_HOMES = {
    **dict.fromkeys(("Batch", "BatchStream", "collate", "collate_packed"), "data.batching"),
    **dict.fromkeys(("FORMATS", "DataError", "check_first_records", "detect_format", "load_records"), "data.dataset"),
    **dict.fromkeys(("ensure_tiny_model", "is_complete_tiny_model"), "data.tiny_model"),
    **dict.fromkeys(("ALPACA_TEMPLATE", "ALPACA_TEMPLATE_NO_INPUT", "IGNORE_INDEX", "PROMPT_TEMPLATE", "Example",
                     "encode_generation_prompt", "encode_prompt", "format_alpaca_prompt", "tokenize_records"), "data.tokenization"),
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # once: later reads find it without this hook
    return value


__all__ = sorted([*_HOMES, "SAMPLE_TRAIN", "SAMPLE_VALIDATION"])
