"""Data: raw records -> tokenized examples with labels -> deterministic padded batches.

Also the bundled sample data (``data/sample/``) and the tiny-model generator. Nothing here
knows about pipelines or ``torch.distributed``.
"""
from data.batching import Batch, BatchStream, collate, collate_packed
from data.dataset import FORMATS, DataError, check_first_records, detect_format, load_records
from data.tiny_model import ensure_tiny_model, is_complete_tiny_model
from data.tokenization import (
    ALPACA_TEMPLATE,
    ALPACA_TEMPLATE_NO_INPUT,
    IGNORE_INDEX,
    PROMPT_TEMPLATE,
    Example,
    encode_generation_prompt,
    encode_prompt,
    format_alpaca_prompt,
    format_prompt,
    tokenize_records,
)
from data.make_sample import SAMPLE_DIR, TRAIN_FILE, VALIDATION_FILE

SAMPLE_TRAIN = SAMPLE_DIR / TRAIN_FILE
SAMPLE_VALIDATION = SAMPLE_DIR / VALIDATION_FILE

__all__ = [
    "ALPACA_TEMPLATE",
    "ALPACA_TEMPLATE_NO_INPUT",
    "FORMATS",
    "Batch",
    "BatchStream",
    "DataError",
    "Example",
    "IGNORE_INDEX",
    "PROMPT_TEMPLATE",
    "SAMPLE_TRAIN",
    "SAMPLE_VALIDATION",
    "check_first_records",
    "collate",
    "collate_packed",
    "detect_format",
    "encode_generation_prompt",
    "encode_prompt",
    "ensure_tiny_model",
    "format_alpaca_prompt",
    "format_prompt",
    "is_complete_tiny_model",
    "load_records",
    "tokenize_records",
]
