"""``--plan`` held to its word on one GPU: the configurations the plan picks, trained at real
shapes under a memory cap, each row's measured GPU and host peaks beside the plan's.

    python3 bench/plan_matrix.py --out OUT --budget_s 540                  # the default rows
    python3 bench/plan_matrix.py --out OUT --rows lora@65536,full@longest  # some rows
    python3 bench/plan_matrix.py --list                                    # the rows and their flags
    python3 bench/plan_matrix.py --summarise OUT                           # the table again
    python3 bench/plan_matrix.py --replan OUT         # today's plan for the configurations OUT measured

A row is ``<job>@<length>``: ``full`` is full fine-tuning of ``llama-3b`` (OpenLLaMA-3B shapes),
``lora`` Llama-3-8B with rank-16 adapters on every linear layer (``lora32`` a Qwen2.5-32B base),
both as the long-row job (batch 1, every automatic choice the plan's: ``num_stages -1 seq_chunks
-1 tiled_mlp auto resident_stages -1``, ``activation_offload``); the length is a number of tokens,
``longest`` (the plan's own longest row, computed on this machine first) or ``short`` (64 x 512
tokens in 8 micro-batches). Random weights, bf16, a ``--cap_gb`` GPU (24) and synthetic tokens.

Each row is ``bench/memory_at_peak.py`` over ``main.py`` for ``--iterations`` steps, two unless told (the offload pool
keeps what the first made, as the plan's second walk does): its report says what was on the GPU
at the peak, grouped by the line that made it. Rows run ``--parallel`` at a time (their caps and
the plan's host figures within the machine's); each has a time limit, and a watch over the host
stops the youngest row when less than ``--host_floor`` of the host's memory is available, so a row
that would exhaust the host ends on its own instead of taking the machine down. The peaks are per
process (GPU: ``max_memory_allocated``; host: the peak resident set, page-locked buffers included;
the pinned allocator's peak is recorded beside it); rows that ran beside others have
no step time worth quoting (``alone`` says which ran alone). ``OUT/matrix.json`` is rewritten
after every row; ``OUT/matrix.md`` and stdout get the table; ``OUT/rows.tgz`` the logs and reports.

The target: no row the plan accepts fails, and every measured peak is within 10% below the
plan's figure and never above it.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from guarded import HOST_FLOOR, meminfo  # noqa: E402

GiB = 2**30
JOBS = {
    "full": dict(model="llama-3b", lora=False),
    "lora": dict(model="llama-3-8b", lora=True),
    "lora32": dict(model="qwen2.5-32b", lora=True, short=["--activation_offload"]),  # the plan's advice at 24 GiB
}
DEFAULT_ROWS = ("lora@65536,lora@longest,lora@32768,lora@131072,lora@short,full@131072,full@longest,full@65536,"
                "lora@4096,full@4096,full@32768,full@262144,lora32@short")
LORA_FLAGS = ["--lora_rank", "16", "--lora_alpha", "32", "--lora_target_modules", "all-linear"]
# seconds per step on an H200 (rough: this project's earlier long-row and LoRA rows) and a start-up's
STEP_S = {"full": {4096: 1.0, 32768: 4.0, 65536: 11.0, 131072: 40.0, 262144: 250.0},
          "lora": {4096: 1.5, 32768: 6.0, 65536: 16.0, 131072: 50.0}, "lora32": {4096: 6.0}}
START_S = {"full": 90.0, "lora": 100.0, "lora32": 240.0}


def parse_row(name: str) -> tuple[str, str]:
    job, _, length = name.partition("@")
    if job not in JOBS or not (length in ("longest", "short") or length.isdigit()):
        raise SystemExit(f"error: bad row {name!r}; expected <{'|'.join(JOBS)}>@<tokens|longest|short>, "
                         "e.g. lora@65536, full@longest, lora@short")
    return job, length


def row_flags(job: str, tokens: int | None, short: bool, cap_gb: float, host_gb: float | None,
              iterations: int = 2) -> list[str]:
    """main.py's flags of a row (``tokens`` for a long row, ``short`` for the 64 x 512 job)."""
    spec = JOBS[job]
    flags = ["--config", "", "--model", spec["model"], "--dataset", "synthetic", "--device", "cuda", "--dtype",
             "bfloat16", "--gpu_memory_gb", str(cap_gb), "--use_offload", "--resident_stages", "-1",
             "--activation_checkpointing", "--num_stages", "-1", "--num_iterations", str(iterations), "--no_save_model",
             "--no_progress_bar", "--overwrite", "--report_to", "none"]
    if host_gb:
        flags += ["--host_memory_gb", f"{host_gb:.1f}"]
    if short:
        flags += ["--seq_length", "512", "--batch_size", "64", "--num_chunks", "8", *spec.get("short", [])]
    else:
        flags += ["--seq_length", str(tokens), "--batch_size", "1", "--num_chunks", "1", "--seq_chunks", "-1",
                  "--tiled_mlp", "auto", "--activation_offload", "--allow_long_sequences"]
    return flags + (LORA_FLAGS if spec["lora"] else [])


def plan_of(flags: list[str]) -> dict:
    """What the plan resolves and estimates for ``flags`` (on this machine: its GPU's kernels)."""
    from pipeline.config import parse_args
    from pipeline.plan.fit import assess_spec
    from pipeline.plan.preflight import read_model
    from pipeline.plan.resolve import resolve
    from schedule import round_robin

    cfg, _, _ = parse_args(flags)
    hf = read_model(cfg, 1).config
    try:
        r = resolve(cfg, 1, hf)
    except Exception as e:  # noqa: BLE001 - a plan error is the row's status, not the bench's end
        return {"plan_error": f"{type(e).__name__}: {e}"}
    one = r.replica
    a = assess_spec(r.spec, round_robin(one.num_stages, 1))
    return {"num_stages": one.num_stages, "seq_chunks": one.seq_chunks, "tiled_mlp": one.tiled_mlp,
            "resident_stages": one.resident_stages, "plan_gib": a.worst.device_peak / GiB, "plan_at": a.worst.at,
            "plan_host_gib": a.total_host / GiB, "plan_fits": a.fits,
            "plan_host_parts_gib": {k: round(v / GiB, 2) for k, v in a.worst.host_parts.items()}}


def longest_tokens(job: str, cap_gb: float, host_gb: float | None) -> int:
    from pipeline.config import parse_args
    from pipeline.plan.long_rows import longest_row
    from pipeline.plan.preflight import read_model

    cfg, _, _ = parse_args(row_flags(job, 4096, False, cap_gb, host_gb))
    return longest_row(cfg, read_model(cfg, 1).config, 1)[0]


class HostWatch(threading.Thread):
    """Samples the host's available memory; below ``floor`` of the total it stops the youngest
    running row (its process group), which then ends with that status."""

    def __init__(self, floor: float):
        super().__init__(daemon=True)
        self.floor, self.running, self.lock = floor, [], threading.Lock()
        self.min_available = meminfo()["MemAvailable"]
        self.stopped: set[int] = set()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            m = meminfo()
            self.min_available = min(self.min_available, m["MemAvailable"])
            if m["MemAvailable"] < self.floor * m["MemTotal"]:
                with self.lock:
                    live = [p for p in self.running if p.poll() is None and p.pid not in self.stopped]
                    if live:
                        self.stopped.add(live[-1].pid)
                        os.killpg(live[-1].pid, signal.SIGKILL)


def start_row(row: dict, out: Path, port: int) -> tuple[subprocess.Popen, object]:
    rdir = out / row["slug"]
    rdir.mkdir(parents=True, exist_ok=True)
    flags = row["flags"] + ["--save_dir", str(rdir / "run"), "--save_results", str(rdir / "results.json")]
    cmd = [sys.executable, str(ROOT / "bench/memory_at_peak.py"), "--out", str(rdir / "peak.txt"), "--trace",
           str(rdir / "trace.pkl"), "--", *flags]
    log = open(rdir / "log.txt", "w")
    log.write("$ " + " ".join(cmd) + "\n")
    log.flush()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // row["share"]))}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log


def finish_row(row: dict, out: Path, rc: int, wall: float, stopped: bool, timed_out: bool) -> None:
    rdir = out / row["slug"]
    log = (rdir / "log.txt").read_text(errors="replace")
    row.update(rc=rc, wall_s=round(wall, 1))
    if stopped:
        row["status"] = "stopped (host memory under the floor)"
    elif timed_out:
        row["status"] = "killed (time limit)"
    elif "ran out of GPU memory" in log or "out of memory" in log.lower():
        row["status"] = "OOM"
    elif "this configuration does not fit" in log:
        row["status"] = "refused by the plan"
    else:
        row["status"] = "ok" if rc == 0 else f"failed (rc {rc})"
    errors = [line for line in log.splitlines() if line.startswith("error:") or "Error" in line]
    if errors and row["status"] != "ok":
        row["error"] = errors[-1][:400]
    try:
        iters = json.loads((rdir / "results.json").read_text())["iterations"]
    except (OSError, ValueError, KeyError):
        iters = []
    if iters:
        last = iters[-1]["per_rank"][0]
        row.update(gpu_gib=max(max(r["peak_mem_bytes"]) for r in iters) / GiB,
                   rss_gib=last.get("host_rss_bytes", 0) / GiB, pinned_gib=last.get("host_pinned_bytes", 0) / GiB,
                   step_s=iters[-1]["step_time_s"], tflops=iters[-1].get("tflops_per_gpu"))
        row["host_gib"] = row["rss_gib"]  # page-locked blocks are resident too
    for k, mine in (("plan_gib", "gpu_gib"), ("plan_host_gib", "host_gib")):
        if row.get(k) and row.get(mine) is not None:
            row[mine.replace("_gib", "_under")] = round(1 - row[mine] / row[k], 4)  # > 0: under the plan
    trace = rdir / "trace.pkl"
    if trace.exists() and not (rdir / "peak.txt").exists():  # a run that ran out of memory left only its history
        subprocess.run([sys.executable, str(ROOT / "bench/memory_at_peak.py"), "--out", str(rdir / "peak.txt"),
                        "--replay", str(trace), "--tokens", str(row["tokens"])], cwd=ROOT, capture_output=True,
                       timeout=300)
    trace.unlink(missing_ok=True)  # too big to bring back; the report has what it says


def table(rows: list[dict]) -> str:
    head = ("| row | status | config (the plan's) | GPU GiB (plan) | under plan | host GiB (plan) | under plan | "
            "s/step | alone |\n|---|---|---|---|---|---|---|---|---|")
    out = [head]
    for r in rows:
        cfg = (f"{r['num_stages']} stages, seq_chunks {r['seq_chunks']}, tiled {r['tiled_mlp']}, resident "
               f"{r['resident_stages']}") if "num_stages" in r else r.get("plan_error", "")

        def fmt(k, digits=2):
            return f"{r[k]:.{digits}f}" if isinstance(r.get(k), (int, float)) else "-"
        under = {k: f"{100 * r[k]:.1f}%" if isinstance(r.get(k), float) else "-" for k in ("gpu_under", "host_under")}
        out.append(f"| {r['name']} ({r.get('tokens', '')}) | {r.get('status', 'not run')} | {cfg} | "
                   f"{fmt('gpu_gib')} ({fmt('plan_gib')}) | {under['gpu_under']} | {fmt('host_gib')} "
                   f"({fmt('plan_host_gib')}) | {under['host_under']} | {fmt('step_s')} | "
                   f"{'yes' if r.get('alone') else 'no'} |")
    return "\n".join(out)


def write(out: Path, rows: list[dict], extra: dict) -> None:
    (out / "matrix.json").write_text(json.dumps({**extra, "rows": rows}, indent=1))
    (out / "matrix.md").write_text(table(rows) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--rows", default=DEFAULT_ROWS)
    p.add_argument("--cap_gb", type=float, default=24.0)
    p.add_argument("--budget_s", type=float, default=540.0, help="the whole call, archives included")
    p.add_argument("--parallel", type=int, default=3, help="rows at a time")
    p.add_argument("--iterations", type=int, default=2,
                   help="steps a row trains (1 for a row whose step alone is minutes: its first step holds every peak)")
    p.add_argument("--host_floor", type=float, default=HOST_FLOOR, help="share of the host's memory kept available")
    p.add_argument("--list", action="store_true")
    p.add_argument("--summarise", default=None)
    p.add_argument("--replan", default=None, help="a finished matrix's folder: today's plan for its measured rows")
    args = p.parse_args()
    if args.summarise:
        print(table(json.loads((Path(args.summarise) / "matrix.json").read_text())["rows"]))
        return 0
    if args.replan:
        print(replan(json.loads((Path(args.replan) / "matrix.json").read_text())["rows"]))
        return 0
    names = [n for n in args.rows.split(",") if n]
    for n in names:
        parse_row(n)
    if args.list:
        for n in names:
            job, length = parse_row(n)
            print(n, " ".join(row_flags(job, 4096 if not length.isdigit() else int(length), length == "short",
                                        args.cap_gb, None)))
        return 0
    if not args.out:
        raise SystemExit("error: --out is needed (where the rows write)")
    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    host_gb = meminfo()["MemAvailable"] / GiB  # each row's own check sizes against the machine, not its neighbours
    rows = []
    for n in names:
        job, length = parse_row(n)
        tokens = longest_tokens(job, args.cap_gb, host_gb) if length == "longest" else \
            (512 * 8 if length == "short" else int(length))
        flags = row_flags(job, tokens, length == "short", args.cap_gb, host_gb, args.iterations)
        row = {"name": n, "slug": n.replace("@", "_"), "job": job, "tokens": tokens, "flags": flags}
        row.update(plan_of(flags))
        steps = STEP_S[job]
        step = steps.get(tokens) or steps[max(steps)] * (tokens / max(steps)) ** 2
        shared = 1.5 if args.parallel > 1 else 1.15  # sharing the GPU: half as long again
        row["limit_s"] = START_S[job] + args.iterations * step * shared + 45
        rows.append(row)
    extra = {"cap_gb": args.cap_gb, "host_available_gib": host_gb, "versions": versions()}
    write(out, rows, extra)
    print(f"plans made in {time.time() - t0:.0f}s", flush=True)
    watch = HostWatch(args.host_floor)
    watch.start()
    import torch

    gpu_gib = torch.cuda.get_device_properties(0).total_memory / GiB if torch.cuda.is_available() else 0.0
    slots = max(1, min(args.parallel, int(0.95 * gpu_gib // args.cap_gb) if gpu_gib else args.parallel))
    pending = [r for r in rows if "plan_error" not in r and r.get("plan_fits")]
    for r in rows:
        if r not in pending:
            r["status"] = r.get("status") or ("plan error" if "plan_error" in r else "refused by the plan")
    running: list[tuple[dict, subprocess.Popen, object, float]] = []
    port = 29600
    while pending or running:
        left = args.budget_s - (time.time() - t0) - 30
        for entry in list(running):
            r, proc, log, started = entry
            timed_out = time.time() - started > r["limit_s"] or left < 0
            if timed_out and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            if proc.poll() is not None:
                log.close()
                with watch.lock:
                    watch.running.remove(proc)
                r["alone"] = r.get("alone", True) and not any(o is not r for o, *_ in running)
                finish_row(r, out, proc.returncode, time.time() - started, proc.pid in watch.stopped, timed_out)
                running.remove(entry)
                print(f"{r['name']}: {r['status']} at {time.time() - t0:.0f}s", flush=True)
                write(out, rows, extra)
        host_in_use = sum(r["plan_host_gib"] for r, *_ in running)
        for r in list(pending):
            if len(running) >= slots:
                break
            if r["limit_s"] > left:
                r["status"] = "skipped (budget)"
                pending.remove(r)
                continue
            if running and host_in_use + r["plan_host_gib"] > 0.85 * host_gb:
                continue  # waits for memory, in order
            r["share"] = min(slots, len(pending) + len(running))
            proc, log = start_row(r, out, port)
            port += 1
            with watch.lock:
                watch.running.append(proc)
            for o, *_ in running:
                o["alone"] = False
            r["alone"] = not running
            running.append((r, proc, log, time.time()))
            host_in_use += r["plan_host_gib"]
            pending.remove(r)
            print(f"{r['name']}: started ({r['tokens']} tokens) at {time.time() - t0:.0f}s", flush=True)
        time.sleep(1.0)
    watch.done.set()
    extra["host_min_available_gib"] = watch.min_available / GiB
    write(out, rows, extra)
    with tarfile.open(out / "rows.tgz", "w:gz") as tar:
        for r in rows:
            rdir = out / r["slug"]
            for f in ("log.txt", "peak.txt"):
                if (rdir / f).exists():
                    tar.add(rdir / f, arcname=f"{r['slug']}/{f}")
    print(table(rows))
    return 0


def replan(rows: list[dict]) -> str:
    """The plan as the code makes it now for the configuration each measured row ran (its stages,
    segments, tiles and resident stages as resolved then), beside the measured peaks: how an
    estimate changed since is checked against what was measured, on any machine. Without a GPU
    the cuDNN probe's answer is taken as a GPU's (whole causal rows take cuDNN's kernel)."""
    import contextlib
    from unittest import mock

    import torch

    from pipeline.config import parse_args
    from pipeline.plan import fit
    from pipeline.plan.preflight import read_model
    from pipeline.plan.resolve import resolve
    from schedule import round_robin

    def as_on_a_gpu(dtype, *heads):  # the GPU's answer where the rows are cuDNN's candidates
        return True

    out = ["| row | GPU GiB measured | plan then | plan now | under plan now | host GiB measured | plan then | "
           "plan now | under plan now |", "|---|---|---|---|---|---|---|---|---|"]
    probe = contextlib.nullcontext() if torch.cuda.is_available() else mock.patch.object(fit, "cudnn_probe",
                                                                                        as_on_a_gpu)
    with probe:
        for r in rows:
            if r.get("gpu_gib") is None:
                continue
            flags = list(r["flags"])
            for key in ("num_stages", "resident_stages", "seq_chunks", "tiled_mlp"):  # as resolved then, not auto
                if f"--{key}" in flags:
                    flags[flags.index(f"--{key}") + 1] = str(r[key])
                else:
                    flags += [f"--{key}", str(r[key])]
            cfg, _, _ = parse_args(flags)
            hf = read_model(cfg, 1).config
            res = resolve(cfg, 1, hf)
            a = fit.assess_spec(res.spec, round_robin(cfg.num_stages, 1))
            gpu, host = a.worst.device_peak / GiB, a.total_host / GiB
            out.append(f"| {r['name']} | {r['gpu_gib']:.2f} | {r['plan_gib']:.2f} | {gpu:.2f} | "
                       f"{100 * (1 - r['gpu_gib'] / gpu):.1f}% | {r['rss_gib']:.2f} | {r['plan_host_gib']:.2f} | "
                       f"{host:.2f} | {100 * (1 - r['rss_gib'] / host):.1f}% |")
    return "\n".join(out)


def versions() -> dict:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "cores": len(os.sched_getaffinity(0))}


if __name__ == "__main__":
    sys.exit(main())
