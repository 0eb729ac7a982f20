"""The largest model a single 24 GB GPU full-fine-tunes with plain PyTorch: the reference point for
"how much larger a model does MMoC-Pipe train".

Plain training means ``LlamaForCausalLM`` in float32 on the GPU, gradient checkpointing, bf16
autocast, ``torch.optim.AdamW(fused=True)``, one micro-batch of random tokens per optimizer step,
GPU memory capped at ``--mem_cap_gb`` GiB with ``set_per_process_memory_fraction``. The script
searches the number of decoder layers N of a preset architecture (fits at N implies fits at N - 1),
each try a fresh subprocess, until ``--budget_s`` is spent:

    python3 bench/single_gpu_baseline.py --model llama-2-7b --mem_cap_gb 24 --json single_gpu.json
    python3 bench/single_gpu_baseline.py --model tiny --device cpu --budget_s 60   # CPU smoke: float32, no cap

It prints one JSON summary (largest N and its parameter count, the full 7B and 13B presets' counts
and 13B / largest) and writes it to ``--json``. ``--try N`` runs one try and prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pipeline.dist import cap_gpu_memory  # noqa: E402
from pipeline.plan.source import PRESETS, preset_config
from pipeline.spec.shapes import stage_num_params  # noqa: E402

GIB = 2**30
BYTES_PER_PARAM = 16  # float32 weight + gradient + two AdamW moments; activations are small with checkpointing


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(PRESETS), default="llama-2-7b")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: smoke run, no memory cap")
    p.add_argument("--mem_cap_gb", type=float, default=24.0, help="GPU memory cap in GiB (the emulated card)")
    p.add_argument("--micro_batch", type=int, default=1)
    p.add_argument("--seq_length", type=int, default=512)
    p.add_argument("--iterations", type=int, default=3, help="optimizer steps per try (the first is not timed)")
    p.add_argument("--budget_s", type=float, default=180.0, help="wall-clock budget of the whole search")
    p.add_argument("--try_timeout_s", type=float, default=120.0)
    p.add_argument("--try", dest="try_layers", type=int, default=None, help="run one try with N layers")
    p.add_argument("--json", default=None, help="write the summary here")
    return p.parse_args(argv)


def layer_config(model: str, layers: int):
    """The preset's config with ``layers`` decoder layers and no KV cache (training only)."""
    config = preset_config(model)
    config.num_hidden_layers, config.use_cache = layers, False
    return config


def num_params(model: str, layers: int | None = None) -> int:
    """Parameter count of the preset (with ``layers`` decoder layers), from the config alone."""
    config = preset_config(model)
    return stage_num_params(config, range(config.num_hidden_layers if layers is None else layers), True, True)


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def train_steps(config, device: torch.device, args: argparse.Namespace) -> list[float]:
    """Build the model on ``device`` and run ``args.iterations`` optimizer steps; seconds per step."""
    from transformers import LlamaForCausalLM

    with device:
        model = LlamaForCausalLM(config)  # float32 weights allocated directly on the device
    model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    tokens = torch.randint(config.vocab_size, (args.micro_batch, args.seq_length), device=device)
    times = []
    for _ in range(args.iterations):
        t0 = time.perf_counter()
        # bf16 autocast on the GPU; the CPU smoke run stays float32 (CPU bf16 matmuls are slow without AMX)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # host sync: the step's kernels must finish before the clock stops
        times.append(time.perf_counter() - t0)
    return times


def run_try(args: argparse.Namespace) -> dict:
    """One try in this process: does plain training of ``args.try_layers`` layers fit under the cap?"""
    n, device = args.try_layers, torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    cuda = device.type == "cuda"
    if cuda:
        cap_gpu_memory(device, args.mem_cap_gb)
    out = {"layers": n, "params": num_params(args.model, n), "ok": False, "peak_allocated_gib": None,
           "step_time_s": None, "error": None}
    try:
        times = train_steps(layer_config(args.model, n), device, args)
        timed = times[1:] or times
        out.update(ok=True, step_time_s=sum(timed) / len(timed))
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not is_oom(e):
            raise
        out["error"] = "OOM"
    if cuda:
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    return out


def spawn_try(args: argparse.Namespace, n: int, timeout: float) -> dict:
    """``run_try`` for ``n`` layers in a fresh subprocess (a clean CUDA context and allocator)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--try", str(n), "--model", args.model, "--device",
           args.device, "--mem_cap_gb", str(args.mem_cap_gb), "--micro_batch", str(args.micro_batch),
           "--seq_length", str(args.seq_length), "--iterations", str(args.iterations)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"layers": n, "ok": False, "error": f"timeout ({timeout:.0f}s)"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"layers": n, "ok": False, "error": f"rc {proc.returncode}: {tail[-300:]}"}


def estimate_layers(args: argparse.Namespace) -> int:
    """First guess: the most layers whose weights, grads and AdamW state (counted, not allocated) fill 90% of
    the cap."""
    total = PRESETS[args.model]["num_hidden_layers"]
    if args.device != "cuda":
        return total
    budget = 0.9 * args.mem_cap_gb * GIB / BYTES_PER_PARAM
    return max([1] + [n for n in range(1, total + 1) if num_params(args.model, n) <= budget])


def next_layers(lo: int, hi: int, hint: int | None) -> int:
    """Next N to try, knowing N = lo fits and N = hi does not: ``hint`` if strictly between, else the midpoint."""
    return hint if hint is not None and lo < hint < hi else (lo + hi) // 2


def search(args: argparse.Namespace) -> dict:
    """The largest fitting layer count (gallop from a first guess, then bisect) within ``args.budget_s``;
    the summary dict."""
    start, total = time.time(), PRESETS[args.model]["num_hidden_layers"]
    lo, hi, hint, tries = 0, total + 1, estimate_layers(args), []
    step, galloping = 1, True
    while hi - lo > 1:
        left = args.budget_s - (time.time() - start)
        if left < 5:
            break
        n = next_layers(lo, hi, hint)
        tries.append(spawn_try(args, n, min(args.try_timeout_s, left)))
        print(json.dumps(tries[-1]), flush=True)
        ok = tries[-1]["ok"]
        if not ok and tries[-1].get("error") != "OOM":
            break  # a crash or timeout says nothing about fitting: stop, reported as incomplete
        lo, hi = (n, hi) if ok else (lo, n)
        # the boundary is usually near the first guess: walk away from it by 1, 2, 4 ... layers
        # until the outcome flips, then bisect
        galloping = galloping and ok == tries[0]["ok"]
        hint, step = ((n + step if ok else n - step) if galloping else None), step * 2
    largest = num_params(args.model, lo) if lo else None
    ref = {name: num_params(name) for name in ("llama-2-7b", "llama-2-13b")}
    cap = args.mem_cap_gb if args.device == "cuda" else None
    return {"model": args.model, "device": args.device, "mem_cap_gb": cap,
            "micro_batch": args.micro_batch, "seq_length": args.seq_length, "preset_layers": total,
            "largest_layers": lo, "largest_params": largest, "largest_params_b": largest / 1e9 if largest else None,
            "complete": hi - lo == 1 and all(t["ok"] or t.get("error") == "OOM" for t in tries),
            "reference_params": ref,
            "ratio_13b_to_largest": ref["llama-2-13b"] / largest if largest else None,
            "seconds": round(time.time() - start, 1), "tries": tries}


def main() -> None:
    args = parse_args()
    if args.try_layers is not None:
        print(json.dumps(run_try(args)), flush=True)
        return
    summary = search(args)
    print(json.dumps(summary, indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
