"""generate.py: the prompt of each data format is the one training built (token for token, as the
part of a training example before its first trained token), and the command prints the model's
continuation of it (greedy: what the Hugging Face model itself generates from that prompt)."""
from __future__ import annotations

import json

import pytest
import torch

from data import IGNORE_INDEX, encode_generation_prompt, tokenize_records
from data.generation import GenerateError, main, prompt_record, training_format

# A ChatML-like template (as tests/one_process/test_chat_data.py's): role tag, newline, content.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
ARTICLE = "The council approved the new budget for the harbour on Tuesday after a long debate."


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>"]})
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.mark.parametrize("fmt,record,answer", [
    ("xsum", {"document": ARTICLE}, {"summary": "Budget approved."}),
    ("alpaca", {"instruction": "Summarise the text.", "input": ARTICLE}, {"output": "Budget approved."}),
    ("alpaca", {"instruction": "Name a harbour town.", "input": ""}, {"output": "Swansea."}),
    ("chat", {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who won?"}]},
     {"messages": [{"role": "assistant", "content": "Swansea won."}]}),
])
def test_prompt_is_the_training_prompt(tok, fmt, record, answer):
    """The training example of the whole record, up to its first trained token, is the prompt."""
    whole = {**record, **{k: (record[k] + v if isinstance(v, list) else v) for k, v in answer.items()}}
    [example], _ = tokenize_records([whole], tok, 512, fmt=fmt)
    first = next(i for i, label in enumerate(example.labels) if label != IGNORE_INDEX)
    assert encode_generation_prompt(tok, fmt, record) == example.input_ids[:first]


def test_text_prompt_is_the_start_of_training_text(tok):
    [example], _ = tokenize_records([{"text": ARTICLE}], tok, 512, fmt="text")
    assert encode_generation_prompt(tok, "text", {"text": ARTICLE}) == example.input_ids[:-1]  # all but eos


def test_prompt_records_from_the_command_line():
    assert prompt_record("xsum", "doc") == {"document": "doc"}
    assert prompt_record("alpaca", "do it", input="ctx") == {"instruction": "do it", "input": "ctx"}
    assert prompt_record("chat", "hi", system="be kind")["messages"] == [
        {"role": "system", "content": "be kind"}, {"role": "user", "content": "hi"}]
    assert prompt_record("text", "once") == {"text": "once"}


def test_generate_prints_the_models_continuation(tiny_model_dir, tmp_path, capsys):
    """As a user runs it on a run's save_dir/model: the format is the run's (results.json names
    the sample data: XSum), greedy, on the CPU; the text is what the Hugging Face model generates
    from the training prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path / "run"
    run.mkdir()
    (run / "model").symlink_to(tiny_model_dir)
    (run / "results.json").write_text(json.dumps({"config": {"dataset": "sample", "dataset_split": "train"}}))
    assert training_format(run / "model") == "xsum"
    assert main(["--model", str(run / "model"), "--prompt", ARTICLE, "--max_new_tokens", "8", "--device", "cpu"]) == 0
    printed, err = capsys.readouterr()
    assert err == "", err  # no loading bar beside the answer
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([encode_generation_prompt(tok, "xsum", {"document": ARTICLE})])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                         pad_token_id=tok.eos_token_id)
    expected = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert expected.strip() and printed == expected + "\n"


def test_generate_prompts_file_and_sampling(tiny_model_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"instruction": f"Say {w}.", "input": ""}) + "\n" for w in ("yes", "no")))
    argv = ["--model", str(tiny_model_dir), "--prompts", str(prompts), "--format", "alpaca", "--max_new_tokens", "4",
            "--do_sample", "--seed", "3"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert first.startswith("--- 1\n") and "\n--- 2\n" in first
    assert main(argv) == 0 and capsys.readouterr().out == first  # the seed makes sampling repeat


def test_generate_refusals_are_one_line(tiny_model_dir, tmp_path, capsys):
    assert main(["--model", str(tmp_path), "--prompt", "x"]) == 2
    assert main(["--model", str(tiny_model_dir), "--prompt", "x"]) == 2  # no results.json beside it: no format
    assert main(["--model", str(tiny_model_dir), "--prompt", "x", "--format", "chat", "--device", "cpu"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 3 and all(line.startswith("error: ") for line in lines), lines
    assert "no config.json" in lines[0] and "give --format" in lines[1] and "chat template" in lines[2]
    with pytest.raises(GenerateError, match="line 1 has no 'document' field"):
        from data.generation import read_prompts

        (tmp_path / "p.jsonl").write_text('{"text": "x"}\n')
        read_prompts(tmp_path / "p.jsonl", "xsum")
