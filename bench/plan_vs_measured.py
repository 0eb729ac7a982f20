"""The ``--plan`` memory estimate against the peak allocated GPU memory the bench measured.

    python bench/plan_vs_measured.py bench/results/*.json

Each measured row of ``bench/offload_bench.py`` (global batch 64 x 512, 16 micro-batches, GPipe,
activation checkpointing, bf16; GPUs and stages from the file's arguments and the row's name)
is planned again and compared rank by rank. Needs no GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import schedule as sched  # noqa: E402
from bench.offload_bench import parse_row  # noqa: E402
from pipeline.config import make_config  # noqa: E402
from pipeline.plan.source import preset_config  # noqa: E402
from pipeline.plan.fit import memory_plan  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+")
    p.add_argument("--gpus", type=int, default=4, help="for result files that do not record it")
    args = p.parse_args()
    print("| row | rank | estimated GiB | measured GiB | error |\n|---|---|---|---|---|")
    worst = 0.0
    for path in args.results:
        data = json.loads(Path(path).read_text())
        bench_args = data.get("args") or {}
        gpus, default_stages = bench_args.get("gpus", args.gpus), bench_args.get("num_stages", 8)
        for row in data["rows"]:
            measured = row.get("peak_allocated_gb_per_rank")
            if row.get("status") != "ok" or not measured:
                continue
            _, cap, mode, noclip, stages, _, model, _ = parse_row(row["row"])
            if mode == "fsdp2":
                continue
            model, stages = model or "llama-2-7b", stages or default_stages
            cfg = make_config(dict(model=model, dataset="synthetic", seq_length=512, batch_size=64, num_chunks=16,
                                   num_stages=stages, schedule="gpipe", activation_checkpointing=True, device="cuda",
                                   dtype="bfloat16", use_offload=mode != "resident", use_prefetch=mode in ("prefetch", "actoff"),
                                   activation_offload=mode == "actoff",
                                   gpu_memory_gb=cap, grad_clip=0.0 if noclip else 1.0,
                                   max_skipped_steps=-1 if noclip else 5))
            ranks, _ = memory_plan(cfg, preset_config(model), sched.round_robin(stages, gpus), "cuda")
            for r, m in zip(ranks, measured):
                est = r.device_peak / 2**30
                err = est / m - 1
                worst = max(worst, abs(err))
                print(f"| {row['row']} | {r.rank} | {est:.2f} | {m:.2f} | {err:+.1%} |")
    print(f"\nlargest error: {worst:.1%}")


if __name__ == "__main__":
    main()
