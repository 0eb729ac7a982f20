"""FSDP2 + CPU-offload full fine-tuning of a Llama model: the peer baseline for MMoC-Pipe's benchmark table.

Same model (random-weight ``LlamaForCausalLM`` preset), same global batch and sequence length, same
activation checkpointing per decoder layer; what differs is the parallelism: pure data parallel with
parameters, gradients and AdamW state sharded (ZeRO-3) and, with ``--offload``, kept on the host.

    torchrun --nproc_per_node 4 bench/fsdp2_baseline.py --model llama-2-7b --batch_size 64 \
        --seq_length 512 --micro_batch 2 --iterations 4 --warmup 1 --mem_cap_gb 48 --json out.json

Without CUDA it runs on gloo in float32 (``--model tiny``) so it can be checked on a CPU machine.
"""
import argparse
import json
import os
import resource
import time
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

# (hidden, intermediate, layers, heads, kv heads, vocab)
PRESETS: dict[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (256, 688, 8, 4, 4, 2048),
    "llama-2-7b": (4096, 11008, 32, 32, 32, 32000),
    "llama-2-13b": (5120, 13824, 40, 40, 40, 32000),
}
GIB = 2**30


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(PRESETS), default="llama-2-7b")
    p.add_argument("--batch_size", type=int, default=64, help="global sequences per optimizer step")
    p.add_argument("--seq_length", type=int, default=512)
    p.add_argument("--micro_batch", type=int, default=2, help="sequences per forward/backward on one rank")
    p.add_argument("--iterations", type=int, default=4, help="measured optimizer steps")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured optimizer steps before them")
    p.add_argument("--mem_cap_gb", type=float, default=None, help="cap GPU memory per rank (emulates a smaller card)")
    p.add_argument("--offload", action="store_true", default=True,
                   help="CPUOffloadPolicy: sharded params, grads and the AdamW step on the host (default)")
    p.add_argument("--no_offload", dest="offload", action="store_false", help="keep the shards on the GPU")
    p.add_argument("--sync_each_micro", action="store_true",
                   help="reduce-scatter after every micro-batch instead of keeping unsharded grads until the last")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--json", default=None, help="rank 0 writes the results here")
    return p.parse_args()


def llama_config(name: str) -> LlamaConfig:
    hidden, inter, layers, heads, kv_heads, vocab = PRESETS[name]
    return LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                       rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False)


def build_model(config: LlamaConfig, device: torch.device, offload: bool) -> LlamaForCausalLM:
    """Builds on meta, wraps each layer in activation checkpointing and fully_shard, then materialises the shards."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    layers = model.model.layers
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if device.type == "cuda":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for i, layer in enumerate(layers):
        # AC outside fully_shard (torchtitan's order): recompute in backward re-enters the FSDP hooks as in forward.
        layers[i] = checkpoint_wrapper(layer)
        fully_shard(layers[i], **kwargs)
    fully_shard(model, **kwargs)
    # Only this rank's shard is allocated, so 13B never exists unsharded in one process.
    model.to_empty(device="cpu" if offload else device)
    # Fill each local shard directly (under no_grad, to_local() is the shard itself): no DTensor RNG tracker needed.
    torch.manual_seed(dist.get_rank())
    with torch.no_grad():
        for name, param in model.named_parameters():
            shard = param.to_local()
            shard.fill_(1.0) if name.endswith("norm.weight") else shard.normal_(0.0, 0.02)
    # to_empty left inv_freq uninitialised; buffers are not FSDP-managed, so this one goes straight to the GPU.
    model.model.rotary_emb = LlamaRotaryEmbedding(config).to(device)
    model.train()
    return model


def any_rank(flag: bool, device: torch.device) -> bool:
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # host sync: every rank must agree before leaving the loop
    return bool(t.item())


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or (isinstance(e, RuntimeError) and "out of memory" in str(e))


def train_step(model: FSDPModule, opt: torch.optim.Optimizer, vocab: int, num_micro: int, args: argparse.Namespace,
               device: torch.device, gen: torch.Generator) -> float:
    """One optimizer step over this rank's share of the global batch; returns the mean micro-batch loss."""
    total = torch.zeros((), device=device)
    for m in range(num_micro):
        last = m == num_micro - 1
        model.set_requires_gradient_sync(last or args.sync_each_micro)
        ids = torch.randint(vocab, (args.micro_batch, args.seq_length), device=device, generator=gen)
        loss = model(input_ids=ids, labels=ids).loss / num_micro
        loss.backward()
        total += loss.detach()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total.item()  # host sync; the timed step ends here anyway


def gather_floats(values: list[float], device: torch.device) -> list[list[float]]:
    """Returns values[k] of every rank, indexed [rank][k]."""
    local = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return [t.tolist() for t in out]


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    # torchrun sets OMP_NUM_THREADS=1; the offloaded AdamW step runs on these threads.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        if args.mem_cap_gb is not None:
            total_mem = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.mem_cap_gb * GIB / total_mem), device)
    per_rank, rem = divmod(args.batch_size, world)
    if rem or per_rank % args.micro_batch:
        raise ValueError(f"batch_size ({args.batch_size}) must split into world_size ({world}) ranks of whole "
                         f"micro-batches ({args.micro_batch}); got {args.batch_size / world} sequences per rank")
    num_micro = per_rank // args.micro_batch
    config = llama_config(args.model)
    hidden, layers = config.hidden_size, config.num_hidden_layers

    step_times: list[float] = []
    losses: list[float] = []
    status, n_params = "ok", 0
    oom = False
    try:
        model = build_model(config, device, args.offload)
        n_params = sum(p.numel() for p in model.parameters())  # DTensor numel is the global size
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    except Exception as e:
        if not is_oom(e):
            raise
        oom = True
    if any_rank(oom, device):
        status = "OOM"
    else:
        gen = torch.Generator(device=device)
        for step in range(args.warmup + args.iterations):
            gen.manual_seed(1000 * step + rank)  # different data per rank and step
            try:
                if use_cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                loss = train_step(model, opt, config.vocab_size, num_micro, args, device, gen)
                if use_cuda:
                    torch.cuda.synchronize()
                if step >= args.warmup:
                    step_times.append(time.perf_counter() - t0)
                    losses.append(loss)
            except Exception as e:
                if not is_oom(e):
                    raise
                oom = True
                if args.json:  # this rank's word, in case its peers hang; rank 0 overwrites it if they do not
                    with open(args.json, "w") as f:
                        json.dump({"status": "OOM", "rank": rank, "step": step, "args": vars(args),
                                   "torch": torch.__version__}, f, indent=2)
                # A rank that OOMs inside a collective leaves its peers blocked there; they fall to the
                # process-group timeout. Symmetric OOMs (same shapes on every rank) all arrive here.
                torch.cuda.empty_cache()
            if any_rank(oom, device):
                status = "OOM"
                break

    mem = [torch.cuda.max_memory_allocated(device) / GIB, torch.cuda.max_memory_reserved(device) / GIB] \
        if use_cuda else [0.0, 0.0]
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # ru_maxrss is KiB on Linux
    per_rank_stats = gather_floats(mem + [rss_gib], device)
    all_times = gather_floats(step_times, device) if status == "ok" else []
    if rank == 0:
        result: dict[str, Any] = {
            "status": status, "baseline": "fsdp2", "args": vars(args), "torch": torch.__version__,
            "transformers": transformers.__version__, "world_size": world,
            "device": torch.cuda.get_device_name(device) if use_cuda else "cpu",
            "params": n_params, "num_micro_batches": num_micro,
            "peak_allocated_gib_per_rank": [s[0] for s in per_rank_stats],
            "peak_reserved_gib_per_rank": [s[1] for s in per_rank_stats],
            "host_rss_peak_gib_per_rank": [s[2] for s in per_rank_stats],
        }
        result["peak_allocated_gib"] = max(result["peak_allocated_gib_per_rank"])
        result["peak_reserved_gib"] = max(result["peak_reserved_gib_per_rank"])
        result["host_rss_peak_gib"] = max(result["host_rss_peak_gib_per_rank"])
        line = f"fsdp2 model={args.model} world={world} offload={args.offload} status={status}"
        if status == "ok":
            times = [max(ts) for ts in zip(*all_times)]  # a step lasts until its slowest rank finishes
            step_s = sum(times) / len(times)
            n_embed = config.vocab_size * hidden
            flops_per_token = 6 * (n_params - n_embed) + 6 * layers * args.seq_length * hidden
            tokens_per_s = args.batch_size * args.seq_length / step_s
            tflops = flops_per_token * tokens_per_s / world / 1e12
            result.update(step_times_s=times, step_time_s=step_s, tokens_per_s=tokens_per_s,
                          flops_per_token=flops_per_token, tflops_per_gpu=tflops, losses=losses)
            line += f" step_s={step_s:.3f} tok/s={tokens_per_s:.1f} tflops/gpu={tflops:.2f} loss={losses[-1]:.4f}"
        line += (f" peak_alloc_gib={result['peak_allocated_gib']:.2f} peak_reserved_gib={result['peak_reserved_gib']:.2f}"
                 f" host_rss_gib={result['host_rss_peak_gib']:.2f}")
        print(line, flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
