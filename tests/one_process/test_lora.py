"""LoRA: the pipeline trains peft's adapters exactly as peft on the plain Hugging Face model does
(float32, one process), for every schedule and offload mode; the base weights stay frozen and
out of the optimizer; the adapter saves in peft's format, reloads with
``PeftModel.from_pretrained`` and generates; a checkpoint resumes bit for bit; a saved adapter
continues; bad settings are one line before launch. Over processes and families:
tests/multi_process/test_gloo_lora.py."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from pipeline.config import ConfigError
from tests.helpers.reference import assert_same_training, in_process_trainer, reference_train, train_adapters
from tests.helpers.runs import tiny_cfg

# adam_eps 1e-4: a B matrix starts at zero, so after a few steps it is nothing but AdamW updates,
# each about lr whatever its gradient's size; an element whose gradient is near the float32 noise
# of the whole tensor's (summation orders: segments, chunks, stages) gets an lr-sized step
# decided by that noise. At 1e-6 that put the segmented run 1.1e-5 from peft's (relative, in the
# 2-norm), at 1e-4 1.2e-6: eps bounds the amplification. A lost gradient or a skipped adapter
# still moves the adapters by orders of magnitude more.
LORA = dict(lora_rank=4, lora_alpha=8.0, lora_target_modules="all-linear", adam_eps=1e-4)


def lora_cfg(path, **kw):
    return tiny_cfg(path, **{**LORA, **kw})


@functools.lru_cache(maxsize=None)
def lora_reference(path: str, **kw):
    return reference_train(lora_cfg(path, **kw), Path(path))




@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
@pytest.mark.parametrize("offload,prefetch", [(False, False), (True, False), (True, True)])
def test_lora_matches_peft(tiny_model_dir, schedule, offload, prefetch):
    cfg = lora_cfg(tiny_model_dir, schedule=schedule, use_offload=offload, use_prefetch=prefetch)
    losses, adapters, _ = train_adapters(cfg)
    assert_same_training(losses, adapters, *lora_reference(str(tiny_model_dir)))


@pytest.mark.parametrize("extra", [
    dict(use_offload=True, resident_stages=1, schedule="interleaved"),
    dict(use_offload=True, activation_checkpointing=True, keep_layers=1, fuse_last_stage="false"),
    dict(use_offload=True, activation_offload=True, schedule="gpipe"),
    dict(seq_chunks=3, use_offload=True),
    pytest.param(dict(seq_chunks=2, activation_offload=True, schedule="interleaved"), marks=pytest.mark.slow),
    # a GPU's default: every decoder layer, its LoRA layers included, through torch.compile
    pytest.param(dict(use_offload=True, activation_checkpointing=True, keep_layers=1, compile_layers="true"),
                 marks=pytest.mark.slow),
    pytest.param(dict(use_offload=True, tiled_mlp="true"), marks=pytest.mark.slow),
], ids=["resident_and_offloaded", "checkpointed", "activation_offload", "seq_chunks", "seq_chunks_act_offload",
        "compiled_layers", "tiled_mlp"])
def test_lora_modes_match_peft(tiny_model_dir, extra):
    """Resident and offloaded stages on one rank, checkpointed layers, activation offload,
    sequence segments, compiled layers and a tiled MLP: the same adapters."""
    import torch._dynamo.utils as dynamo_utils

    compiled = extra.get("compile_layers") == "true"
    if compiled:
        torch._dynamo.reset()
        dynamo_utils.counters.clear()
    losses, adapters, _ = train_adapters(lora_cfg(tiny_model_dir, **extra))
    # the layers went through the compiler, graphs shared between them: 2 for the 6 layers, as the
    # first layer's input needs no gradient (the embedding is frozen) and the others' do
    if compiled:
        assert 0 < dynamo_utils.counters["stats"]["unique_graphs"] <= 2, dict(dynamo_utils.counters["stats"])
    assert_same_training(losses, adapters, *lora_reference(str(tiny_model_dir)))


# More stages than decoder layers (8 for 6): the first stage holds only the embedding and the
# last only the final norm and the head, all frozen, so neither has a trained parameter and the
# first one's output needs no gradient; each runner on that layout.
EDGE_LAYOUTS = {
    "resident": dict(),
    "offloaded": dict(use_offload=True, resident_stages=1),
    "checkpointed": dict(use_offload=True, activation_checkpointing=True, fuse_last_stage="false"),
    "fused_last": dict(activation_checkpointing=True, fuse_last_stage="true"),
    "activation_offload": dict(use_offload=True, activation_offload=True),
    "seq_chunks": dict(seq_chunks=2, use_offload=True),
    "tiled_mlp": dict(use_offload=True, activation_offload=True, tiled_mlp="true"),
    "offloaded_segments": dict(use_offload=True, activation_offload=True, seq_chunks=2),
}


@pytest.mark.parametrize("extra", list(EDGE_LAYOUTS.values()), ids=list(EDGE_LAYOUTS))
def test_stages_without_a_trained_parameter_match_peft(tiny_model_dir, extra):
    cfg = lora_cfg(tiny_model_dir, num_stages=8, schedule="1f1b", **extra)
    losses, adapters, trainer = train_adapters(cfg)
    layers = {s: len(getattr(st.model, "layers", ())) for s, st in trainer.stages.items()}
    assert layers[0] == 0 and layers[7] == 0, layers
    assert trainer.stores[0].numel == 0 and trainer.stores[7].numel == 0
    assert_same_training(losses, adapters, *lora_reference(str(tiny_model_dir)))


def test_lora_attention_targets_match_peft(tiny_model_dir):
    kw = dict(lora_target_modules="q_proj,k_proj,v_proj,o_proj", lora_rank=8, lora_alpha=4.0)
    losses, adapters, _ = train_adapters(lora_cfg(tiny_model_dir, use_offload=True, **kw))
    assert all(".self_attn." in k for k in adapters)
    assert_same_training(losses, adapters, *lora_reference(str(tiny_model_dir), **kw))


def test_base_weights_are_frozen(tiny_model_dir):
    """Only the adapters have gradients, masters and AdamW state; offloaded base weights are in
    host memory in the compute dtype between loads, and unchanged after training."""
    cfg = lora_cfg(tiny_model_dir, use_offload=True, resident_stages=1, num_iterations=2)
    trainer = in_process_trainer(cfg)
    before = {s: {k: v.clone() for k, v in st.frozen.state_dict().items()} for s, st in trainer.stores.items()}
    trainer.train()
    for s, store in trainer.stores.items():
        assert all(".lora_" in n for n in store.names), store.names
        assert store.numel == sum(p.numel() for n, p in trainer.stages[s].named_parameters() if ".lora_" in n)
        assert all(not p.requires_grad and p.grad is None for n, p in trainer.stages[s].named_parameters()
                   if ".lora_" not in n)
        assert store.frozen.offload == (s != 0) and store.frozen.dtype == torch.float32
        if store.frozen.offload:
            assert not store.frozen.loaded  # the device copy went back after the last backward
        n_state = sum(v.numel() for st in store.optimizer.state.values() for k, v in st.items() if k != "step")
        assert n_state == 2 * store.numel
        for k, v in store.frozen.state_dict().items():
            assert torch.equal(v, before[s][k]), k


def test_adapter_reloads_with_peft_and_merges(tiny_model_dir, tmp_path):
    """save_dir/adapter is peft's format: PeftModel.from_pretrained loads it, its logits are the
    pipeline's adapters' (the reference's), it generates; --merge_lora's model equals peft's
    merge_and_unload."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = lora_cfg(tiny_model_dir, use_offload=True, save_model=True, merge_lora=True, save_dir=str(tmp_path / "run"))
    _, adapters, trainer = train_adapters(cfg)
    trainer.save([])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(base, tmp_path / "run" / "adapter").eval()
    from peft import get_peft_model_state_dict

    from tests.helpers.tolerance import assert_close

    assert_close(get_peft_model_state_dict(peft_model), adapters, 0.0)
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    out = peft_model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 10)
    # generate.py with --adapter: the base model and the adapter, the training prompt, peft's continuation
    from data import encode_generation_prompt
    from data.generation import generate
    from data.generation import build_parser as generate_parser

    args = generate_parser().parse_args(["--model", str(tiny_model_dir), "--adapter", str(tmp_path / "run" / "adapter"),
                                         "--format", "xsum", "--prompt", "the match ended", "--max_new_tokens", "6",
                                         "--device", "cpu"])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = torch.tensor([encode_generation_prompt(tok, "xsum", {"document": "the match ended"})])
    expected_ids = peft_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                                       do_sample=False, pad_token_id=tok.eos_token_id)
    assert generate(args) == [tok.decode(expected_ids[0, prompt.shape[1]:], skip_special_tokens=True)]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model", dtype=torch.float32).eval()
    expected = peft_model.merge_and_unload().state_dict()
    assert_close(merged.state_dict(), expected, 1e-6)


def test_adapter_records_its_base_as_an_absolute_path(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """A run on a relative model path (train.sh's default model is .cache/tiny-llama) records its
    base in adapter_config.json as an absolute path: from another directory peft's recorded base
    loads and generate.py with --adapter alone generates what --model <the base> does."""
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    from data.generation import main as generate_main
    from pipeline.plan.source import saved_model_dir

    monkeypatch.chdir(tiny_model_dir.parent.parent)
    relative = str(tiny_model_dir.relative_to(tiny_model_dir.parent.parent))
    cfg = lora_cfg(relative, num_iterations=1, save_model=True, save_dir=str(tmp_path / "run"))
    train_adapters(cfg)[2].save([])
    adapter = str(tmp_path / "run" / "adapter")
    monkeypatch.chdir(tmp_path)  # another directory
    recorded = PeftConfig.from_pretrained(adapter).base_model_name_or_path
    assert Path(recorded).is_absolute() and Path(recorded).resolve() == tiny_model_dir.resolve(), recorded
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(recorded), adapter)
    argv = ["--adapter", adapter, "--prompt", "the match ended", "--max_new_tokens", "4", "--device", "cpu"]
    capsys.readouterr()  # the run's log
    assert generate_main(argv, model_dir=saved_model_dir) == 0
    assert generate_main(["--model", str(tiny_model_dir), *argv], model_dir=saved_model_dir) == 0
    first, second = capsys.readouterr().out.splitlines()
    assert first == second


def test_checkpoint_resumes_bit_for_bit(tiny_model_dir, tmp_path):
    """A checkpoint holds the adapters and their AdamW state (no base weight); resumed at step 2,
    the third step is the uninterrupted run's, bit for bit."""
    save_dir = str(tmp_path / "run")
    cfg = lora_cfg(tiny_model_dir, use_offload=True, checkpoint_every=2, save_dir=save_dir, grad_clip=0.5)
    losses, adapters, _ = train_adapters(cfg)
    ckpt = Path(save_dir) / "checkpoints" / "step_00000002"
    assert (ckpt / "adapter" / "adapter_model.safetensors").is_file()
    assert not list(ckpt.glob("model-*.safetensors"))  # the base weights never change: not saved
    again, resumed, _ = train_adapters(lora_cfg(tiny_model_dir, use_offload=True, save_dir=save_dir, grad_clip=0.5,
                                         resume=str(ckpt)))
    assert again == losses[2:]
    assert sorted(resumed) == sorted(adapters) and all(torch.equal(resumed[k], adapters[k]) for k in adapters)


def test_lora_adapter_continues(tiny_model_dir, tmp_path):
    """lora_adapter: training starts from a saved peft adapter, as peft's does from the same one."""
    first = lora_cfg(tiny_model_dir, num_iterations=1, save_model=True, save_dir=str(tmp_path / "a"))
    _, _, trainer = train_adapters(first)
    trainer.save([])
    adapter = str(tmp_path / "a" / "adapter")
    cfg = lora_cfg(tiny_model_dir, lora_adapter=adapter, use_offload=True, schedule="interleaved")
    losses, adapters, _ = train_adapters(cfg)
    assert_same_training(losses, adapters, *reference_train(lora_cfg(tiny_model_dir, lora_adapter=adapter),
                                                            tiny_model_dir))


# --- the comparison must be able to fail -------------------------------------------------------
def test_detects_lost_adapter_gradient(tiny_model_dir, monkeypatch):
    from offload.store import StageStore

    original = StageStore.step

    def lossy(self, *args, **kw):  # stage 2's adapters step without their gradient
        if self.module.index == 2:
            self.grad.zero_()
        return original(self, *args, **kw)

    monkeypatch.setattr(StageStore, "step", lossy)
    losses, adapters, _ = train_adapters(lora_cfg(tiny_model_dir, use_offload=True))
    with pytest.raises(AssertionError):
        assert_same_training(losses, adapters, *lora_reference(str(tiny_model_dir)))


def test_detects_skipped_adapter(tiny_model_dir, monkeypatch):
    """A layer whose adapter is left out of the forward (its base weights still computing)."""
    from pipeline.stage import lora

    original = lora.inject

    def skipping(stage, settings):
        original(stage, settings)
        if stage.index == 1:
            layer = next(iter(stage.model.layers.values()))
            layer.self_attn.q_proj.enable_adapters(False)  # peft's own switch: the base output only

    monkeypatch.setattr(lora, "inject", skipping)
    losses, adapters, _ = train_adapters(lora_cfg(tiny_model_dir, use_offload=True))
    with pytest.raises(AssertionError):
        assert_same_training(losses, adapters, *lora_reference(str(tiny_model_dir)))


# --- settings ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,words", [
    (dict(lora_rank=-1), "lora_rank (-1) must be >= 0"),
    (dict(lora_rank=0, merge_lora=True), "merge_lora need lora_rank > 0"),
    (dict(lora_rank=4, lora_alpha=0.0), "lora_alpha (0.0) must be > 0"),
    (dict(lora_rank=4, lora_dropout=1.0), "lora_dropout (1.0) must be in [0, 1)"),
    (dict(lora_rank=4, lora_dropout=0.1, activation_offload=True), "does not work with activation_offload"),
    (dict(lora_rank=4, lora_target_modules="lm_head"), "lm_head cannot take adapters"),
    (dict(lora_rank=4, lora_target_modules="all-linear,q_proj"), "all-linear stands alone"),
    (dict(lora_rank=4, use_offload=True, resident_stages=0, delayed_update=True), "delayed_update does not apply"),
    (dict(lora_rank=4, lora_adapter="/nonexistent"), "is not a peft adapter directory"),
])
def test_bad_settings_are_one_line(tiny_model_dir, kw, words):
    from pipeline.plan.preflight import check_config

    with pytest.raises(ConfigError) as e:
        check_config(tiny_cfg(tiny_model_dir, **kw), 1)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_unknown_target_module_is_one_line(tiny_model_dir):
    from pipeline.plan.preflight import check_files

    with pytest.raises(ConfigError, match=r"qkv_proj is not a linear module of this model's decoder layers \(down_proj"):
        check_files(lora_cfg(tiny_model_dir, lora_target_modules="qkv_proj,q_proj"))


def _saved_adapter(model, out, r=4, alpha=8, targets="all-linear", **config) -> str:
    """A peft adapter of ``model`` saved to ``out``, ``config`` written over its adapter_config.json."""
    import json
    import warnings

    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets)).save_pretrained(out)
    c = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**c, **config}))
    return str(out)


def test_an_adapter_that_does_not_fit_is_one_line_with_every_difference(tiny_model_dir, tmp_path):
    """lora_adapter checked against the flags and the model before launch (it failed after launch
    with two tracebacks, one difference a run): rank, alpha and targets in one line with the flags
    that take the adapter; another model's adapter by its shapes and the base it records; a peft
    setting the stages do not train. One that fits passes, with num_layers too."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from pipeline.plan.preflight import read_model

    def refusal(adapter, **kw) -> str:
        with pytest.raises(ConfigError) as e:
            read_model(lora_cfg(tiny_model_dir, lora_adapter=adapter, **kw))
        assert "\n" not in str(e.value)
        return str(e.value)

    mine = _saved_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "mine")
    read_model(lora_cfg(tiny_model_dir, lora_adapter=mine))
    read_model(lora_cfg(tiny_model_dir, lora_adapter=mine, num_layers=3, num_stages=3))
    settings = _saved_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "qv", r=2, alpha=4,
                              targets=["q_proj", "v_proj"])
    assert refusal(settings) == (
        f"lora_adapter {settings!r} does not fit this run: r 2 (this run's lora_rank 4); lora_alpha 4 (this run's 8); "
        "target_modules q_proj,v_proj (this run's down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj); train with "
        "its settings (--lora_rank 2 --lora_alpha 4 --lora_target_modules q_proj,v_proj)")
    small = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512))
    small.save_pretrained(tmp_path / "small")
    theirs = _saved_adapter(small, tmp_path / "theirs", base_model_name_or_path=str(tmp_path / "small"))
    msg = refusal(theirs)
    assert msg.startswith(f"lora_adapter {theirs!r} does not fit this run: 28 of its tensors have other shapes than "
                          "this model's (e.g. model.layers.0.self_attn.q_proj.lora_A.weight (4, 32), this model "
                          "(4, 64)); 56 of this model's adapter tensors are not in it (e.g. model.layers.2."), msg
    assert f"it records the base model {str(tmp_path / 'small')!r}, another model (hidden_size 32, this model 64; " in msg
    assert msg.endswith(f"give a plain LoRA adapter of this model ({str(tiny_model_dir)!r})"), msg
    rslora = _saved_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "rs", use_rslora=True)
    assert "use_rslora True (not trained here)" in refusal(rslora)


# --- the memory plan -----------------------------------------------------------------------------
def test_plan_counts_frozen_weights_once_and_adapters_on_the_gpu():
    """LoRA's parameters in the plan: offloaded, the frozen base weights are host memory in the
    compute dtype (2 bytes a parameter, not full fine-tuning's 18) and the adapters with their fp32
    masters, gradients and AdamW state the GPU's; a Llama-3-70B LoRA of every linear layer, 4K-token
    rows, plans within 24 GiB on each of two GPUs, without a GPU."""
    from pipeline.plan.fit import memory_plan
    from pipeline.spec.lora import adapter_numel, lora_settings
    from pipeline.spec.shapes import stage_param_counts
    from pipeline.plan.source import preset_config
    from pipeline.config import make_config

    hf = preset_config("llama-3-70b")
    kw = dict(model="llama-3-70b", batch_size=8, num_chunks=8, seq_length=4096, num_stages=40, device="cuda",
              use_offload=True, resident_stages=0, activation_checkpointing=True, activation_offload=True,
              gpu_memory_gb=24.0)
    lora = make_config(dict(kw, lora_rank=16, lora_target_modules="all-linear"))
    full = make_config(kw)
    mapping = [s % 2 for s in range(40)]
    ranks, _ = memory_plan(lora, hf, mapping, "cuda")
    full_ranks, _ = memory_plan(full, hf, mapping, "cuda")
    frozen = sum(stage_param_counts(hf, 40))
    assert 70e9 < frozen < 71e9
    host_params = sum(r.host_parts["parameters"] for r in ranks)
    assert host_params == 2 * frozen
    assert sum(r.host_parts["parameters"] for r in full_ranks) == 18 * frozen
    adapters = adapter_numel(hf, lora_settings(lora, hf), range(80))
    assert adapters == 16 * 80 * (2 * (8192 + 8192) + 2 * (8192 + 1024) + 3 * (8192 + 28672))
    assert all(r.device_peak < 0.9 * 24 * 2**30 for r in ranks), [r.device_peak / 2**30 for r in ranks]
    assert all(r.device_peak < f.device_peak for r, f in zip(ranks, full_ranks))


def test_lora_counts_the_flops_it_does(tiny_model_dir):
    """LoRA computes no frozen weight's gradient: a step's matmuls are twice the forward's (forward
    and input gradients), attention's three passes and the adapters' own products, about 2/3 of full
    fine-tuning's 3x the forward on short rows; the step line's tflops (the trainer's count) uses it."""
    from pipeline.spec.lora import lora_settings, trained_adapters
    from pipeline.spec.shapes import attention_flops_per_token, forward_flops_per_token, model_flops_per_token
    from pipeline.plan.source import preset_config

    hf = preset_config("llama-3-8b")
    cfg = lora_cfg(tiny_model_dir, model="llama-3-8b", lora_rank=16)
    adapters = trained_adapters(hf, lora_settings(cfg, hf))
    assert adapters == 16 * 32 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))
    full, lora = model_flops_per_token(hf, 32, 512), model_flops_per_token(hf, 32, 512, adapters)
    fwd, attn = forward_flops_per_token(hf, 32, True, 512), attention_flops_per_token(hf, 512)
    assert full == 3 * fwd and lora == 2 * fwd + attn + 6 * adapters
    assert 0.66 < lora / full < 0.68
    trainer = in_process_trainer(lora_cfg(tiny_model_dir, num_iterations=1))
    hf_tiny = trainer.rank.source.config
    assert trainer.flops_per_token == model_flops_per_token(
        hf_tiny, hf_tiny.num_hidden_layers, 64, trainer.rank.spec.trained_adapters)
