"""One sweep's bookkeeping for the peer baselines (``fsdp2_baseline.py``, ``deepspeed_baseline.py``,
``roundpipe_baseline.py``) and ``peers.py``: pure Python, no torch, so every decision (does the next
point fit the budget, is a point clearly slower than the best so far, which point is a system's
best) is testable on a CPU machine.

A peer's result file is one JSON object::

    {"system": "deepspeed", "model": "llama-2-7b", "num_params": 6738415616, "num_gpus": 2,
     "tokens_per_step": 32768, "points": [POINT, ...], "best": {system: POINT}, ...}

and a POINT is ``{"system", "config", "status", "exact", "warmup_s", "step_times_s", "step_time_s",
"tokens_per_s", "tflops_per_gpu", "peak_allocated_gib", "peak_reserved_gib"}``; ``status`` is ``ok``,
``OOM``, ``pruned`` (its warm-up step was over ``prune_factor`` x the best step so far: not measured
further), ``not run (budget)`` or ``failed: <why>``. One file may hold several systems
(``roundpipe-async`` and ``roundpipe-sync`` share a build).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

# Parameter counts of the presets (LlamaForCausalLM, untied lm_head), the N of 6*N*tokens.
def model_params(name: str) -> int | None:
    """The active parameters of preset ``name`` (``pipeline.plan.source.PRESETS``; a routed layer's
    experts count top_k of them): the N of every row's model FLOP rate; None for another name."""
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    from pipeline.plan.source import PRESETS, preset_config
    from pipeline.spec.shapes import stage_num_params

    if name not in PRESETS:
        return None
    config = preset_config(name)
    return stage_num_params(config, range(config.num_hidden_layers), True, True, active=True)


def model_tflops_per_gpu(num_params: int, tokens_per_step: int, step_s: float, num_gpus: int,
                         frozen: bool = False) -> float:
    """Model FLOP rate per GPU: 6 * N * tokens / step time / GPUs (no recompute, no attention term),
    the one definition every row of the peers table uses; ``frozen`` (LoRA): 4 * N, as no frozen
    weight gets a gradient (the adapters' own products are under 1% of it)."""
    return (4 if frozen else 6) * num_params * tokens_per_step / step_s / num_gpus / 1e12


def fits(elapsed_s: float, budget_s: float | None, estimate_s: float) -> bool:
    """Whether a point estimated to take ``estimate_s`` still ends within the budget."""
    return budget_s is None or elapsed_s + estimate_s <= budget_s


def should_prune(warmup_s: float, best_step_s: float | None, factor: float) -> bool:
    """A point whose warm-up step is over ``factor`` x the best measured step of its system is not
    worth its measured steps (the warm-up step is an upper bound: it also pays allocator and
    compile warm-up). ``factor <= 0`` never prunes."""
    return factor > 0 and best_step_s is not None and warmup_s > factor * best_step_s


class Steps:
    """One point's step times: ``warmup`` warm-up steps, then the measured ones (and their losses).
    After the last warm-up step the point stops early when it is clearly slower than the best so
    far (``should_prune``) or its measured steps would not fit the budget at the warm-up's pace."""

    def __init__(self, warmup: int, iterations: int, best_s: float | None, prune_factor: float,
                 budget_s: float | None, started_at: float) -> None:
        self.warmup, self.iterations, self.best_s, self.prune_factor = warmup, iterations, best_s, prune_factor
        self.budget_s, self.started_at = budget_s, started_at
        self.warm: list[float] = []
        self.times: list[float] = []
        self.losses: list[float] = []

    def add(self, step: int, dt: float, loss: float, now: float) -> str | None:
        """Record step ``step`` (0-based) of ``dt`` seconds at time ``now`` (the clock of
        ``started_at``); returns the status to stop with (``pruned``, ``not run (budget)``), else None."""
        if step >= self.warmup:
            self.times.append(dt)
            self.losses.append(loss)
            return None
        self.warm.append(dt)
        if step == self.warmup - 1:
            if should_prune(dt, self.best_s, self.prune_factor):
                return "pruned"
            if not fits(now - self.started_at, self.budget_s, self.iterations * dt):
                return "not run (budget)"
        return None


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def point(system: str, config: dict, exact: bool, *, status: str = "ok", warmup_s: list[float] | None = None,
          step_times_s: list[float] | None = None, num_params: int | None = None,
          tokens_per_step: int | None = None, num_gpus: int | None = None,
          peak_allocated_gib: float | None = None, peak_reserved_gib: float | None = None, **extra) -> dict:
    """One sweep point; the rates are derived from the measured steps (none when there are none)."""
    p = {"system": system, "config": config, "status": status, "exact": exact, "warmup_s": warmup_s or [],
         "step_times_s": step_times_s or [], "step_time_s": None, "tokens_per_s": None, "tflops_per_gpu": None,
         "peak_allocated_gib": peak_allocated_gib, "peak_reserved_gib": peak_reserved_gib, **extra}
    if status == "ok" and step_times_s:
        step = mean(step_times_s)
        p["step_time_s"] = step
        if tokens_per_step:
            p["tokens_per_s"] = tokens_per_step / step
            if num_params and num_gpus:
                p["tflops_per_gpu"] = model_tflops_per_gpu(num_params, tokens_per_step, step, num_gpus)
    return p


def measured_point(system: str, config: dict, exact: bool, status: str, steps: Steps, **kw) -> dict:
    """``point`` of a point that ran: its steps (the measured ones count only when it ended ok)."""
    return point(system, config, exact, status=status, warmup_s=steps.warm,
                 step_times_s=steps.times if status == "ok" else [], losses=steps.losses, **kw)


def point_line(label: str, p: dict) -> str:
    """The log line of a finished point."""
    peak = p["peak_allocated_gib"]
    return (f"{label} status={p['status']} warmup_s={[round(w, 2) for w in p['warmup_s']]} "
            f"step_s={fmt_or_dash(p['step_time_s'])} tflops/gpu={fmt_or_dash(p['tflops_per_gpu'])} "
            f"peak_alloc_gib={fmt_or_dash(peak, 2)}")


def best_by_system(points: list[dict]) -> dict[str, dict]:
    """Each system's fastest measured point (``ok`` with a step time); systems with none are absent."""
    best: dict[str, dict] = {}
    for p in points:
        if p.get("status") != "ok" or p.get("step_time_s") is None:
            continue
        cur = best.get(p["system"])
        if cur is None or p["step_time_s"] < cur["step_time_s"]:
            best[p["system"]] = p
    return best


def best_step(points: list[dict], system: str) -> float | None:
    b = best_by_system(points).get(system)
    return None if b is None else b["step_time_s"]


def result(header: dict, points: list[dict]) -> dict:
    """The result file's object: the header, every point, each system's best."""
    return {**header, "points": points, "best": best_by_system(points)}


def write_json(path: str | os.PathLike | None, obj: dict) -> None:
    """Write atomically (a killed run leaves the previous complete file, never half of one)."""
    if not path:
        return
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def parse_int_list(text: str) -> list[int]:
    """``"32,16,8"`` -> ``[32, 16, 8]``; a bad list exits with one line naming it."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"error: expected comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"error: expected comma-separated positive integers, got {text!r}")
    return values


def fmt_or_dash(v: float | None, p: int = 3) -> str:
    return "-" if v is None else f"{v:.{p}f}"
