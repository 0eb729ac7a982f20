"""The metrics tests' training configuration, the Hugging Face validation loss they compare
with, and the rows of a run's metrics.jsonl (tests/one_process/test_metrics.py in one process,
tests/multi_process/test_gloo_metrics.py over torchrun)."""
from __future__ import annotations

import json

import torch

from pipeline.config import make_config

EVAL_BATCHES = 3


def tiny_cfg(model_dir, tmp_path, **kw):
    base = dict(model=str(model_dir), dataset="sample", seq_length=64, batch_size=8, num_chunks=4,
                num_iterations=2, num_stages=4, dtype="float32", device="cpu", lr=1e-3, warmup_iterations=1,
                grad_clip=1.0, attn_implementation="eager", save_model=False, save_dir=str(tmp_path),
                progress_bar=False)
    base.update(kw)
    return make_config(base)


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
