"""The table of ``bench/qlora_rows.sh``'s rows: ``python3 bench/qlora_table.py OUT`` (OUT: its $OUT/qlora).

Each of this project's rows (``OUT/<row>/results.json``, main.py's ``save_results``; its first
``--warmup`` [1] iterations left out) beside its plan (``OUT/<row>/plan.txt``, ``--plan`` of the same
flags): s/step, tokens/s, model TFLOP/s, the peak GPU memory measured (allocated, the largest rank)
and planned, host memory measured (the processes' peak RSS) and planned (a row its time limit
cut: the steps its ``run/metrics.jsonl`` holds, without host memory); then the peer's best point
(``OUT/peers/peft-qlora.json``, bench/peer_qlora.py). A row without a result says why (its log's
last error line, else its last line). Writes ``OUT/table.md`` and prints it.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import offload_bench  # noqa: E402
import sweep  # noqa: E402

ROWS = ("70b", "8b", "8b-bf16", "8b-long")
# --plan's rank line: rank, stages, peak device, (parts), at, host
PLAN_RANK = re.compile(r"^\s*(\d+)\s+\[[^\]]*\]\s+([\d.]+) GiB\s+\(.*\)\s+\S+\s+([\d.]+) GiB\s*$", re.M)
PLAN_HOST = re.compile(r"^host: ([\d.]+) GiB", re.M)


def plan_peaks(text: str) -> tuple[float | None, float | None]:
    """(the largest rank's planned GPU peak, the planned host memory of all ranks) in GiB."""
    ranks = PLAN_RANK.findall(text)
    host = PLAN_HOST.search(text)
    return (max(float(r[1]) for r in ranks) if ranks else None), (float(host.group(1)) if host else None)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def our_row(out: Path, row: str, warmup: int) -> dict | None:
    """One of this project's rows, or None when it was not run."""
    d = out / row
    if not d.is_dir():
        return None
    plan_gpu, plan_host = plan_peaks(_read(d / "plan.txt"))
    base = {"row": row, "plan_gpu_gib": plan_gpu, "plan_host_gib": plan_host}
    try:
        res = json.loads((d / "results.json").read_text())
    except (OSError, ValueError):
        res = None
    if not res:
        steps = [json.loads(line) for line in _read(d / "run" / "metrics.jsonl").splitlines() if line.strip()]
        steps = [r for r in steps if r.get("kind") == "train"][warmup:]
        if steps:  # a row its time limit cut: the steps it finished (metrics.jsonl is written as they end)
            return {**base, "status": "ok", "model": "(cut: metrics.jsonl)", "base": "-", "rows": "-",
                    "step_time_s": sum(r["step_time_s"] for r in steps) / len(steps),
                    "tokens_per_s": sum(r["tokens_per_s"] for r in steps) / len(steps),
                    "tflops": sum(r["tflops_per_gpu"] for r in steps) / len(steps),
                    "gpu_gib": max(r["peak_mem_bytes"] for r in steps) / 2**30, "host_gib": None}
    if not res or len(res.get("iterations", [])) <= warmup:
        lines = [line for line in _read(d / "train.log").splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith(("error:", "[rank"))] or \
            [line for line in lines if "Error" in line]  # main.py's line, else a traceback's
        why = (errors or lines)[0 if errors else -1][:120] if lines else ""
        return {**base, "status": "no result" + (f": {why}" if why else "")}
    s = offload_bench.summarise(res, "main", argparse.Namespace(warmup=warmup))
    config = res.get("config", {})
    n = sweep.model_params(config.get("model", ""))
    tokens = config.get("batch_size", 0) * config.get("seq_length", 0)
    return {**base, "status": "ok", "model": config.get("model"), "step_time_s": s["step_time_s"],
            "tokens_per_s": s["tokens_per_s"], "gpu_gib": s["peak_allocated_gb"], "host_gib": s["host_rss_gb"],
            "tflops": sweep.model_tflops_per_gpu(n, tokens, s["step_time_s"], 1) if n else None,
            "rows": f"{config.get('batch_size')} x {config.get('seq_length')}",
            "base": "4-bit " + config.get("bnb_4bit_quant_type", "nf4") if config.get("load_in_4bit") else "bf16"}


def peer_row(out: Path) -> dict | None:
    try:
        res = json.loads((out / "peers" / "peft-qlora.json").read_text())
    except (OSError, ValueError):
        lines = [line for line in _read(out / "peers" / "peft-qlora.log").splitlines() if line.strip()]
        return {"row": "peer", "status": f"no result: {lines[-1][:120]}"} if lines else None
    best = (res.get("best") or {}).get("peft-qlora")
    if best is None:
        statuses = sorted({p["status"] for p in res.get("points", [])}) or ["none"]
        return {"row": "peer", "status": "no point measured (" + ", ".join(statuses) + ")"}
    return {"row": "peer", "status": "ok", "model": res["model"], "step_time_s": best["step_time_s"],
            "tokens_per_s": best["tokens_per_s"], "gpu_gib": best.get("peak_allocated_gib"),
            "tflops": best.get("tflops_per_gpu"), "rows": f"micro-batch {best['config']['micro_batch_per_rank']}",
            "base": "4-bit nf4 (peft + bitsandbytes, whole model on the GPU)"}


def fmt(v, p: int = 2) -> str:
    return "-" if v is None else f"{v:.{p}f}"


def table(rows: list[dict]) -> str:
    lines = ["| row | model | base | rows | s/step | tokens/s | model TFLOP/s | peak GPU GiB (plan) | "
             "host GiB (plan) |", "|" + "---|" * 9]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['row']} | {r['status']} |" + " |" * 7)
            continue
        lines.append(f"| {r['row']} | {r['model']} | {r['base']} | {r['rows']} | {fmt(r['step_time_s'])} | "
                     f"{fmt(r['tokens_per_s'], 0)} | {fmt(r['tflops'], 1)} | {fmt(r['gpu_gib'])} "
                     f"({fmt(r.get('plan_gpu_gib'))}) | {fmt(r.get('host_gib'), 1)} "
                     f"({fmt(r.get('plan_host_gib'), 1)}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--warmup", type=int, default=1, help="iterations of each row left out of its figures")
    args = p.parse_args(argv)
    rows = [r for r in [*(our_row(args.out, row, args.warmup) for row in ROWS), peer_row(args.out)] if r is not None]
    text = table(rows)
    (args.out / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
