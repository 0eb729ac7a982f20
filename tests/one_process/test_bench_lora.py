"""L1: the peers' LoRA set-up (bench/peer_lora.py, as bench/fsdp2_baseline.py and
bench/roundpipe_baseline.py use it) on a tiny Llama: exactly peft's adapters train, FSDP2's model
keeps its frozen weights in bf16 beside float32 adapters, and the model RoundPipe's Llama preset
takes keeps the structure that preset reads. FSDP2 training with LoRA on gloo:
tests/multi_process/test_bench_smoke.py. RoundPipe itself needs CUDA."""
from __future__ import annotations

import re
import zipfile

import pytest
import torch
from torch import nn

from tests.helpers.bench import load_bench
from tests.helpers.paths import ROOT

peer_lora = load_bench("peer_lora")
fsdp2 = load_bench("fsdp2_baseline")
rp = load_bench("roundpipe_baseline")

PEFT_PREFIX = "base_model.model."
# What RoundPipe 0.1.1's Llama preset (roundpipe/models/llama.py) reads off the model it wraps.
PRESET_READS = {"model.model.embed_tokens", "model.model.rotary_emb", "model.model.config", "model.model.layers",
                "model.model.norm", "model.config.vocab_size", "model.lm_head", "model.loss_function"}


def tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False)


def tiny_llama(dtype=torch.float32):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config()).to(dtype)


def peft_reference(targets: str, rank: int = 4) -> tuple[set[str], int]:
    """The trainable names (without PeftModel's prefix) and count of peft's own LoRA model."""
    from peft import LoraConfig, get_peft_model

    ref = get_peft_model(tiny_llama(), LoraConfig(r=rank, lora_alpha=8, target_modules=peer_lora.targets(targets),
                                                  task_type="CAUSAL_LM"))
    names = {n.removeprefix(PEFT_PREFIX) for n, p in ref.named_parameters() if p.requires_grad}
    return names, ref.get_nb_trainable_parameters()[0]


def lora_args(targets: str = "all-linear", rank: int = 4):
    return fsdp2.parse_args(["--lora_rank", str(rank), "--lora_alpha", "8", "--lora_target_modules", targets])


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj"])
def test_injected_adapters_are_exactly_peft_trainable_parameters(targets):
    model = tiny_llama()
    count = peer_lora.inject(model, 4, 8.0, targets)
    names, want = peft_reference(targets)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == names and all(peer_lora.is_adapter(n) for n in trainable)
    assert count == want == sum(p.numel() for n, p in model.named_parameters() if n in trainable)
    assert type(model.lm_head) is nn.Linear  # peft's all-linear leaves the head out, as this project's does


def test_fsdp2_meta_model_freezes_the_base_in_bf16_beside_float32_adapters():
    """What fully_shard then wraps: one dtype among the trainable parameters (FSDP2's rule for a
    unit), the frozen ones in bf16; full fine-tuning (rank 0) unchanged: everything trains, float32."""
    model = fsdp2.meta_model(tiny_config(), lora_args(), torch.bfloat16)
    names, want = peft_reference("all-linear")
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert set(trainable) == names and sum(p.numel() for p in trainable.values()) == want
    assert {p.dtype for p in trainable.values()} == {torch.float32}
    assert {p.dtype for n, p in model.named_parameters() if n not in trainable} == {torch.bfloat16}
    full = fsdp2.meta_model(tiny_config(), fsdp2.parse_args([]), torch.bfloat16)
    assert all(p.requires_grad and p.dtype == torch.float32 for p in full.parameters())


def test_fsdp2_adapter_shards_start_as_peft_starts_them():
    """B zero (the adapted model is the base model), A inside kaiming-uniform's 1 / sqrt(fan_in)."""
    a, b, w = torch.empty(4, 64), torch.ones(64, 4), torch.empty(64, 64)
    fsdp2.init_shard_("model.layers.0.self_attn.q_proj.lora_A.default.weight", a)
    fsdp2.init_shard_("model.layers.0.self_attn.q_proj.lora_B.default.weight", b)
    fsdp2.init_shard_("model.layers.0.self_attn.q_proj.base_layer.weight", w)
    assert not b.any() and 0 < a.abs().max() <= 64 ** -0.5 and w.std() == pytest.approx(0.02, rel=0.2)


def _resolve(model, path: str):
    obj = model
    for part in path.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def preset_reads_in_wheel() -> set[str] | None:
    """``model.…`` paths RoundPipe's Llama preset reads, from the wheel's source (None without the wheel)."""
    wheels = sorted((ROOT / ".whl").glob("roundpipe-*.whl"))
    if not wheels:
        return None
    with zipfile.ZipFile(wheels[-1]) as z:
        source = z.read("roundpipe/models/llama.py").decode()
    return set(re.findall(r"\bmodel\.(?:model\.)?[a-z_]+(?:\.[a-z_]+)?", source)) - {"model.model"}


def test_roundpipe_lora_keeps_what_the_llama_preset_reads():
    """peft's layers go inside the decoder layers; the preset's class test and everything it reads
    (embedding, rotary, layers, norm, a plain linear head for its fused loss) stay as they were."""
    from peft.tuners.lora import Linear as LoraLinear

    model = tiny_llama(torch.bfloat16)
    before = {path: type(_resolve(model, path)) for path in PRESET_READS}
    layers_before = [dict(layer.named_modules()) for layer in model.model.layers]
    rp.add_lora(model, rp.parse_args(["--lora_rank", "4", "--lora_alpha", "8"]))
    assert type(model).__name__ == "LlamaForCausalLM"  # the preset's registry key
    assert {path: type(_resolve(model, path)) for path in PRESET_READS} == before
    assert type(model.lm_head) is nn.Linear and not model.lm_head.weight.requires_grad
    for layer, old in zip(model.model.layers, layers_before):
        wrapped = {name for name, m in layer.named_modules() if isinstance(m, LoraLinear)}
        assert wrapped == {name for name, m in old.items() if isinstance(m, nn.Linear)}
        for name in wrapped:
            assert layer.get_submodule(name).base_layer is old[name]  # the same weights, wrapped
    trainable = [p for p in model.parameters() if p.requires_grad]  # what optim_parameters() copies
    assert {p.dtype for p in trainable} == {torch.bfloat16}  # the model's dtype; RoundPipe keeps float32 copies
    assert sum(p.numel() for p in trainable) == peft_reference("all-linear")[1]


def test_the_preset_reads_listed_here_are_the_wheels():
    found = preset_reads_in_wheel()
    if found is None:
        pytest.skip("no RoundPipe wheel in .whl/ (bash ../shared/gpu/peer_wheels.sh fills it)")
    assert found == PRESET_READS


def test_roundpipe_refuses_a_lora_head():
    with pytest.raises(SystemExit, match="stay frozen"):
        rp.parse_args(["--lora_rank", "4", "--lora_target_modules", "lm_head"])
