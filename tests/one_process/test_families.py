"""Every registered model family trains as its own Hugging Face model trains.

Each family is a tiny model made by the generator (``data.ensure_tiny_model(family=...)``: the
spec's ``tiny`` settings, windows shorter than the rows, tied heads where the family ties),
with every norm and bias moved off its initial value so that each one matters. For each family:
stage forwards equal the Hugging Face forward; training over 4 stages equals plain single-process
training for gpipe, 1f1b and interleaved, with and without offload (and recompute); two processes
train it as one (tests/multi_process/test_gloo_families.py); the saved model loads in Hugging
Face and generates; resume is bit-exact. The mutations at the end show that the comparisons see
a missing q/k norm, a dropped embedding scale, a lost router loss and a token routed to another
expert in a recompute.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from models import supports_sdpa, tiny_config
from tests.helpers.families import FAMILY_TYPES, MODES, SEQ, family_cfg, family_model, family_reference
from tests.helpers.reference import assert_same_training, hf_model, reference_train, stages_forward, train_in_process
from tests.helpers.runs import tiny_cfg
from tests.helpers.tolerance import rel_err as _rel


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("families"))


def _impls(family: str) -> list[str]:
    return ["eager", "sdpa"] if supports_sdpa(tiny_config(family, num_hidden_layers=4)) else ["eager"]


# --- forwards --------------------------------------------------------------------------------------
@pytest.mark.parametrize("family,impl", [(f, i) for f in FAMILY_TYPES for i in _impls(f)])
def test_stage_forward_equals_hf(root, family, impl):
    path = family_model(family, root)
    hf = hf_model(path, impl)
    x = torch.randint(3, hf.config.vocab_size, (2, SEQ))
    with torch.no_grad():
        ref = hf(x).logits
    for num_stages in (1, 3):
        assert _rel(stages_forward(hf.config, path, x, num_stages), ref) <= 1e-5, num_stages


def test_a_missing_qk_norm_is_seen(root):
    """Qwen3 normalises each head's queries and keys: without the q norm the stages differ."""
    path = family_model("qwen3", root)
    hf = hf_model(path, "sdpa")
    x = torch.randint(3, hf.config.vocab_size, (2, SEQ))
    with torch.no_grad():
        ref = hf(x).logits

    def drop_q_norm(stage):
        for layer in stage.model.layers.values():
            layer.self_attn.q_norm = torch.nn.Identity()

    assert _rel(stages_forward(hf.config, path, x, 2, drop_q_norm), ref) > 1e-2


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_a_dropped_embedding_scale_is_seen(root, family):
    """Gemma scales the embedding by sqrt(hidden) through a buffer of its module, which no
    checkpoint holds: a stage that lost it differs."""
    path = family_model(family, root)
    hf = hf_model(path, "eager")
    x = torch.randint(3, hf.config.vocab_size, (2, SEQ))
    with torch.no_grad():
        ref = hf(x).logits

    def unscaled(stage):
        if stage.is_first:
            stage.model.embed_tokens.embed_scale.fill_(1.0)

    assert _rel(stages_forward(hf.config, path, x, 2), ref) <= 1e-5
    assert _rel(stages_forward(hf.config, path, x, 2, unscaled), ref) > 1e-2


# --- training ----------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
@pytest.mark.parametrize("family", FAMILY_TYPES)
def test_training_matches_hf(root, family, schedule, mode):
    """4 stages in one process; a tied head over 4 stages where the family ties."""
    path = family_model(family, root)
    assert_same_training(*train_in_process(family_cfg(path, schedule=schedule, **MODES[mode])).outcome,
                         *family_reference(str(path)))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_TYPES)
def test_saved_model_loads_and_generates(root, tmp_path, family):
    """The saved directory is the family's Hugging Face model (per-expert checkpoints for
    Qwen3-MoE, one tied matrix for Gemma): it loads, computes the trained weights' logits and
    generates."""
    from transformers import AutoModelForCausalLM

    path = family_model(family, root)
    run = train_in_process(family_cfg(path, save_dir=str(tmp_path), save_model=True, num_iterations=2))
    run.trainer.save([])
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "model", attn_implementation="eager",
                                                 dtype=torch.float32).eval()
    trained = hf_model(path, "eager")
    trained.load_state_dict(run.masters, strict=False)  # a tied head is the embedding
    x = torch.randint(3, saved.config.vocab_size, (2, 24))
    with torch.no_grad():
        assert _rel(saved(x).logits, trained(x).logits) <= 1e-6
    out = saved.generate(x[:1, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 12)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_TYPES)
def test_resume_is_bit_exact(root, tmp_path, family):
    path = family_model(family, root)
    kw = dict(schedule="1f1b", use_offload=True, num_iterations=4)
    whole, whole_params = train_in_process(family_cfg(path, save_dir=str(tmp_path / "whole"), **kw)).outcome
    train_in_process(family_cfg(path, save_dir=str(tmp_path / "cut"), checkpoint_every=2,
                                **{**kw, "num_iterations": 2}))
    resumed, params = train_in_process(family_cfg(path, save_dir=str(tmp_path / "cut"), resume="latest", **kw)).outcome
    assert resumed == whole[2:]
    assert params.keys() == whole_params.keys()
    for k, v in params.items():
        assert torch.equal(v, whole_params[k]), k


# --- mixture of experts ------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_lost_router_loss_is_seen(root, monkeypatch):
    """Without the router loss's gradient (the config asks for it) training differs."""
    from pipeline.stage.router_loss import RouterLoss

    path = family_model("qwen3_moe", root)
    monkeypatch.setattr(RouterLoss, "roots", lambda self, *a, **kw: ([], []))
    losses, params = train_in_process(family_cfg(path)).outcome
    with pytest.raises(AssertionError):
        assert_same_training(losses, params, *family_reference(str(path)))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_token_routed_elsewhere_in_a_recompute_is_seen(root, monkeypatch, family):
    """Every layer recomputed: a recompute that sends one token to another expert than its
    forward did (the replay bypassed) trains something else than Hugging Face."""
    from models.moe import Routing

    calls = []

    def misroute(self, layer, recorded):
        calls.append(layer)
        wrong = recorded.clone()
        wrong[0, 0] = (wrong[0, 0] + 1) % self.num_experts
        return wrong

    monkeypatch.setattr(Routing, "replay", misroute)
    path = family_model(family, root)
    losses, params = train_in_process(family_cfg(path, **MODES["offload"], fuse_last_stage="false")).outcome
    assert calls  # recomputes replayed
    with pytest.raises(AssertionError):
        assert_same_training(losses, params, *family_reference(str(path)))


def test_router_loss_is_part_of_the_loss(root):
    """With one micro-batch the first step's loss is the Hugging Face model's: its language-model
    loss plus ``router_aux_loss_coef`` times its router loss, a visible part of it here."""
    from pipeline.run.build import build_stream
    from pipeline.plan.source import resolve_model

    path = family_model("qwen3_moe", root)
    cfg = family_cfg(path, num_chunks=1, num_iterations=1)
    losses = train_in_process(cfg).losses
    batch = build_stream(cfg, resolve_model(cfg))[0].next_batch()
    with torch.no_grad():
        out = hf_model(path, "sdpa")(input_ids=batch.input_ids, labels=batch.labels)
    assert abs(losses[0] - float(out.loss)) <= 1e-5 * float(out.loss)
    assert out.aux_loss * cfg_coef(path) > 1e-3 * out.loss


def cfg_coef(path: Path) -> float:
    return json.loads((path / "config.json").read_text())["router_aux_loss_coef"]


# --- families not registered ------------------------------------------------------------------------
def _config(cls: str, **kw):
    import transformers

    return getattr(transformers, cls)(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2, **kw)


def test_self_check_accepts_a_llama_shaped_family():
    """SmolLM3 is not registered; its layers are Llama's under other names: accepted."""
    from models import spec_for
    from models.registry import forget
    from pipeline.stage.selfcheck import family_spec

    config = _config("SmolLM3Config")
    forget("smollm3")
    spec = family_spec(config)
    assert spec.family == "smollm3 (self-checked)" and spec_for(config) is spec


def test_self_check_refuses_a_family_that_differs():
    """Granite scales its embedding and logits outside the modules a stage takes: refused, with
    what differed, in one line."""
    from models import UnsupportedModel
    from pipeline.stage.selfcheck import family_spec

    with pytest.raises(UnsupportedModel) as e:
        family_spec(_config("GraniteConfig", embedding_multiplier=2.0, logits_scaling=3.0))
    message = str(e.value)
    assert "'granite'" in message and "qwen3_moe" in message and "loss" in message and "\n" not in message


def test_an_unregistered_family_is_refused_before_launch(tmp_path):
    """resolve_model (every rank, before any process group) turns the refusal into a ConfigError."""
    from pipeline.config import ConfigError
    from pipeline.plan.source import resolve_model

    config = _config("GraniteConfig", embedding_multiplier=2.0, logits_scaling=3.0)
    config.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="model_type 'granite' is not supported"):
        resolve_model(tiny_cfg(tmp_path))


def test_a_self_checked_family_says_so_in_one_line(tmp_path):
    """Starcoder2 is not registered and passes the self-check: the run's log (resolve's lines,
    printed by rank 0 and by --plan) says it runs on the generic path and what was compared."""
    from models.registry import forget
    from pipeline.stage.selfcheck import family_spec
    from pipeline.plan.resolve import resolve

    cfg = tiny_cfg(tmp_path)
    config = _config("Starcoder2Config")
    forget("starcoder2")
    family_spec(config)  # what resolve_model does first: the self-check passes
    lines = [line for line in resolve(cfg, 2, config).lines if line.startswith("model:")]
    assert len(lines) == 1 and "model_type 'starcoder2' is not registered; it trains on the generic stage path" \
        in lines[0] and "the loss and every parameter's gradient equal to 1e-05" in lines[0], lines
    assert not [line for line in resolve(cfg, 2, _config("LlamaConfig")).lines if line.startswith("model:")]


# --- on a GPU, in bf16 -------------------------------------------------------------------------------
def bf16_agreement(root: str, family: str, device: str) -> tuple[float, float, list]:
    """The pipeline's bf16 training (4 stages, 1F1B, offload, every layer recomputed) against
    Hugging Face's own mixed-precision training of the same model (bf16 compute with gradient
    accumulation over the micro-batches, float32 masters: ``reference_train``), and the noise of
    the latter: its distance from its own float32 training and from its run without
    accumulation (another summation order). Returns (the distance over every parameter at once,
    the noise so measured, per tensor (distance / its noise, name))."""
    import dataclasses

    path = family_model(family, root)
    cfg = family_cfg(path, device=device, dtype="bfloat16", schedule="1f1b", num_iterations=4, **MODES["offload"])
    params = train_in_process(cfg).masters
    _, ref = reference_train(cfg, path, device=device, compute_dtype=torch.bfloat16)
    _, f32 = reference_train(cfg, path, device=device)
    _, whole = reference_train(dataclasses.replace(cfg, num_chunks=1), path, device=device,
                               compute_dtype=torch.bfloat16)
    flat = lambda d: torch.cat([d[k].float().flatten() for k in sorted(ref)])  # noqa: E731
    noise = max(_rel(flat(ref), flat(f32)), _rel(flat(ref), flat(whole)))
    per_tensor = [(_rel(params[k], ref[k]) / max(_rel(ref[k], f32[k]), _rel(ref[k], whole[k]), 5e-4), k)
                  for k in sorted(ref)]
    return _rel(flat(params), flat(ref)), noise, per_tensor


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILY_TYPES)
def test_bf16_training_matches_hf_within_its_noise(root, family):
    """bf16 on a GPU: the pipeline is as far from Hugging Face's mixed-precision training as
    that is from itself under another summation order or float32 (over all weights, at most 2x;
    a single tensor, a small norm's among them, at most 5x its own)."""
    distance, noise, per_tensor = bf16_agreement(root, family, "cuda")
    assert distance <= 2 * noise, (distance, noise)
    assert max(per_tensor)[0] <= 5, max(per_tensor)


def test_only_a_norms_vector_starts_constant_whatever_empty_memory_holds(monkeypatch):
    """A skeleton marks a norm's weight as constant (``constant_init``: 1 here), never another
    vector made with ``torch.empty``: gpt-oss's attention sinks (and biases) held whatever the
    allocator's memory held, often zeros, so a random preset's sinks came out 0 or drawn by chance.
    Here that memory is all zeros."""
    from models.spec import skeleton

    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).zero_())
    model = skeleton(tiny_config("gpt_oss", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2))
    marked = {n: getattr(p, "constant_init", None) for n, p in model.named_parameters() if p.ndim == 1}
    assert {n for n in marked if n.endswith("sinks")} and all(marked[n] is None for n in marked if n.endswith("sinks"))
    assert all(marked[n] == 1.0 for n in marked if "norm" in n) and any("norm" in n for n in marked), marked
