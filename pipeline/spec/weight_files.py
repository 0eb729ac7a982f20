"""The weight files of a Hugging Face directory: which file holds each tensor (safetensors or
``.bin``, sharded or single), reading some of them one at a time (``read_tensors``), and the check
that a tied head is stored as the embedding's copy. The checks before any process group open
them (``check_files``); the stages read their own tensors through ``read_tensors``
(``pipeline.stage.weights``); nothing else of the plan reads a tensor."""
from __future__ import annotations

from pathlib import Path

import torch

from inputs import read_json


# Weight files a Hugging Face directory may hold, in the order transformers prefers them.
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


_SINGLES = ("model.safetensors", "pytorch_model.bin")


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file holding it, from an index (safetensors or ``.bin``) or a single file.

    Raises:
        FileNotFoundError: the directory holds no weights this reads.
        ValueError: an index that cannot be read.
    """
    model_dir = Path(model_dir)
    for name in _INDEXES:
        index = model_dir / name
        if index.exists():
            weight_map = read_json(index, "weight index")  # InputError (a ValueError): not UTF-8, not JSON
            try:
                weight_map = weight_map["weight_map"]
            except (KeyError, TypeError) as e:
                raise ValueError(f"{index} is not a weight index ({type(e).__name__}: {e})") from None
            missing = sorted({v for v in weight_map.values() if not (model_dir / v).is_file()})
            if missing:
                raise FileNotFoundError(f"{index.name} names {len(missing)} missing file(s) in {model_dir}, "
                                        f"e.g. {missing[0]}")
            return {k: model_dir / v for k, v in weight_map.items()}
    for name in _SINGLES:
        single = model_dir / name
        if single.exists():
            return {k: single for k in _tensor_names(single)}
    raise FileNotFoundError(f"no weights in {model_dir}: expected model.safetensors, pytorch_model.bin or their "
                            f"sharded .index.json")


def check_weight_files(model_dir: Path) -> None:
    """Every weight file of ``model_dir`` opens: a safetensors header that covers the file, a
    ``.bin`` whose archive reads. Raises ValueError naming the first that does not (a truncated
    file is what an interrupted download leaves)."""
    files = weight_files(model_dir)  # a single file is opened there
    if any((Path(model_dir) / name).exists() for name in _INDEXES):
        for path in sorted(set(files.values())):
            _tensor_names(path)


def _tensor_names(path: Path) -> list[str]:
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                return list(f.keys())
        return list(_load_bin(path))
    except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError derives from Exception only
        raise _unreadable(path, e) from None


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape in the safetensors file ``path``, from its header (no tensor is read);
    ValueError naming the file where it cannot be read."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError derives from Exception only
        raise _unreadable(path, e) from None


def _unreadable(path: Path, e: Exception) -> ValueError:
    reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return ValueError(f"weight file {path} cannot be read ({reason}): truncated or corrupt, as an interrupted "
                      f"download leaves it; download it again")


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    # mmap: only the tensors a stage copies are read from disk; weights_only: a pickle runs no code.
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)


def check_tied_checkpoint(model_dir: Path) -> None:
    """Raise ValueError if ``model_dir``'s config ties the head to the embedding but its
    checkpoint stores an lm_head.weight that differs: transformers then loads the two apart
    (it ties only equal copies), which one shared matrix could not reproduce."""
    files = weight_files(model_dir)
    if "lm_head.weight" not in files:
        return
    names = ["model.embed_tokens.weight", "lm_head.weight"]
    tensors = {k: t for name in names for k, t in read_tensors(files[name], [name])}
    if not torch.equal(*(tensors[k] for k in names)):
        raise ValueError("config.json says tie_word_embeddings but the checkpoint's lm_head.weight differs from "
                         "model.embed_tokens.weight (transformers would train them apart); set "
                         "tie_word_embeddings to false in config.json to train them as two matrices")


def read_tensors(path: Path, keys: list[str]):
    """(name, tensor) for ``keys`` of one weight file, one tensor at a time."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            for k in keys:
                yield k, f.get_tensor(k)
    else:
        tensors = _load_bin(path)
        for k in keys:
            yield k, tensors[k]


__all__ = ["check_tied_checkpoint", "check_weight_files", "read_tensors", "tensor_shapes", "weight_files"]
