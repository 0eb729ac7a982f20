"""L1 tests of data/: label masks, truncation, batching, the batch stream, loading, tiny model."""
from __future__ import annotations

import json
import os

import datasets
import pytest
import torch

from data import (
    IGNORE_INDEX,
    SAMPLE_TRAIN,
    SAMPLE_VALIDATION,
    BatchStream,
    DataError,
    Example,
    collate,
    detect_format,
    encode_prompt,
    ensure_tiny_model,
    is_complete_tiny_model,
    load_records,
    tokenize_records,
)
from data.make_sample import make_records
from data.tokenization import _PROMPT_PREFIX, _PROMPT_SUFFIX
from tests.helpers.char_tokenizer import BOS, EOS, PAD, CharTokenizer, chars

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return ensure_tiny_model(
        tmp_path_factory.mktemp("models") / "tiny", data_files=[SAMPLE_TRAIN]
    )


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


# ---------------------------------------------------------------- tokenization


def test_xsum_labels_mask_prompt_char_tokenizer():
    [example], skipped = tokenize_records(
        [{"document": "abc", "summary": "xy"}], CharTokenizer(), seq_length=200
    )
    prompt = [BOS] + chars(_PROMPT_PREFIX + "abc" + _PROMPT_SUFFIX)
    assert skipped == 0
    assert example.input_ids == prompt + chars("xy") + [EOS]
    assert example.labels == [IGNORE_INDEX] * len(prompt) + chars("xy") + [EOS]


def test_xsum_labels_mask_prompt_tiny_tokenizer(tiny_tokenizer):
    tok = tiny_tokenizer
    doc, summary = "Swansea City beat Leeds 3-1 on Monday.", "Swansea beat Leeds 3-1."
    [example], _ = tokenize_records([{"document": doc, "summary": summary}], tok, 512)

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    prompt = [tok.bos_token_id] + ids(_PROMPT_PREFIX) + ids(doc) + ids(_PROMPT_SUFFIX)
    answer = ids(summary) + [tok.eos_token_id]
    assert example.input_ids == prompt + answer
    for i, (token, label) in enumerate(zip(example.input_ids, example.labels)):
        assert label == (IGNORE_INDEX if i < len(prompt) else token), i
    trained = [label for label in example.labels if label != IGNORE_INDEX]
    assert tok.decode(trained) == summary + tok.eos_token
    assert encode_prompt(tok, doc) == prompt


def test_truncation_cuts_document_and_keeps_summary():
    tok, summary = CharTokenizer(), "the summary"
    fixed = 1 + len(_PROMPT_PREFIX) + len(_PROMPT_SUFFIX)
    seq_length = fixed + 40 + len(summary) + 1  # 40 > seq_length // 4: the minimum does not bind
    [example], _ = tokenize_records(
        [{"document": "d" * 500, "summary": summary}], tok, seq_length
    )
    assert len(example) == seq_length
    assert example.input_ids == (
        [BOS] + chars(_PROMPT_PREFIX + "d" * 40 + _PROMPT_SUFFIX + summary) + [EOS]
    )
    assert example.labels[-len(summary) - 1 :] == chars(summary) + [EOS]
    assert example.labels[: -len(summary) - 1] == [IGNORE_INDEX] * (fixed + 40)


def test_truncation_keeps_the_document_and_cuts_the_summary():
    """A summary that fills seq_length is cut, not the whole document: at least seq_length // 4
    document tokens stay (here all 3); a record with no room left for a target is skipped."""
    tok = CharTokenizer()
    fixed = 1 + len(_PROMPT_PREFIX) + len(_PROMPT_SUFFIX)
    stats: dict[str, int] = {}
    rows = [{"document": "doc", "summary": "summary"}, {"document": "doc", "summary": "s" * 300}]
    [example], skipped = tokenize_records(rows[:1], tok, fixed + 6, stats=stats)
    assert example.input_ids == [BOS] + chars(_PROMPT_PREFIX + "doc" + _PROMPT_SUFFIX + "sum")
    assert example.labels == [IGNORE_INDEX] * (fixed + 3) + chars("sum")  # no eos: it was cut
    assert skipped == 0 and stats == {"truncated": 1, "summary_cut": 1, "unusable": 0}
    with pytest.raises(DataError, match="no usable xsum records: all 2"):
        tokenize_records(rows, tok, fixed + 3)  # the prompt alone fills it
    # why records were skipped: a missing field, or no target left (the data: line says which)
    _, skipped = tokenize_records(rows + [{"document": "doc", "summary": ""}], tok, fixed + 4, stats=stats)
    assert skipped == 1 and stats["unusable"] == 1
    _, skipped = tokenize_records([rows[0], {"document": "d" * 40, "summary": "s"}], tok, fixed + 4, stats=stats)
    assert skipped == 1 and stats["unusable"] == 0


def test_no_trainable_token_is_skipped_and_empty_result_is_error():
    tok = CharTokenizer()
    fixed = 1 + len(_PROMPT_PREFIX) + len(_PROMPT_SUFFIX)
    rows = [{"document": "doc", "summary": "s"}] * 3
    with pytest.raises(DataError, match="no usable xsum records: all 3"):
        tokenize_records(rows, tok, fixed)


def test_text_format_trains_all_tokens_and_cuts_the_end():
    tok = CharTokenizer()
    [example], _ = tokenize_records([{"text": "hello"}], tok, 100)
    assert example.input_ids == [BOS] + chars("hello") + [EOS]
    assert example.labels == [IGNORE_INDEX] + chars("hello") + [EOS]
    [example], _ = tokenize_records([{"text": "hello"}], tok, 4)
    assert example.input_ids == [BOS] + chars("hel")
    assert example.labels == [IGNORE_INDEX] + chars("hel")


def test_corrupt_rows_are_skipped_and_counted():
    rows = [
        {"document": "good", "summary": "fine"},
        {"document": "no summary"},
        {"document": None, "summary": "x"},
        {"document": 7, "summary": "x"},
        {"document": "doc", "summary": ""},
        {"document": "   ", "summary": "x"},
        "not a mapping",
    ]
    examples, skipped = tokenize_records(rows, CharTokenizer(), 200, fmt="xsum")
    assert skipped == 6
    assert len(examples) == 1 and examples[0].labels[-5:] == chars("fine") + [EOS]


def test_detect_format():
    assert detect_format(["id", "document", "summary"]) == "xsum"
    assert detect_format(["text", "meta"]) == "text"
    with pytest.raises(DataError, match=r"need 'document' and 'summary'.*or 'text'"):
        detect_format(["document", "title"])


def test_tokenize_detects_format_from_dataset_columns():
    ds = datasets.Dataset.from_list([{"text": "abc"}, {"text": None}])
    examples, skipped = tokenize_records(ds, CharTokenizer(), 16)
    assert (len(examples), skipped) == (1, 1)


# ---------------------------------------------------------------- batches


def example(n: int, first_label: int = 1) -> Example:
    ids = list(range(10, 10 + n))
    return Example(ids, [IGNORE_INDEX] * first_label + ids[first_label:])


def test_collate_pads_to_multiple_of_8_and_shifts_targets():
    batch = collate([example(3), example(10, first_label=4)], pad_id=PAD, seq_length=64)
    assert batch.input_ids.shape == (2, 16) and batch.input_ids.dtype == torch.long
    assert batch.input_ids[0].tolist() == [10, 11, 12] + [PAD] * 13
    assert batch.labels[0].tolist() == [IGNORE_INDEX, 11, 12] + [IGNORE_INDEX] * 13
    assert batch.targets[0].tolist() == [11, 12] + [IGNORE_INDEX] * 14
    assert torch.equal(batch.targets[:, :-1], batch.labels[:, 1:])
    assert (batch.targets[:, -1] == IGNORE_INDEX).all()
    assert batch.num_targets == 2 + 6 == int((batch.targets != IGNORE_INDEX).sum())


def test_collate_width_is_capped_at_seq_length():
    batch = collate([example(10)], pad_id=PAD, seq_length=12)
    assert batch.input_ids.shape == (1, 12)
    with pytest.raises(ValueError, match=r"13 tokens, more than seq_length \(12\)"):
        collate([example(13)], pad_id=PAD, seq_length=12)


def test_targets_match_hf_shifted_loss(tiny_model, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    records = load_records(str(SAMPLE_VALIDATION)).select(range(4))
    examples, _ = tokenize_records(records, tiny_tokenizer, 128)
    batch = collate(examples, pad_id=tiny_tokenizer.pad_token_id, seq_length=128)
    with torch.no_grad():
        out = model(input_ids=batch.input_ids, labels=batch.labels)
    ours = torch.nn.functional.cross_entropy(
        out.logits.flatten(0, 1), batch.targets.flatten(), reduction="sum"
    ) / batch.num_targets
    torch.testing.assert_close(ours, out.loss)


def test_microbatches_split_rows_contiguously():
    batch = collate([example(3 + i) for i in range(6)], pad_id=PAD, seq_length=64)
    chunks = batch.microbatches(3)
    assert [c.batch_size for c in chunks] == [2, 2, 2]
    assert torch.equal(torch.cat([c.input_ids for c in chunks]), batch.input_ids)
    assert torch.equal(torch.cat([c.targets for c in chunks]), batch.targets)
    assert torch.equal(chunks[1].labels, batch.labels[2:4])
    assert sum(c.num_targets for c in chunks) == batch.num_targets
    assert chunks[0].num_targets == 2 + 3
    with pytest.raises(ValueError, match=r"batch size \(6\) must be divisible .* \(4\)"):
        batch.microbatches(4)


def stream(n: int = 10, batch_size: int = 3, seed: int = 0) -> BatchStream:
    return BatchStream([example(2 + i % 5) for i in range(n)], batch_size, pad_id=PAD,
                       seq_length=64, seed=seed)


def rows_of(s: BatchStream, num_batches: int) -> list[list[int]]:
    out = []
    for _ in range(num_batches):
        start = s.position if s.position + s.batch_size <= len(s.examples) else 0
        s.next_batch()
        out.append(s._epoch_order()[start : start + s.batch_size].tolist())
    return out


def test_batch_stream_is_deterministic():
    a, b, c = stream(), stream(), stream(seed=1)
    for _ in range(7):
        x, y = a.next_batch(), b.next_batch()
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.targets, y.targets)
    assert rows_of(stream(), 3) != rows_of(c, 3)


def test_batch_stream_cycles_epochs_and_drops_last_partial_batch():
    s = stream(n=10, batch_size=3)
    rows = rows_of(s, 7)
    epoch0 = sum(rows[:3], [])
    assert len(set(epoch0)) == 9  # three full batches of distinct rows, one row dropped
    assert s.epoch == 2 and s.position == 3
    assert sum(rows[3:6], []) != epoch0  # reshuffled with seed + epoch


def test_batch_stream_resume_continues_identically():
    original = stream()
    for _ in range(5):
        original.next_batch()
    resumed = stream()
    resumed.load_state_dict(json.loads(json.dumps(original.state_dict())))
    for _ in range(6):
        x, y = original.next_batch(), resumed.next_batch()
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.labels, y.labels)
    with pytest.raises(ValueError, match=r"checkpoint has batch_size=3 \(this run batch_size=2\)"):
        stream(batch_size=2).load_state_dict(original.state_dict())


def test_batch_stream_needs_one_full_batch():
    with pytest.raises(DataError, match=r"has 3 usable examples.*batch_size=4"):
        stream(n=3, batch_size=4)


# ---------------------------------------------------------------- loading records

ROWS = [{"id": str(i), "document": f"doc {i}", "summary": f"sum {i}"} for i in range(5)]


def test_load_records_from_saved_dataset_and_dataset_dict(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(tmp_path / "single")
    assert load_records(str(tmp_path / "single"))["document"] == [r["document"] for r in ROWS]
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list(ROWS),
        "validation": datasets.Dataset.from_list(ROWS[:2]),
    }).save_to_disk(tmp_path / "dict")
    assert load_records(str(tmp_path / "dict"), split="validation").num_rows == 2
    with pytest.raises(DataError, match=r"no split 'test'.*\['train', 'validation'\]"):
        load_records(str(tmp_path / "dict"), split="test")


def test_load_records_from_files(tmp_path):
    ds = datasets.Dataset.from_list(ROWS)
    ds.to_json(tmp_path / "a.jsonl")
    ds.to_parquet(tmp_path / "a.parquet")
    ds.to_csv(tmp_path / "a.csv", index=False)
    for name in ("a.jsonl", "a.parquet", "a.csv"):
        loaded = load_records(str(tmp_path / name))
        assert loaded["summary"] == [r["summary"] for r in ROWS], name
    (tmp_path / "parts").mkdir()
    ds.select(range(2)).to_json(tmp_path / "parts" / "0.jsonl")
    ds.select(range(2, 5)).to_json(tmp_path / "parts" / "1.jsonl")
    assert load_records(str(tmp_path / "parts" / "*.jsonl")).num_rows == 5
    assert load_records(str(SAMPLE_TRAIN)).num_rows == 300


def test_load_records_errors(tmp_path):
    (tmp_path / "x.txt").write_text("hello\n")
    (tmp_path / "cols.jsonl").write_text(json.dumps({"title": "t", "body": "b"}) + "\n")
    (tmp_path / "empty_dir").mkdir()
    cases = {
        str(tmp_path / "missing.jsonl"): "no such file or directory",
        str(tmp_path / "x.txt"): r"unknown file extension\(s\) \['.txt'\]",
        str(tmp_path / "*.nomatch"): "the glob matches no files",
        str(tmp_path / "empty_dir"): "not a save_to_disk output",
        str(tmp_path / "cols.jsonl"): r"columns \['body', 'title'\] match no known format",
        "surely_not_a_cached_dataset_name": "local cache \\(offline\\) failed",
    }
    env_before = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    offline_before = datasets.config.HF_HUB_OFFLINE
    for source, message in cases.items():
        with pytest.raises(DataError, match=message) as info:
            load_records(source)
        assert repr(source) in str(info.value)
    # Offline mode is forced only while a dataset name is being loaded.
    assert {k: os.environ.get(k) for k in env_before} == env_before
    assert datasets.config.HF_HUB_OFFLINE == offline_before


def test_data_files_not_utf8_or_malformed_name_the_file_and_line(tmp_path):
    """A byte that is not UTF-8 anywhere in a JSON Lines or CSV file (the JSON reader took it into
    the table, and reading the record later raised UnicodeDecodeError, mid-run), a CSV row with
    another number of fields (datasets said only "An error occurred while generating the
    dataset"), a truncated parquet file and a damaged save_to_disk directory: one DataError
    naming the file and, for text, the line."""
    rows = [json.dumps(r) for r in ROWS * 40]  # 200 records: the bad one far past the first checked
    data = ("\n".join(rows[:149]) + "\n").encode() + b'{"document": "caf\xe9", "summary": "s"}\n' + \
        ("\n".join(rows[150:]) + "\n").encode()
    (tmp_path / "latin.jsonl").write_bytes(data)
    at = data.index(b"\xe9")
    with pytest.raises(DataError, match=rf"^data file '{tmp_path / 'latin.jsonl'}' is not UTF-8 text: line 150 "
                                        rf"\(byte {at} of the file\) holds 0xe9, .*iconv -f cp1252 -t utf-8 "):
        load_records(str(tmp_path / "latin.jsonl"))
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "a.csv").write_bytes(b'document,summary\n"one","s"\n"caf\xe9","s"\n')
    with pytest.raises(DataError, match=rf"^data source '{tmp_path / 'parts'}/\*.csv': data file "
                                        r"'.*a.csv' is not UTF-8 text: line 3 "):
        load_records(str(tmp_path / "parts" / "*.csv"))
    (tmp_path / "fields.csv").write_text('document,summary\n"one","s"\n"two","s"\n"three","s","extra"\n')
    with pytest.raises(DataError, match=r"Expected 2 fields in line 4, saw 3"):
        load_records(str(tmp_path / "fields.csv"))
    (tmp_path / "doc.json").write_text('[\n  {"document": "a", "summary": "b"},\n'
                                       '  {"document": "c" "summary": "d"}\n]\n')
    with pytest.raises(DataError, match=r"doc.json' is not valid JSON at line 3, column 20: Expecting ','"):
        load_records(str(tmp_path / "doc.json"))
    datasets.Dataset.from_list(ROWS).to_parquet(tmp_path / "whole.parquet")
    whole = (tmp_path / "whole.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(DataError, match=r"cut.parquet' is not a readable parquet file \(ArrowInvalid: "):
        load_records(str(tmp_path / "cut.parquet"))
    datasets.Dataset.from_list(ROWS).save_to_disk(tmp_path / "saved")
    (tmp_path / "saved" / "state.json").write_text('{"_data_files": [')
    with pytest.raises(DataError, match=r"state.json' is not valid JSON at line 1, column 18"):
        load_records(str(tmp_path / "saved"))


# ---------------------------------------------------------------- sample data and tiny model


def test_sample_files_match_generator():
    for path, num, seed, prefix in [(SAMPLE_TRAIN, 300, 0, "train"),
                                    (SAMPLE_VALIDATION, 40, 1, "validation")]:
        records = [json.loads(line) for line in path.read_text().splitlines()]
        assert records == make_records(num, seed=seed, id_prefix=prefix)
        assert all(80 <= len(r["document"].split()) <= 200 for r in records)


def test_tiny_model_loads_and_is_idempotent(tiny_model, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert model.config.num_hidden_layers == 8 and model.config.vocab_size == 2048
    assert not model.config.tie_word_embeddings
    assert next(model.parameters()).dtype == torch.float32
    tok = tiny_tokenizer
    assert (tok.unk_token, tok.bos_token, tok.eos_token, tok.pad_token) == (
        "<unk>", "<s>", "</s>", "<pad>")
    assert model.config.bos_token_id == tok.bos_token_id
    assert model.config.pad_token_id == tok.pad_token_id
    assert len(tok) <= model.config.vocab_size
    mtime = (tiny_model / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tiny_model, data_files=[SAMPLE_TRAIN]) == tiny_model
    assert (tiny_model / "model.safetensors").stat().st_mtime_ns == mtime
    assert not [p for p in tiny_model.parent.iterdir() if p.name.startswith(".")]  # no temp dirs
    with pytest.raises(ValueError, match="built with"):
        ensure_tiny_model(tiny_model, data_files=[SAMPLE_TRAIN], num_layers=2)


def test_half_written_model_dir_is_rebuilt(tmp_path):
    from transformers import AutoModelForCausalLM

    path = tmp_path / "tiny"
    path.mkdir()
    (path / "config.json").write_text("{}")  # an interrupted build: no marker
    assert not is_complete_tiny_model(path)
    small = dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, vocab_size=300)
    ensure_tiny_model(path, data_files=[SAMPLE_VALIDATION], **small)
    assert is_complete_tiny_model(path)
    assert AutoModelForCausalLM.from_pretrained(path).config.hidden_size == 32
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"\['notes.txt'\]"):
        ensure_tiny_model(foreign, data_files=[SAMPLE_VALIDATION], **small)
    assert (foreign / "notes.txt").read_text() == "mine"


def test_synthetic_rows_are_the_drawn_tokens_held_in_four_bytes_a_token():
    """The rows are numpy's draw for the seed, every token trained, served as lists by index and
    slice; the array behind them is int32 (not two Python lists a row: 0.75 GiB at 64 x 256K)."""
    import numpy as np

    from data.synthetic import synthetic_examples

    examples = synthetic_examples(6, 40, 1000, seed=3)
    drawn = np.random.default_rng(3).integers(1, 1000, size=(6, 40)).tolist()
    assert [e.input_ids for e in examples] == drawn and [e.labels for e in examples] == drawn
    assert [e.input_ids for e in examples[2:5]] == drawn[2:5] and len(examples) == 6
    assert examples.rows.dtype == np.int32 and examples.rows.nbytes == 6 * 40 * 4
    batch = collate(examples[:2], pad_id=0, seq_length=40)
    assert batch.input_ids.tolist() == drawn[:2]
