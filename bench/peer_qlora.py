"""peft + bitsandbytes QLoRA on plain Hugging Face, on one GPU: the peer a user picks for QLoRA,
beside this project's load_in_4bit rows (``bench/qlora_rows.sh``).

    python3 bench/peer_qlora.py --model llama-3-8b --batch_size 64 --seq_length 512 --mem_cap_gb 24 \
        --lora_rank 16 --lora_alpha 32 --micro_batches 8,16 --json OUT/peers/peft-qlora.json --budget_s 120
    python3 bench/peer_qlora.py --model tiny --device cpu --batch_size 4 --seq_length 32 --micro_batches 2 \
        --lora_rank 4 --iterations 1 --warmup 1          # CPU smoke (float32, bitsandbytes' CPU path)

The QLoRA recipe as its users run it: ``LlamaForCausalLM`` of the preset's shapes with every linear
layer but the head as bitsandbytes' ``Linear4bit`` (transformers' ``replace_with_bnb_linear`` with
``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=nf4, bnb_4bit_compute_dtype=bfloat16)``;
random weights, each drawn on the GPU in bf16 and quantized there as ``from_pretrained`` quantizes
a checkpoint's, so nothing is written or read), peft's ``prepare_model_for_kbit_training`` (the
other parameters in float32, gradient checkpointing per decoder layer, non-reentrant), peft's
LoRA (``get_peft_model``, all-linear: bench/peer_lora.py's targets), bf16 autocast, torch's fused
AdamW over the adapters, the batch in micro-batches (gradient accumulation) and the norm clipped.
The whole model stays on the GPU (8B: about 5.5 GB of 4-bit weights): no offload, no pipeline.

Each micro-batch size is a sweep point (``bench/sweep.py``'s JSON, one build): ``--warmup`` steps
then ``--iterations`` measured ones, the point given up when it runs out of memory, is clearly
slower than the best (``--prune_factor``) or would not end within ``--budget_s``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_lora  # noqa: E402
import sweep  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = "peft-qlora"
GIB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3-8b", help="a preset of pipeline.plan.source (Llama shapes)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: smoke run in float32")
    p.add_argument("--batch_size", type=int, default=64, help="sequences per optimizer step")
    p.add_argument("--seq_length", type=int, default=512)
    p.add_argument("--micro_batches", default="8,16", help="micro-batch sizes to sweep (divisors of batch_size)")
    p.add_argument("--quant_type", choices=("nf4", "fp4"), default="nf4")
    p.add_argument("--iterations", type=int, default=2, help="measured optimizer steps per point")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured optimizer steps before them")
    p.add_argument("--budget_s", type=float, default=None, help="start no point that would end after this")
    p.add_argument("--prune_factor", type=float, default=1.5)
    p.add_argument("--mem_cap_gb", type=float, default=None, help="cap the GPU's memory (emulates a smaller card)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--json", default=None)
    peer_lora.add_args(p)
    args = p.parse_args(argv)
    if not args.lora_rank:
        args.lora_rank = 16
    peer_lora.check(args)
    args.micro_batches = sweep.parse_int_list(args.micro_batches)
    bad = [m for m in args.micro_batches if args.batch_size % m]
    if bad:
        raise SystemExit(f"error: --micro_batches {bad} do not divide --batch_size {args.batch_size}")
    return args


def build(args: argparse.Namespace, device: torch.device):
    """The 4-bit model with peft's adapters, prepared as the QLoRA recipe prepares it."""
    import bitsandbytes as bnb
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig, LlamaForCausalLM
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from pipeline.plan.source import preset_config

    config = preset_config(args.model)
    config.use_cache = False
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=args.quant_type, bnb_4bit_compute_dtype=dtype)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    replace_with_bnb_linear(model, modules_to_not_convert=["lm_head"], quantization_config=quant)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, module in model.named_modules():
            for pname, p in list(module.named_parameters(recurse=False)):
                value = torch.empty(p.shape, dtype=dtype, device=device)
                if p.ndim == 1:
                    value.fill_(1.0)  # the norms' weights
                else:
                    value.normal_(0.0, config.initializer_range, generator=gen)
                if isinstance(module, bnb.nn.Linear4bit) and pname == "weight":
                    module.weight = bnb.nn.Params4bit(value, requires_grad=False, **p.__dict__).to(device)
                else:
                    setattr(module, pname, torch.nn.Parameter(value, requires_grad=False))
    with device:  # its frequencies were made on the meta device
        model.model.rotary_emb = type(model.model.rotary_emb)(config)
    model.is_loaded_in_4bit = True  # what from_pretrained sets on a 4-bit model (peft reads it)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                      target_modules=peer_lora.targets(args.lora_target_modules), task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    model.train()
    return model, config


def step_fn(model, opt, params, batch: torch.Tensor, micro: int, args, device: torch.device):
    """One optimizer step over ``batch`` in micro-batches of ``micro`` rows; returns the loss."""
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
        "cpu", enabled=False)
    n = batch.shape[0] // micro
    total = 0.0
    for mb in batch.split(micro):
        with autocast:
            loss = model(input_ids=mb, labels=mb).loss / n
        loss.backward()
        total += loss.detach()
    if args.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(total)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # the memory cap and the generator want an index
        device = torch.device("cuda", torch.cuda.current_device())
    t0 = time.perf_counter()
    if device.type == "cuda" and args.mem_cap_gb:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.mem_cap_gb * GIB / total), device)
    model, config = build(args, device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, fused=device.type == "cuda")
    header = {"system": SYSTEM, "model": args.model, "num_params": sweep.model_params(args.model), "num_gpus": 1,
              "tokens_per_step": args.batch_size * args.seq_length, "build_s": round(time.perf_counter() - t0, 1),
              **peer_lora.summary(args, sum(p.numel() for p in params))}
    print(f"{SYSTEM}: built in {header['build_s']}s, {header['trainable_params']} adapter parameters", flush=True)
    batch = torch.randint(config.vocab_size, (args.batch_size, args.seq_length), device=device,
                          generator=torch.Generator(device=device).manual_seed(1))
    points = []
    for micro in args.micro_batches:
        steps = sweep.Steps(args.warmup, args.iterations, sweep.best_step(points, SYSTEM), args.prune_factor,
                            args.budget_s, t0)
        cfg = {"micro_batch_per_rank": micro, "gradient_accumulation_steps": args.batch_size // micro,
               "lora_rank": args.lora_rank}
        status = "ok"
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            for i in range(args.warmup + args.iterations):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                loss = step_fn(model, opt, params, batch, micro, args, device)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                stop = steps.add(i, time.perf_counter() - start, loss, time.perf_counter())
                if stop:
                    status = stop
                    break
        except torch.OutOfMemoryError:
            status = "OOM"
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
        peaks = {"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
                 "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB} if device.type == "cuda" else {}
        points.append(sweep.measured_point(SYSTEM, cfg, True, status, steps, num_params=header["num_params"],
                                           tokens_per_step=header["tokens_per_step"], num_gpus=1, **peaks))
        print(sweep.point_line(f"{SYSTEM} micro_batch={micro}", points[-1]), flush=True)
        sweep.write_json(args.json, sweep.result(header, points))


if __name__ == "__main__":
    main()
