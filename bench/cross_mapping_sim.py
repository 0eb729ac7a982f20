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
* Each case is a run's configuration (one row of ``tokens`` per micro-batch): its program
  (``program_spec``: bf16 parameters loaded and bf16 gradients offloaded per stage residency,
  prefetch, global-norm clipping) and its decoder layers per stage (``stage_layers``, the
  default cost partition at ``--tflops``); the CPU optimizer step takes no time (it is the same
  for every mapping).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.config import TrainConfig, make_config  # noqa: E402
from pipeline.plan.source import preset_config
from pipeline.spec.shapes import stage_param_counts  # noqa: E402
from pipeline.spec.partition import stage_layers  # noqa: E402
from pipeline.spec.programs import program_spec  # noqa: E402
from schedule.mapping import compare_mappings  # noqa: E402

MODELS = {"Llama-2 7B": "llama-2-7b", "Llama-2 13B": "llama-2-13b"}  # table name -> preset (pipeline/stage/model.py)
GROUPS = [0, 1, 0, 1]  # root complex of GPU 0..3


def run_config(preset: str, num_stages: int, tokens: int, args: argparse.Namespace) -> TrainConfig:
    """The configuration of the run a table row describes: one row of ``tokens`` per micro-batch."""
    return make_config({"model": preset, "num_stages": num_stages, "schedule": args.schedule,
                        "num_chunks": args.num_microbatches, "batch_size": args.num_microbatches,
                        "seq_length": tokens, "use_offload": True, "use_prefetch": True, "resident_stages": 0,
                        "plan_tflops": args.tflops})


def stage_params(cfg: TrainConfig, hf_config) -> list[int]:
    """Parameters per stage, cut as the run cuts them (``stage_layers``)."""
    return stage_param_counts(hf_config, cfg.num_stages, stage_layers(cfg, hf_config, len(GROUPS)))


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
    for model, preset in MODELS.items():
        hf = preset_config(preset)
        for num_stages in (8, 16):
            for tokens in args.tokens:
                cfg = run_config(preset, num_stages, tokens, args)
                stage_bytes = [2 * n for n in stage_params(cfg, hf)]
                plan, rows = compare_mappings(GROUPS, stage_bytes, program_spec(cfg, hf), tokens_per_microbatch=tokens,
                                              tflops=args.tflops, link_gbps=args.link_gbps)
                r = {row.name: row for row in rows}
                print(f"| {model} | {num_stages} | {tokens} | {r['cross'].gpu_of_rank} | {r['cross'].step_time:.3f} "
                      f"| {r['sequential'].step_time:.3f} | {r['worst'].step_time:.3f} {r['worst'].gpu_of_rank} "
                      f"| {r['worst'].step_time / r['cross'].step_time:.3f} | {r['cross'].staggered_step_time:.3f} "
                      f"| {r['sequential'].staggered_step_time:.3f} |")
    print(f"\nGPUs 0,2 under root complex A, 1,3 under B; {args.link_gbps:g} GB/s per GPU link and per root uplink "
          f"(shared max-min fairly while concurrent); {args.tflops:g} TFLOP/s per GPU; schedule {args.schedule}, "
          f"{args.num_microbatches} micro-batches, bf16 loads and gradient offloads, prefetch, clipping; "
          f"decoder layers per stage by the cost partition; CPU optimizer step time not modelled.")


if __name__ == "__main__":
    main()
