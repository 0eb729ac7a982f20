"""Where one training step's device time goes: kernel time by kind, for the compute-efficiency work.

    python3 bench/profile_step.py --out OUT -- --model llama-3b --num_stages 13 --batch_size 64 \
        --num_chunks 16 --seq_length 512 --use_offload --resident_stages -1 --activation_checkpointing \
        --gpu_memory_gb 48 --dataset synthetic --device cuda --dtype bfloat16
    python3 bench/profile_step.py --smoke --out /tmp/prof     # the plumbing on a CPU (tiny model)

One process holds every stage (world size 1, as the one-GPU bench rows do), trains ``--warmup``
steps, then records one step with ``torch.profiler`` (CUDA kernels and copies; on a CPU, the
operators). Each kernel is put in one kind by its name (``KINDS``, first match wins): matrix
products, attention, norms / rotary / activations, the optimizer, element-wise, copies
(host<->device, device<->device), communication (NCCL), other; ``idle`` is the step's wall time
that no kernel covers on the compute device. The floor is the step's model FLOPs
(``pipeline.spec.shapes.model_flops_per_token``: matmuls and causal attention, no recompute) at
``--matmul_tflops`` (measured once here with a large bf16 product unless given). Writes ``OUT/profile.json``, ``OUT/profile.md`` (the table) and
the Chrome trace ``OUT/trace.json`` (https://ui.perfetto.dev).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# (kind, pattern on the lower-cased kernel or operator name); the first match wins.
KINDS = (
    ("copies", r"memcpy|memset|copy_|_to_copy|\bto\b|pin_memory"),
    ("communication", r"nccl|gloo|all_?reduce|all_?gather|reduce_?scatter|sendrecv"),
    ("attention", r"flash|fmha|attention|sdpa|softmax"),
    ("matmul", r"gemm|matmul|\bmm\b|addmm|bmm|linear|wgmma|xmma|cutlass|cublas|nvjet|sm90_|grouped_mm"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("norm/rotary/activation", r"rms|norm|rotary|rope|silu|gelu|swiglu|sigmoid|tanh|rsqrt"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce|add|mul|div|fill|cat|index|embedding|where"),
)


def kind_of(name: str) -> str:
    """The kind of a kernel (or, on a CPU, an operator) by its name."""
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other"


def covered(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end)`` intervals (kernels on several streams overlap)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def breakdown(events: list[tuple[str, float, float]], wall_s: float) -> dict[str, float]:
    """Seconds per kind from (name, start_s, end_s) device events, and ``idle``: the wall time no
    event covers."""
    out: dict[str, float] = {}
    for name, s, e in events:
        k = kind_of(name)
        out[k] = out.get(k, 0.0) + (e - s)
    out["idle"] = max(0.0, wall_s - covered([(s, e) for _, s, e in events]))
    return out


def matmul_rate(device) -> float:
    """bf16 TFLOP/s of an 8192^3 product, the median of 10 (the floor's rate)."""
    import torch

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times = sorted(times[2:])
    return 2 * 8192 ** 3 / times[len(times) // 2] / 1e12


def table(result: dict) -> str:
    rows = ["| kind | seconds | share of the step |", "|---|---|---|"]
    wall = result["step_s"]
    for kind, sec in sorted(result["kinds"].items(), key=lambda kv: -kv[1]):
        rows.append(f"| {kind} | {sec:.3f} | {100 * sec / wall:.1f}% |")
    rows.append(f"| **step (wall)** | {wall:.3f} | |")
    if result.get("floor_s"):
        rows.append(f"| floor: model FLOPs at {result['matmul_tflops']:.0f} TFLOP/s | {result['floor_s']:.3f} | "
                    f"{100 * result['floor_s'] / wall:.1f}% |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="profile_out")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--matmul_tflops", type=float, default=0.0, help="the floor's rate (0: measure it)")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: the plumbing only")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="main.py flags, after --")
    args = p.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pipeline.config import parse_args
    from pipeline.dist import DistEnv
    from pipeline.spec.shapes import model_flops_per_token
    from pipeline.train import Trainer

    flags = [f for f in args.flags if f != "--"]
    if args.smoke:
        flags = ["--model", "tiny", "--dataset", "synthetic", "--device", "cpu", "--dtype", "float32",
                 "--num_stages", "2", "--batch_size", "4", "--num_chunks", "2", "--seq_length", "64"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg, _, _ = parse_args(["--config", "", *flags, "--num_iterations", str(args.warmup + 1), "--no_save_model",
                            "--no_save_metrics", "--overwrite", "--save_dir", str(out / "run")])
    trainer = Trainer(cfg, DistEnv(0, 1, 0, 1))
    cuda = trainer.rank.device.type == "cuda"
    trainer.cfg.num_iterations = args.warmup
    trainer.train()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    trainer.start_iteration, trainer.cfg.num_iterations = args.warmup, args.warmup + 1
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        history = trainer.train()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    prof.export_chrome_trace(str(out / "trace.json"))
    step_s = history[-1]["step_time_s"] if history else wall
    device_type = "cuda" if cuda else "cpu"
    events = [(e.name, e.time_range.start / 1e6, e.time_range.end / 1e6) for e in prof.events()
              if (e.device_type.name.lower() == device_type) and (cuda or e.cpu_parent is None)]
    tokens = cfg.batch_size * cfg.seq_length
    hf = trainer.rank.source.config
    flops = model_flops_per_token(hf, hf.num_hidden_layers, cfg.seq_length) * tokens
    rate = args.matmul_tflops or (matmul_rate(trainer.rank.device) if cuda else 0.0)
    result = {"flags": flags, "device": torch.cuda.get_device_name(0) if cuda else "cpu", "step_s": step_s,
              "wall_s": wall, "kinds": breakdown(events, step_s), "model_flops": flops, "matmul_tflops": rate,
              "floor_s": flops / (rate * 1e12) if rate else None, "clock": {k: history[-1].get(k) for k in
                                                                             ("compute_seconds", "load_wait_seconds",
                                                                              "offload_wait_seconds",
                                                                              "optimizer_wait_seconds",
                                                                              "gc_seconds")} if history else {}}
    (out / "profile.json").write_text(json.dumps(result, indent=2) + "\n")
    text = table(result)
    (out / "profile.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
