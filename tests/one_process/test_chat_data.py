"""L1 tests of chat and Alpaca records: format detection, the exact token/label layout of each
prompt rule (docs/data.md), truncation, skipped records and the one-line errors."""
from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from data import (
    IGNORE_INDEX,
    SAMPLE_VALIDATION,
    DataError,
    check_first_records,
    detect_format,
    format_alpaca_prompt,
    load_records,
    tokenize_records,
)
from data.tiny_model import _train_tokenizer
from tests.helpers.char_tokenizer import BOS, EOS, CharTokenizer, chars


# A small ChatML-like template: role tag, newline, content; an assistant turn ends with eos.
# Every newline is written as an expression (transformers renders with trim_blocks).
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Who won?"},
    {"role": "assistant", "content": "Swansea won."},
    {"role": "user", "content": "By how much?"},
    {"role": "assistant", "content": "Three goals to one."},
]


@pytest.fixture(scope="module")
def tok():
    """A byte-level BPE tokenizer trained on the sample data, with role tags as special tokens
    and TEMPLATE as its chat template (what a chat model's tokenizer directory provides)."""
    tokenizer = _train_tokenizer([Path(SAMPLE_VALIDATION)], 400, 256)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>"]})
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def layout(tok, example) -> str:
    """The example's text with the trained tokens in [brackets] (adjacent ones share a pair)."""
    out, inside = [], False
    for token, label in zip(example.input_ids, example.labels):
        trained = label != IGNORE_INDEX
        assert not trained or label == token
        if trained != inside:
            out.append("[" if trained else "]")
            inside = trained
        out.append(tok.decode([token]))
    return "".join(out) + ("]" if inside else "")


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------- chat


def test_chat_layout_is_pinned(tok):
    """The text fed to the tokenizer is the template's rendering of all messages, tokenized once
    without added special tokens; loss sits on each assistant turn's content and what the
    template closes it with (eos and the newline), nowhere else."""
    [example], skipped = tokenize_records([{"messages": CHAT}], tok, 256)
    assert skipped == 0
    assert layout(tok, example) == (
        "<s><|system|>\nBe brief.\n<|user|>\nWho won?\n<|assistant|>\n[Swansea won.</s>\n]"
        "<|user|>\nBy how much?\n<|assistant|>\n[Three goals to one.</s>\n]"
    )
    assert example.input_ids == ids(tok, tok.apply_chat_template(CHAT, tokenize=False))
    assert example.input_ids[0] == tok.bos_token_id


def test_chat_labels_equal_transformers_assistant_mask(tok):
    """Prefix rendering finds the same tokens as transformers' return_assistant_tokens_mask on
    the same template with {% generation %} around the assistant's part."""
    generation = TEMPLATE.replace(
        "{{ '<|' + m['role'] + '|>\\n' + m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
        "{{ '\\n' }}",
        "{{ '<|' + m['role'] + '|>\\n' }}{% if m['role'] == 'assistant' %}{% generation %}"
        "{{ m['content'] + eos_token + '\\n' }}{% endgeneration %}{% else %}{{ m['content'] + '\\n' }}{% endif %}",
    )
    assert generation != TEMPLATE
    out = tok.apply_chat_template(CHAT, chat_template=generation, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    [example], _ = tokenize_records([{"messages": CHAT}], tok, 256)
    assert example.input_ids == list(out["input_ids"])
    assert [label != IGNORE_INDEX for label in example.labels] == [bool(m) for m in out["assistant_masks"]]


def test_chat_truncates_from_the_end_and_skips_records_without_an_assistant_token(tok):
    [full], _ = tokenize_records([{"messages": CHAT}], tok, 256)
    second = full.labels.index(ids(tok, "Three")[0])  # first token of the second answer
    stats: dict[str, int] = {}
    cut = second + 2
    [example], skipped = tokenize_records([{"messages": CHAT}], tok, cut, stats=stats)
    assert example.input_ids == full.input_ids[:cut] and example.labels == full.labels[:cut]
    assert skipped == 0 and stats == {"truncated": 1, "summary_cut": 0, "unusable": 0}
    # A conversation whose first answer starts past seq_length has nothing to train: skipped;
    # alone, that is an error.
    first = next(i for i, label in enumerate(full.labels) if label != IGNORE_INDEX)
    long = [{"role": "user", "content": "Who won? " * 40}, {"role": "assistant", "content": "Y"}]
    examples, skipped = tokenize_records([{"messages": CHAT}, {"messages": long}], tok, first + 1)
    assert skipped == 1 and [e.input_ids for e in examples] == [full.input_ids[: first + 1]]
    with pytest.raises(DataError, match=r"no usable chat records: all 1 .* seq_length=" + str(first)):
        tokenize_records([{"messages": CHAT}], tok, first)


def test_chat_corrupt_records_are_skipped(tok):
    good = {"messages": CHAT[1:3]}
    rows = [
        good,
        {"messages": []},
        {"messages": "Who won?"},
        {"messages": [{"role": "user", "content": "hi"}]},  # no assistant turn
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},
        {"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]},
        {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]},
        {"messages": None},
        "not a mapping",
    ]
    examples, skipped = tokenize_records(rows, tok, 256)
    assert (len(examples), skipped) == (1, 8)


def test_chat_template_errors_skip_the_record_and_are_named(tok):
    """A template's raise_exception (here: roles must alternate) skips that record; if none is
    left the error quotes the template's message."""
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}"
    tok = _with_template(tok, strict + TEMPLATE)
    examples, skipped = tokenize_records([{"messages": CHAT}, {"messages": CHAT[1:3]}], tok, 256)
    assert (len(examples), skipped) == (1, 1)
    with pytest.raises(DataError, match=r"template failed on record 0: .*first message must be user"):
        tokenize_records([{"messages": CHAT}], tok, 256)


def test_tokenizer_without_chat_template_is_one_line_error(tok):
    with pytest.raises(DataError, match=r"need a tokenizer with a chat template .* chat_template\.jinja") as info:
        tokenize_records([{"messages": CHAT}], _with_template(tok, None), 256)
    assert "\n" not in str(info.value)


def test_template_that_renders_the_last_turn_differently(tok):
    """Qwen3's template puts an empty think block before the last assistant turn only: an earlier
    turn is found in the whole rendering by its content and end, and trained as rendered there."""
    think = TEMPLATE.replace(
        "{{ '<|' + m['role'] + '|>\\n' + m['content'] }}",
        "{{ '<|' + m['role'] + '|>\\n' }}{% if m['role'] == 'assistant' and loop.last %}{{ '<think></think>' }}"
        "{% endif %}{{ m['content'] }}",
    )
    assert think != TEMPLATE
    [example], _ = tokenize_records([{"messages": CHAT}], _with_template(tok, think), 256)
    assert layout(tok, example) == (
        "<s><|system|>\nBe brief.\n<|user|>\nWho won?\n<|assistant|>\n[Swansea won.</s>\n]"
        "<|user|>\nBy how much?\n<|assistant|>\n[<think></think>Three goals to one.</s>\n]"
    )


def test_template_that_rewrites_earlier_turns_is_refused(tok):
    """A template that closes the last assistant turn differently from earlier ones would put
    loss on wrong tokens: refused."""
    last_only = TEMPLATE.replace("{{ eos_token }}", "{% if loop.last %}{{ eos_token }}{% endif %}")
    with pytest.raises(DataError, match=r"chat record 0: .* message 2 differently .* rewrites earlier turns"):
        tokenize_records([{"messages": CHAT}], _with_template(tok, last_only), 256)


def _with_template(tok, template):
    import copy

    other = copy.deepcopy(tok)
    other.chat_template = template
    return other


def test_chat_records_load_from_files_and_saved_datasets(tmp_path, tok):
    """JSONL, JSON, parquet and save_to_disk all give the same examples; keys that only some
    messages have (here 'name') come back as None elsewhere and are dropped before rendering."""
    rows = [{"messages": CHAT}, {"messages": [{"role": "user", "content": "Hi", "name": "ann"},
                                              {"role": "assistant", "content": "Hello."}]}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "c.json").write_text(json.dumps(rows))
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(tmp_path / "c.parquet")
    ds.save_to_disk(tmp_path / "saved")
    expected, _ = tokenize_records(rows, tok, 256)
    for name in ("c.jsonl", "c.json", "c.parquet", "saved"):
        records = load_records(str(tmp_path / name))
        assert detect_format(records.column_names) == "chat", name
        assert records[0]["messages"][0].get("name") is None  # filled in by datasets
        check_first_records(records, name)
        examples, skipped = tokenize_records(records, tok, 256)
        assert skipped == 0 and examples == expected, name


# ---------------------------------------------------------------- alpaca


def test_alpaca_prompts_are_pinned():
    assert format_alpaca_prompt("Add the numbers.", "2 and 3") == (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:\n"
    )
    no_input = (
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n\n### Instruction:\nSay hi.\n\n### Response:\n"
    )
    assert format_alpaca_prompt("Say hi.") == format_alpaca_prompt("Say hi.", "  ") == no_input


def test_alpaca_trains_only_the_output():
    rows = [{"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
            {"instruction": "Say hi.", "output": "hi"},
            {"instruction": "Say hi.", "input": None, "output": "hi"},
            {"instruction": "Say hi.", "input": "", "output": "hi"}]
    examples, skipped = tokenize_records(rows, CharTokenizer(), 512)
    assert skipped == 0
    prompt = [BOS] + chars(format_alpaca_prompt("Add the numbers.", "2 and 3"))
    assert examples[0].input_ids == prompt + chars("5") + [EOS]
    assert examples[0].labels == [IGNORE_INDEX] * len(prompt) + chars("5") + [EOS]
    prompt = [BOS] + chars(format_alpaca_prompt("Say hi."))
    for example in examples[1:]:
        assert example.input_ids == prompt + chars("hi") + [EOS]
        assert example.labels == [IGNORE_INDEX] * len(prompt) + chars("hi") + [EOS]


def test_alpaca_truncates_the_end_and_skips_bad_records():
    prompt = [BOS] + chars(format_alpaca_prompt("Say hi."))
    stats: dict[str, int] = {}
    rows = [{"instruction": "Say hi.", "output": "hello"}]
    [example], _ = tokenize_records(rows, CharTokenizer(), len(prompt) + 2, stats=stats)
    assert example.input_ids == prompt + chars("he")
    assert example.labels == [IGNORE_INDEX] * len(prompt) + chars("he")
    assert stats["truncated"] == 1
    with pytest.raises(DataError, match="no usable alpaca records: all 1"):
        tokenize_records(rows, CharTokenizer(), len(prompt))
    bad = rows + [{"instruction": "x", "output": ""}, {"instruction": None, "output": "y"},
                  {"instruction": "x", "input": 3, "output": "y"}, {"output": "y"}]
    examples, skipped = tokenize_records(bad, CharTokenizer(), 512, fmt="alpaca")
    assert (len(examples), skipped) == (1, 4)


# ---------------------------------------------------------------- detection and checks


def test_detect_format_from_keys():
    assert detect_format(["messages"]) == "chat"
    assert detect_format(["messages", "text"]) == "chat"
    assert detect_format(["instruction", "input", "output"]) == "alpaca"
    assert detect_format(["instruction", "output", "text"]) == "alpaca"
    assert detect_format(["document", "summary", "messages"]) == "xsum"
    with pytest.raises(DataError) as info:
        detect_format(["prompt", "completion"])
    message = str(info.value)
    assert "\n" not in message and "['completion', 'prompt'] match no known format" in message
    for needed in ("'document' and 'summary'", "'messages'", "'instruction' and 'output'", "or 'text'"):
        assert needed in message


def test_check_first_records_chat_and_alpaca():
    bad_chat = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(DataError, match=r"'x': none of the first 1 records has messages as a list of"):
        check_first_records(bad_chat, "x")
    bad_alpaca = datasets.Dataset.from_list([{"instruction": "x", "output": ""}])
    with pytest.raises(DataError, match=r"none of the first 1 records has instruction and output"):
        check_first_records(bad_alpaca, "x")
    check_first_records(datasets.Dataset.from_list([{"instruction": "x", "output": "y"}]), "x")
