"""Long rows on memory-limited GPUs (one by default, ``--gpus N`` for a pipeline over N): this
project, RoundPipe's exact step and FSDP2 with CPU offload on the same job, back to back, one table.

    OUT=$OUT bash bench/long_rows.sh                          # the device call (wheels, then this)
    python3 bench/long_rows.py --out OUT --budget_s 560       # the same, wheels installed
    python3 bench/long_rows.py --out OUT --rows ours@131072,roundpipe@65536
    python3 bench/long_rows.py --smoke --out /tmp/lr          # the plumbing on a CPU (tiny model, short rows)
    python3 bench/long_rows.py --gpus 2 --model llama-3-8b --rows ours@65536/whole,ours@65536,roundpipe@65536
    python3 bench/long_rows.py --summarise OUT                # the table of a finished run again

The job: ``llama-3b`` (OpenLLaMA-3B shapes, random weights), batch 1, bf16, activation
checkpointing, synthetic tokens, a 24 GiB card emulated on an H100 or H200 (this project:
``--gpu_memory_gb 24``; FSDP2: the same cap, ``--mem_cap_gb``; RoundPipe: a ballast process holding
the rest, since it sizes itself from the free memory). Rows are ``<system>@<tokens>[/<variant>]``:

- ``ours@T``: this project with every stage offloaded and ``activation_offload``, and what the
  memory plan chooses for the row (``num_stages -1 seq_chunks -1 tiled_mlp auto``: the fewest stages,
  whole rows before segments, untiled before tiled);
- ``ours@T/whole``, ``ours@T/seg<K>``: the same with whole rows or K segments forced (stages and
  tiles still the plan's), to compare the two ways at one length;
- ``roundpipe@T``: ``bench/roundpipe_baseline.py``, synchronous (exact) step, one micro-batch;
- ``fsdp2@T``: ``bench/fsdp2_baseline.py`` (FSDP2 + CPUOffloadPolicy, per-layer checkpointing), micro-batch 1.

Each row is its own process with a time limit: its estimated start-up plus its steps at the
step time the issue measured (x1.5, at least 60 s more), cut to what is left of ``--budget_s``; a
row whose estimate no longer fits is skipped ("skipped (budget)"), and a row that fails or runs
out of memory leaves its status and log. ``OUT/long_rows.json`` is rewritten after every row
(rows, plan figures, versions); ``OUT/long_rows.md`` and stdout get the table at the end:
s/step, tokens/s, model TFLOP/s (``pipeline.spec.shapes.model_flops_per_token``: matmuls and attention,
causal, no recompute), peak GPU memory (allocated) and for this project the plan's figure, its
error against the peak, and the configuration the plan chose.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from guarded import HOST_STOPPED, STOPPED_STATUS, TIMED_OUT, run_guarded  # noqa: E402

GiB = 2**30
LENGTHS = (16384, 32768, 65536, 131072)
# The default order: what the targets need first (the longest row, the 64K comparison
# with RoundPipe), then the 16K and 32K comparisons, then the segment variants and FSDP2 at 64K
# (out of memory in the issue). 128K in segments is left out: its carried keys/values of every
# stage (43 GB) and the offloaded state (62 GB) do not fit a 125 GiB host together, and the plan
# refuses it there.
DEFAULT_ROWS = ("ours@131072,ours@65536,roundpipe@65536,ours@16384,roundpipe@16384,fsdp2@16384,ours@32768,"
                "roundpipe@32768,fsdp2@32768,ours@16384/seg4,ours@32768/seg8,ours@65536/seg8,fsdp2@65536")
ROW_RE = re.compile(r"(ours|roundpipe|fsdp2)@([1-9]\d*)(?:/(whole|seg[1-9]\d*))?")
# Seconds per step measured on an H200 (2026-11-28: this project's whole rows through cuDNN,
# RoundPipe, FSDP2 at 16K) or extrapolated (FSDP2 at 32K; the lengths a peer runs out of memory
# at end sooner), and a process's start-up (build, placement, first compile), measured there
# too: what a row's time limit is made of. Segment rows are slower than whole ones (32K in 8
# segments: 7.04 s on 2026-11-25): the limit's margin covers them.
STEP_S = {"ours": {16384: 2.1, 32768: 3.8, 65536: 11.0, 131072: 40.0},
          "roundpipe": {16384: 5.0, 32768: 8.6, 65536: 20.7, 131072: 80.0},
          "fsdp2": {16384: 5.2, 32768: 10.5, 65536: 18.0, 131072: 60.0}}
START_S = {"ours": 75.0, "roundpipe": 65.0, "fsdp2": 70.0}
CHOSEN_RE = re.compile(r"long rows: num_stages (\d+), seq_chunks (\d+), tiled_mlp (\w+)")
TILE_RE = re.compile(r"tiled_mlp: each decoder layer's MLP runs in tiles of (\d+) tokens")


def parse_row(name: str) -> tuple[str, int, str | None]:
    m = ROW_RE.fullmatch(name)
    if m is None:
        raise SystemExit(f"error: bad row {name!r}; expected <ours|roundpipe|fsdp2>@<tokens>[/whole|/seg<K>] "
                         "(variants for ours only), e.g. ours@131072, ours@32768/seg8, roundpipe@65536")
    if m[3] and m[1] != "ours":
        raise SystemExit(f"error: row {name!r}: /whole and /seg<K> are variants of ours only")
    return m[1], int(m[2]), m[3]


def iterations(tokens: int) -> tuple[int, int]:
    """(warm-up steps, measured steps) of a row: two measured below 64K, one from there."""
    return (1, 2) if tokens < 65536 else (1, 1)


def estimate_s(system: str, tokens: int, smoke: bool) -> float:
    """A row's expected wall time: start-up and every step (warm-up included)."""
    if smoke:
        return 30.0
    steps = STEP_S[system]
    step = steps.get(tokens) or steps[max(steps)] * (tokens / max(steps)) ** 2
    return START_S[system] + sum(iterations(tokens)) * step


# --- this project's rows ---------------------------------------------------------------------------
def our_flags(args, tokens: int, variant: str | None) -> list[str]:
    if args.smoke:
        base = ["--model", "tiny", "--dtype", "float32", "--device", "cpu", "--num_stages", str(4 * args.gpus)]
    else:
        base = ["--model", args.model, "--dtype", "bfloat16", "--device", "cuda", "--gpu_memory_gb", str(args.cap_gb),
                "--num_stages", "-1"]
    chunks = "-1" if variant is None else "1" if variant == "whole" else variant[3:]
    return ["--config", "", *base, "--dataset", "synthetic", "--allow_long_sequences", "--seq_length", str(tokens),
            "--batch_size", "1", "--num_chunks", "1", "--seq_chunks", chunks, "--tiled_mlp", "auto",
            "--use_offload", "--resident_stages", "0", "--activation_checkpointing", "--activation_offload",
            "--num_iterations", str(sum(iterations(tokens))), "--no_save_model", "--no_progress_bar", "--overwrite"]


def our_plan(args, tokens: int, variant: str | None) -> dict:
    """What the memory plan decides and estimates for the row (computed here, before any row
    runs, so the host memory it checks is the machine's own)."""
    from pipeline.plan import fit as plan_mod
    from pipeline.config import parse_args as parse_cfg
    from pipeline.plan.resolve import resolve
    from pipeline.plan.source import resolve_model
    from schedule import round_robin

    cfg, _, _ = parse_cfg(our_flags(args, tokens, variant))
    hf = resolve_model(cfg).config
    try:
        resolved = resolve(cfg, args.gpus, hf)
    except Exception as e:  # noqa: BLE001 - a plan error is the row's status, not the bench's end
        return {"plan_error": f"{type(e).__name__}: {e}"}
    one = resolved.replica
    a = plan_mod.assess_spec(resolved.spec, round_robin(one.num_stages, args.gpus))
    worst = a.worst
    return {"num_stages": one.num_stages, "seq_chunks": one.seq_chunks, "tiled_mlp": one.tiled_mlp,
            "plan_gib": worst.device_peak / GiB, "plan_at": worst.at, "plan_fits": a.fits,
            "plan_parts_gib": {k: round(v / GiB, 2) for k, v in worst.parts.items()},
            "plan_host_gib": worst.host / GiB, "plan_lines": list(resolved.lines)}


def run_ours(args, row: dict, out: Path, limit_s: float) -> dict:
    tokens, variant = row["tokens"], row["variant"]
    rdir = out / row["slug"]
    rdir.mkdir(parents=True, exist_ok=True)
    results = rdir / "results.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}",
           str(ROOT / "main.py"), *our_flags(args, tokens, variant), "--save_dir", str(rdir / "run"), "--save_results",
           str(results)]
    cores = str(max(1, len(os.sched_getaffinity(0)) // args.gpus))
    rc, log, wall = run(cmd, {"OMP_NUM_THREADS": cores, "NCCL_P2P_DISABLE": "1"}, limit_s, rdir / "log.txt")
    res = {"rc": rc, "wall_s": round(wall, 1), "status": status_of(rc, log)}
    chosen = CHOSEN_RE.search(log)
    if chosen:
        res["chosen"] = f"stages {chosen[1]}, seq_chunks {chosen[2]}, tiled {chosen[3]}"
    tile = TILE_RE.search(log)
    res["mlp_tile_tokens"] = int(tile[1]) if tile else 0
    oom = re.search(r"^error: (rank \d+ ran out of GPU memory.*)$", log, re.M)
    if oom:
        res["error"] = oom[1]
    try:
        iters = json.loads(results.read_text())["iterations"]
    except (OSError, ValueError, KeyError):
        return res
    warm = iterations(tokens)[0]
    measured = iters[warm:] or iters[-1:]
    step = sum(r["step_time_s"] for r in measured) / len(measured)
    peak = max(max(r["peak_mem_bytes"]) for r in iters)
    breakdown = {k: sum(max(p.get(k) or 0.0 for p in r.get("per_rank") or [{}]) for r in measured) / len(measured)
                 for k in ("compute_seconds", "load_wait_seconds", "offload_wait_seconds", "optimizer_wait_seconds")}
    res.update(step_time_s=step, peak_gib=peak / GiB, steps=[r["step_time_s"] for r in iters],
               **{k.replace("_seconds", "_s"): v for k, v in breakdown.items()})
    return res


# --- the peers -------------------------------------------------------------------------------------
def run_peer(args, row: dict, out: Path, limit_s: float) -> dict:
    system, tokens = row["system"], row["tokens"]
    rdir = out / row["slug"]
    rdir.mkdir(parents=True, exist_ok=True)
    jpath = rdir / "peer.json"
    warm, iters = iterations(tokens)
    cores = str(len(os.sched_getaffinity(0)))
    if system == "roundpipe":
        if args.smoke:
            return {"status": "skipped (needs CUDA)"}
        cmd = [sys.executable, str(ROOT / "bench/roundpipe_baseline.py"), "--model", args.model, "--batch_size", "1",
               "--seq_length", str(tokens), "--points", "sync:1", "--iterations", str(iters), "--warmup", str(warm),
               "--mem_cap_gb", str(args.cap_gb), "--json", str(jpath), "--budget_s", str(round(limit_s - 30))]
        env = {"OMP_NUM_THREADS": cores, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
               "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(args.gpus))}
    elif args.gpus > 1:  # FSDP2 is data-parallel: each GPU takes rows of its own, and one row has no half
        return {"status": "skipped (FSDP2 cannot split a batch of one row over GPUs)"}
    else:
        model = "tiny" if args.smoke else args.model
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}",
               str(ROOT / "bench/fsdp2_baseline.py"), "--model", model, "--batch_size", "1", "--seq_length",
               str(tokens), "--micro_batches", "1", "--iterations", str(iters), "--warmup", str(warm), "--json",
               str(jpath), "--budget_s", str(round(limit_s - 30))]
        if not args.smoke:
            cmd += ["--mem_cap_gb", str(args.cap_gb)]
        env = {"OMP_NUM_THREADS": str(max(1, int(cores) // args.gpus)), "NCCL_P2P_DISABLE": "1"}
    rc, log, wall = run(cmd, env, limit_s, rdir / "log.txt")
    res = {"rc": rc, "wall_s": round(wall, 1), "status": status_of(rc, log)}
    try:
        data = json.loads(jpath.read_text())
    except (OSError, ValueError):
        return res
    points = data.get("points", [])
    ok = [p for p in points if p.get("status") == "ok" and p.get("step_time_s")]
    if not ok:
        statuses = sorted({p.get("status", "?") for p in points})
        if statuses:
            res["status"] = "OOM" if any("OOM" in s for s in statuses) else ", ".join(statuses)
        return res
    best = min(ok, key=lambda p: p["step_time_s"])
    res.update(status="ok", step_time_s=best["step_time_s"], peak_gib=best.get("peak_allocated_gib"),
               steps=best.get("warmup_s", []) + best.get("step_times_s", []), config=best.get("config"))
    return res


# --- running rows ----------------------------------------------------------------------------------
def run(cmd: list[str], env_add: dict, limit_s: float, log_path: Path) -> tuple[int, str, float]:
    """Run ``cmd`` in its own process group for at most ``limit_s`` (``guarded.run_guarded``: the
    whole group, torchrun and its workers, RoundPipe's ballast, killed at the limit or when the
    host's memory runs short). Returns (rc, log, wall seconds)."""
    got = run_guarded(cmd, {**os.environ, **env_add, "PYTHONUNBUFFERED": "1"}, max(1.0, limit_s), log_path, cwd=ROOT,
                      header=f"$ {' '.join(f'{k}={v}' for k, v in env_add.items())} {' '.join(cmd)}\n")
    return got.rc, got.log, got.wall_s


def status_of(rc: int, log: str) -> str:
    if TIMED_OUT in log:
        return "killed (time limit)"
    if HOST_STOPPED in log:
        return STOPPED_STATUS
    if "ran out of GPU memory" in log or "OutOfMemory" in log or "out of memory" in log.lower():
        return "OOM"
    if "this configuration does not fit" in log:
        return "refused by the plan"
    return "ok" if rc == 0 else f"failed (rc {rc})"


def flops_per_token(args, tokens: int) -> float:
    from pipeline.spec.shapes import model_flops_per_token
    from pipeline.plan.source import preset_config

    hf = preset_config("tiny" if args.smoke else args.model)
    return model_flops_per_token(hf, hf.num_hidden_layers, tokens)


def versions() -> dict:
    """Versions and the GPU, without starting CUDA in this process (its context would take GPU
    memory from the rows)."""
    import torch
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        out["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out["gpu"] = None
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                       timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        out["commit"] = None
    return out


def fmt(v, p: int = 2) -> str:
    return "-" if v is None else f"{v:.{p}f}" if isinstance(v, float) else str(v)


def table(rows: list[dict]) -> str:
    head = ("| row | status | s/step | tokens/s | model TFLOP/s | peak GiB | plan GiB | plan error | configuration | "
            "compute / load / offload / optimizer wait s |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        cfg = r.get("chosen") or (f"stages {r['num_stages']}, seq_chunks {r['seq_chunks']}, tiled {r['tiled_mlp']} "
                                  "(plan)" if "num_stages" in r else r.get("config") or "")
        if isinstance(cfg, dict):
            cfg = ", ".join(f"{k}={v}" for k, v in cfg.items() if k in ("step", "num_microbatch", "micro_batch_per_rank"))
        err = r["peak_gib"] / r["plan_gib"] - 1 if r.get("peak_gib") and r.get("plan_gib") else None
        waits = " / ".join(fmt(r.get(k)) for k in ("compute_s", "load_wait_s", "offload_wait_s", "optimizer_wait_s")) \
            if "compute_s" in r else ""
        lines.append(f"| {r['row']} | {r.get('status')} | {fmt(r.get('step_time_s'))} | {fmt(r.get('tokens_per_s'), 0)} | "
                     f"{fmt(r.get('tflops'), 1)} | {fmt(r.get('peak_gib'))} | {fmt(r.get('plan_gib'))} | "
                     f"{'-' if err is None else f'{err:+.1%}'} | {cfg} | {waits} |")
    return "\n".join(lines)


def write(out: Path, args, rows: list[dict], meta: dict) -> None:
    (out / "long_rows.json").write_text(json.dumps({"args": vars(args), **meta, "rows": rows}, indent=1))
    (out / "long_rows.md").write_text(table(rows) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="long_rows")
    p.add_argument("--rows", default=None, help=f"comma-separated, in order (default: {DEFAULT_ROWS})")
    p.add_argument("--budget_s", type=float, default=560.0, help="every row together, start-ups included")
    p.add_argument("--model", default="llama-3b")
    p.add_argument("--cap_gb", type=float, default=24.0, help="per GPU")
    p.add_argument("--gpus", type=int, default=1, help="GPUs of one node (PCIe only: NCCL_P2P_DISABLE=1): this "
                   "project's pipeline over them, FSDP2 sharded over them, RoundPipe's rounds over them")
    p.add_argument("--smoke", action="store_true", help="the plumbing on a CPU: tiny model, rows of 128 and 256 "
                   "tokens, RoundPipe skipped")
    p.add_argument("--summarise", metavar="OUT", default=None, help="print OUT's table again, run nothing")
    args = p.parse_args(argv)
    if args.summarise:
        print(table(json.loads((Path(args.summarise) / "long_rows.json").read_text())["rows"]))
        return 0
    start = time.time()
    rows_arg = args.rows or ("ours@128,ours@256/seg4,fsdp2@128,roundpipe@128" if args.smoke else DEFAULT_ROWS)
    todo = [parse_row(r.strip()) for r in rows_arg.split(",") if r.strip()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"versions": versions(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    rows = []
    for system, tokens, variant in todo:
        name = f"{system}@{tokens}" + (f"/{variant}" if variant else "")
        rows.append({"row": name, "slug": name.replace("@", "_").replace("/", "_"), "system": system,
                     "tokens": tokens, "variant": variant, "status": "not run"})
    # The plan of every row of ours first: resolve and assess on this machine's host memory, before
    # any row holds it.
    for row in rows:
        if row["system"] == "ours":
            row.update(our_plan(args, row["tokens"], row["variant"]))
    write(out, args, rows, meta)
    for row in rows:
        left = args.budget_s - (time.time() - start)
        need = estimate_s(row["system"], row["tokens"], args.smoke)
        if "plan_error" in row:
            row["status"] = "plan failed"
            continue
        if left < need:
            row["status"] = f"skipped (budget: {left:.0f}s left, about {need:.0f}s needed)"
            print(f"long_rows: {row['row']}: {row['status']}", flush=True)
            write(out, args, rows, meta)
            continue
        limit = min(left, max(1.5 * need, need + 60))
        print(f"long_rows: {row['row']} (limit {limit:.0f}s, {left:.0f}s left)", flush=True)
        res = (run_ours if row["system"] == "ours" else run_peer)(args, row, out, limit)
        row.update(res)
        if row.get("step_time_s"):
            row["tokens_per_s"] = row["tokens"] / row["step_time_s"]
            row["tflops"] = flops_per_token(args, row["tokens"]) * row["tokens"] / row["step_time_s"] / 1e12
        print(f"long_rows: {row['row']}: {row['status']}, step {fmt(row.get('step_time_s'))} s, peak "
              f"{fmt(row.get('peak_gib'))} GiB (plan {fmt(row.get('plan_gib'))}), {row.get('wall_s')} s", flush=True)
        write(out, args, rows, meta)
    meta["wall_s"] = round(time.time() - start, 1)
    write(out, args, rows, meta)
    print(table(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
