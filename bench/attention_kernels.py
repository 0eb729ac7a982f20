"""Which attention kernel a causal whole-row pass should take on this GPU, for a model's head
size: time (forward + backward) and error against float32 attention, per kernel and shape.

    python3 bench/attention_kernels.py --head_dim 100 --heads 32 --shapes 1x65536,1x16384,16x512

Kernels: sdpa's flash (what whole rows take now: FlashAttention-2, any head size up to 256),
sdpa's cuDNN kernel (head sizes a multiple of 8: others are zero-padded up to ``--pad`` values,
which changes no score and no output column that is kept) and sdpa's memory-efficient kernel.
Zero padding is exact: q.k sums the same products plus zeros, and the padded output columns are
dropped. Error: the largest difference to float32 math attention on the same bf16 inputs,
relative to the output's largest element, on a short row (``--check_len``).
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def attend(q, k, v, backend: str, pad: int, scale: float):
    d = q.shape[-1]
    if pad > d:
        q, k, v = (F.pad(t, (0, pad - d)) for t in (q, k, v))
    with sdpa_kernel([BACKENDS[backend]]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out[..., :d]


def timed(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head_dim", type=int, default=100)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--shapes", default="1x65536,1x16384,16x512", help="rows x tokens, comma-separated")
    ap.add_argument("--pads", default="104,128", help="head sizes the cuDNN kernel is tried at")
    ap.add_argument("--check_len", type=int, default=2048)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    dev, d, h = torch.device("cuda"), args.head_dim, args.heads
    scale = d ** -0.5
    variants = [("flash", d), ("efficient", d)] + [("cudnn", int(p)) for p in args.pads.split(",")]
    if d % 8 == 0:
        variants.append(("cudnn", d))
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, h, args.check_len, d, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=scale)
    errors = {}
    for name, pad in variants:
        try:
            out = attend(q, k, v, name, pad, scale).float()
            errors[(name, pad)] = float((out - ref).abs().max() / ref.abs().max())
        except RuntimeError as e:
            errors[(name, pad)] = f"refused: {str(e).splitlines()[0][:120]}"
    for shape in args.shapes.split(","):
        b, t = (int(x) for x in shape.split("x"))
        flops = 4 * b * h * t * t * d / 2 * 3.5  # causal: forward 2 products, backward 5 (2.5x)
        q, k, v = (torch.randn(b, h, t, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, h, t, d, device=dev, dtype=torch.bfloat16)
        reps = max(2, min(50, int(2e13 // max(flops, 1))))
        for name, pad in variants:
            row = {"rows": b, "tokens": t, "kernel": name, "head_dim": pad, "error": errors[(name, pad)]}
            if isinstance(row["error"], str):
                rows.append(row)
                print(row)
                continue
            try:
                fwd = timed(lambda: attend(q, k, v, name, pad, scale), reps)
                both = timed(lambda: attend(q, k, v, name, pad, scale).backward(grad), reps)
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                attend(q, k, v, name, pad, scale).backward(grad)
                row.update(forward_s=fwd, step_s=both, tflops=flops / both / 1e12,
                           peak_extra_gib=(torch.cuda.max_memory_allocated() - base) / 2**30)
            except RuntimeError as e:
                row["error"] = f"failed: {str(e).splitlines()[0][:120]}"
            q.grad = k.grad = v.grad = None
            rows.append(row)
            print({k_: (round(x, 5) if isinstance(x, float) else x) for k_, x in row.items()}, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
