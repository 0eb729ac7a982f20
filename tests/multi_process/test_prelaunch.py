"""The pre-launch checks (``main.py --check_only``, which train.sh runs, and every rank of a direct
torchrun launch): each bad file, path or value is one ``error:`` line and exit 2, no traceback;
``--help`` works; weights as ``.bin``; XSum truncation keeps some document."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers.paths import ROOT, env_without_dist, scratch_save_dir
from tests.helpers.prelaunch import (chat_file, check_only, fake_checkpoint, one_error, refused_before_launch, train_sh,
                                     without_packages)
from tests.helpers.char_tokenizer import CharTokenizer


@pytest.mark.parametrize("cmd", [["python3", "main.py", "--help"], ["bash", "train.sh", "--help"]])
@pytest.mark.slow
def test_help(cmd):
    proc = subprocess.run(cmd, cwd=ROOT, env=env_without_dist(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--resident_stages" in proc.stdout and "90%" in proc.stdout and "--overwrite" in proc.stdout


@pytest.mark.slow
def test_yaml_syntax_error_through_train_sh(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("batch_size: 8\nlr: [1, 2\nseed: 3\n")
    proc = subprocess.run(["bash", "train.sh"], cwd=ROOT, env={**env_without_dist(), "CONFIG": str(bad)},
                          capture_output=True, text=True, timeout=60)
    one_error(proc, f"config file '{bad}' is not valid YAML at line 3, column 5")


def _model_copy(tiny_model_dir, tmp_path, drop=(), config=None):
    out = tmp_path / "model"
    shutil.copytree(tiny_model_dir, out)
    for name in drop:
        (out / name).unlink()
    if config is not None:
        c = json.loads((out / "config.json").read_text())
        c.update(config)
        (out / "config.json").write_text(json.dumps(c))
    return out


@pytest.mark.slow
def test_model_directory_errors(tiny_model_dir, tmp_path):
    one_error(check_only(["--model", str(tmp_path / "nope")]), f"{tmp_path / 'nope'} does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    one_error(check_only(["--model", str(empty)]), f"no config.json in {empty}")
    weights = [p.name for p in tiny_model_dir.iterdir() if p.name.startswith("model") and "safetensors" in p.name]
    no_weights = _model_copy(tiny_model_dir, tmp_path / "a", drop=weights)
    one_error(check_only(["--model", str(no_weights)]), f"no weights in {no_weights}")
    gpt2 = _model_copy(tiny_model_dir, tmp_path / "b", config={"model_type": "gpt2"})
    one_error(check_only(["--model", str(gpt2)]), "model_type 'gpt2'")
    alien = _model_copy(tiny_model_dir, tmp_path / "c", config={"model_type": "no_such_arch"})
    one_error(check_only(["--model", str(alien)]), "model_type 'no_such_arch'")


@pytest.mark.slow
def test_tokenizer_stages_dims_errors(tiny_model_dir, tmp_path):
    base = ["--model", str(tiny_model_dir)]
    one_error(check_only(base + ["--tokenizer", str(tmp_path)]), f"no tokenizer.json or tokenizer_config.json in {tmp_path}")
    one_error(check_only(base + ["--num_stages", "10"]), "num_stages (10) exceeds the model's decoder layers + 2")
    one_error(check_only(base + ["--ff_dim", "7"]), "ff_dim=7 contradicts the model's intermediate_size=128")
    one_error(check_only(base + ["--num_heads", "7"]), "num_heads=7 contradicts the model's num_attention_heads=4")


@pytest.mark.slow
def test_activation_offload_refusals(tiny_model_dir, tmp_path):
    """activation_offload recomputes each stage whole from its input: kept layers mean nothing
    there, and dropout would draw other masks in the recompute."""
    base = ["--model", str(tiny_model_dir), "--activation_offload"]
    one_error(check_only(base + ["--keep_layers", "1"]), "keep_layers (1) must be 0 or -1 with it")
    dropout = _model_copy(tiny_model_dir, tmp_path / "d", config={"attention_dropout": 0.1})
    one_error(check_only(["--model", str(dropout), "--activation_offload"]), "attention_dropout 0.1")
    assert check_only(base).returncode == 0


@pytest.mark.slow
def test_seq_length_beyond_positions(tiny_model_dir):
    base = ["--model", str(tiny_model_dir), "--seq_length", "512"]  # the model has 256 positions
    one_error(check_only(base), "seq_length (512) exceeds the model's max_position_embeddings (256)")
    assert check_only(base + ["--allow_long_sequences"]).returncode == 0


@pytest.mark.slow
def test_data_file_errors(tiny_model_dir, tmp_path):
    base = ["--model", str(tiny_model_dir)]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    one_error(check_only(base + ["--dataset", str(empty)]), f"{empty} is empty")
    bad = tmp_path / "bad.jsonl"
    good = json.dumps({"document": "a text", "summary": "short"})
    bad.write_text(f"{good}\n{good}\n{{\"document\": broken\n{good}\n")
    one_error(check_only(base + ["--dataset", str(bad)]), f"'{bad}' line 3 is not valid JSON")
    nulls = tmp_path / "nulls.jsonl"
    nulls.write_text(json.dumps({"document": None, "summary": None}) + "\n")
    one_error(check_only(base + ["--dataset", str(nulls)]), "none of the first 1 records has document and summary")


@pytest.mark.slow
def test_save_dir_with_an_earlier_run(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    base = ["--model", str(tiny_model_dir), "--save_dir", str(run)]
    one_error(check_only(base), f"save_dir '{run}' holds an earlier run (model, metrics.jsonl); it has no checkpoint "
                             "to continue from; write elsewhere with --save_dir (--overwrite would discard it)")
    assert check_only(base + ["--overwrite"]).returncode == 0
    # a finished run (its model is there) with no checkpoint: --resume latest would train it again
    one_error(check_only(base + ["--resume", "latest"]), f"save_dir '{run}' holds a finished run (model) with no "
                                                      "checkpoint to continue from")
    shutil.rmtree(run / "model")  # a run that died before its first checkpoint: the restart starts afresh
    assert check_only(base + ["--resume", "latest"]).returncode == 0
    blocked = tmp_path / "file"
    blocked.write_text("")
    one_error(check_only(["--model", str(tiny_model_dir), "--save_dir", str(blocked / "run")]), "is not writable")


@pytest.mark.slow
def test_resume_of_a_checkpoint_that_is_not_there(tiny_model_dir, tmp_path):
    """--resume with a typo of latest: one line before any worker starts, from train.sh and from a
    direct torchrun launch alike (every rank checks it before the process group exists), and
    nothing is made in save_dir. A directory that is no complete checkpoint says why."""
    from tests.helpers.runs import run_torchrun

    run = tmp_path / "run"
    base = ["--model", str(tiny_model_dir), "--num_stages", "2", "--device", "cpu", "--seq_length", "64",
            "--save_dir", str(run)]
    needle = (f"resume 'latset': no such checkpoint directory ({ROOT / 'latset'}); resume takes 'latest' or a "
              f"checkpoint directory such as {run / 'checkpoints' / 'step_00000010'}")
    proc, _ = train_sh(base + ["--resume", "latset"], {"NPROC": "2"})
    refused_before_launch(proc, needle)
    proc = run_torchrun(2, base + ["--resume", "latset"])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and errors == [f"error: {needle}"], proc.stderr[-3000:]
    assert "run: " not in proc.stdout  # refused before the start line
    assert not run.exists()
    (tmp_path / "half").mkdir()
    one_error(check_only(base + ["--resume", str(tmp_path / "half")]),
              f"resume '{tmp_path / 'half'}' is not a complete checkpoint: no COMPLETE marker")


@pytest.mark.slow
def test_torchrun_file_error_is_one_line_from_rank_0(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "main.py"),
           "--config", "", "--model", str(tiny_model_dir), "--num_stages", "2", "--device", "cpu",
           "--seq_length", "32", "--save_dir", str(run)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env_without_dist(), capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "holds an earlier run" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout and "Traceback" not in proc.stderr.split("error:")[0]


@pytest.mark.slow
def test_ctrl_c_during_start_up_is_one_line(tiny_model_dir):
    proc = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "--config", "", "--model", str(tiny_model_dir),
                             "--num_stages", "2", "--device", "cpu", "--save_dir", scratch_save_dir()],
                            cwd=ROOT, env=env_without_dist(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.5)  # importing torch and checking files
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()  # fail, and leave nothing running
        raise
    assert proc.returncode == 130, err[-2000:]
    assert [line for line in err.splitlines() if line.strip()] == [
        "error: interrupted by Ctrl-C (SIGINT) outside the training steps; no checkpoint was written by this stop"]


@pytest.mark.slow
def test_bin_weights_load_like_safetensors(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from pipeline.stage.model import build_stage
    from pipeline.spec.shapes import partition_layers
    from pipeline.stage.weights import weight_files
    from pipeline.plan.source import resolve_model
    from pipeline.config import make_config

    tensors = {}
    for f in sorted(tiny_model_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    single = _model_copy(tiny_model_dir, tmp_path / "single",
                         drop=[p.name for p in tiny_model_dir.glob("model*.safetensors*")])
    torch.save(tensors, single / "pytorch_model.bin")
    sharded = _model_copy(tiny_model_dir, tmp_path / "sharded",
                          drop=[p.name for p in tiny_model_dir.glob("model*.safetensors*")])
    names = sorted(tensors)
    halves = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for file, keys in halves.items():
        torch.save({k: tensors[k] for k in keys}, sharded / file)
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {k: file for file, keys in halves.items() for k in keys}}))
    assert set(weight_files(sharded)) == set(weight_files(single)) == set(tensors)
    for model in (tiny_model_dir, single, sharded):
        hf = resolve_model(make_config({"model": str(model), "num_stages": 2})).config
        parts = partition_layers(hf.num_hidden_layers, 2)
        for s in range(2):
            stage = build_stage(hf, s, 2, parts[s], model_dir=model, seed=0)
            for k, v in stage.state_dict().items():
                torch.testing.assert_close(v, tensors[k].float(), rtol=0, atol=0)
    assert check_only(["--model", str(sharded)]).returncode == 0


def _truncate(path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])  # what an interrupted download leaves


def test_truncated_weight_file_is_one_line(tiny_model_dir, tmp_path):
    """A truncated safetensors file, alone or one shard of several, is a ValueError naming it
    (check_files makes it one error: line), not safetensors' own traceback."""
    from safetensors.torch import load_file, save_file

    from pipeline.spec.weight_files import check_weight_files

    weights = [p.name for p in tiny_model_dir.glob("model*.safetensors*")]
    single = _model_copy(tiny_model_dir, tmp_path / "single", drop=weights)
    tensors = {k: v for f in sorted(tiny_model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
    save_file(tensors, single / "model.safetensors")
    _truncate(single / "model.safetensors")
    with pytest.raises(ValueError, match=rf"^weight file {single / 'model.safetensors'} cannot be read \(.*\): "
                                         "truncated or corrupt"):
        check_weight_files(single)
    sharded = _model_copy(tiny_model_dir, tmp_path / "sharded", drop=weights)
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, sharded / file)
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: file for file, keys in halves.items() for k in keys}}))
    check_weight_files(sharded)
    _truncate(sharded / "model-00002-of-00002.safetensors", keep=0.9)
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors cannot be read"):
        check_weight_files(sharded)


@pytest.mark.slow
def test_truncated_weight_file_refused_before_launch(tiny_model_dir, tmp_path):
    weights = [p.name for p in tiny_model_dir.glob("model*.safetensors*")]
    broken = _model_copy(tiny_model_dir, tmp_path / "broken")
    for name in weights:
        if name.endswith(".safetensors"):
            _truncate(broken / name)
    one_error(check_only(["--model", str(broken)]), f"weight file {broken}")


def test_long_summary_keeps_a_quarter_of_the_document():
    from data import IGNORE_INDEX, tokenize_records

    stats: dict[str, int] = {}
    records = [{"document": "d" * 500, "summary": "s" * 500}, {"document": "d" * 10, "summary": "s" * 5}]
    examples, skipped = tokenize_records(records, CharTokenizer(), 200, stats=stats)
    assert skipped == 0 and stats == {"truncated": 1, "summary_cut": 1, "unusable": 0}
    ids = examples[0].input_ids
    assert len(ids) == 200 and ids.count(ord("d")) == 200 // 4
    assert any(label != IGNORE_INDEX for label in examples[0].labels[1:])


def _few_records(path, n: int):
    path.write_text("".join(json.dumps({"document": f"article {i} about the harbour", "summary": "a summary"}) + "\n"
                            for i in range(n)))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("case", ["unknown flag", "prefix flag", "proc", "chat", "seq_length", "fresh clone",
                                  "empty yaml", "negative", "negative exponent", "few records", "resume batch_size"])
def test_refused_by_train_sh_before_any_worker(tiny_model_dir, tmp_path, case):
    """Each bad input of a run through train.sh: one error line, exit 2, before any worker
    starts (no start line, no launcher line), and, on a fresh clone, before the model is built."""
    base = ["--model", str(tiny_model_dir), "--num_stages", "2", "--save_dir", str(tmp_path / "run")]
    env = {**env_without_dist(), "NPROC": "2"}
    args, needle = {
        "unknown flag": (base + ["--nproc_per_node", "2"], "unrecognized arguments: --nproc_per_node 2 (did you mean "),
        "prefix flag": (base + ["--master", "29611"], "unrecognized arguments: --master 29611"),
        "proc": (base[:-1] + ["/proc/mmoc_run"], "save_dir '/proc/mmoc_run' is not writable"),
        "chat": (base + ["--dataset", str(chat_file(tmp_path / "chat.jsonl"))],
                 "'messages' (chat) records need a tokenizer with a chat template and this one has none"),
        "seq_length": (base + ["--seq_length", "24"], "leaves no trainable token in any of the first 64 records of "
                                                      "'sample' (their prompts fill it); the shortest seq_length"),
        "fresh clone": (["--num_stages", "40", "--cache_dir", str(tmp_path / "cache"), "--save_dir",
                         str(tmp_path / "run")], "num_stages (40) exceeds the model's decoder layers + 2 (8 + 2)"),
        "empty yaml": (base, "is empty (no key: value); give its keys, or --config '' for the built-in defaults"),
        "negative": (base + ["--weight_decay", "-0.5"], "weight_decay (-0.5) must be >= 0"),
        # argparse took -1e-4 for a flag: "--lr: expected one argument"
        "negative exponent": (base + ["--lr", "-1e-4"], "lr (-0.0001) must be >= 0"),
        # after launch, torchrun's failure lines around it
        "few records": (base + ["--dataset", str(_few_records(tmp_path / "five.jsonl", 5))],
                        f"data source '{tmp_path / 'five.jsonl'}' has 5 records, fewer than one batch (batch_size 8)"),
        "resume batch_size": (base + ["--resume", "latest", "--batch_size", "8"],
                              f"resume: {tmp_path / 'run' / 'checkpoints' / 'step_00000002'} was saved by a run with "
                              "batch_size=4 (this run batch_size=8); its data position and AdamW state hold only for "
                              "those: resume with --batch_size 4, or start afresh with --overwrite"),
    }[case]
    if case == "resume batch_size":
        fake_checkpoint(tmp_path / "run", 2, {"batch_size": 4, "seed": 0},
                        {"epoch": 0, "position": 8, "seed": 0, "batch_size": 4, "num_examples": 296})
    if case == "empty yaml":
        env["CONFIG"] = str(tmp_path / "empty.yaml")
        (tmp_path / "empty.yaml").write_text("# nothing\n")
    proc = subprocess.run(["bash", str(ROOT / "train.sh"), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)
    refused_before_launch(proc, needle)
    if case == "fresh clone":
        assert not (tmp_path / "cache").exists()  # refused from the shape alone: nothing was generated


@pytest.mark.slow
def test_without_matplotlib_the_model_is_saved_and_one_line_says_so(tiny_model_dir, tmp_path):
    """A machine without matplotlib (a GPU user's own environment): the run trains and saves its
    model, and one warning at start-up says metrics.png will not be drawn (the plot was drawn
    before the model was saved, and the ModuleNotFoundError left save_dir without one). A flag
    given twice is a warning too, once: from the run, not again from train.sh's check."""
    run = tmp_path / "run"
    proc, _ = train_sh(["--model", str(tiny_model_dir), "--num_stages", "2", "--num_iterations", "2", "--seq_length",
                        "64", "--save_dir", str(run), "--report_to", "none", "--lr", "1e-4", "--lr", "2e-4"],
                       {"NPROC": "2", **without_packages(tmp_path, "matplotlib")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "model" / "config.json").is_file() and (run / "finished.json").is_file()
    assert not (run / "metrics.png").exists() and "Traceback" not in proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "warning:" in line]
    assert warnings == [
        "warning: the command line sets lr twice (--lr 1e-4, then --lr 2e-4): the last, --lr 2e-4, is used",
        "warning: matplotlib is not installed, so metrics.png will not be drawn; metrics.jsonl holds what it would "
        "show. python3 -m pip install matplotlib (requirements.txt lists it)"], proc.stderr[-3000:]
    assert "step    2/2 " in proc.stdout and "lr 2.00e-04" in proc.stdout


@pytest.mark.slow
def test_packages_a_setting_needs_are_one_line_before_launch(tiny_model_dir, tmp_path):
    """lora_rank without peft failed after launch (51 lines); with report_to's tensorboard missing
    too, both are named in one line; a package every run needs is one line, not an import traceback."""
    env = without_packages(tmp_path, "peft", "tensorboard")
    one_error(check_only(["--model", str(tiny_model_dir), "--lora_rank", "8"], extra_env=env),
              "lora_rank 8 needs the peft package and report_to tensorboard needs the tensorboard package, which are "
              "not installed: python3 -m pip install 'peft>=0.21,<0.22' tensorboard")
    one_error(check_only(["--model", str(tiny_model_dir)], extra_env=without_packages(tmp_path, "datasets")),
              "MMoC-Pipe needs the datasets package, which is not installed: python3 -m pip install -r "
              "requirements-gpu.txt")


@pytest.mark.slow
def test_files_that_are_not_utf8_and_outputs_that_are_not_checkpoints(tiny_model_dir, tmp_path):
    """A Latin-1 byte in a dataset (a UnicodeDecodeError traceback, 32 lines) or in validation
    data; --resume of a finished model ("a checkpoint whose save did not finish")."""
    base = ["--model", str(tiny_model_dir)]
    good = _few_records(tmp_path / "good.jsonl", 20).read_bytes()
    (tmp_path / "latin.jsonl").write_bytes(good + b'{"document": "caf\xe9", "summary": "s"}\n')
    one_error(check_only(base + ["--dataset", str(tmp_path / "latin.jsonl")]),
              f"data file '{tmp_path / 'latin.jsonl'}' is not UTF-8 text: line 21 (byte {len(good) + 17} of the file) "
              "holds 0xe9")
    one_error(check_only(base + ["--eval_every", "2", "--eval_dataset", str(tmp_path / "latin.jsonl")]),
              "is not UTF-8 text: line 21")
    one_error(check_only(base + ["--eval_every", "2", "--eval_dataset", str(_few_records(tmp_path / "v.jsonl", 3))]),
              f"validation data '{tmp_path / 'v.jsonl'}' has 3 records, fewer than one batch (batch_size 8)")
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "model" / "config.json").write_text("{}")
    one_error(check_only(base + ["--save_dir", str(run), "--resume", str(run / "model")]),
              f"resume '{run / 'model'}' is a finished Hugging Face model, not a training checkpoint (no AdamW state "
              f"or data position): to train it further, start from it with --model {run / 'model'} and another "
              "--save_dir")


@pytest.mark.slow
def test_model_tokenizer_and_output_paths_are_one_line(tiny_model_dir, tmp_path):
    """A model path that is a weight file, a model config that is not UTF-8, a tokenizer file that
    is not JSON (which file, which line), a save_results directory that cannot be made (the run
    failed there after training), a resume from another model's checkpoint (its weights failed to
    load after launch)."""
    base = ["--model", str(tiny_model_dir)]
    weights = next(tiny_model_dir.glob("*.safetensors"))
    one_error(check_only(["--model", str(weights)]), f"model '{weights}': {weights} is a file; give the Hugging Face "
                                                     "model directory that holds it")
    latin = _model_copy(tiny_model_dir, tmp_path / "latin")
    text = (latin / "config.json").read_bytes()
    (latin / "config.json").write_bytes(text.replace(b'"llama"', b'"llama", "x": "\xe9"'))
    one_error(check_only(["--model", str(latin)]), f"model config '{latin / 'config.json'}' is not UTF-8 text: line ")
    tok = _model_copy(tiny_model_dir, tmp_path / "tok")
    (tok / "tokenizer_config.json").write_text('{"model_max_length": 256,\n "bos_token": }\n')
    one_error(check_only(base + ["--tokenizer", str(tok)]),
              f"tokenizer '{tok}' cannot be loaded: tokenizer file '{tok / 'tokenizer_config.json'}' is not valid JSON "
              "at line 2, column 15: Expecting value")
    one_error(check_only(base + ["--save_results", "/proc/mmoc/results.json"]),
              "save_results' directory '/proc/mmoc' is not writable")
    run = tmp_path / "run"
    ckpt = fake_checkpoint(run, 2, {"batch_size": 8, "seed": 0},
                           {"epoch": 0, "position": 16, "seed": 0, "batch_size": 8, "num_examples": 296})
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32, "vocab_size": 512}))
    one_error(check_only(base + ["--save_dir", str(run), "--resume", "latest"]),
              f"resume: {ckpt} holds the weights of another model than '{tiny_model_dir}' (hidden_size 32, this model "
              "64); give --model the model its run trained, or start afresh with --overwrite")


@pytest.mark.slow
def test_check_only_says_it_in_one_line(tiny_model_dir):
    """main.py --check_only (what train.sh runs first): exit 2, one error line, no traceback."""
    one_error(check_only(["--model", str(tiny_model_dir), "--seq_length", "32", "--seq_chunks", "40"]),
               "seq_chunks (40) must be between 1 (whole rows) and seq_length (32)")


@pytest.mark.slow
def test_report_to_wandb_without_wandb_is_one_line(tiny_model_dir):
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here: tests/one_process/test_metrics.py runs it offline")
    one_error(check_only(["--model", str(tiny_model_dir), "--report_to", "tensorboard,wandb"]),
              "report_to wandb needs the wandb package, which is not installed")
