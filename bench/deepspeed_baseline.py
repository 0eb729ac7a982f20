"""DeepSpeed ZeRO-Offload full fine-tuning of a Llama model: a peer baseline for MMoC-Pipe's table.

ZeRO stage 2 (gradients and optimizer state partitioned over the ranks), the optimizer state and
its step on the host (``offload_optimizer: cpu``, pinned, DeepSpeedCPUAdam in AdamW mode), bf16
parameters and compute on the GPU, activation checkpointing through HF's
``gradient_checkpointing_enable``, gradient clipping 1.0; the same random-weight preset, global
batch and sequence length as the other rows:

    OMP_NUM_THREADS=16 torchrun --nproc_per_node 2 bench/deepspeed_baseline.py --model llama-2-7b \
        --batch_size 64 --seq_length 512 --micro_batches 32,16,8 --mem_cap_gb 48 --json ds.json --budget_s 200

One engine serves the whole sweep: a point sets the micro-batch per rank and the gradient
accumulation steps (global batch / micro-batch / ranks) on the engine and marks the accumulation
boundary itself (``set_gradient_accumulation_boundary``), so switching needs no rebuild. The
CPU Adam's OpenMP threads come from ``OMP_NUM_THREADS`` (read when the op loads; set it to the
rank's share of the cores: torchrun would set 1), torch's own from ``torch.set_num_threads``. The
op JIT-compiles on first use (g++, ninja; cached under ~/.cache/torch_extensions):
``python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"``
builds it ahead. Budget, pruning and the JSON as in ``bench/sweep.py``.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sweep  # noqa: E402
from fsdp2_baseline import PRESETS, agree_max, gather_floats, llama_config, timed_step  # noqa: E402

GIB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(PRESETS), default="llama-2-7b")
    p.add_argument("--batch_size", type=int, default=64, help="global sequences per optimizer step")
    p.add_argument("--seq_length", type=int, default=512)
    p.add_argument("--micro_batches", default="16,32,8", help="micro-batches per rank to sweep, in this order")
    p.add_argument("--iterations", type=int, default=2, help="measured optimizer steps per point")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured optimizer steps before them, per point")
    p.add_argument("--mem_cap_gb", type=float, default=None, help="cap GPU memory per rank (emulates a smaller card)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--budget_s", type=float, default=None)
    p.add_argument("--prune_factor", type=float, default=1.5)
    p.add_argument("--json", default=None, help="rank 0 writes the results here")
    p.add_argument("--local_rank", type=int, default=None, help="ignored (deepspeed launcher)")
    return p.parse_args(argv)


def ds_config(micro_batch: int, accum: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """ZeRO-2 with the optimizer on the host (ZeRO-Offload), bf16, clipping."""
    return {
        "train_batch_size": micro_batch * accum * world,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": args.grad_clip,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.0}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def accum_steps(batch_size: int, world: int, micro_batch: int) -> int:
    """Gradient accumulation steps of a point; raises when the micro-batch does not divide the rank's share."""
    per_rank, rem = divmod(batch_size, world)
    if rem or per_rank % micro_batch:
        raise ValueError(f"batch_size ({batch_size}) must split into {world} ranks of whole micro-batches "
                         f"({micro_batch}); use a divisor of {batch_size // world}")
    return per_rank // micro_batch


def engine_step(engine, vocab: int, micro_batch: int, accum: int, seq_length: int, device: torch.device,
                gen: torch.Generator) -> float:
    """One optimizer step of ``accum`` micro-batches; returns the mean micro-batch loss."""
    total = torch.zeros((), device=device)
    for m in range(accum):
        # The boundary is ours to mark: the engine's own counter assumes one fixed accumulation.
        engine.set_gradient_accumulation_boundary(m == accum - 1)
        ids = torch.randint(vocab, (micro_batch, seq_length), device=device, generator=gen)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)  # scales by 1 / accumulation steps
        total += loss.detach() / accum
    engine.step()
    return total.item()  # host sync; the timed step ends here anyway


def main() -> None:
    args = parse_args()
    t_start = time.perf_counter()
    import deepspeed  # imported here: its import is slow and --help should not need it
    import transformers
    from transformers import LlamaForCausalLM

    deepspeed.init_distributed(dist_backend="nccl")
    dist = torch.distributed
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(max(1, cores // local_world))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    if args.mem_cap_gb is not None:
        total_mem = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.mem_cap_gb * GIB / total_mem), device)
    micro_batches = sweep.parse_int_list(args.micro_batches)
    accums = [accum_steps(args.batch_size, world, m) for m in micro_batches]
    tokens_per_step = args.batch_size * args.seq_length

    config = llama_config(args.model)
    # Built in bf16 straight on the GPU (ZeRO-2 keeps the whole bf16 model there anyway).
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(default_dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(micro_batches[0], accums[0], world, args))
    header: dict[str, Any] = {
        "system": "deepspeed", "args": vars(args), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
        "transformers": transformers.__version__, "num_gpus": world, "device": torch.cuda.get_device_name(device),
        "model": args.model, "num_params": n_params, "tokens_per_step": tokens_per_step,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "threads_per_rank": torch.get_num_threads(),
        "optimizer": type(engine.optimizer.optimizer).__name__ if hasattr(engine.optimizer, "optimizer") else None,
        "build_s": time.perf_counter() - t_start,
    }
    points: list[dict] = []
    if rank == 0:
        print(f"deepspeed: built in {header['build_s']:.1f}s, optimizer {header['optimizer']}", flush=True)

    gen = torch.Generator(device=device)
    for micro_batch, accum in zip(micro_batches, accums):
        cfg = {"zero_stage": 2, "offload_optimizer": "cpu", "pin_memory": True, "micro_batch_per_rank": micro_batch,
               "gradient_accumulation_steps": accum, "grad_clip": args.grad_clip, "bf16": True,
               "activation_checkpointing": True, "mem_cap_gb": args.mem_cap_gb,
               "omp_num_threads": header["omp_num_threads"]}
        best = sweep.best_step(points, "deepspeed")
        if points and not sweep.fits(agree_max(time.perf_counter() - t_start, device), args.budget_s,
                                     args.warmup * best if best else 0.0):
            points.append(sweep.point("deepspeed", cfg, True, status="not run (budget)"))
            sweep.write_json(args.json if rank == 0 else None, sweep.result(header, points))
            continue
        # Switch the engine to this point: micro-batch, then accumulation steps for the global batch.
        engine.set_train_micro_batch_size(micro_batch)
        engine.set_train_batch_size(args.batch_size)
        torch.cuda.reset_peak_memory_stats(device)
        steps, status = sweep.Steps(args.warmup, args.iterations, best, args.prune_factor, args.budget_s, t_start), "ok"
        for step in range(args.warmup + args.iterations):
            gen.manual_seed(1000 * step + rank)
            timed = timed_step(lambda: engine_step(engine, config.vocab_size, micro_batch, accum, args.seq_length,
                                                   device, gen), device)
            if timed is None:
                status = "OOM"
                break
            dt, loss_value = timed
            stop = steps.add(step, dt, loss_value, time.perf_counter())
            if stop:
                status = stop
                break
        rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
        stats = gather_floats([torch.cuda.max_memory_allocated(device) / GIB,
                               torch.cuda.max_memory_reserved(device) / GIB, rss_gib], device)
        points.append(sweep.measured_point(
            "deepspeed", cfg, True, status, steps, num_params=n_params, tokens_per_step=tokens_per_step, num_gpus=world,
            peak_allocated_gib=max(s[0] for s in stats), peak_reserved_gib=max(s[1] for s in stats),
            peak_allocated_gib_per_rank=[s[0] for s in stats], host_rss_peak_gib_per_rank=[s[2] for s in stats]))
        if rank == 0:
            print(sweep.point_line(f"deepspeed micro_batch={micro_batch} accum={accum}", points[-1]), flush=True)
            sweep.write_json(args.json, sweep.result(header, points))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
