"""FSDP2 + CPU-offload fine-tuning of a Llama model (full, or LoRA): the peer baseline for MMoC-Pipe's tables.

Same model (random-weight ``LlamaForCausalLM`` preset), same global batch and sequence length, same
activation checkpointing per decoder layer; what differs is the parallelism: pure data parallel with
parameters, gradients and AdamW state sharded (ZeRO-3) and, with ``--offload``, kept on the host.

    torchrun --nproc_per_node 2 bench/fsdp2_baseline.py --model llama-2-7b --batch_size 64 \
        --seq_length 512 --iterations 2 --warmup 1 --mem_cap_gb 48 --json out.json \
        --micro_batches 32,16,8,4 --sync_modes deferred,each --budget_s 200

The sweep builds the model once and runs each point (micro-batch per rank x gradient sync mode)
in turn: ``deferred`` reduce-scatters only on the last micro-batch of a step
(``set_requires_gradient_sync(False)`` before the others), ``each`` after every micro-batch; a
point with one micro-batch per rank runs once (the modes are the same). Points run until
``--budget_s`` is spent; a point whose warm-up step is over ``--prune_factor`` x the best step so
far is recorded as ``pruned``. Without ``--micro_batches`` it runs one point, ``--micro_batch``
(default 32: the best-known setting at 64 x 512 on 2 GPUs; 2 mis-tuned it). The rank's share of
the cores runs the host AdamW (``torch.set_num_threads``; torchrun sets ``OMP_NUM_THREADS=1``), fused
(``--adamw``: torch's default for CPU tensors is its for-loop implementation).
The JSON (``bench/sweep.py``'s format) is rewritten after every point; its top-level step time,
rates and peaks are the best point's.

LoRA (``--lora_rank R``, ``--lora_alpha``, ``--lora_target_modules``: bench/peer_lora.py) as a
careful peft + FSDP2 user sets it up: peft's adapters injected into the model on the meta device,
before any wrapping; the frozen base weights in bf16 (they need no float32 master: they never
change), the adapters in float32 (the optimizer's masters; FSDP2 wants one dtype among a unit's
trainable parameters, and allows frozen ones beside them in the same unit, so each decoder layer
stays one unit); computed in bf16 through the same ``MixedPrecisionPolicy``; AdamW and clipping over
the adapters only. The JSON's ``lora_rank``, ``lora_alpha``, ``lora_target_modules`` and
``trainable_params`` say so (and each point's config its ``lora_rank``); ``num_params`` stays the
base model's, the N of every row's 6 x N x tokens.

Without CUDA it runs on gloo in float32 (``--model tiny``) so it can be checked on a CPU machine.
"""
import argparse
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import transformers
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_lora  # noqa: E402
import sweep  # noqa: E402
from host_clip import clip_host_grads_, local  # noqa: E402

# (hidden, intermediate, layers, heads, kv heads, vocab)
PRESETS: dict[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (256, 688, 8, 4, 4, 2048),
    "llama-2-7b": (4096, 11008, 32, 32, 32, 32000),
    "llama-3b": (3200, 8640, 26, 32, 32, 32000),
    "llama-2-13b": (5120, 13824, 40, 40, 40, 32000),
    "llama-3-8b": (4096, 14336, 32, 32, 8, 128256),
}
GIB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(PRESETS), default="llama-2-7b")
    p.add_argument("--batch_size", type=int, default=64, help="global sequences per optimizer step")
    p.add_argument("--seq_length", type=int, default=512)
    p.add_argument("--micro_batch", type=int, default=32, help="sequences per forward/backward on one rank "
                   "(one point; the best-known setting at 64 x 512 on 2 GPUs)")
    p.add_argument("--micro_batches", default=None, help="sweep these micro-batches per rank, e.g. 32,16,8,4 "
                   "(overrides --micro_batch)")
    p.add_argument("--sync_modes", default=None, help="deferred,each: gradient sync on the last micro-batch "
                   "only, or after every one (default: each with --sync_each_micro, else deferred)")
    p.add_argument("--iterations", type=int, default=4, help="measured optimizer steps per point")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured optimizer steps before them, per point")
    p.add_argument("--budget_s", type=float, default=None, help="start no point that would end after this "
                   "many seconds from the start (model build included)")
    p.add_argument("--prune_factor", type=float, default=1.5,
                   help="skip a point's measured steps when its warm-up step is over this x the best step (0: never)")
    p.add_argument("--mem_cap_gb", type=float, default=None, help="cap GPU memory per rank (emulates a smaller card)")
    p.add_argument("--offload", action="store_true", default=True,
                   help="CPUOffloadPolicy: sharded params, grads and the AdamW step on the host (default)")
    p.add_argument("--no_offload", dest="offload", action="store_false", help="keep the shards on the GPU")
    p.add_argument("--sync_each_micro", action="store_true",
                   help="reduce-scatter after every micro-batch instead of keeping unsharded grads until the last "
                        "(the default --sync_modes)")
    p.add_argument("--adamw", choices=("fused", "foreach", "for-loop"), default="fused",
                   help="torch AdamW implementation; with offload it runs on the host, where the default "
                        "(for-loop on CPU tensors) is several times slower than the fused CPU kernel")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--grad_clip", type=float, default=1.0, help="clip the global gradient norm (0: off), as the "
                   "other rows do")
    p.add_argument("--json", default=None, help="rank 0 writes the results here")
    peer_lora.add_args(p)
    args = p.parse_args(argv)
    peer_lora.check(args)
    return args


def llama_config(name: str) -> LlamaConfig:
    hidden, inter, layers, heads, kv_heads, vocab = PRESETS[name]
    return LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                       rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False)


def meta_model(config: LlamaConfig, args: argparse.Namespace, base_dtype: torch.dtype) -> LlamaForCausalLM:
    """The model on the meta device; with ``--lora_rank``, peft's adapters injected (float32) and
    every other, frozen, parameter cast to ``base_dtype``."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    if args.lora_rank:
        peer_lora.inject(model, args.lora_rank, args.lora_alpha, args.lora_target_modules)
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(base_dtype)
    return model


def init_shard_(name: str, param: torch.Tensor) -> None:
    """Fill one parameter's local shard directly (under no_grad, to_local() is the shard itself): no
    DTensor RNG tracker needed. Adapters start as peft starts them: B zero (the adapted model is the
    base model), A uniform within 1 / sqrt(fan_in) (its kaiming-uniform bound)."""
    shard = local(param)
    if name.endswith("norm.weight"):
        shard.fill_(1.0)
    elif ".lora_B." in name:
        shard.zero_()
    elif ".lora_A." in name:
        bound = param.shape[1] ** -0.5
        shard.uniform_(-bound, bound)
    else:
        shard.normal_(0.0, 0.02)


def build_model(config: LlamaConfig, device: torch.device, offload: bool, args: argparse.Namespace,
                bf16: bool) -> LlamaForCausalLM:
    """Builds on meta (with LoRA's adapters), wraps each layer in activation checkpointing and
    fully_shard, then materialises the shards. ``bf16``: compute in bf16 (the GPU's setting; the
    CPU smoke runs float32), and with LoRA keep the frozen weights in it."""
    model = meta_model(config, args, torch.bfloat16 if bf16 else torch.float32)
    layers = model.model.layers
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if bf16:
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
    torch.manual_seed(dist.get_rank())
    with torch.no_grad():
        for name, param in model.named_parameters():
            init_shard_(name, param)
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


def timed_step(step: Callable[[], float], device: torch.device,
               on_oom: Callable[[], None] = lambda: None) -> tuple[float, float] | None:
    """``step()`` (returning its loss) timed between device syncs: the slowest rank's seconds and
    this rank's loss, or None on every rank when any rank ran out of memory (``on_oom`` first
    frees what the step left). A rank that OOMs inside a collective leaves its peers blocked
    there; they fall to the process-group timeout. Symmetric OOMs (same shapes on every rank) all
    arrive here."""
    use_cuda = device.type == "cuda"
    oom, dt, loss = False, 0.0, float("nan")
    try:
        if use_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step()
        if use_cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    except Exception as e:
        if not is_oom(e):
            raise
        oom = True
        on_oom()
        torch.cuda.empty_cache()
    if any_rank(oom, device):
        return None
    return agree_max(dt, device), loss  # a step lasts until its slowest rank finishes


def sweep_points(micro_batches: list[int], sync_modes: list[str], per_rank: int) -> list[tuple[int, str]]:
    """The (micro-batch, sync mode) points in order; one point for a micro-batch that makes one
    micro-batch per rank (``single``: nothing to defer). Raises when a micro-batch does not divide
    the rank's share of the batch."""
    bad = [m for m in micro_batches if per_rank % m]
    if bad:
        raise ValueError(f"micro-batches {bad} do not divide the {per_rank} sequences per rank; "
                         f"use divisors of {per_rank}")
    unknown = sorted(set(sync_modes) - {"deferred", "each"})
    if unknown:
        raise ValueError(f"sync modes {unknown} unknown; expected deferred and/or each")
    points: list[tuple[int, str]] = []
    for m in micro_batches:
        for mode in (["single"] if per_rank // m == 1 else sync_modes):
            if (m, mode) not in points:
                points.append((m, mode))
    return points


def train_step(model: FSDPModule, opt: torch.optim.Optimizer, params: list[torch.Tensor], vocab: int,
               micro_batch: int, num_micro: int, sync_each: bool, seq_length: int, device: torch.device,
               gen: torch.Generator, grad_clip: float) -> float:
    """One optimizer step over this rank's share of the global batch; returns the mean micro-batch
    loss. ``params``: the trainable parameters (the optimizer's, the clipped ones)."""
    total = torch.zeros((), device=device)
    for m in range(num_micro):
        last = m == num_micro - 1
        model.set_requires_gradient_sync(last or sync_each)
        ids = torch.randint(vocab, (micro_batch, seq_length), device=device, generator=gen)
        loss = model(input_ids=ids, labels=ids).loss / num_micro
        loss.backward()
        total += loss.detach()
    if grad_clip > 0:
        if any(p.grad is not None and local(p.grad).device.type == "cpu" for p in params):
            clip_host_grads_(params, grad_clip)  # host shards: on every core, not one
        else:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total.item()  # host sync; the timed step ends here anyway


def gather_floats(values: list[float], device: torch.device) -> list[list[float]]:
    """Returns values[k] of every rank, indexed [rank][k]."""
    local = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return [t.tolist() for t in out]


def agree_max(value: float, device: torch.device) -> float:
    """The largest value over the ranks, so every rank takes the same budget / prune decision."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # host sync, between points only
    return t.item()


def setup(args: argparse.Namespace) -> torch.device:
    """This rank's process group, threads, device and memory cap."""
    use_cuda = torch.cuda.is_available()
    # Offloaded gradients are host tensors: clipping all-reduces their norm on the CPU, over gloo.
    dist.init_process_group("cuda:nccl,cpu:gloo" if use_cuda else "gloo")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    # torchrun sets OMP_NUM_THREADS=1; the offloaded AdamW step runs on these threads.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world))
    if not use_cuda:
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    if args.mem_cap_gb is not None:
        total_mem = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.mem_cap_gb * GIB / total_mem), device)
    return device


def write_results(path: str | None, header: dict, points: list[dict], host_rss: list[float],
                  status: str | None = None) -> None:
    """The JSON (rank 0's to write); the top level carries the best point (offload_bench reads it)."""
    if not path:
        return
    res = sweep.result(header, points)
    best = res["best"].get("fsdp2")
    res["status"] = status or ("ok" if best else (points[-1]["status"] if points else "failed"))
    if best:
        res.update(step_time_s=best["step_time_s"], tokens_per_s=best["tokens_per_s"],
                   tflops_per_gpu=best["tflops_per_gpu"], step_times_s=best["step_times_s"],
                   peak_allocated_gib=best["peak_allocated_gib"], peak_reserved_gib=best["peak_reserved_gib"],
                   peak_allocated_gib_per_rank=best["peak_allocated_gib_per_rank"],
                   peak_reserved_gib_per_rank=best["peak_reserved_gib_per_rank"],
                   num_micro_batches=best["config"]["num_micro_batches"], losses=best["losses"])
    res["host_rss_peak_gib_per_rank"] = host_rss
    res["host_rss_peak_gib"] = max(host_rss) if host_rss else None
    sweep.write_json(path, res)


def build_training(config: LlamaConfig, device: torch.device, args: argparse.Namespace):
    """The sharded model, the trainable parameters (all, or LoRA's adapters) and their AdamW; None
    when this rank ran out of memory building them."""
    try:
        model = build_model(config, device, args.offload, args, bf16=device.type == "cuda")
        trainable = [p for p in model.parameters() if p.requires_grad]
        impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[args.adamw]
        return model, trainable, torch.optim.AdamW(trainable, lr=args.lr, **impl)
    except Exception as e:
        if not is_oom(e):
            raise
        return None


def run_point(model: FSDPModule, opt: torch.optim.Optimizer, trainable: list[torch.Tensor], args: argparse.Namespace,
              vocab: int, micro_batch: int, mode: str, steps: sweep.Steps, device: torch.device) -> str:
    """One point's warm-up and measured steps (into ``steps``); returns the point's status."""
    rank, per_rank = dist.get_rank(), args.batch_size // dist.get_world_size()
    gen = torch.Generator(device=device)
    for step in range(args.warmup + args.iterations):
        gen.manual_seed(1000 * step + rank)  # different data per rank and step
        timed = timed_step(lambda: train_step(model, opt, trainable, vocab, micro_batch, per_rank // micro_batch,
                                              mode == "each", args.seq_length, device, gen, args.grad_clip),
                           device, on_oom=lambda: opt.zero_grad(set_to_none=True))
        if timed is None:
            return "OOM"
        dt, loss = timed
        stop = steps.add(step, dt, loss, time.perf_counter())
        if stop:
            return stop
    return "ok"


def main() -> None:
    args = parse_args()
    t_start = time.perf_counter()
    device = setup(args)
    use_cuda, rank, world = device.type == "cuda", dist.get_rank(), dist.get_world_size()
    per_rank, rem = divmod(args.batch_size, world)
    if rem:
        raise ValueError(f"batch_size ({args.batch_size}) must split into world_size ({world}) ranks")
    micro_batches = sweep.parse_int_list(args.micro_batches) if args.micro_batches else [args.micro_batch]
    modes = (args.sync_modes or ("each" if args.sync_each_micro else "deferred")).split(",")
    points_todo = sweep_points(micro_batches, modes, per_rank)
    config = llama_config(args.model)
    tokens_per_step = args.batch_size * args.seq_length
    header: dict[str, Any] = {
        "system": "fsdp2", "baseline": "fsdp2", "args": vars(args), "torch": torch.__version__,
        "transformers": transformers.__version__, "world_size": world, "num_gpus": world,
        "device": torch.cuda.get_device_name(device) if use_cuda else "cpu", "model": args.model,
        "tokens_per_step": tokens_per_step, "threads_per_rank": torch.get_num_threads(),
    }
    points: list[dict] = []
    host_rss: list[float] = []
    json_path = args.json if rank == 0 else None
    built = build_training(config, device, args)
    model, trainable, opt = built or (None, [], None)
    # DTensor numel is the global size; the base model's count (adapters left out) is every row's N
    n_params = sum(p.numel() for name, p in model.named_parameters() if not peer_lora.is_adapter(name)) if model else 0
    header["params"] = header["num_params"] = n_params
    header.update(peer_lora.summary(args, sum(p.numel() for g in opt.param_groups for p in g["params"]) if opt else 0))
    if any_rank(built is None, device):
        write_results(json_path, header, points, host_rss, "OOM")
        dist.destroy_process_group()
        return

    for micro_batch, mode in points_todo:
        cfg = {"micro_batch_per_rank": micro_batch, "num_micro_batches": per_rank // micro_batch, "grad_sync": mode,
               "offload": args.offload, "grad_clip": args.grad_clip, "mem_cap_gb": args.mem_cap_gb,
               "threads_per_rank": torch.get_num_threads(), "adamw": args.adamw, "activation_checkpointing": True,
               **({"lora_rank": args.lora_rank} if args.lora_rank else {})}
        elapsed = agree_max(time.perf_counter() - t_start, device)
        best = sweep.best_step(points, "fsdp2")
        # The warm-up steps must fit at about the best step so far (the first point always runs);
        # after them, the measured ones must fit at the warm-up's pace.
        if points and not sweep.fits(elapsed, args.budget_s, args.warmup * best if best else 0.0):
            points.append(sweep.point("fsdp2", cfg, True, status="not run (budget)"))
            write_results(json_path, header, points, host_rss)
            continue
        if use_cuda:
            torch.cuda.reset_peak_memory_stats(device)
        steps = sweep.Steps(args.warmup, args.iterations, best, args.prune_factor, args.budget_s, t_start)
        status = run_point(model, opt, trainable, args, config.vocab_size, micro_batch, mode, steps, device)
        mem = [torch.cuda.max_memory_allocated(device) / GIB, torch.cuda.max_memory_reserved(device) / GIB] \
            if use_cuda else [0.0, 0.0]
        rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # ru_maxrss is KiB on Linux
        stats = gather_floats(mem + [rss_gib], device)
        host_rss = [s[2] for s in stats]
        points.append(sweep.measured_point(
            "fsdp2", cfg, True, status, steps, num_params=n_params, tokens_per_step=tokens_per_step, num_gpus=world,
            peak_allocated_gib=max(s[0] for s in stats), peak_reserved_gib=max(s[1] for s in stats),
            peak_allocated_gib_per_rank=[s[0] for s in stats], peak_reserved_gib_per_rank=[s[1] for s in stats]))
        if rank == 0:
            print(sweep.point_line(f"fsdp2 model={args.model} world={world} micro_batch={micro_batch} sync={mode}",
                                   points[-1]), flush=True)
        write_results(json_path, header, points, host_rss)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The results are written and the process group is gone. The interpreter's teardown sometimes
    # aborts after gloo ("terminate called without an active exception": a C++ thread still
    # joinable), which would fail a finished run.
    os._exit(0)
