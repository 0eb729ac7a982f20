"""Simulated step time of cross vs sequential vs worst rank -> GPU mappings (cost model only, no GPU).

    python3 bench/cross_mapping_sim.py                 # the table in README.md ("Cross mapping")
    python3 bench/cross_mapping_sim.py --tflops 120 --schedule 1f1b --num_microbatches 8

Assumptions (all printed under the table):
* 4 GPUs under two PCIe root complexes: GPUs 0 and 2 under one, 1 and 3 under the other
  (the 4x L20 box of ``tests/data/topo_4xL20_2roots.txt``). Each GPU's host link moves 25 GB/s
  per direction; a root complex's uplink also moves 25 GB/s per direction, shared max-min
  fairly by the GPUs under it that copy at the same time (loads and offloads do not interfere).
* Compute: forward 2 FLOPs per parameter and token, backward twice that, at ``--tflops``
  achieved per GPU (attention and the embedding lookup are counted as matmul FLOPs).
* bf16 parameters are loaded and bf16 gradients offloaded per stage residency; prefetch on;
  global-norm clipping on; the CPU optimizer step takes no time (it is the same for every mapping).
"""
from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from schedule.mapping import compare_mappings  # noqa: E402

# Llama-2 shapes (pipeline/model.py PRESETS), repeated here so the script needs no torch.
MODELS = {
    "Llama-2 7B": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000),
    "Llama-2 13B": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                        num_key_value_heads=40, vocab_size=32000),
}
GROUPS = [0, 1, 0, 1]  # root complex of GPU 0..3


def stage_params(shape: dict, num_stages: int) -> list[int]:
    """Parameters per stage, with the trainer's own partition (pipeline/model.py)."""
    from pipeline.model import stage_param_counts

    return stage_param_counts(types.SimpleNamespace(**shape), num_stages)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tflops", type=float, default=60.0, help="achieved TFLOP/s per GPU")
    p.add_argument("--link_gbps", type=float, default=25.0, help="host link and root uplink GB/s per direction")
    p.add_argument("--schedule", default="interleaved")
    p.add_argument("--num_microbatches", type=int, default=16)
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 2048], help="tokens per micro-batch")
    args = p.parse_args(argv)
    print("| model | stages | tokens / micro-batch | cross: rank -> GPU | cross s | sequential s | worst s "
          "(rank -> GPU) | worst / cross | cross + stagger s | sequential + stagger s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model, shape in MODELS.items():
        for num_stages in (8, 16):
            stage_bytes = [2 * n for n in stage_params(shape, num_stages)]
            for tokens in args.tokens:
                plan, rows = compare_mappings(GROUPS, stage_bytes, args.schedule, args.num_microbatches,
                                              tokens_per_microbatch=tokens, tflops=args.tflops,
                                              link_gbps=args.link_gbps, offload=True, prefetch=True, clip=True)
                r = {row.name: row for row in rows}
                print(f"| {model} | {num_stages} | {tokens} | {r['cross'].gpu_of_rank} | {r['cross'].step_time:.3f} "
                      f"| {r['sequential'].step_time:.3f} | {r['worst'].step_time:.3f} {r['worst'].gpu_of_rank} "
                      f"| {r['worst'].step_time / r['cross'].step_time:.3f} | {r['cross'].staggered_step_time:.3f} "
                      f"| {r['sequential'].staggered_step_time:.3f} |")
    print(f"\nGPUs 0,2 under root complex A, 1,3 under B; {args.link_gbps:g} GB/s per GPU link and per root uplink "
          f"(shared max-min fairly while concurrent); {args.tflops:g} TFLOP/s per GPU; schedule {args.schedule}, "
          f"{args.num_microbatches} micro-batches, bf16 loads and gradient offloads, prefetch, clipping; CPU "
          f"optimizer step time not modelled.")


if __name__ == "__main__":
    main()
