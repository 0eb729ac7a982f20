"""The cost model against a recorded timeline, again, from the files a run left.

    python3 bench/timeline_vs_model.py ROW_DIR [--groups 0,0]

ROW_DIR is a run's ``save_dir`` holding ``timeline.json`` (``timeline: true``), next to the
run's ``save_results`` file ``ROW_DIR.json`` (the layout ``bench/offload_bench.py`` writes), or
give that file with ``--results``. The schedule is rebuilt from the run's config, the stage ->
rank mapping read off the trace, and the op durations measured there fed to the cost model
(``pipeline.run.timeline.calibrated_prediction``) twice: for one iteration from a clean start and
for one in a steady state (the previous iteration's optimizer steps still running, as in the
recorded one). ``--groups``: the root complex of each rank's GPU, as the run found it (each rank
its own when not given). ``--step_scale 0.5,0.25``: also the steady state with every optimizer
step that much as long (what a faster CPU optimizer would buy, all else as measured).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import schedule as sched  # noqa: E402
from pipeline.config import make_config  # noqa: E402
from pipeline.plan.source import PRESETS, preset_config
from pipeline.spec.shapes import stage_param_counts  # noqa: E402
from pipeline.spec.settings import compute_dtype  # noqa: E402
from pipeline.spec.partition import stage_layers  # noqa: E402
from pipeline.spec.programs import program_spec  # noqa: E402
from pipeline.plan.layout import replica_config  # noqa: E402
from pipeline.run.timeline import calibrated_prediction, measured_step_time, read_chrome_trace  # noqa: E402


def scale_steps(events: list[dict], factor: float) -> list[dict]:
    """``events`` with every optimizer step ``factor`` times as long."""
    return [{**e, "end": e["start"] + factor * (e["end"] - e["start"])} if e["op"] == "S" else e for e in events]


def compare(row_dir: Path, results: Path, groups: list[int] | None, step_scales: tuple[float, ...] = ()) -> dict:
    events = read_chrome_trace(row_dir / "timeline.json")
    saved = json.loads(results.read_text())
    # Files written before the ``partition`` setting existed come from runs that split the
    # layers evenly; the default (cost) would give other stage sizes.
    cfg = replica_config(make_config({"partition": "layers", **saved["config"]}))
    S = cfg.num_stages
    mapping = [-1] * S
    for e in events:
        if e["op"] == "F":
            mapping[e["stage"]] = e["rank"]
    if -1 in mapping:
        raise SystemExit(f"error: {row_dir / 'timeline.json'} has no forward of stages "
                         f"{[s for s, r in enumerate(mapping) if r < 0]}")
    if cfg.model in PRESETS:
        hf = preset_config(cfg.model)
    else:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(cfg.model)
    elem = torch.empty(0, dtype=compute_dtype(cfg, torch.device(cfg.device))).element_size()
    stage_bytes = [n * elem for n in stage_param_counts(hf, S, stage_layers(cfg, hf, len(set(mapping))))]
    # The saved config may say -1 (auto); the trace says what ran: with offload, the stages a
    # rank never loaded stayed resident (the same number on every rank).
    resident = cfg.resident_stages
    if cfg.use_offload and resident < 0:
        loaded = {e["stage"] for e in events if e["op"] == "L"}
        resident = min(sum(1 for s in sched.stages_of(r, mapping) if s not in loaded) for r in set(mapping))
    program = program_spec(dataclasses.replace(cfg, resident_stages=resident), hf).build(mapping)
    steady = calibrated_prediction(events, program, mapping, stage_bytes, groups)
    # The same durations, one iteration from a clean start (what the model predicted before).
    clean = calibrated_prediction(events, program, mapping, stage_bytes, groups, steady=False)
    measured = measured_step_time(events)
    scaled = {f: calibrated_prediction(scale_steps(events, f), program, mapping, stage_bytes, groups).host_end
              for f in step_scales}
    per_iteration = [it.get("step_time_s", it.get("time_s")) for it in saved["iterations"]]  # time_s: older files
    return {"row": row_dir.name, "measured_timeline_step_s": measured,
            "clean_start": {"host_end_s": clean.host_end, "step_time_s": clean.step_time},
            "steady_state": {"host_end_s": steady.host_end, "step_time_s": steady.step_time},
            "error_clean_host_end_pct": 100 * (clean.host_end - measured) / measured,
            "error_clean_with_steps_pct": 100 * (clean.step_time - measured) / measured,
            "error_steady_pct": 100 * (steady.host_end - measured) / measured,
            "iteration_times_s": per_iteration, "steady_state_with_steps_scaled_s": scaled}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("row_dirs", nargs="+", type=Path)
    p.add_argument("--results", type=Path, help="the run's save_results file (default ROW_DIR.json)")
    p.add_argument("--groups", default="", help="root complex of each rank's GPU, e.g. 0,0")
    p.add_argument("--step_scale", default="", help="e.g. 0.5,0.25: optimizer steps that much as long")
    args = p.parse_args()
    groups = [int(g) for g in args.groups.split(",")] if args.groups else None
    scales = tuple(float(f) for f in args.step_scale.split(",")) if args.step_scale else ()
    print("| row | measured step s (timeline) | model, clean start s | error % | model + its steps s | error % | "
          "model, steady state s | error % |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for d in args.row_dirs:
        r = compare(d, args.results or d.with_name(d.name + ".json"), groups, scales)
        rows.append(r)
        print(f"| {r['row']} | {r['measured_timeline_step_s']:.3f} | {r['clean_start']['host_end_s']:.3f} | "
              f"{r['error_clean_host_end_pct']:+.1f} | {r['clean_start']['step_time_s']:.3f} | "
              f"{r['error_clean_with_steps_pct']:+.1f} | {r['steady_state']['host_end_s']:.3f} | "
              f"{r['error_steady_pct']:+.1f} |")
    if scales:
        print("\n| row | " + " | ".join(f"steady state, steps x{f:g} s" for f in scales) + " |")
        print("|---|" + "---|" * len(scales))
        for r in rows:
            print(f"| {r['row']} | " + " | ".join(f"{r['steady_state_with_steps_scaled_s'][f]:.3f}" for f in scales) + " |")


if __name__ == "__main__":
    main()
