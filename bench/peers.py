"""Every peer on this project's job, each at its best, in one table.

    python3 bench/peers.py --out OUT --budget_s 420                  # run the peers, print the table
    python3 bench/peers.py --summarise OUT                           # the table of a finished run again

The job: Llama-2-7B architecture with random weights, global batch 64 x 512 tokens, bf16 compute,
a 48 GiB per-GPU cap, activation checkpointing, ``NCCL_P2P_DISABLE=1``, 2 GPUs. Peers, each a
sweep in one process (one build) that writes ``OUT/peers/<peer>.json`` (``bench/sweep.py``'s format)
and its log next to it:

- ``fsdp2``: ``bench/fsdp2_baseline.py`` (FSDP2 + CPUOffloadPolicy), micro-batch per rank 32, 16, 8,
  4, each with and without gradient sync per micro-batch;
- ``deepspeed``: ``bench/deepspeed_baseline.py`` (ZeRO-2 + offload_optimizer cpu), micro-batch 32, 16, 8;
- ``roundpipe``: ``bench/roundpipe_baseline.py`` (RoundPipe 0.1.1), asynchronous and synchronous
  steps (systems ``roundpipe-async``, ``roundpipe-sync``) at several micro-batch counts.

Each peer runs with its threads as its docs advise (``OMP_NUM_THREADS`` = the cores of one rank:
all of them for RoundPipe's single process) and, for DeepSpeed and RoundPipe, the allocator setting
their authors' benchmarks use (``expandable_segments:True``). A peer runs within its budget (its
share of ``--budget_s``, never past what is left) and is killed 90 s after it; a peer that fails
leaves its status in the table and the others run. This project's rows come from
``bench/offload_bench.py``'s ``rows.json`` (``--ours DIR``, default ``OUT/bench``).

LoRA: ``--lora_rank R`` (with ``--lora_alpha``, ``--lora_target_modules``) makes the job peft's
LoRA on the frozen model, passed to ``fsdp2`` and ``roundpipe`` (their LoRA setups: their scripts'
docstrings); the peers are then those two, as DeepSpeed is not needed for the LoRA tables and its
script has no LoRA switch (``--peers deepspeed`` with ``--lora_rank`` is refused). A row of this
project run by main.py itself (``bench/lora_rows.sh``) joins the table with ``--ours_results
NAME=PATH`` (PATH: its ``save_results`` file). The one-GPU LoRA table::

    python3 bench/peers.py --gpus 1 --cap_gb 24 --model llama-3-8b --lora_rank 16 --lora_alpha 32 \
        --lora_target_modules all-linear --out OUT --ours_results lora-8b=OUT/results.json

The table (``OUT/peers.md``, ``OUT/peers.json``) has one line per system: its best point (the sweep
stays in the peer's JSON), s/step, peak GPU memory (allocated, largest GPU), exact (the update
each step is the synchronous one: RoundPipe's asynchronous step uses one-step-old weights),
tokens/s, model TFLOP/s per GPU = 6 x N x tokens / s / GPUs for every row alike, and for this
project's rows the time breakdown ``offload_bench`` prints.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import offload_bench  # noqa: E402
import peer_lora  # noqa: E402
import sweep  # noqa: E402
from guarded import STOPPED_STATUS, run_guarded  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PEERS = ("fsdp2", "deepspeed", "roundpipe")
LORA_PEERS = ("fsdp2", "roundpipe")  # the scripts with a LoRA switch
OURS_WARMUP = 2  # a main.py results file's first iterations left out of its row, as offload_bench's rows leave them
DEFAULT_BUDGETS = {"fsdp2": 150.0, "deepspeed": 170.0, "roundpipe": 330.0}
KILL_GRACE_S = 90.0
BREAKDOWN = ("compute_s", "load_wait_s", "offload_wait_s", "optimizer_wait_s", "other_s")


def peer_command(peer: str, args: argparse.Namespace, json_path: Path, budget_s: float) -> tuple[list[str], dict]:
    """The command line and the environment additions of one peer's sweep."""
    cores = len(os.sched_getaffinity(0))
    common = ["--model", args.model, "--batch_size", str(args.batch_size), "--seq_length", str(args.seq_length),
              "--mem_cap_gb", str(args.cap_gb), "--json", str(json_path), "--budget_s", str(round(budget_s)),
              "--grad_clip", str(args.grad_clip)]
    if args.lora_rank and peer in LORA_PEERS:  # choose_peers refused the others
        common += ["--lora_rank", str(args.lora_rank), "--lora_alpha", str(args.lora_alpha),
                   "--lora_target_modules", args.lora_target_modules]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}"]
    env = {"NCCL_P2P_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    if peer == "fsdp2":
        env["OMP_NUM_THREADS"] = str(max(1, cores // args.gpus))
        return torchrun + [str(ROOT / "bench/fsdp2_baseline.py"), *common, "--micro_batches", args.fsdp_micro_batches,
                           "--sync_modes", args.fsdp_sync_modes, "--iterations", "2", "--warmup", "2"], env
    if peer == "deepspeed":
        env.update(OMP_NUM_THREADS=str(max(1, cores // args.gpus)), PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
        return torchrun + [str(ROOT / "bench/deepspeed_baseline.py"), *common, "--micro_batches",
                           args.deepspeed_micro_batches, "--iterations", "2", "--warmup", "2"], env
    if peer == "roundpipe":
        env.update(OMP_NUM_THREADS=str(cores), PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
                   CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(args.gpus)))
        return [sys.executable, str(ROOT / "bench/roundpipe_baseline.py"), *common, "--points",
                args.roundpipe_points, "--iterations", "3", "--warmup", "1"], env
    raise SystemExit(f"error: unknown peer {peer!r}; expected one of {', '.join(PEERS)}")


def choose_peers(text: str | None, lora_rank: int) -> list[str]:
    """``--peers`` (default: every peer; with ``--lora_rank``, those with a LoRA switch); a peer
    unknown, or without a LoRA switch under ``--lora_rank``, exits with one line."""
    offered = LORA_PEERS if lora_rank else PEERS
    peers = [x for x in (text or ",".join(offered)).split(",") if x]
    for peer in peers:
        if peer not in PEERS:
            raise SystemExit(f"error: unknown peer {peer!r}; expected some of {', '.join(PEERS)}")
        if peer not in offered:
            raise SystemExit(f"error: peer {peer!r} has no LoRA switch; with --lora_rank choose among "
                             f"{', '.join(LORA_PEERS)}")
    return peers


def parse_budgets(text: str) -> dict[str, float]:
    """``"fsdp2=150,roundpipe=330"`` over the defaults."""
    budgets = dict(DEFAULT_BUDGETS)
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, _, value = item.partition("=")
        if name not in PEERS or not value:
            raise SystemExit(f"error: bad peer budget {item!r}; expected PEER=SECONDS with PEER in {', '.join(PEERS)}")
        budgets[name] = float(value)
    return budgets


def run_peer(peer: str, args: argparse.Namespace, out: Path, budget_s: float) -> dict:
    """Runs one peer's sweep; returns {peer, rc, wall_s, status} (the points are in its JSON)."""
    json_path = out / f"{peer}.json"
    cmd, env_add = peer_command(peer, args, json_path, budget_s)
    got = run_guarded(cmd, {**os.environ, **env_add}, budget_s + KILL_GRACE_S, out / f"{peer}.log", cwd=ROOT,
                      header=f"$ {' '.join(f'{k}={v}' for k, v in env_add.items())} {' '.join(cmd)}\n")
    status = STOPPED_STATUS if got.host_stopped else run_status(got.rc, got.timed_out)
    return {"peer": peer, "rc": got.rc, "wall_s": round(got.wall_s, 1), "budget_s": round(budget_s), "status": status}


def run_status(rc: int, timed_out: bool) -> str:
    """A peer run's outcome. A signal that is not ours (the kernel's OOM killer sends SIGKILL too)
    must not read as the budget's doing."""
    if rc == 0:
        return "ok"
    if timed_out:
        return "killed (budget)"
    return f"killed by signal {-rc}" if rc < 0 else f"failed (rc {rc})"


def peer_rows(peer: str, res: dict | None, run: dict | None = None) -> list[dict]:
    """The table rows of one peer's result: each system's best point, or one line with why there is none."""
    if res is None:
        why = (run or {}).get("status", "not run")
        return [{"system": peer, "status": f"no result ({why})" if run else why}]
    best = res.get("best") or sweep.best_by_system(res.get("points", []))
    systems = list(dict.fromkeys(p["system"] for p in res.get("points", [])))
    rows = []
    for system in systems or [peer]:
        p = best.get(system)
        if p is None:
            statuses = sorted({q["status"] for q in res.get("points", []) if q["system"] == system})
            rows.append({"system": system, "status": "no point measured (" + ", ".join(statuses or ["none"]) + ")"})
            continue
        n_points = sum(1 for q in res["points"] if q["system"] == system)
        cut = f" (run {run['status']})" if run and run.get("status") != "ok" else ""  # partial sweep
        rows.append({"system": system, "status": "ok", "config": config_text(p["config"]) + cut, "exact": p["exact"],
                     "step_time_s": p["step_time_s"], "peak_allocated_gib": p.get("peak_allocated_gib"),
                     "tokens_per_s": p.get("tokens_per_s"), "points": n_points,
                     "tflops_per_gpu": sweep.model_tflops_per_gpu(res["num_params"], res["tokens_per_step"],
                                                                  p["step_time_s"], res["num_gpus"],
                                                                  frozen=bool(p["config"].get("lora_rank")))})
    return rows


def config_text(cfg: dict) -> str:
    """The switches that tell one sweep point from another."""
    keys = ("micro_batch_per_rank", "grad_sync", "gradient_accumulation_steps", "num_microbatch",
            "forward_backward_per_step", "lora_rank")
    return ", ".join(f"{k}={cfg[k]}" for k in keys if k in cfg) or "-"


def our_rows(rows_json: dict, gpus: int, tokens_per_step: int) -> list[dict]:
    """This project's rows from offload_bench's rows.json, with the same TFLOP/s definition as the peers."""
    out = []
    for r in rows_json.get("rows", []):
        if r.get("status") != "ok":
            out.append({"system": f"mmoc-pipe {r['row']}", "status": r.get("status")})
            continue
        n = sweep.model_params(r.get("model") or "llama-2-7b")
        out.append({"system": f"mmoc-pipe {r['row']}", "status": "ok",
                    "config": offload_bench.describe(r) or "-", "exact": "delayed" not in r["row"],
                    "step_time_s": r["step_time_s"], "peak_allocated_gib": r.get("peak_allocated_gb"),
                    "tokens_per_s": r.get("tokens_per_s"),
                    "tflops_per_gpu": sweep.model_tflops_per_gpu(n, tokens_per_step, r["step_time_s"], gpus,
                                                                 frozen=bool(r.get("lora")))
                    if n else None, **{k: r.get(k) for k in BREAKDOWN}})
    return out


def results_row(spec: str) -> dict:
    """``NAME=PATH``: a row of this project's run by main.py itself (PATH: its ``save_results``
    file), in the form of offload_bench's rows.json rows."""
    name, sep, path = spec.partition("=")
    if not (sep and name and path):
        raise SystemExit(f"error: --ours_results {spec!r}: expected NAME=PATH (PATH: main.py's save_results file)")
    res = load_json(Path(path))
    if not res or len(res.get("iterations", [])) <= OURS_WARMUP:
        return {"row": name, "status": f"no result (no {path} with over {OURS_WARMUP} iterations)"}
    summary = offload_bench.summarise(res, "main", argparse.Namespace(warmup=OURS_WARMUP))
    config = res.get("config", {})
    return {"row": name, "model": config.get("model"), "lora": bool(config.get("lora_rank")), **summary}


def fmt(v, p: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return f"{v:.{p}f}"


def table(rows: list[dict]) -> str:
    """One markdown line per system; systems without a measured point show why."""
    head = ("| system | best config | s/step | peak GPU GiB | exact? | tokens/s | model TFLOP/s/GPU | compute s | "
            "load wait s | offload wait s | optim wait s | other s |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['system']} | {r.get('status')} |" + " |" * 10)
            continue
        parts = " | ".join(fmt(r.get(k)) for k in BREAKDOWN)
        lines.append(f"| {r['system']} | {r.get('config', '-')} | {fmt(r['step_time_s'])} | "
                     f"{fmt(r.get('peak_allocated_gib'), 1)} | {fmt(r.get('exact'))} | {fmt(r.get('tokens_per_s'), 0)} | "
                     f"{fmt(r.get('tflops_per_gpu'), 1)} | {parts} |")
    return "\n".join(lines)


def load_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def collect(out: Path, ours: Path | None, peers: list[str], runs: dict[str, dict], gpus: int,
            tokens_per_step: int, ours_results: list[str] = ()) -> list[dict]:
    """Our rows (offload_bench's, when their rows.json exists; then main.py's ``ours_results``),
    then each peer's best rows."""
    ours_json = (load_json(ours / "rows.json") if ours else None) or {"rows": []}
    rows = our_rows({"rows": ours_json["rows"] + [results_row(spec) for spec in ours_results]}, gpus,
                    tokens_per_step)
    for peer in peers:
        res = load_json(out / "peers" / f"{peer}.json")
        rows += peer_rows(peer, res, runs.get(peer))
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="peer_results")
    p.add_argument("--ours", default=None, help="offload_bench's output directory (default OUT/bench)")
    p.add_argument("--ours_results", action="append", default=[], metavar="NAME=PATH",
                   help="a row of this project's run by main.py (PATH: its save_results file); repeatable")
    p.add_argument("--peers", default=None, help=f"default {','.join(PEERS)}; with --lora_rank {','.join(LORA_PEERS)}")
    p.add_argument("--budget_s", type=float, default=420.0, help="all peers together")
    p.add_argument("--peer_budgets", default="", help="PEER=SECONDS,... over " +
                   ",".join(f"{k}={v:.0f}" for k, v in DEFAULT_BUDGETS.items()))
    p.add_argument("--model", default="llama-2-7b")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--cap_gb", type=float, default=48.0)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--seq_length", type=int, default=512)
    p.add_argument("--grad_clip", type=float, default=1.0,
                   help="every peer clips at this norm (0: none; compare with this project's -noclip rows); host "
                        "gradients' norms on every core (bench/host_clip.py), DeepSpeed's on the GPU")
    p.add_argument("--fsdp_micro_batches", default="32,16,8,4")
    p.add_argument("--fsdp_sync_modes", default="deferred,each", help="FSDP2's gradient sync modes to sweep")
    p.add_argument("--deepspeed_micro_batches", default="32,16,8")
    p.add_argument("--roundpipe_points", default="async:8,sync:8,async:4,sync:4,async:16,sync:16")
    p.add_argument("--summarise", metavar="OUT", default=None, help="run nothing: print OUT's table again")
    peer_lora.add_args(p)
    args = p.parse_args(argv)
    peer_lora.check(args)
    args.peers = choose_peers(args.peers, args.lora_rank)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    peers = args.peers
    tokens_per_step = args.batch_size * args.seq_length
    if args.summarise:
        out = Path(args.summarise)
        runs = {r["peer"]: r for r in (load_json(out / "peers.json") or {}).get("runs", [])}
        print(table(collect(out, Path(args.ours) if args.ours else out / "bench", peers, runs, args.gpus,
                            tokens_per_step, args.ours_results)))
        return
    budgets = parse_budgets(args.peer_budgets)
    out = Path(args.out)
    (out / "peers").mkdir(parents=True, exist_ok=True)
    start, runs = time.time(), {}
    for peer in peers:
        left = args.budget_s - (time.time() - start)
        budget = min(budgets[peer], left)
        if budget < 60:
            runs[peer] = {"peer": peer, "status": "not run (budget)", "budget_s": round(max(budget, 0))}
        else:
            print(f"peers: {peer} with a budget of {budget:.0f}s", flush=True)
            runs[peer] = run_peer(peer, args, out / "peers", budget)
        print(json.dumps(runs[peer]), flush=True)
    rows = collect(out, Path(args.ours) if args.ours else out / "bench", peers, runs, args.gpus, tokens_per_step,
                   args.ours_results)
    text = table(rows)
    (out / "peers.md").write_text(text + "\n")
    (out / "peers.json").write_text(json.dumps({"args": vars(args), "runs": list(runs.values()), "rows": rows},
                                               indent=1))
    print(text)


if __name__ == "__main__":
    main()
