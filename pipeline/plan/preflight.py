"""What a run settles before any process group exists, and the home of the rules on files and on
the machine: ``check_config`` (the settings, by ``settings_rules.check_settings``; a GPU asked
for is there; the small files settings name: topology, lora_adapter) and ``check_files`` (the
packages the settings need; the model's files, then the model read once and checked against the
settings by ``resolve_model`` with ``pipeline.plan.model_rules``; its weight files, a tied head
against the embedding (the only check that reads tensors); tokenizer, data and validation data,
that save_dir is its own, that the data gives one batch of training examples, the checkpoint a
resume names and that it continues under these settings and this model: the save_dir's and the
resume's rules are ``pipeline.plan.save_dir``'s). ``main.py`` runs them on every rank, and
``--check_only`` (``train.sh``) before any worker starts, so a bad setting or path is one line.
``start_notes`` are what rank 0 says once at start-up that the settings do not (a figure
matplotlib's absence leaves out, a slow thread count or dtype on the CPU).
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch

from inputs import InputError, first_bad_json, read_json
from models import supported_types, tied
from pipeline.config import ConfigError, TrainConfig, report_targets
from pipeline.plan.fit import device_type
from pipeline.plan.save_dir import check_resume, check_resume_model, check_save_dir
from pipeline.plan.settings_rules import check_settings
from pipeline.spec.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config
from pipeline.spec.settings import eval_source, lacks_validation_split
from pipeline.plan.source import (ModelSource, PRESETS, build_generated_model, generated_model_dir, model_dir,
                                  needs_generated, resolve_model, tokenizer_dir)


# --- the data ---------------------------------------------------------------------------------
def check_examples(records, tokenizer, seq_length: int, source: str, count: int = 64) -> list:
    """The first ``count`` records tokenize to examples with a trainable token at ``seq_length``:
    a chat template the records need, and a seq_length long enough for the prompts, are found
    here, before launch. A seq_length too short names the shortest that trains a record.
    Returns the examples of those records."""
    from transformers.utils import logging as hf_logging

    from data import DataError, tokenize_records

    first = records.select(range(min(count, len(records))))
    # The tokenizer's one warning of a record longer than the model's positions is the run's to give.
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        try:
            return tokenize_records(first, tokenizer, seq_length)[0]
        except DataError as e:
            error = e
        lo, hi = seq_length, 1 << 17  # lo fails; find the shortest that does not
        if not _trains(first, tokenizer, hi):
            raise error  # corrupt records, not their length
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if _trains(first, tokenizer, mid) else (mid, hi)
    finally:
        hf_logging.set_verbosity(level)
    raise DataError(f"seq_length ({seq_length}) leaves no trainable token in any of the first {len(first)} records "
                    f"of {source!r} (their prompts fill it); the shortest seq_length that trains one of them is {hi}")


def check_batches(records, cfg: TrainConfig, source: str, examples: list | None = None) -> None:
    """The training data gives one batch at least: ``batch_size`` records (each trains one row at
    most), and where ``examples`` are the examples of all of them (a small dataset, which
    ``check_examples`` tokenized whole), the batch the run's own stream would build (packing too)."""
    from data import BatchStream, DataError

    if len(records) < cfg.batch_size:
        raise DataError(f"data source {source!r} has {len(records)} records, fewer than one batch (batch_size "
                        f"{cfg.batch_size}); lower batch_size or add data")
    if examples is not None:  # BatchStream refuses what its first epoch cannot fill, as the run would
        BatchStream(examples, cfg.batch_size, pad_id=0, seq_length=cfg.seq_length, seed=cfg.seed,
                    packing=cfg.packing)


def _trains(records, tokenizer, seq_length: int) -> bool:
    from data import DataError, tokenize_records

    try:
        tokenize_records(records, tokenizer, seq_length)
        return True
    except DataError:
        return False


# --- settings, the machine, the files settings name -------------------------------------------
def check_config(cfg: TrainConfig, world_size: int, need_devices: bool = True) -> None:
    """What a run checks before it reads the model or the data, on every rank and under --plan:
    the settings (``check_settings``), the machine (``need_devices=False``, --plan, plans a GPU
    run on a machine without one), and the small files the settings name (topology, lora_adapter)."""
    check_settings(cfg, world_size)
    if need_devices and cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda was asked for but no CUDA GPU is visible "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); use device: auto or cpu")
    if cfg.topology:
        from pipeline.plan.topology import load_topology_file

        try:
            load_topology_file(cfg.topology)
        except (OSError, ValueError) as e:
            raise ConfigError(str(e)) from None
    check_adapter(cfg)


def check_adapter(cfg: TrainConfig) -> None:
    """``lora_adapter`` is a saved peft LoRA adapter (how it fits the run and the model is the
    model's rule, ``model_rules.adapters_fit``: every difference in one line)."""
    if not cfg.lora_rank or not cfg.lora_adapter:
        return
    d = Path(cfg.lora_adapter)
    missing = [f for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (d / f).is_file()]
    if missing:
        raise ConfigError(f"lora_adapter {cfg.lora_adapter!r} is not a peft adapter directory: {', '.join(missing)} "
                          "missing")
    try:
        adapter = adapter_config(d)
    except InputError as e:
        raise ConfigError(f"lora_adapter {cfg.lora_adapter!r}: {e}") from None
    if adapter.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"lora_adapter {cfg.lora_adapter!r} is a {adapter.get('peft_type')} adapter; only LORA "
                          "trains here")


# --- packages a setting needs ---------------------------------------------------------------
# The packages beyond torch and transformers that some settings need, as pip installs them
# (requirements-gpu.txt lists all but wandb).
PACKAGES = {"peft": "'peft>=0.21,<0.22'", "tensorboard": "tensorboard", "wandb": "wandb", "matplotlib": "matplotlib"}


def installed(package: str) -> bool:
    """``package`` can be imported: found, not imported (wandb imports in seconds)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a broken install, or a finder that refuses it
        return False


def needed_packages(cfg: TrainConfig) -> list[tuple[str, str]]:
    """(package, the setting that needs it) for every package the run cannot go without."""
    needs = [("peft", f"lora_rank {cfg.lora_rank}")] if cfg.lora_rank else []
    if cfg.save_metrics:
        needs += [(name, f"report_to {name}") for name in report_targets(cfg.report_to)]
    return needs


def check_packages(cfg: TrainConfig) -> None:
    """Every package a setting needs is installed: all that are not, in one line."""
    missing = [(package, why) for package, why in needed_packages(cfg) if not installed(package)]
    if not missing:
        return
    needs = " and ".join(f"{why} needs the {package} package" for package, why in missing)
    drop = f"; or drop it from report_to ({cfg.report_to!r}; none = metrics.jsonl only)" \
        if any(why.startswith("report_to") for _, why in missing) else ""
    raise ConfigError(f"{needs}, which {'is' if len(missing) == 1 else 'are'} not installed: python3 -m pip install "
                      f"{' '.join(PACKAGES[p] for p, _ in missing)} (requirements-gpu.txt lists all but wandb){drop}")


def start_notes(cfg: TrainConfig, world_size: int, environ=os.environ) -> list[str]:
    """What this run will do that its settings do not say, one line each, for rank 0 to print once
    at start-up: a figure it cannot draw, a thread count or a dtype that will be slow on the CPU, a
    warm-up longer than the run."""
    notes = []
    figures = {png: data for png, data, on in (("metrics.png", "metrics.jsonl", cfg.save_metrics),
                                                ("timeline.png", "timeline.json", cfg.timeline)) if on}
    if figures and not installed("matplotlib"):
        notes.append(f"matplotlib is not installed, so {' and '.join(figures)} will not be drawn; "
                     f"{' and '.join(figures.values())} {'hold' if len(figures) > 1 else 'holds'} what "
                     f"{'they' if len(figures) > 1 else 'it'} would show. python3 -m pip install matplotlib "
                     "(requirements.txt lists it)")
    on_cpu = device_type(cfg) == "cpu"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if on_cpu and "OMP_NUM_THREADS" not in environ and cores > 1:
        each = "the process runs" if world_size == 1 else f"each of the {world_size} processes runs"
        notes.append(f"OMP_NUM_THREADS is not set, so {each} every operation on all {cores} cores: where other "
                     "programs use them too, a step of the default model with --nproc 1 on two cores took 1.8x to "
                     "10x as long as with OMP_NUM_THREADS=1; set it, e.g. OMP_NUM_THREADS=1 bash train.sh ...")
    if cfg.warmup_iterations > cfg.num_iterations:
        notes.append(f"warmup_iterations ({cfg.warmup_iterations}) > num_iterations ({cfg.num_iterations}): the "
                     f"learning rate never reaches lr ({cfg.lr:g}); the last step runs at "
                     f"{cfg.lr * cfg.num_iterations / cfg.warmup_iterations:.2e}")
    if on_cpu and cfg.dtype == "float16":
        notes.append("dtype float16 on the CPU: most CPUs have no float16 arithmetic and convert every operation "
                     "(2.2x float32's step time for the default model on two cores; 15x measured elsewhere); dtype "
                     "float32 (auto) is faster there")
    return notes


def planned_processes(cfg: TrainConfig, launched: int) -> int:
    """The processes ``--plan`` plans for: torchrun's (``launched`` > 1), else ``nproc``, else
    this machine's as train.sh would start them (one per visible GPU, or 2 without one). A plan for
    another machine (``planned_for``'s GPUs, none here) has no such default: ConfigError asks for
    ``nproc``, the GPUs of that machine."""
    if launched > 1 or cfg.nproc:
        return launched if launched > 1 else cfg.nproc
    if device_type(cfg) == "cuda" and not torch.cuda.is_available():
        size = f"GPUs of {cfg.gpu_memory_gb:g} GiB (gpu_memory_gb)" if cfg.gpu_memory_gb else "GPUs"
        raise ConfigError(f"--plan for {size} on a machine without one plans another machine: give --nproc, the "
                          "number of its GPUs (one process each), e.g. --nproc 2")
    return torch.cuda.device_count() or 2


# --- the model --------------------------------------------------------------------------------
def check_model_files(cfg: TrainConfig) -> None:
    """The model's directory holds a config.json this transformers reads, and a tokenizer
    directory given holds a tokenizer; before ``resolve_model`` reads them."""
    path = model_dir(cfg)
    if path is not None and not (cfg.model == "generated" and not (path / "config.json").is_file()):
        _check_model_config(cfg.model, path)
    if cfg.tokenizer and tokenizer_dir(cfg) is None:
        raise ConfigError(f"tokenizer {cfg.tokenizer!r}: no tokenizer.json or tokenizer_config.json in "
                          f"{Path(cfg.tokenizer)}")


def _check_model_config(name: str, path: Path) -> None:
    if not path.exists():
        raise ConfigError(f"model {name!r}: {path} does not exist (give a Hugging Face model directory "
                          f"or a preset: {', '.join(PRESETS)}, generated)")
    if path.is_file():
        raise ConfigError(f"model {name!r}: {path} is a file; give the Hugging Face model directory that holds "
                          f"it (with its config.json), or a preset: {', '.join(PRESETS)}, generated")
    if not (path / "config.json").is_file():
        raise ConfigError(f"model {name!r}: no config.json in {path} (give a Hugging Face model "
                          f"directory or a preset: {', '.join(PRESETS)}, generated)")
    from transformers import AutoConfig

    try:
        read_json(path / "config.json", "model config")  # not UTF-8, not JSON: the line, before transformers
        AutoConfig.from_pretrained(path)
    except InputError as e:
        raise ConfigError(f"model {name!r}: {e}") from None
    except (ValueError, KeyError, OSError) as e:  # an unknown model_type, or a broken config.json
        model_type = _json_field(path / "config.json", "model_type")
        if model_type is not None:
            raise ConfigError(f"model {name!r} has model_type {model_type!r}, which this transformers cannot "
                              f"read; supported: {', '.join(supported_types())}") from None
        raise ConfigError(f"model {name!r}: cannot read {path / 'config.json'}: "
                          f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None


def _json_field(path: Path, key: str):
    try:
        value = json.loads(path.read_text())
        return value.get(key) if isinstance(value, dict) else None
    except (OSError, ValueError):
        return None


def read_model(cfg: TrainConfig, world_size: int | None = None) -> ModelSource:
    """The model's files checked, then the model read and checked against the settings
    (``resolve_model``): what --plan and ``check_files`` read, once a process."""
    check_model_files(cfg)
    return resolve_model(cfg, world_size)


def build_model(cfg: TrainConfig) -> None:
    """Build the generated model on first use; a failure is one line."""
    try:
        build_generated_model(cfg)
    except (OSError, ValueError, RuntimeError) as e:
        raise ConfigError(f"could not build the generated model in {generated_model_dir(cfg)}: {e}") from None


def check_model_weights(cfg: TrainConfig, source: ModelSource) -> None:
    """Every weight file the model's index names is there and whole, and a tied model's head is
    stored as the embedding's copy: the two tensors the checks read (``resolve_model``, the model's
    rules and --plan read none)."""
    if source.weights_dir is None:
        return
    from pipeline.spec.weight_files import check_tied_checkpoint, check_weight_files

    try:
        check_weight_files(source.weights_dir)
        if tied(source.config):
            check_tied_checkpoint(source.weights_dir)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"model {cfg.model!r}: {e}") from None


# Config keys a full-precision base for merge_lora must share with the model it trained on
MERGE_BASE_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "vocab_size")


def check_base_4bit(cfg: TrainConfig, source: ModelSource) -> None:
    """``load_in_4bit``: bitsandbytes is there and can compute on the run's device; a
    ``merge_lora_base`` is a full-precision Hugging Face directory of the model's shape (a
    preset's random base has none)."""
    if not (cfg.lora_rank and cfg.load_in_4bit):
        return
    from pipeline.stage.quantized import unavailable

    device = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
    why = unavailable(device)
    if why:
        raise ConfigError(why)
    if not cfg.merge_lora_base:
        return
    if source.weights_dir is None:
        raise ConfigError(f"merge_lora_base: model {cfg.model!r} is a preset, whose random weights were drawn at "
                          "start-up and are no directory's: there is no full-precision base to merge into; drop "
                          "merge_lora (save_dir/adapter is written)")
    path = Path(cfg.merge_lora_base)
    theirs = _json_field(path / "config.json", "model_type") and json.loads((path / "config.json").read_text())
    if not theirs:
        raise ConfigError(f"merge_lora_base {cfg.merge_lora_base!r} is not a Hugging Face model directory (no "
                          f"readable config.json in {path}); give the full-precision base the run trains on")
    mine = source.config.to_dict()
    keys = [k for k in MERGE_BASE_KEYS if k in mine and not (k == "num_hidden_layers" and cfg.num_layers)]
    differ = [f"{k} {theirs.get(k)!r} (the model's {mine.get(k)!r})" for k in keys if theirs.get(k) != mine.get(k)]
    if differ:
        raise ConfigError(f"merge_lora_base {cfg.merge_lora_base!r} is not the model's full-precision base: "
                          f"{', '.join(differ)}")
    from pipeline.spec.weight_files import check_weight_files

    try:
        check_weight_files(path)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"merge_lora_base {cfg.merge_lora_base!r}: {e}") from None


# --- data and tokenizer -----------------------------------------------------------------------
def check_eval_data(cfg: TrainConfig) -> None:
    """Validation taken from the training data needs a validation split there, and the validation
    data is readable, in a format, and one batch at least."""
    if not cfg.eval_every:
        return
    if lacks_validation_split(cfg):
        raise ConfigError(f"eval_every={cfg.eval_every} but dataset {cfg.dataset!r} has no validation split "
                          f"(it is a file or a single saved Dataset); set eval_dataset to the validation data")
    name, split = eval_source(cfg)
    if name == "synthetic":
        return
    from data import DataError, check_first_records, load_records

    records = load_records(name, split)
    check_first_records(records, name)
    if len(records) < cfg.batch_size:
        raise DataError(f"validation data {name!r} has {len(records)} records, fewer than one batch (batch_size "
                        f"{cfg.batch_size}); set eval_dataset to more data or lower batch_size")


def load_tokenizer(cfg: TrainConfig, source: ModelSource):
    """The run's tokenizer, whose tokens all have a row in the model's embedding."""
    if source.tokenizer_dir is None:
        raise ConfigError(f"model {cfg.model!r} has no tokenizer (no tokenizer.json or tokenizer_config.json "
                          f"in {cfg.tokenizer or cfg.model}); set tokenizer: <directory>")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source.tokenizer_dir)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a broken tokenizer
        from data.dataset import error_line

        why = first_bad_json(sorted(Path(source.tokenizer_dir).glob("*.json")), "tokenizer file") or error_line(e)
        raise ConfigError(f"tokenizer {str(source.tokenizer_dir)!r} cannot be loaded: {why}") from None
    if max(tokenizer.vocab_size, len(tokenizer)) > source.config.vocab_size:
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary is "
                          f"{source.config.vocab_size}")
    return tokenizer


def check_files(cfg: TrainConfig, rank0: bool = True, world_size: int | None = None) -> ModelSource | None:
    """Checks that read files (model, tokenizer, data, save_dir, the checkpoint a resume names): run
    before any process group exists (``main.py``, on every rank alike, and ``--check_only``), so a
    bad path is one line.
    Returns the model read (``resolve_model``), for the run to use, not read again.

    ``rank0``: this process also tests save_dir's lock (the other ranks would find their own
    run's), builds the generated model on first use (after every check its shape allows, so a
    refused run builds nothing) and checks the first records' examples with its tokenizer; the
    other ranks skip what needs the model until rank 0 has built it, and return None (``train``
    reads it once it is there). ``world_size``: the processes, for the model's rules on stages
    per process."""
    from data import SAMPLE_TRAIN, check_first_records, load_records

    check_packages(cfg)
    check_resume(cfg)
    pending = needs_generated(cfg) and not (generated_model_dir(cfg) / "config.json").is_file()
    source = read_model(cfg, world_size)  # a generated model not built yet: the shape it will have
    records = None
    if cfg.dataset != "synthetic":
        records = load_records(str(SAMPLE_TRAIN) if cfg.dataset == "sample" else cfg.dataset, cfg.dataset_split)
        check_first_records(records, cfg.dataset)
        check_batches(records, cfg, cfg.dataset)
    check_eval_data(cfg)
    check_save_dir(cfg, test_lock=rank0)
    if pending:
        if not rank0:
            return None
        build_model(cfg)
        source = read_model(cfg, world_size)
    check_model_weights(cfg, source)
    check_base_4bit(cfg, source)
    check_resume_model(cfg, source)
    evaluated = cfg.eval_every and eval_source(cfg)[0] != "synthetic"
    if records is not None or evaluated:
        tokenizer = load_tokenizer(cfg, source)
        if records is not None:
            count = 64
            examples = check_examples(records, tokenizer, cfg.seq_length, cfg.dataset, count)
            check_batches(records, cfg, cfg.dataset, examples if len(records) <= count else None)
    return source
