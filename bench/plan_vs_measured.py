"""The ``--plan`` memory estimate against the peak allocated GPU memory the bench measured.

    python bench/plan_vs_measured.py bench/results/*.json

Each measured row of ``bench/offload_bench.py`` (its default settings: global batch 64 x 512,
16 micro-batches, 8 stages on 4 GPUs, GPipe, activation checkpointing, bf16) is planned
again from its name and compared rank by rank. Needs no GPU.
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
from pipeline.model import preset_config  # noqa: E402
from pipeline.plan import memory_plan  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+")
    p.add_argument("--gpus", type=int, default=4)
    args = p.parse_args()
    print("| row | rank | estimated GiB | measured GiB | error |\n|---|---|---|---|---|")
    worst = 0.0
    for path in args.results:
        for row in json.loads(Path(path).read_text())["rows"]:
            measured = row.get("peak_allocated_gb_per_rank")
            if row.get("status") != "ok" or not measured:
                continue
            _, cap, mode, model = parse_row(row["row"])
            if mode == "fsdp2":
                continue
            model = model or "llama-2-7b"
            cfg = make_config(dict(model=model, dataset="synthetic", seq_length=512, batch_size=64, num_chunks=16,
                                   num_stages=8, schedule="gpipe", activation_checkpointing=True, device="cuda",
                                   dtype="bfloat16", use_offload=mode != "resident", use_prefetch=mode == "prefetch",
                                   gpu_memory_gb=cap))
            ranks, _ = memory_plan(cfg, preset_config(model), sched.round_robin(8, args.gpus), "cuda")
            for r, m in zip(ranks, measured):
                est = r.device_peak / 2**30
                err = est / m - 1
                worst = max(worst, abs(err))
                print(f"| {row['row']} | {r.rank} | {est:.2f} | {m:.2f} | {err:+.1%} |")
    print(f"\nlargest error: {worst:.1%}")


if __name__ == "__main__":
    main()
