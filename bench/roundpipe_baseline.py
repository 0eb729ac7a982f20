"""RoundPipe 0.1.1 fine-tuning of a Llama model (full, or LoRA): a peer baseline for MMoC-Pipe's tables.

One process drives every visible GPU (RoundPipe's device threads; no torchrun, no NCCL: activations
and parameters move through host memory). The model is RoundPipe's ``LlamaForCausalLM`` preset
(``wrap_model_to_roundpipe(..., use_sequential_preset=True)``), bf16 parameters, fp32 optimizer
copies (``optim_dtype=torch.float32``), RoundPipe's CPU Adam (``roundpipe.optim.Adam``, decoupled
weight decay 0, i.e. AdamW), the gradient norm clipped to 1.0 inside the step function, its
chunked fused LM-head loss (``return_logits=False``) and its stage recompute (activation
checkpointing is built in). This follows the authors' benchmark (RoundPipe-artifact
``roundpipe/train.py`` and ``train-sync.py``), on the same random-weight preset, global batch and
sequence length as the other rows:

    python3 bench/roundpipe_baseline.py --model llama-2-7b --batch_size 64 --seq_length 512 \
        --mem_cap_gb 48 --points async:8,sync:8,async:4,sync:4 --json rp.json --budget_s 330

One build serves both step modes: ``model.step(fn)`` (asynchronous, the default: the step runs on
RoundPipe's optimizer thread while the next iteration computes with one-step-old parameters, so
the run is not exact) and ``model.step(fn, is_async=False)`` (the update is applied before the next
iteration: exact). A point ``MODE:N[xA]`` runs A ``forward_backward`` calls of N micro-batches each
per optimizer step (A defaults to 1). Systems ``roundpipe-async`` / ``roundpipe-sync`` in the JSON.

The memory cap: RoundPipe sizes its stages from the GPUs' free memory plus this process's
reserved memory (``get_min_gpu_memory``, read when ``roundpipe`` is imported), so a ``torch.empty``
in this process would count as available. A ballast subprocess takes (free - cap) on every GPU
before this process touches CUDA and holds it until this process exits.

transformers 5 renamed ``create_causal_mask(input_embeds=...)`` to ``inputs_embeds`` (and dropped
``cache_position``); the preset's call goes through ``keyword_adapter``. Threads: one process, so
``OMP_NUM_THREADS`` should be every core (RoundPipe's Adam is OpenMP C++, JIT-compiled on first use
and cached; ``python3 -c "from roundpipe.optim.optim_builder import load_optim_function;
load_optim_function('adam')"`` builds it ahead). Budget, pruning and the JSON as in ``bench/sweep.py``.

LoRA (``--lora_rank R``, ``--lora_alpha``, ``--lora_target_modules``: bench/peer_lora.py) as the
authors' LoRA benchmark sets it up (RoundPipe-artifact ``roundpipe/train_lora.py``): peft's layers
injected into the Hugging Face model in place before ``wrap_model_to_roundpipe`` (the model keeps
its class, so the sequential Llama preset still takes it; a ``PeftModel`` would not), the adapters
in the model's dtype with RoundPipe's float32 optimizer copies (``optim_dtype``), and the optimizer
over ``optim_parameters()``, which holds the parameters that require a gradient: the adapters. The
head stays a plain linear layer: the preset's fused loss reads its weight. Host memory is pinned
(``--pin_model alloc``, RoundPipe's default; the authors' throughput runs pin too): RoundPipe's
docs advise ``off`` only for a LoRA model larger than host memory, at the cost of unpinned copies.
"""
from __future__ import annotations

import argparse
import inspect
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_lora  # noqa: E402
import sweep  # noqa: E402
from host_clip import clip_host_grads_  # noqa: E402

GIB = 2**30
POINT_RE = re.compile(r"(async|sync):([1-9]\d*)(?:x([1-9]\d*))?")


def parse_points(text: str) -> list[tuple[str, int, int]]:
    """``"async:8,sync:4x2"`` -> ``[("async", 8, 1), ("sync", 4, 2)]``; a bad point exits with one line."""
    points = []
    for item in text.split(","):
        m = POINT_RE.fullmatch(item.strip())
        if m is None:
            raise SystemExit(f"error: bad RoundPipe point {item!r}; expected MODE:N[xA] with MODE async or sync, "
                             f"N micro-batches per forward_backward, A of them per step (e.g. async:8, sync:4x2)")
        points.append((m[1], int(m[2]), int(m[3] or 1)))
    return points


def keyword_adapter(fn: Callable[..., Any], renames: dict[str, str]) -> Callable[..., Any]:
    """``fn`` called with keywords renamed (old -> new, where ``fn`` has the new name and not the old)
    and those ``fn`` does not take dropped: RoundPipe's Llama preset calls transformers 4's
    ``create_causal_mask`` signature."""
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    def adapted(*args: Any, **kwargs: Any) -> Any:
        for old, new in renames.items():
            if old in kwargs and old not in params and new in params:
                kwargs[new] = kwargs.pop(old)
        if not takes_any:
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        return fn(*args, **kwargs)

    return adapted


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-2-7b")
    p.add_argument("--batch_size", type=int, default=64, help="global sequences per optimizer step")
    p.add_argument("--seq_length", type=int, default=512)
    p.add_argument("--points", default="async:8,sync:8,async:4,sync:4,async:16,sync:16",
                   help="MODE:N[xA] points in this order (see the docstring)")
    p.add_argument("--iterations", type=int, default=3, help="measured optimizer steps per point")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured optimizer steps before them, per point "
                   "(the first point gets one more: it compiles)")
    p.add_argument("--mem_cap_gb", type=float, default=None, help="per-GPU cap, held by a ballast process")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--recompute_grain", choices=("stage", "layer"), default="stage")
    p.add_argument("--budget_s", type=float, default=None)
    p.add_argument("--prune_factor", type=float, default=1.5)
    p.add_argument("--json", default=None)
    p.add_argument("--pin_model", choices=("alloc", "register", "off"), default="alloc",
                   help="RoundPipe's host-memory pinning of the model (see the docstring)")
    peer_lora.add_args(p)
    p.add_argument("--ballast", type=float, default=None, help=argparse.SUPPRESS)  # internal: the ballast child
    args = p.parse_args(argv)
    peer_lora.check(args)
    return args


def ballast(cap_gb: float) -> None:
    """Child: leave ``cap_gb`` GiB free on every visible GPU, say so, hold until stdin closes."""
    import torch

    held = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)  # after this process's own context
        take = max(0, free - int(cap_gb * GIB))
        held.append(torch.empty(take, dtype=torch.uint8, device=f"cuda:{i}"))
        print(f"ballast: GPU {i} total {total / GIB:.1f} GiB, held {take / GIB:.1f} GiB, "
              f"left {torch.cuda.mem_get_info(i)[0] / GIB:.1f} GiB", file=sys.stderr, flush=True)
    print("ready", flush=True)
    sys.stdin.read()  # returns at EOF: the parent exited or closed the pipe


def start_ballast(cap_gb: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, __file__, "--ballast", str(cap_gb)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    if line != "ready":
        raise RuntimeError(f"the memory ballast did not start (said {line!r}, rc {proc.poll()})")
    return proc


def build_hf_model(model_name: str, seq_length: int):
    """The random-weight preset (``pipeline.plan.source.PRESETS``: Llama, Qwen3, Qwen3-MoE shapes) in
    bf16, initialised on GPU 0 (fast) and moved to the host, where RoundPipe keeps it; RoundPipe
    picks its sequential preset by the model's class."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from pipeline.plan.source import preset_config

    config = preset_config(model_name)
    config.use_cache = False
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda:0"):
        model = AutoModelForCausalLM.from_config(config)
    torch.set_default_dtype(default_dtype)
    model = model.to("cpu")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # RoundPipe counts this process's reserved memory as available
    # RoundPipe 0.1.1's Qwen3 and gpt-oss presets read each layer's attention_type, which
    # transformers 4 set on the decoder layer and 5 keeps only in config.layer_types.
    types = getattr(config, "layer_types", None)
    for i, layer in enumerate(model.model.layers):
        if types and not hasattr(layer, "attention_type"):
            layer.attention_type = types[i]
    return model, config


def add_lora(hf_model, args: argparse.Namespace) -> int:
    """peft's adapters into ``hf_model`` (on the host, before RoundPipe wraps it); returns their
    element count. Refuses a model the Llama preset would no longer take as it expects."""
    from torch import nn

    head = type(hf_model.lm_head)
    n = peer_lora.inject(hf_model, args.lora_rank, args.lora_alpha, args.lora_target_modules)
    # The preset picks its wrapper by class name and feeds lm_head.weight to its fused loss.
    if type(hf_model.lm_head) is not head or not isinstance(hf_model.lm_head, nn.Linear):
        raise SystemExit(f"error: LoRA wrapped the head ({type(hf_model.lm_head).__name__}); RoundPipe's preset "
                         "needs a plain linear head")
    return n


def active_params(model_name: str) -> int:
    """The parameters a token runs through (a routed layer's experts: top_k of them): what the
    model FLOP rate counts, as for this project's rows."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from pipeline.plan.source import preset_config
    from pipeline.spec.shapes import stage_num_params

    config = preset_config(model_name)
    return stage_num_params(config, range(config.num_hidden_layers), True, True, active=True)


def adapt_presets() -> None:
    """RoundPipe's presets call transformers 4's mask builders; this routes them to the installed ones."""
    import importlib

    renames = {"input_embeds": "inputs_embeds", "past_key_values": "cache"}
    for preset in ("llama", "qwen3", "qwen3_moe"):
        module = importlib.import_module(f"roundpipe.models.{preset}")
        for fn in ("create_causal_mask", "create_sliding_window_causal_mask"):
            if hasattr(module, fn):
                setattr(module, fn, keyword_adapter(getattr(module, fn), renames))


def build_roundpipe(hf_model, args: argparse.Namespace):
    """RoundPipe's model over ``hf_model`` (its sequential preset), the optimizer's parameters
    (float32 copies of those that require a gradient: all, or LoRA's adapters) and its CPU Adam."""
    import torch
    from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe
    from roundpipe.optim import Adam

    adapt_presets()
    model = wrap_model_to_roundpipe(hf_model, optim_dtype=torch.float32, use_sequential_preset=True,
                                    model_run_config=RoundPipeRunConfig(recompute_grain=args.recompute_grain),
                                    pin_model=args.pin_model)
    params = list(model.optim_parameters())
    return model, params, Adam(params, lr=args.lr, weight_decay=0.0, decoupled_weight_decay=True)


def run_steps(model, step_fn: Callable[[], None], args: argparse.Namespace, vocab: int, gen, point: tuple,
              steps: sweep.Steps) -> str:
    """One point's warm-up and measured steps (into ``steps``); returns the point's status."""
    import torch
    from roundpipe import RoundPipeRunConfig

    mode, num_micro, accum = point
    run_config = RoundPipeRunConfig(num_microbatch=num_micro)
    try:
        for step in range(steps.warmup + steps.iterations):
            ids = torch.randint(vocab, (args.batch_size, args.seq_length), generator=gen)
            t0 = time.perf_counter()
            total = 0.0
            for chunk in ids.chunk(accum):
                loss = model.forward_backward(
                    input_kwargs={"input_ids": chunk, "labels": chunk, "return_logits": False},
                    loss_fn=lambda outputs, _: outputs.loss / num_micro / accum, run_config=run_config)
                total += float(loss)  # a host tensor already (RoundPipe synchronised on it)
            model.step(step_fn, is_async=(mode == "async"))
            dt = time.perf_counter() - t0
            stop = steps.add(step, dt, total, time.perf_counter())
            if stop:
                return stop
    except Exception as e:  # noqa: BLE001 - one point failing must not lose the others
        oom = isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e)
        status = "OOM" if oom else f"failed: {type(e).__name__}: {str(e)[:200]}"
        print(f"roundpipe roundpipe-{mode} N={num_micro} A={accum}: {status}", file=sys.stderr, flush=True)
        return status
    return "ok"


def main() -> None:
    args = parse_args()
    if args.ballast is not None:
        ballast(args.ballast)
        return
    t_start = time.perf_counter()
    points_todo = parse_points(args.points)
    # Before anything touches CUDA: the ballast's context and allocation must be in place when
    # roundpipe is imported (it reads the free memory then).
    holder = start_ballast(args.mem_cap_gb) if args.mem_cap_gb is not None else None
    import torch
    import transformers

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    hf_model, config = build_hf_model(args.model, args.seq_length)
    n_params = active_params(args.model)  # the base model's, adapters left out: every row's N
    if args.lora_rank:
        add_lora(hf_model, args)

    import roundpipe
    from roundpipe.device import device_list

    num_gpus = len(device_list)
    model, params, optim = build_roundpipe(hf_model, args)

    def step_fn() -> None:
        # Runs on RoundPipe's optimizer thread, on the fp32 host copies and their gradients.
        if args.grad_clip > 0:  # host tensors: summed on every core, not torch's one-core norm
            clip_host_grads_(params, args.grad_clip)
        optim.step()
        optim.zero_grad()

    tokens_per_step = args.batch_size * args.seq_length
    header: dict[str, Any] = {
        "system": "roundpipe", "args": vars(args), "torch": torch.__version__,
        "roundpipe": getattr(roundpipe, "__version__", None), "transformers": transformers.__version__,
        "num_gpus": num_gpus, "device": torch.cuda.get_device_name(0), "model": args.model, "num_params": n_params,
        "tokens_per_step": tokens_per_step, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "threads": torch.get_num_threads(), "build_s": time.perf_counter() - t_start,
        "memory_cap": "ballast process" if holder else None, "pin_model": args.pin_model,
        **peer_lora.summary(args, sum(p.numel() for p in params)),
    }
    print(f"roundpipe: built in {header['build_s']:.1f}s on {num_gpus} GPUs", flush=True)
    points: list[dict] = []
    gen = torch.Generator().manual_seed(0)
    for index, (mode, num_micro, accum) in enumerate(points_todo):
        system = f"roundpipe-{mode}"
        cfg = {"step": mode, "num_microbatch": num_micro, "forward_backward_per_step": accum,
               "recompute_grain": args.recompute_grain, "optim_dtype": "float32", "grad_clip": args.grad_clip,
               "mem_cap_gb": args.mem_cap_gb, "omp_num_threads": header["omp_num_threads"],
               **({"lora_rank": args.lora_rank} if args.lora_rank else {})}
        best = sweep.best_step(points, system)
        if points and not sweep.fits(time.perf_counter() - t_start, args.budget_s,
                                     args.warmup * (best or sweep.best_step(points, "roundpipe-async") or 0.0)):
            points.append(sweep.point(system, cfg, mode == "sync", status="not run (budget)"))
            sweep.write_json(args.json, sweep.result(header, points))
            continue
        warmup = args.warmup + (1 if index == 0 else 0)
        for i in range(num_gpus):
            torch.cuda.reset_peak_memory_stats(i)
        steps = sweep.Steps(warmup, args.iterations, best, args.prune_factor, args.budget_s, t_start)
        status = run_steps(model, step_fn, args, config.vocab_size, gen, (mode, num_micro, accum), steps)
        peaks = [torch.cuda.max_memory_allocated(i) / GIB for i in range(num_gpus)]
        reserved = [torch.cuda.max_memory_reserved(i) / GIB for i in range(num_gpus)]
        points.append(sweep.measured_point(
            system, cfg, mode == "sync", status, steps, num_params=n_params, tokens_per_step=tokens_per_step,
            num_gpus=num_gpus, peak_allocated_gib=max(peaks), peak_reserved_gib=max(reserved),
            peak_allocated_gib_per_gpu=peaks,
            host_rss_peak_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB))
        print(sweep.point_line(f"{system} num_microbatch={num_micro} accum={accum}", points[-1]), flush=True)
        sweep.write_json(args.json, sweep.result(header, points))
        if status.startswith("failed"):
            break  # RoundPipe's threads may be left mid-iteration: later points would measure nothing sound
    if holder is not None:
        holder.stdin.close()
    sys.stdout.flush()
    os._exit(0)  # RoundPipe's device and optimizer threads do not always let the interpreter exit


if __name__ == "__main__":
    main()
