"""Writing results to disk so that nothing half-written is ever taken for a finished file.

Every output is written under a temporary name and renamed into place once complete; a
model directory is complete only once it has been renamed from ``<name>.partial``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.config import RESUME_FREE, ConfigError
from pipeline.dist import DistEnv, barrier, broadcast_object, gather_objects
from pipeline.plan.saved import (CHECKPOINTS, FINISHED, MARKER, STATE_DIR, TRAINER_STATE, candidates, checkpoint_dir,
                                 find_latest, rank_file, read_trainer_state, resume_refusal, saved_at, stage_file)


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


def _fsync(path: Path) -> None:
    """Force a written file to disk: a marker must never reach the disk before the data it vouches
    for (a power loss could otherwise leave a "complete" checkpoint with empty files)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    """This process's umask, read without setting it (``os.umask`` sets it, for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _cpu_copy(store) -> dict[str, torch.Tensor]:
    """A stage's fp32 weights as separate CPU tensors: safetensors refuses tensors that share one
    storage (ours are views of a flat buffer), and resident masters live on the GPU."""
    return {k: v.to("cpu", copy=True) for k, v in store.master_state_dict().items()}


def _shard_name(stage: int, num_stages: int) -> str:
    return f"model-{stage + 1:05d}-of-{num_stages:05d}.safetensors"


def _write_hf_files(out_dir: Path, stores: dict, source, env: DistEnv, num_stages: int, tensors_of=None) -> None:
    """Every rank writes its stages' shards into the existing ``out_dir``; rank 0 then writes the
    index, config and tokenizer. Ends with a collective (the gather), no barrier."""
    from safetensors.torch import save_file

    from pipeline.stage.weights import checkpoint_tensors

    mine = {}
    for s, store in stores.items():
        tensors = checkpoint_tensors(source.config, tensors_of(s, store) if tensors_of else _cpu_copy(store))
        path = out_dir / _shard_name(s, num_stages)
        save_file(tensors, str(path), metadata={"format": "pt"})
        # safetensors writes a private (0600) file: the shard gets the mode of the run's other files
        os.chmod(path, 0o666 & ~_umask())
        _fsync(path)
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
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        config = source.config
        config.dtype = torch.float32  # the masters are saved in float32
        config.save_pretrained(out_dir)
        if source.tokenizer_dir is not None:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(source.tokenizer_dir).save_pretrained(out_dir)


def save_hf_model(out_dir: Path, stores: dict, source, env: DistEnv, num_stages: int, tensors=None) -> None:
    """A Hugging Face directory (config, one safetensors shard per stage, index, tokenizer) that
    ``AutoModelForCausalLM.from_pretrained`` loads. Each rank writes only its own stages.
    ``tensors(s, store)``: a stage's weights (default: its fp32 masters; LoRA's merged model)."""
    tmp = out_dir.with_name(out_dir.name + ".partial")
    if env.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    _write_hf_files(tmp, stores, source, env, num_stages, tensors)
    if env.rank == 0:
        _replace_dir(tmp, out_dir)
    barrier()


ADAPTER_DIR = "adapter"  # a LoRA checkpoint's (and save_dir's) adapter, in peft's format


def adapter_dir(path: Path | str) -> Path:
    return Path(path) / ADAPTER_DIR


def _part_name(stage: int) -> str:
    return f"stage{stage:05d}.safetensors"


def _write_adapter_parts(out_dir: Path, stores: dict) -> None:
    """Every rank: its stages' adapters (fp32 masters, peft's keys) as part files in ``out_dir``."""
    from safetensors.torch import save_file

    from pipeline.stage.lora import adapter_tensors

    for s, store in stores.items():
        path = out_dir / _part_name(s)
        save_file(adapter_tensors(store), str(path), metadata={"format": "pt"})
        _fsync(path)


def _merge_adapter_parts(out_dir: Path, settings, base_model: str | None, dtype: torch.dtype) -> None:
    """Rank 0, once every part is on disk: the parts into peft's one ``adapter_model.safetensors``
    (adapters are small: LoRA rank 16 of every linear layer of a 70B model is 0.8 GB in fp32) and
    its ``adapter_config.json``; for a 4-bit base (``settings.base``), ``BASE_QUANTIZATION``:
    ``BitsAndBytesConfig``'s arguments for the base it was trained on (compute ``dtype``)."""
    from safetensors.torch import load_file, save_file

    from data.generation import BASE_QUANTIZATION
    from pipeline.spec.lora import ADAPTER_WEIGHTS
    from pipeline.stage.lora import peft_config

    parts = sorted(out_dir.glob("stage*.safetensors"))
    merged = {}
    for part in parts:
        merged.update(load_file(str(part)))
    path = out_dir / ADAPTER_WEIGHTS
    save_file(dict(sorted(merged.items())), str(path), metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~_umask())
    _fsync(path)
    for part in parts:
        part.unlink()
    # The base as an absolute path: a relative one (.cache/tiny-llama) names nothing from another directory
    peft_config(settings, base_model and os.path.abspath(base_model)).save_pretrained(str(out_dir))
    if settings.base is not None:
        write_json_atomic(out_dir / BASE_QUANTIZATION, settings.base.record(str(dtype).removeprefix("torch.")))


def save_adapter(out_dir: Path, stores: dict, settings, base_model: str | None, env: DistEnv,
                 dtype: torch.dtype) -> None:
    """A peft adapter directory (``PeftModel.from_pretrained(base, out_dir)`` loads it), written
    as ``<out_dir>.partial`` and renamed once complete (``dtype``: the run's compute dtype). Collective."""
    tmp = out_dir.with_name(out_dir.name + ".partial")
    if env.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    _write_adapter_parts(tmp, stores)
    barrier()  # every part on disk before rank 0 reads them
    if env.rank == 0:
        _merge_adapter_parts(tmp, settings, base_model, dtype)
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


def mark_finished(save_dir: Path, step: int, env: DistEnv) -> None:
    """Rank 0, once a run's final outputs are written: ``save_dir/finished.json`` names the step
    they are at, so that resuming an older checkpoint into save_dir is refused before launch
    instead of training over them (``pipeline.plan.save_dir.check_save_dir``)."""
    if env.rank == 0:
        write_json_atomic(Path(save_dir) / FINISHED, {"step": step, "finished_at": time.time()})


def rng_state(device: torch.device) -> dict:
    """This process's RNG states, as plain types (``torch.load(weights_only=True)`` reads them)."""
    import random

    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    out = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "numpy": {"kind": kind, "keys": keys.tolist(), "pos": pos, "has_gauss": has_gauss, "gauss": gauss}}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_rng_state(state: dict, device: torch.device) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save_training_checkpoint(save_dir: Path, step: int, stores: dict, source, env: DistEnv, *, num_stages: int,
                             trainer_state: dict, device: torch.device, keep: int, rank_state: bool = True,
                             adapters=None, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``save_dir/checkpoints/step_{step}`` (see above); collective: every rank calls it.

    Every rank writes its own stages' shards and optimizer states and its RNG state; after a
    barrier rank 0 writes the trainer state and the COMPLETE marker last, renames the
    directory into place and only then deletes checkpoints beyond the newest ``keep``.
    ``rank_state=False``: this rank writes no RNG state (data parallelism: only replica 0's ranks
    write, and pass no ``stores`` in the other replicas, so those write nothing at all).
    ``adapters`` (LoRA's settings): the checkpoint holds the adapters in peft's format
    (``adapter/``) instead of the model's shards: the base weights never change (``dtype``: the
    compute dtype a 4-bit base's record names)."""
    final = checkpoint_dir(save_dir, step)
    tmp = final.with_name(final.name + ".partial")
    if env.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / STATE_DIR).mkdir(parents=True)
    barrier()
    if adapters is None:
        _write_hf_files(tmp, stores, source, env, num_stages)
    else:
        if env.rank == 0:
            adapter_dir(tmp).mkdir()
        barrier()
        _write_adapter_parts(adapter_dir(tmp), stores)
    for s, store in stores.items():
        path = tmp / stage_file(s)
        torch.save({"numel": store.numel, "optimizer": store.optimizer_state_dict()}, path)
        _fsync(path)
    if rank_state:
        path = tmp / rank_file(env.rank)
        torch.save(rng_state(device), path)
        _fsync(path)
    barrier()  # every rank's files are on disk before the marker vouches for them
    if env.rank == 0:
        if adapters is not None:
            _merge_adapter_parts(adapter_dir(tmp), adapters, source.weights_dir and str(source.weights_dir), dtype)
        write_json_atomic(tmp / TRAINER_STATE, {**trainer_state, "step": step})
        _fsync(tmp / TRAINER_STATE)
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        write_json_atomic(tmp / MARKER, {"step": step, "saved_at": time.time(), "files": files})
        _fsync(tmp / MARKER)
        _replace_dir(tmp, final)
        prune_checkpoints(Path(save_dir), keep)
    barrier()
    return final


def prune_checkpoints(save_dir: Path, keep: int) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep`` and leftovers of interrupted saves.
    Runs on rank 0 right after a save completed, so no ``.partial`` is still being written."""
    complete = [p for p in candidates(save_dir) if not p.name.endswith(".partial") and (p / MARKER).is_file()]
    complete.sort(key=saved_at, reverse=True)
    root = Path(save_dir) / CHECKPOINTS
    doomed = complete[keep:] + sorted(root.glob("step_*.partial")) + sorted(root.glob("step_*.old"))
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def load_stage_state(path: Path, store, stage: int) -> None:
    """Restore stage ``stage``'s AdamW state from the checkpoint into ``store``."""
    state = torch.load(Path(path) / stage_file(stage), map_location="cpu", weights_only=True)
    if state["numel"] != store.numel:
        raise ValueError(f"{path}: stage {stage} has {state['numel']} parameters in the checkpoint, "
                         f"{store.numel} in this run")
    store.load_optimizer_state_dict(state["optimizer"])


def load_rank_state(path: Path, rank: int) -> dict:
    return torch.load(Path(path) / rank_file(rank), map_location="cpu", weights_only=True)


# --- resume -----------------------------------------------------------------------------------
@dataclass
class ResumePoint:
    path: Path
    state: dict  # trainer_state.json

    @property
    def iteration(self) -> int:
        return int(self.state["iteration"])


def find_resume(resume: str, save_dir: str, env: DistEnv, log) -> ResumePoint | None:
    """The checkpoint ``resume`` names ('latest' or a path), found and validated by rank 0 and
    shared with every rank. 'latest' with no complete checkpoint means a fresh start."""
    if not resume:
        return None
    answer: tuple[str, object] = ("none", None)
    if env.rank == 0:
        if resume == "latest":
            path = find_latest(Path(save_dir), log.warn)
            if path is not None:
                answer = ("ok", (str(path), read_trainer_state(path)))
        else:  # checked before launch too (save_dir.check_resume); here: damaged since
            refusal = resume_refusal(resume, save_dir)
            answer = ("error", refusal) if refusal else ("ok", (resume, read_trainer_state(Path(resume))))
    kind, value = broadcast_object(answer)
    if kind == "error":
        raise ConfigError(value)
    if kind == "none":
        log.info(f"resume: no complete checkpoint in {Path(save_dir) / CHECKPOINTS}; starting from the beginning")
        return None
    path, state = value
    return ResumePoint(Path(path), state)


def check_resume_partition(point: ResumePoint | None, num_stages: int, parts: list[range], partition: str) -> None:
    """Raise ConfigError when ``point`` has this run's stage count and layers but other decoder
    layers per stage: its AdamW state is saved per stage, so it fits only the partition it was
    saved with. ``resolve`` adopts that partition unless counts were given; another stage count
    continues from the weights with a fresh AdamW state, as asked."""
    if point is None or point.state["num_stages"] != num_stages:
        return
    now = [[r.start, r.stop] for r in parts]
    # other layers in all (num_layers changed): a fresh AdamW state, as for another stage count
    if point.state["parts"] != now and point.state["parts"][-1][1] == now[-1][1]:
        counts = ",".join(str(b - a) for a, b in point.state["parts"])
        raise ConfigError(f"resume: {point.path} holds the decoder layers {point.state['parts']} per stage, this run "
                          f"(partition {partition}) {now}; its AdamW state is per stage: resume with partition: "
                          f"{counts} (or change num_stages for a fresh AdamW state)")


def stretched_schedule(then: dict, cfg, step: int) -> str | None:
    """The line that says a resume at ``step`` changes the learning rates of the steps after it:
    ``num_iterations`` differs from the run ``then`` (its settings) and the schedule decays over
    it. None when the rates are the ones that run would have used."""
    from pipeline.run.optim import lr_at

    before = then.get("num_iterations")
    if not isinstance(before, int) or before == cfg.num_iterations or cfg.lr_schedule == "constant" or step < 1:
        return None
    old = dataclasses.replace(cfg, num_iterations=before)
    was = f"step {step} ran at lr {lr_at(step - 1, old):.2e}"
    if step < before:
        was += f" and step {step + 1} would have run at {lr_at(step, old):.2e}"
    return (f"resume: num_iterations {cfg.num_iterations}, the checkpoint's run {before}: the {cfg.lr_schedule} "
            f"learning-rate schedule is stretched over {cfg.num_iterations} steps; {was}, now step {step + 1} runs "
            f"at {lr_at(step, cfg):.2e}")


class CheckpointManager:
    """One rank's training checkpoints: what exact continuation needs after a step (weights and
    AdamW state per stage, data position, loss scale, RNG states, the run's shape), saved with
    ``save_training_checkpoint`` and restored at start-up (``build_stage`` has read the weights).
    With data parallelism replica 0 writes; every replica restores."""

    def __init__(self, cfg, env: DistEnv, source, device: torch.device, log, layout, *, stores: dict, stream,
                 scaler, parts: list[range], mapping: list[int], adapters=None,
                 dtype: torch.dtype = torch.float32) -> None:
        """``adapters``: LoRA's settings (the checkpoints hold the adapters), None for full
        fine-tuning; ``dtype``: the compute dtype."""
        self.cfg, self.env, self.source, self.device, self.log, self.layout = cfg, env, source, device, log, layout
        self.stores, self.stream, self.scaler, self.parts, self.mapping = stores, stream, scaler, parts, mapping
        self.adapters, self.dtype = adapters, dtype

    @property
    def saved_stores(self) -> dict:
        """The stores whose weights and AdamW state are written: replica 0's (all replicas hold the same)."""
        return self.stores if self.layout.replica == 0 else {}

    def save(self, step: int) -> Path:
        """Collective; the stores' steps must be done (``Executor.finish``)."""
        from pipeline.run.optim import lr_at

        cfg = self.cfg
        t0 = time.perf_counter()
        trainer_state = {
            "iteration": step,
            # lr_at is a pure function of the iteration: the iteration is the scheduler's state.
            "lr_scheduler": {"schedule": cfg.lr_schedule, "iteration": step, "last_lr": lr_at(step - 1, cfg)},
            "data": self.stream.state_dict(),
            "num_stages": cfg.num_stages, "world_size": self.env.world_size, "mapping": list(self.mapping),
            "data_parallel": cfg.data_parallel,
            "parts": [[r.start, r.stop] for r in self.parts], "config": cfg.to_dict(),
            "loss_scaler": self.scaler.state_dict() if self.scaler else None,
        }
        for s in sorted(self.stores):
            self.stores[s].gather_optimizer_state()
        path = save_training_checkpoint(Path(cfg.save_dir), step, self.saved_stores, self.source, self.env,
                                        num_stages=cfg.num_stages, trainer_state=trainer_state, device=self.device,
                                        keep=cfg.keep_checkpoints, rank_state=self.layout.replica == 0,
                                        adapters=self.adapters, dtype=self.dtype)
        self.log.info(f"saved checkpoint {path} ({time.perf_counter() - t0:.1f}s)")
        return path

    def restore(self, point: ResumePoint) -> None:
        """Continue from ``point``: data position and iteration always; AdamW state when the stages
        are the same as the checkpoint's (it is saved per stage, so the process count may differ);
        RNG states when the processes are the same too. The weights were loaded by build_stage."""
        st, cfg, env = point.state, self.cfg, self.env
        if self.scaler is not None and st.get("loss_scaler"):
            self.scaler.load_state_dict(st["loss_scaler"])
        try:
            self.stream.load_state_dict(st["data"])
        except ValueError as e:
            raise ConfigError(f"resume from {point.path}: {e}") from None
        same_stages = st["num_stages"] == cfg.num_stages and st["parts"] == [[r.start, r.stop] for r in self.parts]
        if same_stages:
            for s, store in self.stores.items():
                load_stage_state(point.path, store, s)
            # replica 0's ranks saved theirs; every replica's pipeline rank p draws what its rank p drew
            then = st["world_size"] // st.get("data_parallel", 1)
            if then == self.layout.pipeline_size:
                set_rng_state(load_rank_state(point.path, self.layout.position), self.device)
            else:  # training draws no random numbers after the initialisation, so nothing is lost
                self.log.info(f"resume: {then} processes per pipeline then, {self.layout.pipeline_size} now: "
                              "AdamW state restored per stage, RNG states not restored")
        elif env.rank == 0:
            self.log.warn(f"resume: {point.path} has {st['num_stages']} stages (layers {st['parts']}), this run "
                          f"{cfg.num_stages}; continuing from its weights with a fresh AdamW state")
        now = cfg.to_dict()
        changed = [f"{k} {v!r} -> {now[k]!r}" for k, v in st["config"].items()
                   if k in now and k not in RESUME_FREE and now[k] != v]
        self.log.info(f"resumed from {point.path} at iteration {point.iteration}"
                      + (f"; changed since: {', '.join(changed)}" if changed else ""))
        stretched = stretched_schedule(st["config"], cfg, point.iteration)
        if stretched and env.rank == 0:
            self.log.warn(stretched)
