"""How fast the host runs one stage's optimizer step, and what bounds it.

The offloaded stages' AdamW runs on the CPU (offload/adamw.py: torch's fused AdamW over the
fp32 masters). With gradient clipping every step waits for the global norm, so a rank's steps
run back to back after its last backward and their speed sets how much of them the next
iteration's forwards can hide. This measures, for a stage-sized flat parameter (default: a 7B
model's stage of 8), with the process' share of the cores as training gives it:
  step        fused AdamW alone (grad_scale folded in, as with clipping): what a STEP does
  copy        the fp32 -> bf16 refresh of the pinned working copy (queued behind the steps;
              the first load after a step converts the masters on the GPU instead)
  step+copy   the two back to back: what a STEP did before that
  blocked:C   step and copy chunk by chunk (C elements), each copy reading what the step
              just wrote while it is still in cache
  memcpy      an fp32 copy of the same size (a bandwidth reference: 8 bytes an element)
each with ``--procs`` processes doing the same at once (the ranks of one host step together).

  python3 bench/cpu_adamw_bench.py --numel 840e6 --procs 2 --threads 14
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.multiprocessing as mp

# bytes of host memory each variant moves per element (reads + writes)
BYTES = {"step": 28, "copy": 6, "step+copy": 34, "memcpy": 8}


def _variants(chunks: list[int]) -> list[str]:
    return ["memcpy", "step", "copy", "step+copy"] + [f"blocked:{c}" for c in chunks]


def _fused(tensors, lr: float, scale: torch.Tensor) -> None:
    p, g, m, v, step = tensors
    step += 1
    torch._fused_adamw_([p], [g], [m], [v], [], [step], amsgrad=False, lr=lr, beta1=0.9, beta2=0.95,
                        weight_decay=0.0, eps=1e-8, maximize=False, grad_scale=scale, found_inf=None)


def _worker(rank: int, args, barrier, queue) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    share = cpus[rank * args.threads:(rank + 1) * args.threads] or cpus
    os.sched_setaffinity(0, share)
    torch.set_num_threads(len(share))
    n = int(args.numel)
    p = torch.randn(n)
    g = torch.randn(n)
    m = torch.zeros(n)
    v = torch.zeros(n)
    work = torch.empty(n, dtype=torch.bfloat16)
    dst = torch.empty(n)
    step = torch.zeros(())
    scale = torch.full((), 1.0 / 0.1)
    out = {}
    for name in _variants(args.chunks):
        times = []
        for _ in range(args.reps):
            barrier.wait()
            t0 = time.perf_counter()
            if name == "memcpy":
                dst.copy_(p)
            elif name == "step":
                _fused((p, g, m, v, step), 1e-6, scale)
            elif name == "copy":
                work.copy_(p)
            elif name == "step+copy":
                _fused((p, g, m, v, step), 1e-6, scale)
                work.copy_(p)
            else:
                c = int(name.split(":")[1])
                for lo in range(0, n, c):
                    sl = slice(lo, lo + c)
                    _fused((p[sl], g[sl], m[sl], v[sl], step), 1e-6, scale)
                    step -= 1  # one step per pass, as the unblocked variants
                    work[sl].copy_(p[sl])
                step += 1
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times[1:] if len(times) > 1 else times)
    queue.put((rank, share, out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=float, default=840e6, help="elements of one stage (7B / 8 stages: ~840e6)")
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2], help="processes stepping at once (each a run)")
    ap.add_argument("--threads", type=int, default=14, help="cores per process (training: its share less two)")
    ap.add_argument("--chunks", type=int, nargs="*", default=[1 << 20, 1 << 22], help="blocked variants' chunk sizes")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    results = []
    for procs in args.procs:
        barrier, queue = ctx.Barrier(procs), ctx.Queue()
        ps = [ctx.Process(target=_worker, args=(r, args, barrier, queue)) for r in range(procs)]
        for proc in ps:
            proc.start()
        got = sorted(queue.get() for _ in ps)
        for proc in ps:
            proc.join()
        for rank, share, out in got:
            for name, sec in out.items():
                nbytes = BYTES.get(name.split(":")[0], BYTES["step+copy"]) * args.numel
                row = {"procs": procs, "rank": rank, "threads": len(share), "variant": name, "seconds": sec,
                       "Gelem_s": args.numel / sec / 1e9, "GB_s": nbytes / sec / 1e9}
                results.append(row)
                print(f"procs {procs} rank {rank} threads {len(share):2d} {name:>16s} {sec:7.3f} s "
                      f"{row['Gelem_s']:5.2f} Gelem/s {row['GB_s']:6.1f} GB/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
