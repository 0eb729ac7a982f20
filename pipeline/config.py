"""The one typed configuration of a run: defaults here < ``fine_tune.yaml`` < command-line flags.

Every field is a YAML key and a flag of the same name (``--batch_size 8``). A boolean field
``use_x`` or ``x`` is set with ``--use_x`` / ``--x`` and cleared with ``--no_x``. The fields
fall into sections (``SECTIONS``: model, data, parallelism, offload, optimizer, lora, output,
launch), each a dataclass declared beside what it configures where the layers allow it
(``data/settings.py``, ``schedule/settings.py``, ``offload/settings.py``; the others here, their
owners sitting above the config). ``TrainConfig`` composes them: a YAML file may give its keys
flat or under their section (``optimizer: {lr: 1e-5}``), and the code reads them flat (``cfg.lr``).
The rules between fields are ``pipeline.plan.settings_rules``'s.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import sys
from dataclasses import dataclass
from typing import Any

from data.settings import DataSection
from inputs import InputError, NumberParser, join_negative_values, read_yaml
from inputs.settings import AT_LEAST_ONE, Check, above, at_least, fraction, setting
from offload.settings import OffloadSection
from schedule.settings import PARTITIONS, ParallelismSection

DTYPES = ("auto", "float32", "bfloat16", "float16")
LR_SCHEDULES = ("constant", "linear", "cosine")
ATTN_IMPLS = ("auto", "sdpa", "eager")
ATTN_BACKENDS = ("auto", "flash")  # pipeline.stage.attention.BACKENDS (not imported: config loads no torch)
REPORT_TO = ("tensorboard", "wandb", "none")  # report_to's names, one or several comma-separated
QUANT_TYPES = ("nf4", "fp4")  # bitsandbytes' 4-bit data types (load_in_4bit)


class ConfigError(ValueError):
    """Bad configuration: printed as one line by rank 0, exit code 2."""


# --- the sections whose owners sit above the config (the stages, the run, train.sh) -----------
@dataclass
class ModelSection:
    """The model and its tokenizer, and the attention kernels its layers run."""

    model: str = setting("generated", "Hugging Face model directory, or a preset with random weights (tiny, llama-3b, "
                         "llama-2-7b, llama-2-13b, llama-3-8b, llama-3-70b, qwen3-4b, qwen2.5-32b, qwen3-moe-small), "
                         "or 'generated' (small Llama made locally on first use).")
    tokenizer: str = setting("", "Tokenizer directory; default: the model's own (presets use the generated one).")
    num_layers: int = setting(0, "Keep only the first num_layers decoder layers (0 = all).", check=at_least(0))
    embedding_dim: int = setting(0, "Must equal the model's hidden_size if set (0 = read from the model).",
                                 check=at_least(0))
    ff_dim: int = setting(0, "Must equal the model's intermediate_size if set (0 = read from the model).",
                          check=at_least(0))
    num_heads: int = setting(0, "Must equal the model's num_attention_heads if set (0 = read from the model).",
                             check=at_least(0))
    attn_implementation: str = setting("auto", "Attention kernel: sdpa, eager, or auto (sdpa where it computes the "
                                       "family's attention; eager for soft-capped scores (Gemma 2) and attention "
                                       "sinks (gpt-oss)).", choices=ATTN_IMPLS)
    attention_backend: str = setting("auto", "Kernel of whole causal rows under sdpa on a GPU: auto (cuDNN where it "
                                     "takes the model's heads, the head size zero-padded to a multiple of 8: 1.4-1.7x "
                                     "flash-2 on Hopper; flash elsewhere) or flash (torch's own choice).",
                                     choices=ATTN_BACKENDS)
    cache_dir: str = setting(".cache", "Where the generated model and tokenizer are kept.")


@dataclass
class OptimizerSection:
    """The steps: how many, AdamW's and the learning rate's settings, the dtype and its loss scale."""

    num_iterations: int = setting(20, "Optimizer steps to run.", check=AT_LEAST_ONE)
    lr: float = setting(1e-4, "Peak learning rate (AdamW).", check=at_least(0))
    min_lr_ratio: float = setting(0.1, "Final learning rate as a fraction of lr (linear/cosine).",
                                  check=fraction(upper_open=False))
    lr_schedule: str = setting("cosine", "Decay after warm-up.", choices=LR_SCHEDULES)
    warmup_iterations: int = setting(0, "Linear warm-up steps.", check=at_least(0))
    weight_decay: float = setting(0.0, "AdamW weight decay (not applied to 1-D weights such as norms).",
                                  check=at_least(0))
    adam_beta1: float = setting(0.9, "AdamW beta1.", check=fraction(upper_open=True))
    adam_beta2: float = setting(0.95, "AdamW beta2.", check=fraction(upper_open=True))
    adam_eps: float = setting(1e-8, "AdamW epsilon.", check=at_least(0))
    grad_clip: float = setting(1.0, "Global gradient-norm clipping threshold (0 = off).", check=at_least(0))
    seed: int = setting(0, "Seed for data order and random initialisation.", check=at_least(0))
    dtype: str = setting("auto", "Compute dtype; auto = bfloat16 on GPU, float32 on CPU. Master weights are float32.",
                         choices=DTYPES)
    loss_scale: float = setting(65536.0, "float16 only: the initial loss scale (dynamic: halves on an overflow, "
                                "doubles after loss_scale_window finite steps).", check=above(0))
    loss_scale_window: int = setting(1000, "float16 only: finite steps before the loss scale doubles (0 = a fixed "
                                     "scale).", check=at_least(0, " (0 = a fixed scale)"))
    max_skipped_steps: int = setting(5, "A step whose loss or gradient is NaN/inf is skipped on every rank; stop with "
                                     "an error after more than this many in a row (0 = stop at the first; -1 = no "
                                     "check, non-finite steps are applied).", check=at_least(-1))


# Modules outside the decoder layers: frozen always (peft's all-linear leaves the head out too).
LORA_FROZEN = ("embed_tokens", "lm_head")
ALL_LINEAR = "all-linear"


@dataclass
class LoraSection:
    """Low-rank adapters instead of full fine-tuning, and QLoRA's 4-bit base (what a run makes of
    them: ``pipeline.spec.lora.LoraSettings``)."""

    lora_rank: int = setting(0, "LoRA: train low-rank adapters (peft's) of this rank instead of the whole model (0 = "
                             "full fine-tuning). The base weights are frozen: no gradient, master copy or AdamW "
                             "state, kept in the compute dtype (with use_offload in host memory, streamed to the GPU "
                             "like an offloaded stage); the adapters and their AdamW state stay on the GPU.",
                             check=at_least(0, " (0 = full fine-tuning)"))
    lora_alpha: float = setting(16.0, "LoRA scaling numerator: an adapter's update is multiplied by lora_alpha / "
                                "lora_rank.")
    lora_dropout: float = setting(0.0, "Dropout on an adapter's input (peft's lora_dropout), 0 <= p < 1. Not with "
                                  "activation_offload, whose recompute would draw another mask.")
    lora_target_modules: str = setting("all-linear", "The modules that get adapters, by peft's names, comma-separated "
                                       "(e.g. q_proj,k_proj,v_proj,o_proj), or all-linear (every linear layer of the "
                                       "decoder layers; not the head). Mixture-of-experts experts are not linear "
                                       "layers and get none.")
    lora_adapter: str = setting("", "A saved peft adapter directory (adapter_config.json, adapter_model.safetensors) "
                                "to continue training; its rank, alpha and target modules must be this run's.")
    merge_lora: bool = setting(False, "With lora_rank: also write the base model with the adapters merged into it to "
                               "save_dir/model (save_dir/adapter is written anyway). With load_in_4bit it needs "
                               "merge_lora_base: merging into the 4-bit weights would bake their rounding into the "
                               "model.")
    merge_lora_base: str = setting("", "With merge_lora and load_in_4bit: the full-precision Hugging Face directory "
                                   "of the base model (usually model itself) whose weights the adapters are merged "
                                   "into.")
    load_in_4bit: bool = setting(False, "QLoRA, with lora_rank: the decoder layers' linear weights are quantized once "
                                 "at load to 4 bits with bitsandbytes (as transformers' "
                                 "BitsAndBytesConfig(load_in_4bit=True) does, blocks of 64; the compute dtype is the "
                                 "run's): 0.5625 bytes a parameter with their scales instead of 2, in host memory "
                                 "with use_offload and streamed to the GPU. The embedding, norms and head stay in the "
                                 "compute dtype. Needs bitsandbytes (requirements.txt); the adapter records the "
                                 "quantization (adapter/base_quantization.json) and generate.py --adapter loads its "
                                 "base the same way.")
    bnb_4bit_quant_type: str = setting("nf4", "With load_in_4bit: the 4-bit data type (bitsandbytes'), nf4 (normal "
                                       "float, QLoRA's) or fp4.", choices=QUANT_TYPES)
    bnb_4bit_use_double_quant: bool = setting(False, "With load_in_4bit: quantize the per-block scales too (8 bits in "
                                              "blocks of 256, QLoRA's double quantization): 0.516 bytes a parameter "
                                              "instead of 0.5625.")


def lora_targets(cfg: LoraSection) -> list[str]:
    """The module names ``lora_target_modules`` lists, as given (all-linear not expanded)."""
    return [t.strip() for t in cfg.lora_target_modules.split(",") if t.strip()]


@dataclass
class OutputSection:
    """What a run writes to save_dir, how often, and where a resumed run continues from."""

    save_dir: str = setting("outputs/run", "Output directory: Hugging Face model at the end, metrics. A save_dir that "
                            "holds an earlier run is refused unless resume or overwrite is set; one that a live run "
                            "writes is refused whatever is set (rank 0 holds save_dir/.lock while it runs).")
    overwrite: bool = setting(False, "Start afresh in a save_dir that holds an earlier run, replacing its model, "
                              "metrics and results (its checkpoints stay until pruned by keep_checkpoints).")
    save_model: bool = setting(True, "Write the fine-tuned model in Hugging Face format to save_dir/model (with "
                               "lora_rank: the adapter in peft's format to save_dir/adapter).")
    save_params: bool = setting(False, "Also write the whole state dict to save_dir/params.pt.")
    save_results: str = setting("", "JSON file for per-iteration time, tokens/s, loss and peak memory of every rank "
                                "(empty = save_dir/results.json).")
    save_metrics: bool = setting(True, "Write save_dir/metrics.jsonl (a row per step and evaluation) and "
                                 "save_dir/metrics.png.")
    progress_bar: bool = setting(True, "tqdm progress bar on the rank that computes the loss (only when stdout is a "
                                 "terminal).")
    eval_every: int = setting(0, "Validation loss and perplexity every N steps and after the last (0 = off).",
                              check=at_least(0))
    timeline: bool = setting(False, "Record one iteration per rank; write save_dir/timeline.json (Chrome trace), "
                             "timeline.png (Gantt) and timeline_predicted.json (cost model).")
    timeline_iteration: int = setting(-1, "Iteration the timeline records (-1 = the last).")
    debug_schedule: bool = setting(False, "Print every rank's action list before training.")
    checkpoint_every: int = setting(0, "Save a training checkpoint (weights, AdamW state, data position) to "
                                    "save_dir/checkpoints/step_N every N steps and at the end (0 = only when stopped "
                                    "by SIGINT/SIGTERM).", check=at_least(0))
    keep_checkpoints: int = setting(3, "Keep the newest K complete checkpoints; older ones are deleted once a newer "
                                    "one is complete.", check=AT_LEAST_ONE)
    resume: str = setting("", "Continue a run: 'latest' (newest complete checkpoint in save_dir/checkpoints; none: "
                          "start fresh, unless save_dir holds a finished run, which is refused rather than trained "
                          "again) or a checkpoint directory; empty = start from the model. A checkpoint older than "
                          "the step a finished run in save_dir ended at is refused (it would train over that run).")
    report_to: str = setting("tensorboard", "Where the rows of metrics.jsonl also go, from the rank that writes it "
                             "(with save_metrics): tensorboard (event files in save_dir/tensorboard; `tensorboard "
                             "--logdir save_dir/tensorboard`), wandb (Weights & Biases, if installed; "
                             "WANDB_MODE=offline needs no network, WANDB_PROJECT names the project, default "
                             "mmoc-pipe), none, or several comma-separated (a YAML list too).", listed=REPORT_TO)

    @property
    def results_path(self) -> str:
        """Where the per-iteration results go: save_results, or save_dir/results.json."""
        return self.save_results or os.path.join(self.save_dir, "results.json")


@dataclass
class LaunchSection:
    """train.sh's: which processes run where, nothing about the training itself."""

    cuda_visible_devices: str = setting("", "GPUs to use (train.sh exports it); empty = all.")
    nproc: int = setting(0, "Processes train.sh starts (0 = one per visible GPU, or 2 without a GPU); train.sh's "
                         "--nproc, then NPROC, come before the YAML's.",
                         check=at_least(0, " (0 = one process per visible GPU, or 2 without one)"))
    master_port: int = setting(29500, "Rendezvous port train.sh gives torchrun; train.sh's --master_port, then "
                               "MASTER_PORT, come before the YAML's.",
                               check=Check(lambda v: 1 <= v <= 65535, "a TCP port, 1..65535"))


# The sections in the order --help and docs/config.md list them, each a YAML mapping of its keys.
SECTION_TYPES: dict[str, type] = {"model": ModelSection, "data": DataSection, "parallelism": ParallelismSection,
                                  "offload": OffloadSection, "optimizer": OptimizerSection, "lora": LoraSection,
                                  "output": OutputSection, "launch": LaunchSection}


# A dataclass takes the fields of its last base first: the bases are SECTION_TYPES backwards, so
# the fields (and to_dict) run in its order.
@dataclass
class TrainConfig(LaunchSection, OutputSection, LoraSection, OptimizerSection, OffloadSection,
                  ParallelismSection, DataSection, ModelSection):
    """Every setting of a run, read flat (``cfg.lr``); each section's class documents its fields."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


assert TrainConfig.__bases__ == tuple(reversed(SECTION_TYPES.values())), "TrainConfig's bases: SECTION_TYPES backwards"
SECTIONS: dict[str, tuple[str, ...]] = {section: tuple(f.name for f in dataclasses.fields(cls))
                                        for section, cls in SECTION_TYPES.items()}
# Keys a resumed run may change without it being reported as a change of the run: the launch
# section, and where, how long and how often it writes.
RESUME_FREE = frozenset(SECTIONS["launch"]) | {"resume", "num_iterations", "checkpoint_every", "keep_checkpoints",
                                                "save_dir", "save_model", "save_params", "save_results", "overwrite",
                                                "debug_schedule", "report_to"}


def _fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(TrainConfig)}


_SECTION_OF = {name: section for section, names in SECTIONS.items() for name in names}
# a name declared in two sections would be one field of TrainConfig, quietly
assert len(_SECTION_OF) == sum(map(len, SECTIONS.values())), "every TrainConfig field belongs to exactly one section"


def flatten_sections(values: dict[str, Any], source: str = "config") -> dict[str, Any]:
    """``values`` with each section given as a mapping (``optimizer: {lr: 1e-5}``) replaced by its
    keys; flat keys pass through. A section's key must belong to it and be given once."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if key in SECTIONS and isinstance(value, dict):
            items = value.items()
            for name, _ in items:
                if _SECTION_OF.get(name, key) != key:
                    raise ConfigError(f"{source}: key {name!r} is in section {_SECTION_OF[name]!r}, not {key!r}")
        else:
            items = [(key, value)]
        for name, v in items:
            if name in flat:
                raise ConfigError(f"{source}: key {name!r} is given twice (flat and in its section)")
            flat[name] = v
    return flat


def nearest(name: str, known: list[str], n: int = 3) -> list[str]:
    """Up to ``n`` names of ``known`` that look like ``name``, the nearest first."""
    return difflib.get_close_matches(name, known, n=n)


def _negative_flag(name: str) -> str:
    return "no_" + name[len("use_"):] if name.startswith("use_") else "no_" + name


class _Parser(NumberParser):
    """argparse whose errors are one ConfigError line (its own usage message is every flag, 40
    lines) with the nearest flags named, and whose flags match only in full (a prefix such as
    ``--nproc`` must not quietly become another flag)."""

    def repeated(self, argv: list[str]) -> list[str]:
        """A note for each setting that ``argv`` gives more than once with other values (argparse
        keeps the last without a word)."""
        actions = {o: a for a in self._actions for o in a.option_strings}
        given: dict[str, list[str]] = {}
        argv = join_negative_values(argv, self.takes_value)
        for i, arg in enumerate(argv):
            flag, eq, value = arg.partition("=")
            action = actions.get(flag)
            if action is None or not flag.startswith("--"):
                continue
            if action.nargs is None and not eq:
                value = argv[i + 1] if i + 1 < len(argv) else ""
            given.setdefault(action.dest, []).append(f"{flag} {value}" if action.nargs is None else flag)
        notes = []
        for dest, shown in given.items():
            if len(set(shown)) > 1:
                times = "twice" if len(shown) == 2 else f"{len(shown)} times"
                notes.append(f"the command line sets {dest} {times} ({', then '.join(shown)}): the last, "
                             f"{shown[-1]}, is used")
        return notes

    def error(self, message: str):
        unknown = message.partition("unrecognized arguments: ")[2].split()
        flags = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        close = [c for u in unknown if u.startswith("--") for c in nearest(u.split("=")[0], flags)]
        hint = f" (did you mean {', '.join(dict.fromkeys(close))}?)" if close else ""
        # no program name: the same line reaches people who ran train.sh and main.py
        raise ConfigError(f"{message}{hint}; --help lists the flags")


class _Switch(argparse.Action):
    """A boolean's two flags: the first option string (``--x``) sets it, the second (``--no_x``) clears it."""

    def __init__(self, option_strings: list[str], dest: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kw)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, option_string == self.option_strings[0])


def build_parser(file_values: dict[str, Any] | None = None, file_name: str = "") -> _Parser:
    """The flags of every TrainConfig field, grouped by section. ``file_values`` (the YAML file
    ``file_name``'s keys) are shown beside the defaults they replace."""
    file_values = file_values or {}
    p = _Parser(usage="%(prog)s [--config FILE] [--check_only | --plan] [--KEY VALUE | --FLAG | --no_FLAG ...]",
                description="MMoC-Pipe: pipeline-parallel full fine-tuning with offload. Precedence: the defaults "
                            "shown below < the YAML file (--config; default: fine_tune.yaml in the working "
                            "directory, which train.sh reads: its values, where they differ, are shown as "
                            "'fine_tune.yaml: ...') < flags. A boolean --x is cleared with its --no_x.",
                epilog="train.sh also takes --nproc, --master_port and --cuda_visible_devices (or NPROC, MASTER_PORT "
                       "and CUDA_VISIBLE_DEVICES) and passes the other flags to main.py. Every key: docs/config.md.",
                argument_default=argparse.SUPPRESS, allow_abbrev=False)
    p.add_argument("--config", help="YAML file (default: fine_tune.yaml in the working directory, if present; "
                                    "'' for none).")
    p.add_argument("--check_only", dest="mode", action="store_const", const="check",
                   help="Check the configuration and exit (train.sh does this).")
    p.add_argument("--plan", "--dry_run", dest="mode", action="store_const", const="plan",
                   help="Print the memory each GPU and the host need, the action lists and whether the run fits; "
                        "load no weights, train nothing.")
    fields = _fields()
    for section, names in SECTIONS.items():
        group = p.add_argument_group(f"{section} (YAML keys, flat or under '{section}:')")
        for name in names:
            f = fields[name]
            given = f"; {file_name}: {file_values[name]!r}" \
                if name in file_values and file_values[name] != f.default else ""
            # argparse %-formats help strings ("%(default)s"): a literal % must be doubled.
            help_ = f"{f.metadata['help']} (default: {f.default!r}{given})".replace("%", "%%")
            if f.type in ("bool", bool):
                group.add_argument(f"--{name}", f"--{_negative_flag(name)}", dest=name, action=_Switch, help=help_)
            else:
                typ = {"int": int, "float": float, "str": str}[f.type]
                choices = f.metadata.get("choices")
                choices = choices and (*choices, *f.metadata.get("renamed", ()))
                group.add_argument(f"--{name}", dest=name, type=typ, choices=choices, help=help_)
    p.add_argument("--model_path", dest="model", type=str, help=argparse.SUPPRESS)  # an older name of --model, still accepted
    return p


def _coerce(name: str, value: Any, typ: str) -> Any:
    if typ == "str" and isinstance(value, bool):  # YAML's true/false (and on/off) for an auto/true/false key
        return str(value).lower()
    if typ == "bool":
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key {name!r} must be true or false, got {value!r}")
    if typ == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            # 1e3 or 1.0e+3 (YamlLoader reads both as 1000.0): a whole number written as a float
            whole = isinstance(value, float) and math.isfinite(value) and value.is_integer()
            hint = f" (write {int(value)})" if whole else ""
            raise ConfigError(f"config key {name!r} must be an integer, got {value!r}{hint}")
        return value
    if typ == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key {name!r} must be a number, got {value!r}")
        if not math.isfinite(value):  # argparse's float() and YAML's .nan/.inf both make one
            raise ConfigError(f"config key {name!r} must be a finite number, got {value!r}")
        return float(value)
    return "" if value is None else str(value)


def load_yaml(path: str) -> dict[str, Any]:
    """The keys of the config file ``path`` (``inputs.read_yaml``: UTF-8, valid YAML, no key twice)."""
    try:
        data = read_yaml(path, "config file")
    except InputError as e:
        raise ConfigError(str(e)) from None
    if data is None:  # silently the built-in defaults, not the shipped fine_tune.yaml's: refused
        raise ConfigError(f"config file {path!r} is empty (no key: value); give its keys, or --config '' for the "
                          "built-in defaults")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must be a mapping of key: value, got {type(data).__name__}")
    return flatten_sections(data, f"config file {path!r}")


def make_config(yaml_values: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None,
                notes: list[str] | None = None) -> TrainConfig:
    """defaults < yaml_values < overrides; unknown keys and wrongly typed values are errors.
    ``notes`` gets a line for each value given under its older name."""
    fields = _fields()
    values: dict[str, Any] = {}
    for source in (flatten_sections(yaml_values or {}), overrides or {}):
        for key, value in source.items():
            if key not in fields:
                close = nearest(key, list(fields))
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise ConfigError(f"unknown config key {key!r}{hint}")
            if isinstance(value, (list, tuple)) and fields[key].metadata.get("listed"):
                value = ",".join(map(str, value))  # a YAML list of names
            values[key] = _coerce(key, value, fields[key].type)
    for name, value in values.items():
        new = fields[name].metadata.get("renamed", {}).get(value)
        if new is not None:
            values[name] = new
            if notes is not None:
                notes.append(f"{name} {value!r} is now called {new!r}")
    cfg = TrainConfig(**values)
    for name, f in fields.items():
        choices = f.metadata.get("choices")
        if choices and getattr(cfg, name) not in choices:
            raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {getattr(cfg, name)!r}")
    partition_counts(cfg.partition)
    report_targets(cfg.report_to)
    return cfg


def report_targets(report_to: str) -> tuple[str, ...]:
    """The names ``report_to`` lists (``()`` for none). Raises ConfigError for an unknown name."""
    names = tuple(dict.fromkeys(n.strip() for n in report_to.split(",") if n.strip()))
    bad = [n for n in names if n not in REPORT_TO]
    if bad or ("none" in names and len(names) > 1):
        raise ConfigError(f"report_to must be one of {', '.join(REPORT_TO)} or several of them comma-separated "
                          f"(none alone); got {report_to!r}")
    return tuple(n for n in names if n != "none")


def partition_counts(partition: str) -> list[int] | None:
    """The decoder layers per stage ``partition`` names explicitly ("3,5,4,4"); None for
    ``PARTITIONS`` (decided from the model). Raises ConfigError for anything else."""
    if partition in PARTITIONS:
        return None
    try:
        counts = [int(c) for c in partition.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 0:
        raise ConfigError(f"partition must be one of {', '.join(PARTITIONS)} or the decoder layers per stage, "
                          f"comma-separated (e.g. 3,5,4,4); got {partition!r}")
    return counts


# --- each field's own rule -------------------------------------------------------------------
# Declared with the field (``check=``); run by ``check_settings`` (``pipeline.plan.settings_rules``,
# with the rules between fields) and, for train.sh's launch keys, by ``launch_settings``.
def check_fields(values: dict[str, Any]) -> None:
    """Each field's own rule (its ``check=``) on ``values`` (name -> value). Fields that break
    the same rule are named together: "lr (-1.0) and grad_clip (-2.0) must be >= 0"."""
    fields = _fields()
    broken: dict[str, list[str]] = {}
    for name, value in values.items():
        check = fields[name].metadata["check"]
        if check is not None and not check.ok(value):
            broken.setdefault(check.must, []).append(f"{name} ({value})")
    for must, names in broken.items():
        named = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
        raise ConfigError(f"{named} must be {must}")


def config_file(given: str | None) -> str | None:
    """The YAML file a run reads: ``--config`` (empty: none), else fine_tune.yaml in the working directory."""
    if given is None and os.path.exists("fine_tune.yaml"):
        return "fine_tune.yaml"
    return given or None


def _file_values_for_help(argv: list[str]) -> tuple[dict[str, Any], str]:
    """The YAML file's keys, for ``--help`` to show beside the defaults (nothing if it cannot be read)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    path = config_file(pre.parse_known_args(argv)[0].config)
    try:
        return (load_yaml(path), path) if path else ({}, "")
    except ConfigError:
        return {}, ""


def parse_args(argv: list[str] | None = None,
               notes: list[str] | None = None) -> tuple[TrainConfig, str | None, str]:
    """Returns the resolved config, the YAML path it read (if any) and the mode: train, check or
    plan. ``notes`` gets a line for each choice made that the user may not expect (a setting given
    twice on the command line, a value under its older name), for the run to print once."""
    argv = sys.argv[1:] if argv is None else argv
    helped = any(a in ("-h", "--help") for a in argv)
    parser = build_parser(*_file_values_for_help(argv) if helped else ({}, ""))
    args = vars(parser.parse_args(argv))
    if notes is not None:
        notes += parser.repeated(argv)
    path = config_file(args.pop("config", None))
    mode = args.pop("mode", "train")
    yaml_values = load_yaml(path) if path else {}
    return make_config(yaml_values, args, notes), path, mode


# train.sh's launch keys and the environment variables that replace their YAML values.
LAUNCH_ENV = {"cuda_visible_devices": "CUDA_VISIBLE_DEVICES", "nproc": "NPROC", "master_port": "MASTER_PORT"}


def launch_settings(argv: list[str], environ: dict[str, str]) -> dict[str, Any]:
    """train.sh's launch keys: a flag, else the environment variable (``LAUNCH_ENV``), else the
    YAML file, else the default. Every flag of ``argv`` is checked (a bad one is one line here,
    before anything starts). ``cuda_visible_devices`` is None where the environment already has
    its say (the variable is set, or nothing sets it)."""
    args = vars(build_parser().parse_args(argv))
    path = config_file(args.get("config"))
    file_values = load_yaml(path) if path else {}
    fields, out = _fields(), {}
    for key, var in LAUNCH_ENV.items():
        if key in args:
            value = args[key]
        elif var in environ and (environ[var] or key == "cuda_visible_devices"):
            value = environ[var]
            if key != "cuda_visible_devices":
                if not value.strip().isdigit():
                    raise ConfigError(f"{var}={value!r} must be a whole number")
                value = int(value)
            else:
                value = None  # already in the environment
        elif key in file_values:
            value = _coerce(key, file_values[key], fields[key].type)
        else:
            value = fields[key].default
        out[key] = value
    if out["cuda_visible_devices"] == "" and "cuda_visible_devices" not in args:
        out["cuda_visible_devices"] = None  # YAML's empty string: all GPUs, as if unset
    check_fields({"nproc": out["nproc"], "master_port": out["master_port"]})
    return out
