"""A tiny, randomly initialised model of any registered family (Llama by default) with a BPE
tokenizer trained on local data.

Tests and smoke runs need a real Hugging Face model directory without hub access. The
model is built in a temporary sibling directory and renamed into place with a marker file
written last, so several ranks calling ``ensure_tiny_model`` at once, or a crash halfway,
never leave a directory that looks complete but is not.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator, Sequence

MARKER = "tiny_model_complete.json"
SPECIAL_TOKENS = {"unk": "<unk>", "bos": "<s>", "eos": "</s>", "pad": "<pad>"}
# Files save_pretrained may write; a directory holding only these (and no marker) is a
# leftover of an interrupted build and may be replaced.
_OWN_FILES = {
    MARKER, "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
}


def ensure_tiny_model(
    path: str | os.PathLike,
    *,
    data_files: Sequence[str | os.PathLike],
    hidden_size: int = 256,
    intermediate_size: int = 688,
    num_layers: int = 8,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    vocab_size: int = 2048,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    family: str = "llama",
) -> Path:
    """Return ``path``, first building a tiny Llama model + tokenizer there if needed.

    Args:
        path: the model directory (loadable with ``AutoModelForCausalLM.from_pretrained``
            and ``AutoTokenizer.from_pretrained``).
        data_files: ``.jsonl`` files whose ``document``/``summary`` (or ``text``) fields train
            the byte-level BPE tokenizer.
        num_kv_heads: key/value heads (grouped-query attention); None means ``num_heads``.
        seed: seed of the random weight initialisation.
        family: the model_type (``models.supported_types``); its spec's tiny settings apply.

    Raises:
        ValueError: ``path`` holds a complete tiny model built with other settings.
        FileExistsError: ``path`` exists and holds files that are not a tiny model's.
    """
    path = Path(path)
    settings = {
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_heads if num_kv_heads is None else num_kv_heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "seed": seed,
    }
    # Llama, the default, leaves the key out: _is_complete compares the marker whole, and a Llama
    # model on disk whose marker has no family key then still matches.
    if family != "llama":
        settings["family"] = family
    if _is_complete(path, settings):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _build(tmp, [Path(f) for f in data_files], settings)
        # The marker goes last: a directory without it is never taken as complete.
        (tmp / MARKER).write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
        _move_into_place(tmp, path, settings)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def is_complete_tiny_model(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a finished ``ensure_tiny_model`` output (its marker exists)."""
    return (Path(path) / MARKER).is_file()


def _is_complete(path: Path, settings: dict[str, int]) -> bool:
    if not is_complete_tiny_model(path):
        return False
    built = json.loads((path / MARKER).read_text())
    if built != settings:
        raise ValueError(
            f"{path} holds a tiny model built with {built}, but {settings} was asked for; "
            "use another path or delete it"
        )
    return True


def _move_into_place(tmp: Path, path: Path, settings: dict[str, int]) -> None:
    for _ in range(3):
        try:
            # Atomic on POSIX; fails if ``path`` exists and is not empty.
            os.rename(tmp, path)
            return
        except OSError:
            if _is_complete(path, settings):
                return  # another process won the race: use its model
            if not path.exists():
                continue
        leftovers = set(os.listdir(path))
        if not leftovers <= _OWN_FILES:
            raise FileExistsError(
                f"{path} exists without a tiny-model marker and holds other files "
                f"{sorted(leftovers - _OWN_FILES)[:5]}; use another path or delete it"
            )
        # A half-written directory from an older or crashed build: move it aside, then drop it.
        stale = path.parent / f".{path.name}.stale-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, stale)
        except OSError:
            pass  # someone else moved it already
        shutil.rmtree(stale, ignore_errors=True)
    if not _is_complete(path, settings):
        raise RuntimeError(f"could not move the tiny model from {tmp} into {path}")


def _build(out: Path, data_files: list[Path], settings: dict[str, int]) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from models import tiny_config

    tokenizer = _train_tokenizer(
        data_files, settings["vocab_size"], settings["max_position_embeddings"]
    )
    family = settings.get("family", "llama")
    config = tiny_config(
        family,
        # Llama: the plain Llama-2 layout this generator has always made (the quick start's losses)
        features=family != "llama",
        vocab_size=settings["vocab_size"],
        hidden_size=settings["hidden_size"],
        intermediate_size=settings["intermediate_size"],
        num_hidden_layers=settings["num_layers"],
        num_attention_heads=settings["num_heads"],
        num_key_value_heads=settings["num_kv_heads"],
        max_position_embeddings=settings["max_position_embeddings"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    if family == "llama":
        config.tie_word_embeddings = False
    torch.manual_seed(settings["seed"])
    model = AutoModelForCausalLM.from_config(config)
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _train_tokenizer(data_files: list[Path], vocab_size: int, model_max_length: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    missing = [str(f) for f in data_files if not f.is_file()]
    if not data_files or missing:
        raise FileNotFoundError(
            f"ensure_tiny_model needs existing .jsonl data_files to train its tokenizer; "
            f"given {[str(f) for f in data_files]}, missing {missing}"
        )
    backend = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk"]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_texts(data_files), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token=SPECIAL_TOKENS["unk"],
        bos_token=SPECIAL_TOKENS["bos"],
        eos_token=SPECIAL_TOKENS["eos"],
        pad_token=SPECIAL_TOKENS["pad"],
        model_max_length=model_max_length,
    )


def _texts(data_files: list[Path]) -> Iterator[str]:
    for f in data_files:
        with open(f, encoding="utf-8") as lines:
            for line in lines:
                if not line.strip():
                    continue
                record = json.loads(line)
                for field in ("document", "summary", "text"):
                    if isinstance(record.get(field), str):
                        yield record[field]
