"""Validation through the same pipeline: fixed batches of the validation data, run by the
executor with a forward-only program (``schedule.build_forward``), reduced to one token-weighted
mean loss over every validation token."""
from __future__ import annotations

import time
from typing import Callable

from pipeline.config import TrainConfig
from pipeline.spec.settings import eval_source


def build_eval_batches(cfg: TrainConfig, source) -> list:
    """Validation batches of ``batch_size`` rows, in the data's own order (no shuffling), at most
    ``eval_batches`` of them (0 = all); a last group smaller than a batch is left out, since
    the schedule is built for ``num_chunks`` equal micro-batches.

    Args:
        cfg: the run's config.
        source: the run's ``ModelSource`` (its tokenizer, or its vocabulary for synthetic data).
    """
    from data import DataError, collate, load_records, tokenize_records
    from data.synthetic import synthetic_examples

    name, split = eval_source(cfg)
    if name == "synthetic":
        # Another seed than the training rows (seed), so the two sets differ.
        examples = synthetic_examples(max(cfg.batch_size * 2, 16), cfg.seq_length, source.config.vocab_size,
                                      cfg.seed + 1)
        pad = 0
    else:
        assert source.tokenizer_dir is not None, "preflight.check_files refuses validation data without a tokenizer"
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source.tokenizer_dir)
        examples, _ = tokenize_records(load_records(name, split), tokenizer, cfg.seq_length)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    num = len(examples) // cfg.batch_size
    if cfg.eval_batches:
        num = min(num, cfg.eval_batches)
    if num == 0:
        raise DataError(f"validation data {name!r} has {len(examples)} usable examples, fewer than one batch "
                        f"(batch_size={cfg.batch_size}); set eval_dataset to more data or lower batch_size")
    rows = cfg.batch_size
    return [collate(examples[i * rows:(i + 1) * rows], pad_id=pad, seq_length=cfg.seq_length) for i in range(num)]


def evaluate(run: Callable, batches: list) -> dict:
    """Mean validation loss over every target token of ``batches``.

    Args:
        run: ``run(batch) -> summed token loss`` of one batch (None on a rank without the loss);
            the caller runs the forward-only program with ``num_targets=1``, so the executor's
            sum is the plain sum of token losses.
        batches: from ``build_eval_batches``.

    Returns:
        ``{loss, num_tokens, num_batches, time_s}``; ``loss`` is None on ranks without the loss.
    """
    t0 = time.perf_counter()
    total, tokens, have_loss = 0.0, 0, False
    for batch in batches:
        loss_sum = run(batch)  # host sync on the loss rank (the float); others only wait for their sends
        if loss_sum is not None:
            total += loss_sum
            have_loss = True
        tokens += batch.num_targets
    # Token-weighted: each token counts once, whatever batch (and padding) it came in.
    return {"loss": total / max(tokens, 1) if have_loss else None, "num_tokens": tokens,
            "num_batches": len(batches), "time_s": time.perf_counter() - t0}
