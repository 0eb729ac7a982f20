"""Try a trained model: ``python3 generate.py --model outputs/run/model --prompt "..."``.

The prompt is built exactly as training built the records of its data format
(``encode_generation_prompt``): XSum's summarisation prompt, Alpaca's instruction prompt, the
tokenizer's chat template with its generation prompt, or plain text after ``bos``. The format is
the one the run trained on (read from the run's settings: a checkpoint's ``trainer_state.json``,
else the ``results.json`` beside the model directory) unless ``--format`` gives it. ``--adapter``
applies a LoRA run's peft adapter (``save_dir/adapter``) to the base model ``--model`` names
(default: the one the adapter records), after a check that it fits that base, loaded as the run
trained it: in 4 bits (transformers' ``BitsAndBytesConfig``) when the adapter records a 4-bit base
(``BASE_QUANTIZATION``, a ``load_in_4bit`` run's), and says which. A model name that is not a
directory (``generated``) and that check are the entry point's (``generate.py`` passes
``pipeline.plan.source.saved_model_dir`` and ``pipeline.spec.lora.adapter_fits``: this layer
knows no run's model names, nor the model families). Greedy by default, sampled with
``--do_sample``; on a GPU when there is one. Bad input is one ``error:`` line and exit status 2.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

from data.dataset import ALPACA, CHAT, FORMATS, TEXT, XSUM, DataError, detect_format
from inputs import InputError, NumberParser, read_json, read_json_lines, read_text


# (--model, the run's cache_dir or None) -> the directory to load; ValueError for a name it refuses
ModelDir = Callable[[str, "str | None"], Path]
# In an adapter directory beside peft's files: BitsAndBytesConfig's arguments for the 4-bit base
# the adapter was trained on (written by a load_in_4bit run, pipeline.run.checkpoint)
BASE_QUANTIZATION = "base_quantization.json"
# (--adapter, the base model's directory) -> what in the adapter does not fit that base (empty: it fits)
AdapterCheck = Callable[[Path, Path], "list[str]"]
# A checkpoint's settings (pipeline.plan.saved.TRAINER_STATE), and where a run's relative paths
# start when it ran through train.sh: the repository root.
TRAINER_STATE = "trainer_state.json"
REPO_ROOT = Path(__file__).resolve().parents[1]


class GenerateError(ValueError):
    """Bad input to generate.py: printed as one line, exit status 2."""


def run_config(trained: Path) -> dict[str, Any]:
    """The settings of the run that wrote ``trained``: a checkpoint (``save_dir/checkpoints/step_N``)
    or its adapter holds them in its ``trainer_state.json``, ``save_dir/model`` and
    ``save_dir/adapter`` in the ``results.json`` beside them; empty when there is none."""
    trained = Path(trained)
    for file in (trained / TRAINER_STATE, trained.parent / TRAINER_STATE, trained.parent / "results.json"):
        if not file.is_file():
            continue
        try:
            config = read_json(file, "run settings")["config"]
        except (InputError, KeyError, TypeError):
            continue
        if isinstance(config, dict):
            return config
    return {}


def training_format(model_dir: Path) -> str | None:
    """The data format the run that wrote ``model_dir`` (``save_dir/model``, a checkpoint or an
    adapter) trained on, from the ``dataset`` of that run's settings (a relative path as from the
    current directory, else from the repository root, where train.sh runs); None when it cannot be
    told (no settings, synthetic data, data no longer there)."""
    config = run_config(model_dir)
    dataset = config.get("dataset")
    if not dataset or dataset == "synthetic":
        return None
    from data import SAMPLE_TRAIN, load_records

    if dataset == "sample":
        dataset = str(SAMPLE_TRAIN)
    elif not Path(dataset).is_absolute() and not Path(dataset).exists() and (REPO_ROOT / dataset).exists():
        dataset = str(REPO_ROOT / dataset)
    try:
        return detect_format(load_records(dataset, config.get("dataset_split", "train")).column_names)
    except (DataError, OSError, ValueError):
        return None


def prompt_record(fmt: str, prompt: str, input: str = "", system: str = "") -> dict[str, Any]:
    """A record of ``fmt`` without its answer, from the command line's text: the document (XSum),
    the instruction and input (Alpaca), a user turn after an optional system turn (chat), or the
    text to continue."""
    if fmt == XSUM:
        return {"document": prompt}
    if fmt == ALPACA:
        return {"instruction": prompt, "input": input}
    if fmt == CHAT:
        return {"messages": ([{"role": "system", "content": system}] if system else [])
                + [{"role": "user", "content": prompt}]}
    return {TEXT: prompt}


def read_prompts(path: Path, fmt: str, system: str = "") -> list[dict[str, Any]]:
    """The records of a prompts file: ``.jsonl`` holds one record a line with the format's fields
    (``document``; ``instruction`` and ``input``; ``messages``; ``text``), any other file one
    prompt a line (blank lines skipped)."""
    try:
        if Path(path).suffix != ".jsonl":
            lines = [line for line in read_text(path, "--prompts file").splitlines() if line.strip()]
            return [prompt_record(fmt, line, system=system) for line in lines]
        records = read_json_lines(path, "--prompts file")
    except InputError as e:
        raise GenerateError(str(e)) from None
    need = {XSUM: "document", ALPACA: "instruction", CHAT: "messages", TEXT: TEXT}[fmt]
    for line, record in records:
        if need not in record:
            raise GenerateError(f"--prompts {str(path)!r} line {line} has no {need!r} field, which a {fmt} prompt "
                                "needs")
    return [record for _, record in records]


class _Parser(NumberParser):
    def error(self, message: str):  # one line, as every refusal here, not argparse's usage block
        raise GenerateError(f"{message}; --help lists the flags")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="generate.py", description="Continue prompts with a model MMoC-Pipe trained, "
                                "the prompt built as training built it.", allow_abbrev=False)
    p.add_argument("--model", default="", help="Hugging Face model directory (save_dir/model, or a checkpoint's "
                                               "save_dir/checkpoints/step_N: a LoRA run's is its adapter on the base "
                                               "it records), or 'generated' (the small model runs train by "
                                               "default); with --adapter, the base model (default: the one the "
                                               "adapter records).")
    p.add_argument("--adapter", default="", help="A LoRA run's peft adapter directory (save_dir/adapter), applied to "
                                                 "--model, the base model the run trained it on.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="The document (xsum), instruction (alpaca), user message (chat) or text.")
    src.add_argument("--prompts", type=Path, help="A file: one prompt a line, or .jsonl records with the format's "
                                                  "fields.")
    p.add_argument("--format", choices=("auto", *FORMATS), default="auto",
                   help="The data format the model trained on; auto: the run's, from its settings (a "
                        "checkpoint's trainer_state.json, else save_dir/results.json).")
    p.add_argument("--input", default="", help="Alpaca's input (context) for --prompt.")
    p.add_argument("--system", default="", help="A system message before the user's (chat).")
    p.add_argument("--max_new_tokens", type=int, default=60)
    p.add_argument("--do_sample", action="store_true", help="Sample instead of greedy decoding.")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top_p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="auto: bfloat16 on a GPU, float32 on the CPU.")
    return p


def _adapter_base(adapter: Path) -> str | None:
    """The base model a peft adapter records (``base_model_name_or_path``; None for none)."""
    try:
        base = read_json(adapter / "adapter_config.json", "adapter config").get("base_model_name_or_path")
    except (InputError, AttributeError):
        return None
    return base if isinstance(base, str) and base else None


def base_quantization(adapter: Path | None) -> dict | None:
    """The 4-bit base an adapter records (``BitsAndBytesConfig``'s arguments), None for a base
    in full precision (or no adapter)."""
    if adapter is None or not (adapter / BASE_QUANTIZATION).is_file():
        return None
    try:
        record = json.loads((adapter / BASE_QUANTIZATION).read_text())
    except (OSError, ValueError):
        record = None
    if not isinstance(record, dict) or not record.get("load_in_4bit"):
        raise GenerateError(f"--adapter {str(adapter)!r}: {BASE_QUANTIZATION} is not a 4-bit base's record "
                            "(a load_in_4bit run writes it)")
    return record


def _load_base(model_dir: Path, adapter: Path | None, device: str, dtype):
    """The base model as the adapter's run trained on it, with the line saying which (stderr:
    stdout holds only the continuations): in ``dtype`` on the CPU (the caller moves it), or in 4
    bits on ``device`` where the adapter records so."""
    from transformers import AutoModelForCausalLM

    record = base_quantization(adapter)
    if record is None:
        if adapter is not None:
            sys.stderr.write(f"base: {model_dir} in {str(dtype).removeprefix('torch.')} (the adapter's run trained on "
                             "a full-precision base)\n")
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise GenerateError(f"--adapter {str(adapter)!r} was trained on a 4-bit base ({BASE_QUANTIZATION}); loading "
                            "it so needs the bitsandbytes package: python3 -m pip install bitsandbytes==0.50.2")
    from transformers import BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=record.get("bnb_4bit_quant_type", "nf4"),
                               bnb_4bit_use_double_quant=bool(record.get("bnb_4bit_use_double_quant")),
                               bnb_4bit_compute_dtype=dtype)
    sys.stderr.write(f"base: {model_dir} in 4 bits ({quant.bnb_4bit_quant_type}"
                     f"{', double quantization' if quant.bnb_4bit_use_double_quant else ''}; compute "
                     f"{str(dtype).removeprefix('torch.')}), as the adapter's run trained on it\n")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, quantization_config=quant, device_map=device)
    # On a CPU with AVX512-BF16, bitsandbytes' eval mode repacks each weight for an inference
    # kernel that computes in bfloat16 and fails on widths it does not tile (688: "N must be
    # divisible by block_n"); its plain path dequantizes to the compute dtype, as training did
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    return model


def model_directory(args: argparse.Namespace, adapter: Path | None, model_dir: ModelDir) -> Path:
    """The Hugging Face directory to load: ``--model`` as ``model_dir`` resolves it, or with
    ``--adapter`` and no ``--model`` the base model the adapter records."""
    name = args.model or (_adapter_base(adapter) if adapter is not None else None)
    if not name:
        raise GenerateError("give --model (a run's save_dir/model), or --adapter with the base model it records" if
                            adapter is None else f"--adapter {str(adapter)!r} records no base model (its run trained "
                            "on a preset, whose random weights were never saved: give --model save_dir/model of a "
                            "--merge_lora run, without --adapter), or give --model, the base model it trained on")
    try:
        path = model_dir(name, (run_config(adapter).get("cache_dir") or None) if adapter is not None else None)
    except ValueError as e:
        raise GenerateError(f"--model {e}") from None
    if not (path / "config.json").is_file():
        given = f"--model {name!r}" if args.model else f"the base model {name!r} that --adapter records"
        raise GenerateError(f"{given} is not a Hugging Face model directory (no config.json in {path}); give "
                            "--model: a run's save_dir/model, or with --adapter its base model (a directory, or "
                            "'generated')")
    return path


def _checkpoint_adapter(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with a LoRA run's checkpoint given as ``--model`` read as what it holds: the
    adapter (``--adapter step_N/adapter``) of the base model the adapter records."""
    ckpt = Path(args.model) if args.model and not args.adapter else None
    if ckpt is not None and (ckpt / TRAINER_STATE).is_file() and (ckpt / "adapter" / "adapter_config.json").is_file():
        return argparse.Namespace(**{**vars(args), "model": "", "adapter": str(ckpt / "adapter")})
    return args


def _adapter(args: argparse.Namespace) -> Path | None:
    """``--adapter``, checked to be a peft adapter directory that peft is installed to apply."""
    adapter = Path(args.adapter) if args.adapter else None
    if adapter is None:
        return None
    if not (adapter / "adapter_config.json").is_file():
        raise GenerateError(f"--adapter {str(adapter)!r} is not a peft adapter directory (no adapter_config.json); "
                            "give save_dir/adapter of a LoRA run")
    if importlib.util.find_spec("peft") is None:
        raise GenerateError("--adapter needs the peft package, which is not installed: python3 -m pip install "
                            "'peft>=0.21,<0.22' (requirements.txt lists it)")
    return adapter


def generate(args: argparse.Namespace, model_dir: ModelDir | None = None,
             adapter_check: AdapterCheck | None = None) -> list[str]:
    """The continuation of every prompt ``args`` gives, in order; ``model_dir`` resolves
    ``--model`` (default: it names a directory), ``adapter_check`` says what in ``--adapter``
    does not fit the base model (default: nothing checked before peft loads it)."""
    bad = [f"--max_new_tokens ({args.max_new_tokens}) must be at least 1"] * (args.max_new_tokens < 1)
    bad += [f"--temperature ({args.temperature:g}) must be > 0"] * (args.temperature <= 0)
    bad += [f"--top_p ({args.top_p:g}) must be in (0, 1]"] * (not 0 < args.top_p <= 1)
    bad += [f"--seed ({args.seed}) must be >= 0"] * (args.seed < 0)
    if bad:
        raise GenerateError("; ".join(bad))
    args = _checkpoint_adapter(args)
    adapter = _adapter(args)
    model_dir = model_directory(args, adapter, model_dir or (lambda name, cache_dir: Path(name)))
    if adapter is not None and adapter_check is not None:
        try:
            problems = adapter_check(adapter, model_dir)
        except ValueError as e:  # its files cannot be read
            raise GenerateError(f"--adapter {str(adapter)!r}: {e}") from None
        if problems:
            raise GenerateError(f"--adapter {str(adapter)!r} does not fit the base model {str(model_dir)!r}: "
                                f"{'; '.join(problems)}; give --model, the base model its run trained on")
    trained = adapter or model_dir  # save_dir/model or save_dir/adapter: results.json is beside it
    fmt = args.format if args.format != "auto" else training_format(trained)
    if fmt is None:
        raise GenerateError(f"the data format {str(trained)!r} trained on is not known here (no results.json "
                            f"beside it naming data that is still there); give --format {'|'.join(FORMATS)}")
    records = read_prompts(args.prompts, fmt, args.system) if args.prompts is not None else \
        [prompt_record(fmt, args.prompt, args.input, args.system)]

    import torch
    from transformers import AutoTokenizer

    from data.tokenization import encode_generation_prompt

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise GenerateError("--device cuda was asked for but no CUDA GPU is visible; use --device auto or cpu")
    dtype = {"auto": torch.bfloat16 if device == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar for loading a few files: stderr noise beside the answer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if fmt == CHAT and not getattr(tokenizer, "chat_template", None):
        raise GenerateError(f"--format chat needs a tokenizer with a chat template; {str(model_dir)!r} has none")
    model = _load_base(model_dir, adapter, device, dtype)
    if adapter is not None:
        model = with_adapter(model, adapter, model_dir)
    if not getattr(model, "is_loaded_in_4bit", False):  # a 4-bit base is placed by its device_map
        model = model.to(device)
    model = model.eval()
    torch.manual_seed(args.seed)
    sampling = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p) if args.do_sample else \
        dict(do_sample=False)
    out = []
    for record in records:
        try:
            ids = torch.tensor([encode_generation_prompt(tokenizer, fmt, record)], device=device)
        except Exception as e:  # noqa: BLE001 - a chat template's own errors, a record's missing field
            raise GenerateError(f"cannot build the {fmt} prompt of {json.dumps(record)[:80]}: "
                                f"{(str(e).splitlines() or [type(e).__name__])[0]}") from None
        with torch.no_grad():
            tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                    pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                                    else tokenizer.eos_token_id, **sampling)
        out.append(tokenizer.decode(tokens[0, ids.shape[1]:], skip_special_tokens=True))
    return out


def with_adapter(model, adapter: Path, base: Path):
    """``model`` with the peft adapter in ``adapter`` applied; an adapter that does not fit the
    base (another model's) is one line."""
    from peft import PeftModel

    with warnings.catch_warnings():
        # peft reads transformers' deprecated is_gradient_checkpointing: a FutureWarning about
        # their code, not the user's input, printed on every load
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        try:
            return PeftModel.from_pretrained(model, adapter)
        except (RuntimeError, ValueError, KeyError) as e:
            detail = " ".join(line.strip() for line in str(e).splitlines()[:2])  # the first mismatch
            raise GenerateError(f"--adapter {str(adapter)!r} does not load onto the base model {str(base)!r} (is it "
                                f"the base its run trained on? it records {_adapter_base(adapter)!r}): "
                                f"{detail}") from None


def main(argv: list[str] | None = None, model_dir: ModelDir | None = None,
         adapter_check: AdapterCheck | None = None) -> int:
    """generate.py: ``model_dir`` resolves ``--model`` (default: it names a directory),
    ``adapter_check`` says what in ``--adapter`` does not fit the base model."""
    try:
        texts = generate(build_parser().parse_args(argv), model_dir, adapter_check)
    except GenerateError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- {i + 1}")
        print(text, flush=True)
    return 0


__all__ = ["AdapterCheck", "BASE_QUANTIZATION", "GenerateError", "ModelDir", "base_quantization", "build_parser",
           "generate", "main", "model_directory", "prompt_record", "read_prompts", "run_config", "training_format",
           "with_adapter"]
