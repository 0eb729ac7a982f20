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


def test_generate_takes_main_py_model_names(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """--model generated is the generated model a run trained from (in the run's cache_dir, or the
    default .cache from the current directory, else from the repository root where train.sh runs);
    with --adapter and no --model, the base the adapter records; no FutureWarning of peft's loading
    beside the answer; a preset (random weights, never saved) is one line."""
    import warnings

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pipeline.plan import source
    from pipeline.plan.source import GENERATED_MODEL, saved_model_dir

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)).save_pretrained(
            tmp_path / "run" / "adapter")
    adapter = str(tmp_path / "run" / "adapter")
    argv = ["--adapter", adapter, "--prompt", ARTICLE, "--format", "xsum", "--max_new_tokens", "6", "--device", "cpu"]
    assert main(["--model", str(tiny_model_dir), *argv]) == 0
    expected = capsys.readouterr().out
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / GENERATED_MODEL).symlink_to(tiny_model_dir)
    (tmp_path / "run" / "results.json").write_text(json.dumps({"config": {"cache_dir": str(tmp_path / "cache")}}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["--model", "generated", *argv], model_dir=saved_model_dir) == 0  # the run's cache_dir
    assert capsys.readouterr().out == expected and expected.strip()
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]
    # No run's cache_dir: .cache, not in the current directory but in the repository root's.
    (tmp_path / "run" / "results.json").unlink()
    monkeypatch.setattr(source, "REPO_ROOT", tmp_path / "repo")
    (tmp_path / "repo" / ".cache").mkdir(parents=True)
    (tmp_path / "repo" / ".cache" / GENERATED_MODEL).symlink_to(tiny_model_dir)
    monkeypatch.chdir(tmp_path / "run")
    assert saved_model_dir("generated") == tmp_path / "repo" / ".cache" / GENERATED_MODEL
    assert main(["--model", "generated", *argv], model_dir=saved_model_dir) == 0
    assert main(argv, model_dir=saved_model_dir) == 0  # the adapter's recorded base: str(tiny_model_dir)
    assert capsys.readouterr().out == expected * 2
    assert main(["--model", "tiny", *argv], model_dir=saved_model_dir) == 2
    assert main(["--model", "generated", "--prompt", "x", "--format", "xsum"]) == 2  # no resolver: a directory
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: --model 'tiny' is a preset whose random weights"), lines
    assert lines[1].startswith("error: --model 'generated' is not a Hugging Face model directory"), lines


def test_generate_takes_a_checkpoint_as_its_help_says(tiny_model_dir, tmp_path, capsys):
    """--model save_dir/checkpoints/step_N: the data format comes from the checkpoint's own
    settings (trainer_state.json; it failed with "the data format ... is not known"); a LoRA
    run's checkpoint is its adapter on the base it records."""
    import warnings

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    state = json.dumps({"iteration": 2, "config": {"dataset": "sample", "dataset_split": "train"}})
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    for f in tiny_model_dir.iterdir():
        (ckpt / f.name).symlink_to(f)
    (ckpt / "trainer_state.json").write_text(state)
    assert training_format(ckpt) == "xsum"
    argv = ["--prompt", ARTICLE, "--max_new_tokens", "5", "--device", "cpu"]
    assert main(["--model", str(ckpt), *argv]) == 0
    assert main(["--model", str(tiny_model_dir), "--format", "xsum", *argv]) == 0
    first, second = capsys.readouterr().out.split("\n")[:2]
    assert first == second and first.strip()
    lora = tmp_path / "lora" / "checkpoints" / "step_00000002"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adapter = LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)
        get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter).save_pretrained(lora / "adapter")
    (lora / "trainer_state.json").write_text(state)
    config = json.loads((lora / "adapter" / "adapter_config.json").read_text())
    (lora / "adapter" / "adapter_config.json").write_text(json.dumps({**config,
                                                                     "base_model_name_or_path": str(tiny_model_dir)}))
    assert main(["--model", str(lora), *argv]) == 0
    assert main(["--adapter", str(lora / "adapter"), *argv]) == 0
    first, second = capsys.readouterr().out.split("\n")[:2]
    assert first == second and first.strip()


def test_generate_refuses_an_adapter_of_another_model_before_loading(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """An adapter whose shapes are another model's: one line with every difference (peft's error
    was the first one alone); peft not installed; a negative temperature (transformers' own
    ValueError traceback)."""
    import importlib.util
    import warnings

    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.spec.lora import adapter_fits

    small = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        get_peft_model(small, LoraConfig(r=2, target_modules=["q_proj", "down_proj"])).save_pretrained(tmp_path / "a")
    argv = ["--model", str(tiny_model_dir), "--adapter", str(tmp_path / "a"), "--prompt", "x", "--format", "xsum"]
    assert main(argv, adapter_check=adapter_fits) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: --adapter '{tmp_path / 'a'}' does not fit the base model '{tiny_model_dir}': 8 of "
                           "its tensors have other shapes than this model's (e.g. model.layers.0.self_attn.q_proj."
                           "lora_A.weight (2, 32), this model (2, 64)); 16 of this model's adapter tensors are not in "
                           "it"), line
    assert main(["--model", str(tiny_model_dir), "--prompt", "x", "--format", "xsum", "--do_sample",
                 "--temperature", "-1e-2"]) == 2
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    assert main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["error: --temperature (-0.01) must be > 0",
                     "error: --adapter needs the peft package, which is not installed: python3 -m pip install "
                     "'peft>=0.21,<0.22' (requirements.txt lists it)"], lines
