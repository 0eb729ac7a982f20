"""Would the GPU add optimizer bandwidth to the host's? A measurement for the clip-held host AdamW.

With clipping, an offloaded stage's AdamW waits for the global norm, so the host steps every
offloaded stage back to back after the last backward while the next forward waits for them
(bench/results/2026-11-28_hybrid_row_optimizer_wait). The GPU is idle then. It could step some
of those stages itself by streaming their fp32 masters, gradients and moments in (16 bytes an
element) and the masters and moments back (12 bytes), chunk by chunk on two copy streams: DMA
engines, not cores. Whether that adds to the host's rate or takes from it depends on whether the
host step is bound by its cores or by the memory both would share. For one stage-sized flat
parameter (``--numel``) this times:

  host      torch's fused AdamW on the CPU (``--threads`` cores), as ``offload/adamw.py`` runs it
  device    the same step on the GPU: chunks in on one stream, the fused CUDA AdamW, out on another
  both      the two at once, each on its own parameter (a thread runs the host step)

and prints the largest difference between the host's and the device's result, relative to the
largest element (the two kernels may round differently).

    python3 bench/host_and_device_adamw.py --numel 250e6 --threads 16
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

HOST_BYTES, LINK_BYTES = 28, 28  # per element: AdamW's reads + writes; in (p, g, m, v) + out (p, m, v)
KW = dict(amsgrad=False, lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, maximize=False, found_inf=None)


def _state(n: int, pin: bool, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = [torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.01,
           torch.rand(n, generator=gen) * 1e-4]
    return [t.pin_memory() for t in out] if pin else out


def host_step(p, g, m, v, step, scale) -> None:
    step += 1
    torch._fused_adamw_([p], [g], [m], [v], [], [step], grad_scale=scale, **KW)


class DeviceStepper:
    """The GPU's step over host tensors, ``chunk`` elements at a time through ``slots`` device buffers."""

    def __init__(self, chunk: int, slots: int = 3):
        self.chunk, self.dev = chunk, torch.device("cuda")
        self.bufs = [[torch.empty(chunk, device=self.dev) for _ in range(4)] for _ in range(slots)]
        self.h2d, self.d2h = torch.cuda.Stream(), torch.cuda.Stream()
        self.freed = [None] * slots  # per slot: the D2H copy out of it, which the next H2D into it waits for

    def step(self, p, g, m, v, step: torch.Tensor, scale: torch.Tensor) -> None:
        step += 1
        dstep, dscale = step.to(self.dev), scale.to(self.dev)
        compute = torch.cuda.current_stream()
        for i, lo in enumerate(range(0, p.numel(), self.chunk)):
            hi = min(p.numel(), lo + self.chunk)
            slot = i % len(self.bufs)
            bp, bg, bm, bv = (b[:hi - lo] for b in self.bufs[slot])
            with torch.cuda.stream(self.h2d):
                if self.freed[slot] is not None:
                    self.h2d.wait_event(self.freed[slot])
                for dst, src in ((bp, p), (bg, g), (bm, m), (bv, v)):
                    dst.copy_(src[lo:hi], non_blocking=True)
            compute.wait_stream(self.h2d)
            torch._fused_adamw_([bp], [bg], [bm], [bv], [], [dstep], grad_scale=dscale, **KW)
            self.d2h.wait_stream(compute)
            with torch.cuda.stream(self.d2h):
                for dst, src in ((p, bp), (m, bm), (v, bv)):
                    dst[lo:hi].copy_(src, non_blocking=True)
                self.freed[slot] = self.d2h.record_event()
        self.d2h.synchronize()


def timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:] if len(times) > 1 else times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=float, default=250e6, help="elements of one stage (llama-3b, 2 layers: ~2.2e8)")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--chunk", type=float, default=16e6)
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = int(args.numel)
    scale = torch.full((), 0.5)
    host_set, dev_set = _state(n, True, 0), _state(n, True, 1)
    hstep, dstep = torch.zeros(()), torch.zeros(())
    stepper = DeviceStepper(int(args.chunk))

    # the two kernels on the same input, once: how far apart their results are
    ref, got = _state(1 << 22, False, 2), _state(1 << 22, True, 2)
    host_step(*ref, torch.zeros(()), scale)
    stepper.step(*got, torch.zeros(()), scale)
    for name, a, b in zip("pgmv", ref, got):
        if name != "g":
            print(f"host vs device {name}: max |diff| / max |x| = {(a - b).abs().max().item() / a.abs().max().item():.2e}")

    host = timed(lambda: host_step(*host_set, hstep, scale), args.reps)
    dev = timed(lambda: stepper.step(*dev_set, dstep, scale), args.reps)

    def both() -> None:
        t = threading.Thread(target=host_step, args=(*host_set, hstep, scale))
        t.start()
        stepper.step(*dev_set, dstep, scale)
        t.join()

    pair = timed(both, args.reps)
    print(f"host   {host:.3f} s  {n / host / 1e9:.2f} Gelem/s  {HOST_BYTES * n / host / 1e9:.1f} GB/s ({args.threads} threads)")
    print(f"device {dev:.3f} s  {n / dev / 1e9:.2f} Gelem/s  {LINK_BYTES * n / dev / 1e9:.1f} GB/s over the link")
    print(f"both   {pair:.3f} s for two stages: {2 * n / pair / 1e9:.2f} Gelem/s, "
          f"{(host + dev) / pair:.2f}x the two run one after the other")


if __name__ == "__main__":
    main()
