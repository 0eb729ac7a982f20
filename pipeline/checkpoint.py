"""Writing results to disk so that nothing half-written is ever taken for a finished file.

Every output is written under a temporary name and renamed into place once complete; a
model directory is complete only once it has been renamed from ``<name>.partial``.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from pipeline.dist import DistEnv, barrier, gather_objects


def write_json_atomic(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def _replace_dir(tmp: Path, final: Path) -> None:
    """Swap ``tmp`` in as ``final``; an older ``final`` is removed only after the swap."""
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def _cpu_copy(store) -> dict[str, torch.Tensor]:
    """A stage's fp32 weights as separate CPU tensors: safetensors refuses tensors that share one
    storage (ours are views of a flat buffer), and resident masters live on the GPU."""
    return {k: v.to("cpu", copy=True) for k, v in store.master_state_dict().items()}


def _shard_name(stage: int, num_stages: int) -> str:
    return f"model-{stage + 1:05d}-of-{num_stages:05d}.safetensors"


def save_hf_model(out_dir: Path, stores: dict, source, env: DistEnv, num_stages: int) -> None:
    """A Hugging Face directory (config, one safetensors shard per stage, index, tokenizer) that
    ``AutoModelForCausalLM.from_pretrained`` loads. Each rank writes only its own stages."""
    from safetensors.torch import save_file

    tmp = out_dir.with_name(out_dir.name + ".partial")
    if env.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    mine = {}
    for s, store in stores.items():
        tensors = _cpu_copy(store)
        save_file(tensors, str(tmp / _shard_name(s, num_stages)), metadata={"format": "pt"})
        mine[s] = {k: v.numel() * v.element_size() for k, v in tensors.items()}
        del tensors
    everything = gather_objects(mine)
    if env.rank == 0:
        weight_map, total = {}, 0
        for per_rank in everything:
            for s, sizes in per_rank.items():
                for k, nbytes in sizes.items():
                    weight_map[k] = _shard_name(s, num_stages)
                    total += nbytes
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        config = source.config
        config.dtype = torch.float32  # the masters are saved in float32
        config.save_pretrained(tmp)
        if source.tokenizer_dir is not None:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(source.tokenizer_dir).save_pretrained(tmp)
        _replace_dir(tmp, out_dir)
    barrier()


def save_params(path: Path, stores: dict, env: DistEnv) -> None:
    """The whole fp32 state dict in one ``.pt`` file. Ranks write their stages to part files;
    rank 0 then merges them memory-mapped, so it never holds the whole model in RAM."""
    parts_dir = path.with_name(path.name + ".parts")
    if env.rank == 0:
        shutil.rmtree(parts_dir, ignore_errors=True)
        parts_dir.mkdir(parents=True)
    barrier()
    for s, store in stores.items():
        torch.save(_cpu_copy(store), parts_dir / f"stage{s:05d}.pt")
    barrier()
    if env.rank == 0:
        merged = {}
        for part in sorted(parts_dir.glob("stage*.pt")):
            merged.update(torch.load(part, mmap=True, weights_only=True))
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save(merged, tmp)
        os.replace(tmp, path)
        del merged
        shutil.rmtree(parts_dir, ignore_errors=True)
    barrier()
