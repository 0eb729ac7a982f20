"""Sequence packing (``packing: true``): several records a row, positions restarting at 0 for
each, attention and loss never crossing a record. Packed and unpacked training give the same
loss and gradients; a plain causal mask over packed rows does not; a pipeline run with packing
equals the Hugging Face model fed the same packed rows, positions and 4-D mask."""
from __future__ import annotations

import re

import pytest
import torch

from data import IGNORE_INDEX, BatchStream, DataError, Example, collate, collate_packed
from data.batching import pack_rows
from pipeline.spec.shapes import partition_layers
from pipeline.stage.model import build_stage
from tests.helpers.architectures import make_model
from tests.helpers.reference import assert_same_training, in_process_trainer, reference_train, trained
from tests.helpers.runs import text_records, tiny_cfg
from tests.helpers.tolerance import assert_close

SEQ = 96


def _example(ids: list[int], prompt: int = 0) -> Example:
    # The first ``prompt`` tokens are not trained; with prompt 0 even the first token is a label,
    # as a text record of a tokenizer without bos has it: only the boundary rule keeps the previous
    # record's last token from predicting it.
    prompt = min(prompt, len(ids) - 1)
    return Example(list(ids), [IGNORE_INDEX] * prompt + list(ids[prompt:]))


def _records(vocab: int, lengths: list[int], seed: int = 0) -> list[Example]:
    g = torch.Generator().manual_seed(seed)
    return [_example(torch.randint(3, vocab, (n,), generator=g).tolist(), prompt=i % 3 * 2)
            for i, n in enumerate(lengths)]


# --- (3) the collated rows ---------------------------------------------------------------------
def test_collate_packed_restarts_positions_and_cuts_targets_at_boundaries():
    a, b, c = _example([5, 6, 7]), _example([8, 9]), _example([10, 11, 12, 13])
    batch = collate_packed([[a, b], [c]], pad_id=0, seq_length=16)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0], [10, 11, 12, 13, 0, 0, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 0, 1, 2, 3]]
    assert batch.segment_ids.tolist() == [[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]]
    # 7 (a's last token) predicts nothing, though b's first label (8) is trained; 9 ends b
    ignore = [IGNORE_INDEX] * 4
    assert batch.targets.tolist() == [[6, 7, -100, 9] + ignore, [11, 12, 13, -100] + ignore]
    assert batch.num_targets == 6
    # the same targets each record gets alone in a row
    alone = [collate([e], pad_id=0, seq_length=16).targets[0, :len(e)].tolist() for e in (a, b, c)]
    assert batch.targets[0, :5].tolist() == alone[0] + alone[1] and batch.targets[1, :4].tolist() == alone[2]
    with pytest.raises(ValueError, match="more than seq_length"):
        collate_packed([[a, b, c]], pad_id=0, seq_length=8)


def test_pack_rows_is_greedy_in_data_order():
    assert pack_rows([5, 3, 9, 4, 7, 2], 0, 2, 12) == ([[0, 1], [2]], 3)  # 9 does not fit after 5 + 3
    assert pack_rows([5, 3, 9, 4, 7, 2], 3, 2, 12) == ([[3, 4], [5]], 6)  # the last row closes at the end
    assert pack_rows([5, 3, 9, 4, 7, 2], 3, 3, 12) is None                  # no third row left
    assert pack_rows([12, 12], 0, 2, 12) == ([[0], [1]], 2)                 # a full record fills a row


def test_token_line_says_why_nothing_packed_and_what_is_left_out():
    from pipeline.run.build import token_line

    # 13 records of 9 to 12 tokens, seq_length 16: no two fit in a row; 3 rows a batch leave 1 out
    stream = BatchStream(_records(100, [9, 10, 11, 12] * 3 + [9]), 3, pad_id=0, seq_length=16, seed=1, packing=True)
    line = token_line(stream, packing=True)
    assert "12 records in 12 rows (packed)" in line, line
    assert re.search(r"; nothing packed: no record fits beside the next within seq_length=16 \(a record has 1\d "
                     r"tokens on average; a longer seq_length packs some\)", line), line
    assert line.endswith("; 1 records left out of this epoch: too few for a last full batch of 3 rows (the next "
                         "epoch's shuffle leaves out others)"), line
    packed = token_line(BatchStream(_records(100, [3] * 12), 3, pad_id=0, seq_length=16, packing=True), packing=True)
    assert "nothing packed" not in packed and "left out" not in packed, packed


def test_stream_packs_the_epoch_order_and_resumes():
    examples = _records(100, [5, 3, 9, 4, 7, 2, 6, 11, 2, 8] * 3)
    stream = BatchStream(examples, 2, pad_id=0, seq_length=12, seed=1, packing=True)
    counts = stream.token_counts()
    order = stream._epoch_order().tolist()
    served, padding, targets = [], 0, 0
    for _ in range(counts["batches"]):
        before = stream.state_dict()
        batch = stream.next_batch()
        padding += int((batch.segment_ids == 0).sum())
        targets += batch.num_targets
        for r in range(batch.batch_size):
            for s in range(1, int(batch.segment_ids[r].max()) + 1):
                here = batch.segment_ids[r] == s
                assert batch.position_ids[r][here].tolist() == list(range(int(here.sum())))
                served.append(batch.input_ids[r][here].tolist())
        resumed = BatchStream(examples, 2, pad_id=0, seq_length=12, seed=1, packing=True)
        resumed.load_state_dict(before)
        assert torch.equal(resumed.next_batch().input_ids, batch.input_ids)
    # every record once, in the epoch's order, until the last full batch
    assert served == [examples[i].input_ids for i in order[:counts["examples"]]]
    assert sum(map(len, served)) == counts["tokens"] and padding == counts["padding"]
    assert targets == counts["targets"]
    assert stream.epoch == 0 and (stream.next_batch(), stream.epoch)[1] == 1  # the rest is dropped
    with pytest.raises(ValueError, match="packing"):
        BatchStream(examples, 2, pad_id=0, seq_length=12, seed=1).load_state_dict(before)
    with pytest.raises(DataError, match="pack into fewer than one batch"):
        BatchStream(examples[:4], 3, pad_id=0, seq_length=64, packing=True)


def test_microbatches_carry_positions_and_segments():
    batch = collate_packed([[_example([5, 6])], [_example([7]), _example([8, 9])]], pad_id=0, seq_length=8)
    first, second = batch.microbatches(2)
    assert second.position_ids.tolist() == [[0, 0, 1, 0, 1, 2, 3, 4]]
    assert second.segment_ids.tolist() == [[1, 2, 2, 0, 0, 0, 0, 0]]
    assert first.num_targets + second.num_targets == batch.num_targets
    assert collate([_example([5, 6])], pad_id=0, seq_length=8).microbatches(1)[0].segment_ids is None


# --- (1) packed == unpacked, (2) unless attention crosses records --------------------------------
def _loss_and_grads(stages, batch, **kw):
    for stage in stages:
        stage.zero_grad(set_to_none=True)
    h = batch.input_ids
    for stage in stages[:-1]:
        h = stage(h, **kw)
    loss = stages[-1](h, batch.targets, **kw)
    loss.backward()
    return loss.item(), {f"{i}.{k}": p.grad.clone() for i, s in enumerate(stages) for k, p in s.named_parameters()}


def _packed_vs_unpacked(path, impl: str, mutate: str = ""):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    config._attn_implementation = impl
    parts = partition_layers(config.num_hidden_layers, 2)
    stages = [build_stage(config, s, 2, parts[s], model_dir=path, seed=0) for s in range(2)]
    records = _records(config.vocab_size, [23, 40, 17, 31, 9, 50, 12, 28, 44, 7])
    rows, end = pack_rows([len(e) for e in records], 0, 3, SEQ)
    assert end == len(records) and max(map(len, rows)) > 2  # every record, several to a row
    packed = collate_packed([[records[i] for i in row] for row in rows], pad_id=0, seq_length=SEQ)
    unpacked = collate(records, pad_id=0, seq_length=SEQ)
    assert packed.num_targets == unpacked.num_targets and packed.input_ids.numel() < unpacked.input_ids.numel()
    kw = {"position_ids": packed.position_ids, "segment_ids": packed.segment_ids}
    if mutate == "causal":  # positions restart, but the mask is plain causal: attention crosses records
        kw.pop("segment_ids")
    if mutate == "targets":  # the last token of a record predicts the next record's first token
        packed.targets[:, :-1] = packed.labels[:, 1:]
    loss, grads = _loss_and_grads(stages, packed, **kw)
    ref_loss, ref_grads = _loss_and_grads(stages, unpacked)
    assert_close(loss, ref_loss, 1e-5, "loss")
    assert_close(grads, ref_grads, 1e-5, "gradient")


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["llama3", "mistral"])
def test_packed_equals_unpacked(models_root, arch, impl):
    """Same summed loss over the same targets and the same gradients, float32; Mistral's window
    (32) is shorter than the rows, so the segment mask is combined with the sliding window."""
    _packed_vs_unpacked(make_model(arch, models_root), impl)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("mutate", ["causal", "targets"])
def test_comparison_fails_when_records_leak(models_root, impl, mutate):
    with pytest.raises(AssertionError):
        _packed_vs_unpacked(make_model("llama3", models_root), impl, mutate)


# --- (4) the pipeline with packing == Hugging Face fed the packed rows --------------------------
@pytest.mark.parametrize("impl,schedule", [("eager", "1f1b"), ("sdpa", "gpipe")])
def test_pipeline_with_packing_matches_hf(tiny_model_dir, tmp_path, capsys, impl, schedule):
    """2 stages in one process."""
    cfg = tiny_cfg(tiny_model_dir, dataset=text_records(tmp_path / "short.jsonl", 2, 14), packing=True, batch_size=4,
                   num_chunks=2, num_stages=2, schedule=schedule, attn_implementation=impl,
                   save_dir=str(tmp_path / "out"))
    trainer = in_process_trainer(cfg)
    first = BatchStream(trainer.stream.examples, 4, pad_id=0, seq_length=64, packing=True).next_batch()
    assert int(first.segment_ids.max()) >= 3  # really packed: several records a row
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("tokens: "))
    counts = trainer.stream.token_counts()
    assert f"{counts['examples']} records in {counts['rows']} rows (packed)" in line and counts["rows"] < counts["examples"]
    run = trained(trainer)
    ref = reference_train(cfg, cfg.model)
    assert_same_training(*run.outcome, *ref)
