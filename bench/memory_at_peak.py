"""What is on the GPU at a run's peak: one training run (main.py's flags, one process) with the
caching allocator's history on, then the allocations alive at the highest point of allocated
memory, grouped by the line of this project that made them (and the library call under it).
This is how the memory plan's estimate is checked term by term where it and a measurement
disagree (issue 28: ``--plan`` is a promise).

    python3 bench/memory_at_peak.py --out OUT/peak_16k.txt --trace OUT/peak_16k.pkl -- --config "" \\
        --model llama-3b --dataset synthetic --device cuda --seq_length 16384 ... (any main.py flags)
    python3 bench/memory_at_peak.py --out OUT/again.txt --replay OUT/peak_16k.pkl   # a kept history, no GPU

The report: ``--plan``'s text for the same flags, the peak as ``max_memory_allocated`` and as
replayed from the history (within the allocator's rounding of each block to 512 bytes, where the
history holds every event), the allocation that reached it, then the groups, largest first, in
bytes per token of a micro-batch. A run that runs out of GPU memory leaves its history in
``--trace`` (or beside ``--out``) as it fails; ``--replay`` reads it. Allocations of the
backward come from autograd's own thread: without a frame of this project they are named by the
library's innermost frame (an inductor kernel file for compiled layers), or "(no stack)".
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
NOT_MINE = ("bench", "tests")  # top-level folders of the repository that are not the trainer


def replay(events: list[dict]) -> tuple[int, int, dict[int, dict]]:
    """The peak of allocated bytes over ``events`` (the allocator's trace of one device), the index
    of the allocation that reached it, and the allocations alive then, by address. A block counts
    from its ``alloc`` until its ``free_requested``, as ``memory_allocated`` counts it: a block
    freed while other streams still use it is free at once, though the allocator hands it out
    again only later (``free_completed``)."""
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
    return peak, at, live


def _mine(filename: str) -> Path | None:
    """``filename`` relative to the repository where it is the trainer's own code."""
    path = Path(filename)
    if not path.is_relative_to(ROOT):
        return None
    rel = path.relative_to(ROOT)
    top = rel.parts[0] if rel.parts else ""
    return None if top.startswith(".") or top in NOT_MINE else rel  # .whl-site: installed libraries


def origin(frames: list[dict]) -> str:
    """``file:line function`` of the innermost frame of the trainer's own code, and the innermost
    frame's function where that is a library's."""
    for f in frames:
        rel = _mine(f["filename"])
        if rel is not None:
            where = f"{rel}:{f['line']} {f['name']}"
            return where if f is frames[0] else f"{where} <- {frames[0]['name']}"
    return frames[0]["filename"].rsplit("/", 1)[-1] + " " + frames[0]["name"] if frames else "(no stack)"


def groups(live: dict[int, dict]) -> list[tuple[str, int, list[int]]]:
    """(origin, bytes, its blocks' sizes largest first), largest first."""
    sizes: dict[str, list[int]] = defaultdict(list)
    for e in live.values():
        sizes[origin(e.get("frames") or [])].append(e["size"])
    return sorted(((k, sum(v), sorted(v, reverse=True)) for k, v in sizes.items()), key=lambda g: -g[1])


def report(snapshot: dict, device: int, tokens: int, top: int) -> list[str]:
    """The replayed peak of ``snapshot``'s history on ``device`` and its groups, per token too."""
    trace = snapshot["device_traces"][device]
    peak, at, live = replay(trace)
    lines = [f"replayed peak {peak / GiB:.3f} GiB from {len(trace)} events ({len(live)} blocks alive), reached by "
             f"{trace[at]['size'] / 2**20:.0f} MiB from {origin(trace[at].get('frames') or [])}" if at >= 0
             else f"no allocation in {len(trace)} events", "",
             f"     GiB  bytes/token  blocks  origin  [largest blocks, MiB]  ({tokens} tokens a micro-batch)"]
    for key, size, blocks in groups(live)[:top]:
        largest = ", ".join(f"{b / 2**20:.0f}" for b in blocks[:6]) + (", ..." if len(blocks) > 6 else "")
        lines.append(f"{size / GiB:8.3f} {size / tokens:12.0f} {len(blocks):7d}  {key}  [{largest}]")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the report's path")
    p.add_argument("--top", type=int, default=30, help="groups to list")
    p.add_argument("--trace", default=None, help="also write the allocator's history here (pickle)")
    p.add_argument("--replay", default=None, help="report on a kept history instead of running (no GPU needed)")
    p.add_argument("--tokens", type=int, default=1, help="with --replay: tokens of a micro-batch, for bytes/token")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="-- then main.py's flags")
    args = p.parse_args()
    if args.replay:
        with open(args.replay, "rb") as fh:
            snapshot = pickle.load(fh)
        device = next(i for i, t in enumerate(snapshot["device_traces"]) if t)
        lines = report(snapshot, device, args.tokens, args.top)
        Path(args.out).write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return 0
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    # main() sets this too, but only when it starts: the history below starts the allocator first
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch

    import main as entry
    from pipeline.config import parse_args
    from pipeline.train import plan_report

    if not torch.cuda.is_available():
        raise SystemExit("error: memory_at_peak needs a GPU (the caching allocator's history is CUDA's); "
                         "--replay reads a kept one")
    cfg, _, _ = parse_args(flags)
    plan = io.StringIO()
    with redirect_stdout(plan):
        print(plan_report(cfg, 1)[0])
    trace_path = args.trace or str(Path(args.out).with_suffix(".pkl"))

    def keep_history(*_) -> None:  # on running out of memory: main() then leaves the process at once
        with open(trace_path, "wb") as fh:
            pickle.dump(torch.cuda.memory._snapshot(), fh)
        print(f"memory_at_peak: out of GPU memory; the history is in {trace_path} (--replay)", flush=True)

    # one process, a process group of one (main() makes it), no torchrun
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=4_000_000)
    if hasattr(torch._C, "_cuda_attach_out_of_memory_observer"):
        torch._C._cuda_attach_out_of_memory_observer(keep_history)
    rc = entry.main(flags)
    snapshot = torch.cuda.memory._snapshot()
    if args.trace:
        with open(args.trace, "wb") as fh:
            pickle.dump(snapshot, fh)
    torch.cuda.memory._record_memory_history(enabled=None)
    tokens = cfg.seq_length * max(1, cfg.batch_size // max(1, cfg.num_chunks))
    lines = [plan.getvalue().rstrip(), "",
             f"run rc {rc}; max_memory_allocated {torch.cuda.max_memory_allocated() / GiB:.3f} GiB",
             *report(snapshot, torch.cuda.current_device(), tokens, args.top)]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[2:]))  # after the plan's text
    return rc


if __name__ == "__main__":
    sys.exit(main())
