"""What is on the GPU at a run's peak: one training run (main.py's flags, one process) with the
caching allocator's history on, then the allocations alive at the highest point of allocated
memory, grouped by the line of this project that made them (and the library call under it).
This is how the memory plan's estimate is checked term by term where it and a measurement
disagree (issue 28: ``--plan`` is a promise).

    python3 bench/memory_at_peak.py --out OUT/peak_16k.txt -- --config "" --model llama-3b \\
        --dataset synthetic --device cuda --seq_length 16384 ... (any main.py flags)

The report: ``--plan``'s text for the same flags, the peak as ``max_memory_allocated`` and as
replayed from the history (they agree where the history holds every event), then the groups,
largest first.
"""
from __future__ import annotations

import argparse
import io
import os
import pickle
import sys
from collections import defaultdict
from contextlib import redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GiB = 2**30


def replay(events: list[dict]) -> tuple[int, dict[int, dict]]:
    """The peak of allocated bytes over ``events`` (the allocator's trace of one device) and the
    allocations alive at it, by address. A block counts from its ``alloc`` until its
    ``free_requested``, as in ``memory_allocated``: the allocator counts a block freed while
    other streams still use it as free at once, and hands it out again only later
    (``free_completed``)."""
    def walk(stop: int | None):
        live: dict[int, dict] = {}
        now = peak = 0
        at = -1
        for i, e in enumerate(events):
            if stop is not None and i > stop:
                break
            if e["action"] == "alloc":
                live[e["addr"]] = e
                now += e["size"]
                if now > peak:
                    peak, at = now, i
            elif e["action"] == "free_requested" and e["addr"] in live:
                now -= live.pop(e["addr"])["size"]
        return peak, at, live

    peak, at, _ = walk(None)
    _, _, live = walk(at)
    return peak, live


def origin(frames: list[dict]) -> str:
    """``file:line function`` of the innermost frame in this project (not its tests or bench),
    and the innermost frame's function where that is a library's."""
    mine = next((f for f in frames if f["filename"].startswith(str(ROOT)) and "/bench/" not in f["filename"]), None)
    if mine is None:
        return frames[0]["filename"].rsplit("/", 1)[-1] + " " + frames[0]["name"] if frames else "(no stack)"
    where = f"{Path(mine['filename']).relative_to(ROOT)}:{mine['line']} {mine['name']}"
    return where if frames[0] is mine else f"{where} <- {frames[0]['name']}"


def groups(live: dict[int, dict]) -> list[tuple[str, int, list[int]]]:
    """(origin, bytes, its blocks' sizes largest first), largest first."""
    sizes: dict[str, list[int]] = defaultdict(list)
    for e in live.values():
        sizes[origin(e.get("frames") or [])].append(e["size"])
    return sorted(((k, sum(v), sorted(v, reverse=True)) for k, v in sizes.items()), key=lambda g: -g[1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the report's path")
    p.add_argument("--top", type=int, default=30, help="groups to list")
    p.add_argument("--trace", default=None, help="also write the allocator's history here (pickle)")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="-- then main.py's flags")
    args = p.parse_args()
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    # main() sets this too, but only when it starts: the history below starts the allocator first
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch

    import main as entry
    from pipeline.config import parse_args
    from pipeline.train import plan_report

    if not torch.cuda.is_available():
        raise SystemExit("error: memory_at_peak needs a GPU (the caching allocator's history is CUDA's)")
    cfg, _, _ = parse_args(flags)
    report = io.StringIO()
    with redirect_stdout(report):
        print(plan_report(cfg, 1))
    # one process, a process group of one (main() makes it), no torchrun
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=4_000_000)
    rc = entry.main(flags)
    snapshot = torch.cuda.memory._snapshot()
    if args.trace:
        with open(args.trace, "wb") as fh:
            pickle.dump(snapshot, fh)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, live = replay(trace)
    lines = [report.getvalue().rstrip(), "",
             f"run rc {rc}; max_memory_allocated {torch.cuda.max_memory_allocated() / GiB:.3f} GiB; "
             f"replayed peak {peak / GiB:.3f} GiB from {len(trace)} events ({len(live)} blocks alive)", ""]
    # per token of a micro-batch: what the plan's formulas count
    tokens = cfg.seq_length * max(1, cfg.batch_size // max(1, cfg.num_chunks))
    lines.append(f"     GiB  bytes/token  blocks  origin  [largest blocks, MiB]  ({tokens} tokens a micro-batch)")
    for key, size, blocks in groups(live)[:args.top]:
        largest = ", ".join(f"{b / 2**20:.0f}" for b in blocks[:6]) + (", ..." if len(blocks) > 6 else "")
        lines.append(f"{size / GiB:8.3f} {size / tokens:12.0f} {len(blocks):7d}  {key}  [{largest}]")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[2:]))
    return rc


if __name__ == "__main__":
    sys.exit(main())
