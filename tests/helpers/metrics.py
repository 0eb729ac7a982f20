"""The metrics tests' training configuration, the Hugging Face validation loss they compare
with, and the rows of a run's metrics.jsonl (tests/one_process/test_metrics.py in one process,
tests/multi_process/test_gloo_metrics.py over torchrun)."""
from __future__ import annotations

import json

import torch

from tests.helpers.runs import tiny_cfg

EVAL_BATCHES = 3


def metrics_cfg(model_dir, save_dir, **kw):
    """runs.tiny_cfg writing its metrics to ``save_dir`` (the tests read them there), two steps."""
    return tiny_cfg(model_dir, **{"num_iterations": 2, "save_metrics": True, "save_dir": str(save_dir), **kw})


def hf_eval_loss(model_dir, params, cfg) -> float:
    """Token-weighted mean loss of the plain HF model over the first EVAL_BATCHES batches of the
    bundled validation file, in file order (the documented eval batching)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data import SAMPLE_VALIDATION, collate, load_records, tokenize_records

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32).eval()
    model.load_state_dict(params)
    tok = AutoTokenizer.from_pretrained(model_dir)
    examples, _ = tokenize_records(load_records(str(SAMPLE_VALIDATION)), tok, cfg.seq_length)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(EVAL_BATCHES):
            batch = collate(examples[i * cfg.batch_size:(i + 1) * cfg.batch_size], pad_id=tok.pad_token_id
                            if tok.pad_token_id is not None else tok.eos_token_id, seq_length=cfg.seq_length)
            # HF's loss is the batch's mean over its trained tokens: weight it back by their count.
            total += model(input_ids=batch.input_ids, labels=batch.labels).loss.item() * batch.num_targets
            tokens += batch.num_targets
    return total / tokens


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]
