"""A stage's weights: reading only its own tensors from a Hugging Face directory (stacked experts
from their per-expert weights where the family's checkpoints keep them so), and the names a
saved shard uses."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from models import spec_for
from pipeline.spec.weight_files import read_tensors, weight_files

if TYPE_CHECKING:
    from pipeline.stage.model import Stage


def load_weights_(stage: Stage, model_dir: Path, skip: frozenset[str] = frozenset()) -> None:
    """Read only this stage's tensors from the checkpoint (upcast to the stage's dtype); stacked
    experts from their per-expert weights where the checkpoint keeps them so (``ExpertLayout``).
    ``skip``: parameters left to another reader (a 4-bit base's linear weights, read layer by layer)."""
    wanted = {stage.source_name(k): p for k, p in stage.named_parameters() if k not in skip}
    read = read_weights(stage, model_dir, {k: p.shape for k, p in wanted.items()})
    with torch.no_grad():
        for k, t in read.items():
            wanted[k].copy_(t)


def read_weights(stage: Stage, model_dir: Path, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors of the parameters ``shapes`` names (and the shapes they must
    have), as stored; stacked experts assembled from their per-expert weights (``ExpertLayout``)."""
    files = weight_files(model_dir)
    sources = {k: _sources(stage, k, files) for k in shapes}
    missing = [k for k, src in sources.items() if src is None]
    if missing:
        raise KeyError(f"{model_dir}: checkpoint lacks {len(missing)} tensors of stage {stage.index}, e.g. {missing[0]}")
    by_file: dict[Path, list[str]] = {}
    for src in sources.values():
        for name in (n for per_expert in src for n in per_expert):
            by_file.setdefault(files[name], []).append(name)
    read: dict[str, torch.Tensor] = {}
    for path, keys in by_file.items():
        read.update(read_tensors(path, keys))
    out = {}
    for k, src in sources.items():
        parts = [torch.cat([read.pop(n) for n in per_expert]) if len(per_expert) > 1 else read.pop(per_expert[0])
                 for per_expert in src]
        t = parts[0] if src == [[k]] else torch.stack(parts)
        if t.shape != shapes[k]:
            raise ValueError(f"{model_dir}: {k} has shape {tuple(t.shape)}, model expects {tuple(shapes[k])}")
        out[k] = t
    return out


def _sources(stage: Stage, name: str, files: dict[str, Path]) -> list[list[str]] | None:
    """The checkpoint tensors parameter ``name`` is made of: itself, or (stacked experts) per
    expert the weights its slice concatenates; None when the checkpoint has neither."""
    if name in files:
        return [[name]]
    spec = spec_for(stage.config)
    if spec.experts is None or spec.moe is None:
        return None
    src = spec.experts.sources(name, spec.moe.experts(stage.config))
    return src if src is not None and all(n in files for per_expert in src for n in per_expert) else None


def checkpoint_tensors(config, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A stage's tensors under the names its family's checkpoints use (``ExpertLayout``)."""
    spec = spec_for(config)
    if spec.experts is None or spec.moe is None:
        return tensors
    return spec.experts.to_checkpoint(tensors, spec.moe.experts(config))


__all__ = ["checkpoint_tensors", "load_weights_", "read_weights"]
