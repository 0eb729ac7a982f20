"""L1: the QLoRA bench's parts on the CPU: the peer (bench/peer_qlora.py) builds what
transformers' 4-bit loading and peft's QLoRA recipe make (every linear layer but the head in
bitsandbytes' 4 bits, the rest float32, exactly peft's all-linear adapters trainable) and trains
a step; the table (bench/qlora_table.py) reads --plan's peaks from the plan's own text."""
from __future__ import annotations

import torch

from tests.helpers.bench import load_bench

peer = load_bench("peer_qlora")
table = load_bench("qlora_table")


def test_peer_is_the_qlora_recipe_and_trains():
    import bitsandbytes as bnb

    args = peer.parse_args(["--model", "tiny", "--device", "cpu", "--batch_size", "2", "--seq_length", "16",
                            "--micro_batches", "1", "--lora_rank", "4"])
    model, config = peer.build(args, torch.device("cpu"))
    base = model.get_base_model()
    linears = {n: m for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and "lora_" not in n}
    assert {n for n, m in linears.items() if not isinstance(m, bnb.nn.Linear4bit)} == {"lm_head"}
    four_bit = [m for m in linears.values() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(four_bit) == 7 * config.num_hidden_layers
    assert all(m.weight.dtype == torch.uint8 and m.weight.quant_state.quant_type == "nf4" for m in four_bit)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * len(four_bit)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if p.dtype.is_floating_point)
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-3)
    batch = torch.randint(config.vocab_size, (2, 16))
    loss = peer.step_fn(model, opt, params, batch, 1, args, torch.device("cpu"))
    assert loss == loss and any(not torch.equal(a, b) for a, b in zip(before, params))


def test_table_reads_the_plans_peaks():
    from pipeline.config import make_config
    from pipeline.plan.fit import assess_spec, assessment_report, plan_spec
    from pipeline.plan.source import preset_config

    hf = preset_config("llama-3-8b")
    cfg = make_config(dict(model="llama-3-8b", batch_size=64, num_chunks=8, seq_length=512, num_stages=4,
                           device="cuda", gpu_memory_gb=24.0, host_memory_gb=64.0, use_offload=True,
                           activation_checkpointing=True, lora_rank=16, load_in_4bit=True))
    spec = plan_spec(cfg, hf, 1)
    a = assess_spec(spec, [0] * 4)
    gpu, host = table.plan_peaks(assessment_report(a, spec, [0] * 4))
    assert gpu == round(a.worst.device_peak / 2**30, 2) and host == round(a.total_host / 2**30, 2)
