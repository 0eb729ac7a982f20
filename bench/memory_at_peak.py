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


def groups(live: dict[int, dict]) -> list[tuple[str, int, int]]:
    """(origin, bytes, blocks), largest first."""
    size: dict[str, int] = defaultdict(int)
    count: dict[str, int] = defaultdict(int)
    for e in live.values():
        key = origin(e.get("frames") or [])
        size[key] += e["size"]
        count[key] += 1
    return sorted(((k, size[k], count[k]) for k in size), key=lambda g: -g[1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the report's path")
    p.add_argument("--top", type=int, default=30, help="groups to list")
    p.add_argument("--trace", default=None, help="also write the allocator's history here (pickle)")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="-- then main.py's flags")
    args = p.parse_args()
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    import torch

    import main as entry
    from pipeline.config import parse_args
    from pipeline.train import plan_report

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
    for key, size, n in groups(live)[:args.top]:
        lines.append(f"{size / GiB:8.3f} GiB {n:5d}  {key}")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-args.top - 2:]))
    return rc


if __name__ == "__main__":
    sys.exit(main())
