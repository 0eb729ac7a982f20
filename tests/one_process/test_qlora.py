"""QLoRA (``load_in_4bit``): the pipeline trains peft's adapters on a 4-bit base exactly as peft does
on the Hugging Face model that transformers loads with ``BitsAndBytesConfig(load_in_4bit=True, ...)``
(float32, one process, bitsandbytes' CPU path; the reference in training mode, as
``tests/helpers/reference.py`` says why), for resident and offloaded stages, both data types, double
quantization and every runner; the base's linear weights are 4-bit bytes in the store (host
memory when offloaded), which the memory plan counts to the byte; an offloaded weight's backward
reads the bytes loaded at backward time; a layer left unquantized fails the comparison; the
adapter records its 4-bit base, generate.py loads the base so, and --merge_lora merges into the
full-precision base. Over 2 processes x 4 stages: tests/multi_process/test_gloo_qlora.py."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from pipeline.config import ConfigError
from tests.helpers.families import FAMILY_TYPES, family_cfg, family_model
from tests.helpers.qlora import streamed_grad
from tests.helpers.reference import assert_same_training, in_process_trainer, reference_train, train_adapters
from tests.helpers.runs import tiny_cfg
from tests.helpers.tolerance import assert_close

# adam_eps 1e-4: test_lora.py says why (a B matrix is nothing but AdamW updates)
QLORA = dict(lora_rank=4, lora_alpha=8.0, lora_target_modules="all-linear", adam_eps=1e-4, load_in_4bit=True)
QUANT_KEYS = ("bnb_4bit_quant_type", "bnb_4bit_use_double_quant")


def qlora_cfg(path, **kw):
    return tiny_cfg(path, **{**QLORA, **kw})


@functools.lru_cache(maxsize=None)
def qlora_reference(path: str, **quant):
    """peft on transformers' 4-bit model (``quant``: the quantization settings)."""
    return reference_train(qlora_cfg(path, **quant), Path(path))




def check_against_peft(model_dir, **kw):
    losses, adapters, _ = train_adapters(qlora_cfg(model_dir, **kw))
    quant = {k: v for k, v in kw.items() if k in QUANT_KEYS}
    assert_same_training(losses, adapters, *qlora_reference(str(model_dir), **quant))


@pytest.mark.parametrize("kw", [
    dict(schedule="gpipe"),
    dict(use_offload=True, use_prefetch=False),
    dict(use_offload=True, schedule="interleaved", bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True),
    dict(use_offload=True, resident_stages=1, bnb_4bit_use_double_quant=True),
], ids=["resident", "offloaded", "fp4_double_quant_interleaved", "resident_and_offloaded_double_quant"])
def test_qlora_matches_peft(tiny_model_dir, kw):
    check_against_peft(tiny_model_dir, **kw)


@pytest.mark.parametrize("kw", [
    dict(use_offload=True, activation_checkpointing=True, keep_layers=1, fuse_last_stage="false"),
    dict(use_offload=True, activation_offload=True, schedule="gpipe"),
    dict(seq_chunks=3, use_offload=True),
    pytest.param(dict(use_offload=True, tiled_mlp="true"), marks=pytest.mark.slow),
], ids=["checkpointed", "activation_offload", "seq_chunks", "tiled_mlp"])
def test_qlora_runners_match_peft(tiny_model_dir, kw):
    check_against_peft(tiny_model_dir, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_TYPES)
def test_every_family_trains_as_peft_on_its_4bit_model(family, tmp_path_factory):
    """Each registered family's tiny model (norms and biases off their init; mixture-of-experts
    routers and experts are no linear layers and stay in the compute dtype, as transformers
    leaves them), every stage offloaded."""
    root = str(tmp_path_factory.getbasetemp() / "qlora_families")
    path = family_model(family, root)
    losses, adapters, _ = train_adapters(family_cfg(path, use_offload=True, **QLORA))
    assert_same_training(losses, adapters, *reference_train(family_cfg(path, **QLORA), Path(path)))


def test_base_is_4bit_in_the_store_as_planned(tiny_model_dir):
    """Every decoder-layer linear weight is bitsandbytes' 4-bit module, its bytes and scales in the
    store's byte buffer (host memory for an offloaded stage, unchanged by training); the embedding,
    norms and head in the compute dtype; each stage's frozen bytes are the memory plan's."""
    from pipeline.plan.fit import memory_inputs
    from pipeline.spec.footprint import stage_frozen_bytes
    from pipeline.stage.quantized import linear_class

    cfg = qlora_cfg(tiny_model_dir, use_offload=True, resident_stages=1, num_iterations=2)
    trainer = in_process_trainer(cfg)
    before = {s: st.frozen.host_packed.clone() for s, st in trainer.stores.items() if st.frozen.offload}
    trainer.train()
    inp, _ = memory_inputs(trainer.rank.spec, trainer.rank.mapping)
    for s, store in trainer.stores.items():
        stage = trainer.stages[s]
        layers = [(n, m) for layer in stage.model.layers.values() for n, m in layer.named_modules()]
        base = [m for n, m in layers if "lora_" not in n]  # peft's adapters are linear modules of their own
        assert all(type(m) is not torch.nn.Linear for m in base), f"stage {s}: a linear layer is not 4-bit"
        four_bit = [m for m in base if isinstance(m, linear_class())]
        assert len(four_bit) == 7 * len(stage.model.layers) == len(store.frozen.packed)
        assert all(m.weight.dtype == torch.uint8 for m in four_bit)
        assert all(".base_layer." in n or "norm" in n or "embed" in n or "lm_head" in n for n in store.frozen.names)
        assert store.frozen.dtype == torch.float32 and store.frozen.offload == (s != 0)
        assert store.frozen.nbytes == stage_frozen_bytes(inp.stages[s], 4), s
        if store.frozen.offload:
            assert store.frozen.dev_packed is None and not store.frozen.loaded
            assert torch.equal(store.frozen.host_packed, before[s])


def test_offloaded_backward_reads_the_bytes_loaded_now():
    grad, expected = streamed_grad(torch.device("cpu"))
    assert torch.equal(grad, expected)


@pytest.mark.slow
def test_compiled_offloaded_backward_reads_the_bytes_loaded_now():
    """Through torch.compile, whose graph saves the weight's view for its backward (the store's
    hooks rebuild it from the buffer loaded then)."""
    torch._dynamo.reset()
    grad, expected = streamed_grad(torch.device("cpu"), compiled=True)
    torch._dynamo.reset()
    assert_close(grad, expected, 1e-6)


def test_detects_a_backward_of_the_forwards_bytes(monkeypatch):
    """The mutation: bitsandbytes' own Linear4bit forward, whose autograd function keeps a view of
    the bytes the forward read, computes the backward from another stage's bytes."""
    import bitsandbytes as bnb

    from pipeline.stage.quantized import linear_class

    monkeypatch.setattr(linear_class(), "forward", bnb.nn.Linear4bit.forward)
    grad, expected = streamed_grad(torch.device("cpu"))
    assert not torch.allclose(grad, expected, rtol=1e-2)


def test_detects_an_unquantized_layer(tiny_model_dir, monkeypatch):
    """A planted fault: one linear module of stage 1 left in full precision (plain LoRA on it)."""
    from pipeline.stage import quantized

    original = quantized.quantized_modules

    def one_left_out(stage):
        found = original(stage)
        return found[1:] if stage.index == 1 else found

    monkeypatch.setattr(quantized, "quantized_modules", one_left_out)
    losses, adapters, trainer = train_adapters(qlora_cfg(tiny_model_dir, use_offload=True))
    assert any(type(m) is torch.nn.Linear and "lora_" not in n for n, m in trainer.stages[1].named_modules())
    with pytest.raises(AssertionError):
        assert_same_training(losses, adapters, *qlora_reference(str(tiny_model_dir)))


def test_adapter_records_its_4bit_base_and_generates(tiny_model_dir, tmp_path, capsys):
    """save_dir/adapter is peft's, with base_quantization.json (BitsAndBytesConfig's arguments);
    on transformers' 4-bit model it is the pipeline's adapters; generate.py --adapter loads the
    base in 4 bits, says so and continues the prompt as that peft model does."""
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from data import encode_generation_prompt
    from data.generation import BASE_QUANTIZATION, main as generate_main

    out = tmp_path / "run"
    cfg = qlora_cfg(tiny_model_dir, use_offload=True, save_model=True, save_dir=str(out),
                    bnb_4bit_use_double_quant=True)
    _, adapters, trainer = train_adapters(cfg)
    trainer.save([])
    record = json.loads((out / "adapter" / BASE_QUANTIZATION).read_text())
    assert record == {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                      "bnb_4bit_compute_dtype": "float32"}
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, device_map="cpu",
                                                quantization_config=BitsAndBytesConfig(**record))
    for m in base.modules():  # the arithmetic training used (generate.py sets it too: data/generation.py)
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    peft_model = PeftModel.from_pretrained(base, out / "adapter").eval()
    assert_close(get_peft_model_state_dict(peft_model), adapters, 0.0)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = torch.tensor([encode_generation_prompt(tok, "xsum", {"document": "the match ended"})])
    expected = peft_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                                   pad_token_id=tok.eos_token_id)
    capsys.readouterr()
    assert generate_main(["--model", str(tiny_model_dir), "--adapter", str(out / "adapter"), "--format", "xsum",
                          "--prompt", "the match ended", "--max_new_tokens", "6", "--device", "cpu"]) == 0
    printed = capsys.readouterr()
    assert printed.out.splitlines() == [tok.decode(expected[0, prompt.shape[1]:], skip_special_tokens=True)]
    assert "in 4 bits (nf4, double quantization; compute float32)" in printed.err


def test_merge_lora_merges_into_the_full_precision_base(tiny_model_dir, tmp_path):
    """--merge_lora with merge_lora_base: W + scaling * B @ A over the full-precision weights, as
    peft's merge_and_unload of the adapter on the float32 model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    _, _, trainer = train_adapters(qlora_cfg(tiny_model_dir, use_offload=True, save_model=True, save_dir=str(out),
                                             merge_lora=True, merge_lora_base=str(tiny_model_dir)))
    trainer.save([])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    expected = PeftModel.from_pretrained(base, out / "adapter").merge_and_unload().state_dict()
    merged = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32).state_dict()
    assert_close(merged, expected, 1e-6)


def test_checkpoint_resumes_bit_for_bit(tiny_model_dir, tmp_path):
    """A checkpoint holds the adapters (with the base's record) and their AdamW state; resumed at
    step 2 the base is quantized again from the model, and the third step is the uninterrupted
    run's, bit for bit."""
    from data.generation import BASE_QUANTIZATION

    save_dir = str(tmp_path / "run")
    cfg = qlora_cfg(tiny_model_dir, use_offload=True, checkpoint_every=2, save_dir=save_dir)
    losses, adapters, _ = train_adapters(cfg)
    ckpt = Path(save_dir) / "checkpoints" / "step_00000002"
    assert (ckpt / "adapter" / BASE_QUANTIZATION).is_file()
    again, resumed, _ = train_adapters(qlora_cfg(tiny_model_dir, use_offload=True, save_dir=save_dir,
                                                 resume=str(ckpt)))
    assert again == losses[2:]
    assert sorted(resumed) == sorted(adapters) and all(torch.equal(resumed[k], adapters[k]) for k in adapters)


# --- settings ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,words", [
    (dict(load_in_4bit=True), "load_in_4bit need lora_rank > 0"),
    (dict(lora_rank=4, load_in_4bit=True, merge_lora=True), "give merge_lora_base, the full-precision"),
    (dict(lora_rank=4, merge_lora=True, merge_lora_base="/x"), "it needs merge_lora and load_in_4bit"),
    (dict(lora_rank=4, load_in_4bit=True, bnb_4bit_quant_type="int4"), "bnb_4bit_quant_type"),
])
def test_bad_settings_are_one_line(tiny_model_dir, kw, words):
    from pipeline.plan.preflight import check_config

    with pytest.raises(ConfigError) as e:
        check_config(tiny_cfg(tiny_model_dir, **kw), 1)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("case", ["no_bitsandbytes", "preset_base", "other_base", "not_a_model"])
def test_bad_files_are_one_line(tiny_model_dir, wide_vocab_model_dir, tmp_path, monkeypatch, case):
    """Before launch: bitsandbytes missing; a merge_lora_base for a preset, of another shape, or no
    model directory."""
    import importlib.util

    from pipeline.plan.preflight import check_base_4bit
    from pipeline.plan.source import resolve_model

    kw, words = {"no_bitsandbytes": ({}, "needs the bitsandbytes package, which is not installed"),
                 "preset_base": (dict(model="tiny"), "is a preset"),
                 "other_base": (dict(merge_lora_base=str(wide_vocab_model_dir)), "vocab_size 4096"),
                 "not_a_model": (dict(merge_lora_base=str(tmp_path)), "is not a Hugging Face model directory")}[case]
    merge = dict(merge_lora=True, merge_lora_base=str(tiny_model_dir)) if case != "no_bitsandbytes" else {}
    cfg = qlora_cfg(tiny_model_dir, **{**merge, **kw})
    if case == "no_bitsandbytes":
        find = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else
                            find(name, *a))
    with pytest.raises(ConfigError) as e:
        check_base_4bit(cfg, resolve_model(cfg))
    assert words in str(e.value) and "\n" not in str(e.value)


# --- the memory plan -----------------------------------------------------------------------------
def test_plan_counts_the_4bit_base():
    """Llama-3-70B shapes, QLoRA rank 16 on every linear layer, 4K-token rows, one GPU of 24 GiB:
    the base in host memory is its linear weights at 0.5625 bytes a parameter (nf4 and an fp32
    absmax per 64) and the rest in bf16 (under 64 GiB, bf16 LoRA's 131 GiB), and the plan fits."""
    from pipeline.config import make_config
    from pipeline.plan.fit import memory_plan
    from pipeline.spec.lora import Base4bit, quantized
    from pipeline.spec.shapes import stage_param_counts
    from pipeline.plan.source import preset_config

    hf = preset_config("llama-3-70b")
    kw = dict(model="llama-3-70b", batch_size=8, num_chunks=8, seq_length=4096, num_stages=40, device="cuda",
              use_offload=True, resident_stages=0, activation_checkpointing=True, activation_offload=True,
              gpu_memory_gb=24.0, lora_rank=16, lora_target_modules="all-linear")
    mapping = [0] * 40
    (rank,), _ = memory_plan(make_config(dict(kw, load_in_4bit=True)), hf, mapping, "cuda")
    (bf16,), _ = memory_plan(make_config(kw), hf, mapping, "cuda")
    q = quantized(hf, Base4bit(), range(80))
    total = sum(stage_param_counts(hf, 40))
    assert q.numel == 80 * (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672)
    assert abs(q.nbytes / q.numel - 0.5625) < 1e-4
    assert rank.host_parts["parameters"] == q.nbytes + 2 * (total - q.numel)
    assert rank.host_parts["parameters"] < 40 * 2**30 < bf16.host_parts["parameters"]
    assert q.largest == 8192 * 28672  # an MLP weight: dequantized to bf16 for each product
    assert rank.device_peak < 0.9 * 24 * 2**30


def test_plan_of_70b_qlora_holds_the_peak_an_h200_measured():
    """Llama-3-70B QLoRA in 16 stages of 5 layers, 4 x 4K rows, the plan's layout of
    bench/results/2026-12-02_qlora/call3 (an H200: 18.344 GiB allocated at the peak, the offload
    pool's buffers 2295, 2295 and 2004 MiB): the plan is over that peak by at most 10%. A LOAD
    takes the 4-bit bytes and the compute-dtype weights in two buffers, as ``offload.frozen``
    does, so the last stage's layers reuse the others' 4-bit buffer and its head has one of its
    own; one buffer of both (4299 MiB) made the plan 17% over."""
    from pipeline.config import make_config
    from pipeline.plan.fit import memory_plan
    from pipeline.plan.source import preset_config

    kw = dict(model="llama-3-70b", batch_size=4, num_chunks=4, seq_length=4096, num_stages=16, device="cuda",
              use_offload=True, resident_stages=1, activation_checkpointing=True, activation_offload=True,
              tiled_mlp="true", gpu_memory_gb=24.0, lora_rank=16, lora_target_modules="all-linear",
              load_in_4bit=True)
    (rank,), _ = memory_plan(make_config(kw), preset_config("llama-3-70b"), [0] * 16, "cuda")
    measured = 18.344 * 2**30
    assert measured <= rank.device_peak <= measured / 0.9, rank.device_peak / 2**30
