"""Offload-engine benchmark: Llama-2 architecture (random weights, no download), full fine-tuning
on the GPUs of one node, each row a separate ``torchrun`` of ``main.py`` (or of the FSDP2 baseline).

    python bench/offload_bench.py --out bench_results            # every row, in priority order
    python bench/offload_bench.py --rows pcie48-prefetch,pcie48-fsdp2 --budget_s 400
    python bench/offload_bench.py --summarise bench/results/2026-11-22_7b_two_gpus_every_stage_offloaded/callA --warmup 2

Rows are named ``<net><cap>-<mode>[-noclip][-eager][/s<stages>][+<mapping>][@<model>][~<flag>=<value>...]``,
the optional suffixes in exactly that order (``pcie48-prefetch-noclip/s16+cross@llama-2-13b~keep_layers=-1``):

- net ``pcie`` sets NCCL_P2P_DISABLE=1 (GPUs cannot talk directly: inter-GPU traffic goes through
  host memory, as on a commodity PCIe server); ``nvlink`` leaves the machine as it is;
- cap is the per-GPU memory cap in GiB;
- mode is ``prefetch`` (offload + prefetch, every stage offloaded: ``--resident_stages 0``),
  ``noprefetch`` (the same, loads not overlapped), ``hybrid`` (offload + prefetch with
  ``--resident_stages -1``: each GPU keeps as many of its stages, and their AdamW, as fit in 90% of the
  cap), ``delayed`` (``prefetch`` with ``--delayed_update``: not exact, each CPU step overlaps the next
  iteration), ``actoff`` (``prefetch`` with ``--activation_offload``: stage inputs wait in host memory,
  each backward recomputes its stage), ``resident`` (no offload) or ``fsdp2`` (PyTorch FSDP2 + CPUOffloadPolicy + activation
  checkpointing);
- ``-noclip`` trains without gradient clipping (``--grad_clip 0 --max_skipped_steps -1``: no NORM,
  so each stage's CPU step starts as soon as its gradients are in host memory); rows clip at 1.0
  otherwise;
- ``-eager`` passes ``--compile_layers false`` (rows compile their decoder layers otherwise, main.py's
  default on a GPU);
- ``/s<stages>`` overrides ``--num_stages`` for the row;
- ``+cross`` / ``+sequential`` passes ``--mapping planned|round_robin --timeline``: the row also reports
  main.py's mapping line and the timeline's measured step, cost-model step and prediction error
  (``timeline.png`` / ``timeline.json`` stay in ``<out>/<row>/``);
- ``@<model>`` overrides ``--model`` (a preset name: letters, digits, ``.``, ``-``, ``_``);
- ``~<flag>=<value>`` (repeatable) passes ``--<flag> <value>`` to main.py after the row's own flags, so
  that one setting can be compared within a call (``~fuse_last_stage=false``, ``~partition=layers``).

``-noclip``, ``-eager``, ``/s``, ``+`` and ``~`` apply to main.py rows only (not ``fsdp2``). Rows run until ``--budget_s`` is spent;
the table (step time = mean after the warm-up iterations, with its compute / exposed-wait / other
breakdown, and the host's time in Python's cyclic garbage collector, which may fall in any
part) and, for ``+<mapping>`` rows, a mapping table are printed at the end and written to
``<out>/table.md`` and ``<out>/rows.json``. Files of a row are named by ``slug(row)`` (``/`` -> ``_``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from guarded import HOST_STOPPED, STOPPED_STATUS, TIMED_OUT, run_guarded  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODES = ("prefetch", "noprefetch", "hybrid", "delayed", "actoff", "resident", "fsdp2")
MAPPINGS = ("cross", "sequential")
DEFAULT_ROWS = ("pcie48-prefetch,pcie48-hybrid,pcie48-fsdp2,pcie48-resident,pcie48-noprefetch,pcie24-prefetch,"
                "pcie24-fsdp2,pcie24-resident,nvlink48-prefetch,nvlink48-hybrid,nvlink48-fsdp2,nvlink48-resident")
ROW_RE = re.compile(rf"(pcie|nvlink)([1-9]\d*)-({'|'.join(MODES)})(-noclip)?(-eager)?(?:/s([1-9]\d*))?(?:\+({'|'.join(MAPPINGS)}))?"
                    r"(?:@([\w.-]+?))?((?:~[a-z_]+=[\w.-]+)*)")
TIMELINE_RE = re.compile(r"timeline: measured step ([\d.]+)s, cost model(?: \([^)]*\))? ([\d.]+)s, "
                         r"prediction error ([+-]?[\d.]+)%")
# the older mode names too: earlier results' logs say auto, cross, sequential or manual
MAPPING_RE = re.compile(r"(mapping (?:planned|round_robin|auto|cross|sequential|manual)\b[^:]*:.*)$", re.M)
RESIDENT_RE = re.compile(r"offload: (\d+) of (\d+) stages per GPU stay resident")
KEPT_RE = re.compile(r"recompute: (\d+) of (\d+) decoder layers keep their activations")
BREAKDOWN = ("compute", "load_wait", "offload_wait", "optimizer_wait")


class Row(NamedTuple):
    net: str
    cap: int
    mode: str
    noclip: bool
    stages: int | None
    mapping: str | None
    model: str | None
    eager: bool = False
    flags: tuple[tuple[str, str], ...] = ()  # ~<flag>=<value>


def parse_row(name: str) -> Row:
    """``<net><cap>-<mode>[-noclip][-eager][/s<stages>][+<mapping>][@<model>][~<flag>=<value>...]`` -> ``Row``;
    a bad name exits with one error line."""
    m = ROW_RE.fullmatch(name)
    if m is None or (m[3] == "fsdp2" and (m[4] or m[5] or m[6] or m[7] or m[9])):
        raise SystemExit(f"error: bad row name {name!r}; expected "
                         f"<net><cap>-<mode>[-noclip][-eager][/s<stages>][+<mapping>][@<model>][~<flag>=<value>...], "
                         f"e.g. pcie48-prefetch/s16+cross@llama-2-13b~keep_layers=-1 (net: pcie, nvlink; modes: "
                         f"{', '.join(MODES)}; mappings: {', '.join(MAPPINGS)}; -noclip, -eager, /s, + and ~ not "
                         f"with fsdp2)")
    net, cap, mode, noclip, eager, stages, mapping, model, flags = m.groups()
    pairs = tuple(tuple(f.split("=", 1)) for f in flags.split("~")[1:])
    return Row(net, int(cap), mode, bool(noclip), int(stages) if stages else None, mapping, model, bool(eager), pairs)


def slug(name: str) -> str:
    """A row name usable as a file name."""
    return name.replace("/", "_")


def failure(log: str, rc: int) -> str:
    """A failed row's status: OOM when it ran out of GPU memory, or when main.py's plan refused it
    up front (the plan's line, which says how much it needs, is in the row's log)."""
    if "OutOfMemory" in log or "out of memory" in log.lower():
        return "OOM"
    if "this configuration does not fit" in log:
        return "OOM (plan, before start)"
    if TIMED_OUT in log:
        return "killed (time limit)"
    if HOST_STOPPED in log:
        return STOPPED_STATUS
    return f"failed (rc {rc})"


def parse_log(log: str) -> dict:
    """The mapping line, the resident stages per GPU and the timeline's step times / prediction
    error from a main.py log (None if absent)."""
    mapping = MAPPING_RE.search(log)
    tl = TIMELINE_RE.search(log)
    resident = RESIDENT_RE.search(log)
    kept = KEPT_RE.search(log)
    measured, predicted, err = (float(v) for v in tl.groups()) if tl else (None, None, None)
    return {"mapping_line": mapping[1].strip() if mapping else None, "measured_timeline_step_s": measured,
            "predicted_step_s": predicted, "prediction_error_pct": err,
            "resident_stages": f"{resident[1]}/{resident[2]}" if resident else None,
            "kept_layers": f"{kept[1]}/{kept[2]}" if kept else None}


def run_row(name: str, args, out: Path, timeout: float) -> dict:
    row = parse_row(name)
    net, cap, mode, noclip, stages, mapping = row.net, row.cap, row.mode, row.noclip, row.stages, row.mapping
    model = row.model or args.model
    env = dict(os.environ)
    if net == "pcie":
        env["NCCL_P2P_DISABLE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    result = out / f"{slug(name)}.json"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}"]
    if mode == "fsdp2":
        cmd = launch + [str(ROOT / "bench/fsdp2_baseline.py"), "--model", model, "--batch_size",
                        str(args.batch_size), "--seq_length", str(args.seq_length), "--micro_batch",
                        str(args.fsdp_micro_batch), "--iterations", str(args.iterations), "--warmup", str(args.warmup),
                        "--mem_cap_gb", str(cap), "--json", str(result)]
        if cap <= 24:  # deferred gradient sync keeps full fp32 grads (27 GiB for 7B): sync each micro-batch
            cmd.append("--sync_each_micro")
    else:
        cmd = launch + [str(ROOT / "main.py"), "--config", "", "--model", model, "--dataset", "synthetic",
                        "--seq_length", str(args.seq_length), "--batch_size", str(args.batch_size),
                        "--num_chunks", str(args.num_chunks), "--num_stages", str(stages or args.num_stages),
                        "--schedule", args.schedule, "--num_iterations", str(args.iterations),
                        "--gpu_memory_gb", str(cap), "--device", "cuda", "--no_save_model",
                        "--save_dir", str(out / slug(name)), "--save_results", str(result), "--comm_timeout_s", "150",
                        "--activation_checkpointing" if args.checkpointing else "--no_activation_checkpointing",
                        "--use_offload" if mode != "resident" else "--no_offload",
                        "--use_prefetch" if mode in ("prefetch", "hybrid", "delayed", "actoff") else "--no_prefetch",
                        "--resident_stages", "-1" if mode == "hybrid" else "0", "--keep_layers", str(args.keep_layers),
                        "--data_parallel", str(args.data_parallel)]
        cmd += ["--delayed_update"] if mode == "delayed" else []
        cmd += ["--compile_layers", "false"] if row.eager else []
        cmd += ["--activation_offload"] if mode == "actoff" else []
        cmd += ["--grad_clip", "0", "--max_skipped_steps", "-1"] if noclip else ["--grad_clip", "1.0"]
        cmd += ["--mapping", {"cross": "planned", "sequential": "round_robin"}[mapping], "--timeline"] if mapping else []
        cmd += [arg for flag, value in row.flags for arg in (f"--{flag}", value)]  # last: they override
    got = run_guarded(cmd, env, timeout, out / f"{slug(name)}.log", cwd=ROOT)
    log, rc = got.log, got.rc
    row = {"row": name, "model": model, "net": net, "cap_gb": cap, "mode": mode, "stages": stages, "mapping": mapping,
           "rc": rc, "wall_s": round(got.wall_s, 1), **(parse_log(log) if mode != "fsdp2" else {})}
    if rc == 0 and result.exists():
        row.update(summarise(json.loads(result.read_text()), mode, args))
    else:
        row["status"] = failure(log, rc)
    return row


def summarise(res: dict, mode: str, args) -> dict:
    if mode == "fsdp2":
        return {"status": res.get("status", "ok"), **{k: res.get(k) for k in ("step_time_s", "tokens_per_s",
                                                                                "tflops_per_gpu")},
                "peak_allocated_gb": res.get("peak_allocated_gib"), "peak_reserved_gb": res.get("peak_reserved_gib"),
                "host_rss_gb": sum(res.get("host_rss_peak_gib_per_rank") or []) or None}  # GiB, all ranks
    its = res["iterations"][args.warmup:]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    per_rank = [rank for r in its for rank in r["per_rank"]]
    total = lambda key: sum(rank.get(key, 0) for rank in per_rank)  # noqa: E731
    gb = 2**30
    h2d_b, h2d_s, d2h_b, d2h_s = (total(k) for k in ("h2d_bytes", "h2d_seconds", "d2h_bytes", "d2h_seconds"))
    last = res["iterations"][-1]
    step = mean([r.get("step_time_s", r.get("time_s")) for r in its])  # time_s: results.json before the rename
    parts = {f"{k}_s": mean([rank.get(f"{k}_seconds", 0) for rank in per_rank]) for k in BREAKDOWN}
    return {
        "status": "ok",
        "step_time_s": step,
        **parts,
        "other_s": step - sum(parts.values()),  # bubbles and p2p communication
        "gc_s": mean([rank.get("gc_seconds", 0) for rank in per_rank]),  # host, inside any of the above
        "tokens_per_s": mean([r["tokens_per_s"] for r in its]),
        "tflops_per_gpu": mean([r["tflops_per_gpu"] for r in its]),
        "peak_allocated_gb": max(last["peak_mem_bytes"]) / gb,
        "peak_allocated_gb_per_rank": [round(b / gb, 2) for b in last["peak_mem_bytes"]],
        "peak_reserved_gb": max(r.get("peak_reserved_bytes", 0) for r in last["per_rank"]) / gb,
        "host_rss_gb": sum(r.get("host_rss_bytes", 0) for r in last["per_rank"]) / gb,
        "h2d_gbps": h2d_b / h2d_s / 1e9 if h2d_s else None,
        "d2h_gbps": d2h_b / d2h_s / 1e9 if d2h_s else None,
        "losses": [r["loss"] for r in res["iterations"]],
    }


def describe(row: dict) -> str:
    """What main.py chose for a row: the resident stages (hybrid) and the layers kept from recompute."""
    chosen = ((row.get("resident_stages"), "stages resident"), (row.get("kept_layers"), "layers kept"))
    return ", ".join(f"{value} {what}" for value, what in chosen if value and not value.startswith("0/"))


def fmt(v: float | None, p: int = 2) -> str:
    return "-" if v is None else f"{v:.{p}f}"


def table(rows: list[dict]) -> str:
    """The main markdown table, one line a row; rows that did not finish show only their status."""
    head = ("| row | status | step s | compute s | load wait s | offload wait s | optim wait s | other s | GC s | "
            "tokens/s | TFLOP/s/GPU | peak alloc GiB (max rank) | peak reserved GiB | host RSS GiB (all ranks) | "
            "H2D GB/s | D2H GB/s |\n|" + "---|" * 16)
    lines = [head]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['row']} | {r.get('status')} |" + " |" * 14)
            continue
        name = f"{r['row']} ({describe(r)})" if describe(r) else r["row"]
        parts = " | ".join(fmt(r.get(k)) for k in (*(f"{k}_s" for k in BREAKDOWN), "other_s", "gc_s"))
        lines.append(f"| {name} | ok | {fmt(r['step_time_s'])} | {parts} | {fmt(r['tokens_per_s'], 0)} | "
                     f"{fmt(r['tflops_per_gpu'], 1)} | {fmt(r['peak_allocated_gb'], 1)} | "
                     f"{fmt(r['peak_reserved_gb'], 1)} | {fmt(r['host_rss_gb'], 1)} | {fmt(r.get('h2d_gbps'), 1)} | "
                     f"{fmt(r.get('d2h_gbps'), 1)} |")
    return "\n".join(lines)


def short_mapping(line: str | None) -> str:
    """``mapping <mode>: stage -> rank [...]`` plus the planner's predicted step, without the topology detail."""
    if not line:
        return "-"
    head = re.split(r" \((?:position|asked)", line)[0]
    pred = re.search(r"predicted step \S+, round_robin \S+ \([^)]*\)", line)
    return head + (f"; {pred[0]}" if pred else "")


def mapping_table(rows: list[dict]) -> str:
    """The markdown table of the ``+<mapping>`` rows ('' when there are none)."""
    picked = [r for r in rows if "+" in r["row"]]
    if not picked:
        return ""
    lines = ["| row | step s | mapping | timeline measured step s | cost model step s | prediction error % |",
             "|---|---|---|---|---|---|"]
    for r in picked:
        lines.append(f"| {r['row']} | {fmt(r.get('step_time_s'))} | {short_mapping(r.get('mapping_line'))} | "
                     f"{fmt(r.get('measured_timeline_step_s'), 3)} | {fmt(r.get('predicted_step_s'), 3)} | "
                     f"{fmt(r.get('prediction_error_pct'), 1)} |")
    return "\n".join(lines)


def tables(rows: list[dict]) -> str:
    """The main table and, when there are ``+<mapping>`` rows, the mapping table."""
    return "\n\n".join(t for t in (table(rows), mapping_table(rows)) if t)


def resummarise(run_dir: Path, warmup: int) -> str:
    """The tables of a finished run, its main.py rows summarised again with ``warmup`` untimed
    iterations (FSDP2 rows as they were recorded)."""
    data = json.loads((run_dir / "rows.json").read_text())
    rows = []
    for row in data["rows"]:
        result, log = (run_dir / f"{slug(row['row'])}{ext}" for ext in (".json", ".log"))
        if row.get("status") == "ok" and row.get("mode") != "fsdp2" and result.exists():
            settings = argparse.Namespace(**{**data.get("args", {}), "warmup": warmup})
            row = {**row, **summarise(json.loads(result.read_text()), row["mode"], settings)}
        elif row.get("status") != "ok" and log.exists():
            row = {**row, "status": failure(log.read_text(), row.get("rc", 1))}
        rows.append(row)
    return tables(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=DEFAULT_ROWS)
    p.add_argument("--model", default="llama-2-7b")
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--seq_length", type=int, default=512)
    p.add_argument("--num_chunks", type=int, default=16)
    p.add_argument("--num_stages", type=int, default=8)
    p.add_argument("--schedule", default="1f1b", help="main.py's default; every row of the README uses it")
    p.add_argument("--fsdp_micro_batch", type=int, default=32,
                   help="fsdp2 rows: micro-batch per rank (the best known at 64 x 512 on 2 GPUs; bench/peers.py sweeps it)")
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations (the first steps also fault in host memory)")
    p.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--keep_layers", type=int, default=-1, help="main.py's keep_layers for every row (-1 = auto)")
    p.add_argument("--data_parallel", type=int, default=1,
                   help="main.py's data_parallel for every row: replicas of a pipeline of --gpus / D ranks")
    p.add_argument("--budget_s", type=float, default=540)
    p.add_argument("--row_timeout_s", type=float, default=240)
    p.add_argument("--out", default="bench_results")
    p.add_argument("--summarise", metavar="DIR", default=None,
                   help="run nothing: print the tables of a finished run's DIR again (its rows.json and "
                        "per-row JSON files), with this --warmup")
    args = p.parse_args()
    if args.summarise:
        print(resummarise(Path(args.summarise), args.warmup))
        return
    names = args.rows.split(",")
    for name in names:  # every name checked before the first (long) run
        parse_row(name)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start, rows = time.time(), []
    for name in names:
        left = args.budget_s - (time.time() - start)
        if left < 30:
            rows.append({"row": name, "status": "not run (budget)"})
            continue
        row = run_row(name, args, out, min(args.row_timeout_s, left))
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / "rows.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    text = tables(rows)
    (out / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
