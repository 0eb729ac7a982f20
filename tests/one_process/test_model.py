"""Stages: the partition plan, the layer-by-layer forward against Hugging Face's own forward,
and loading only the tensors a rank owns."""
from __future__ import annotations

import pytest
import torch

from pipeline.spec.shapes import partition_layers, stage_num_params
from pipeline.plan.source import preset_config
from pipeline.stage.model import build_stage
from tests.helpers.reference import hf_model
from tests.helpers.segments import fused_and_plain
from tests.helpers.tolerance import assert_close, rel_err


@pytest.mark.parametrize("layers,stages,expected", [
    (8, 4, [2, 2, 2, 2]),
    (6, 4, [1, 2, 2, 1]),       # extra layers go to the middle (the ends carry embedding / head)
    (32, 8, [4] * 8),
    (40, 16, [2] * 4 + [3] * 8 + [2] * 4),
    (4, 5, [0, 1, 1, 1, 1]),    # one stage more than layers: embedding-only first stage
    (4, 6, [0, 1, 1, 1, 1, 0]),  # two more: head-only last stage too
])
def test_partition(layers, stages, expected):
    parts = partition_layers(layers, stages)
    assert [i for r in parts for i in r] == list(range(layers))  # every layer exactly once, in order
    assert [len(r) for r in parts] == expected


def test_partition_rejects_too_many_stages():
    with pytest.raises(ValueError, match=r"num_stages \(7\) must be between 1 and num_layers \+ 2 \(6\)"):
        partition_layers(4, 7)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("num_stages", [1, 3, 8])
def test_stage_forward_equals_hf(tiny_model_dir, impl, num_stages):
    hf = hf_model(tiny_model_dir, impl)
    x = torch.randint(3, hf.config.vocab_size, (2, 24))
    ref = hf(x).logits
    parts = partition_layers(hf.config.num_hidden_layers, num_stages)
    h = x
    with torch.no_grad():
        for s in range(num_stages):
            h = build_stage(hf.config, s, num_stages, parts[s], model_dir=tiny_model_dir, seed=0).eval()(h)
    assert_close(h, ref, 1e-5, "logits")


def test_eager_needs_the_causal_mask(tiny_model_dir):
    """The trap the stage guards against: eager attention given a None mask is non-causal."""
    hf = hf_model(tiny_model_dir, "eager")
    stage = build_stage(hf.config, 0, 1, range(hf.config.num_hidden_layers), model_dir=tiny_model_dir, seed=0).eval()
    x = torch.randint(3, hf.config.vocab_size, (1, 16))
    with torch.no_grad():
        prefix = stage(x[:, :8])
        full = stage(x)
        assert_close(full[:, :8], prefix, 1e-5, "prefix")  # the future does not leak back
        stage.attn_implementation = "sdpa"  # the layers still run eager: the stage now passes mask=None
        leaky = stage(x)
    assert rel_err(leaky[:, :8], prefix) > 1e-2


def test_only_owned_tensors_are_read(tiny_model_dir, monkeypatch):
    from safetensors import safe_open

    read = []
    original = safe_open

    class Spy:
        def __init__(self, *a, **kw):
            self.f = original(*a, **kw)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, k):
            read.append(k)
            return self.f.get_tensor(k)

    monkeypatch.setattr("safetensors.safe_open", Spy)
    hf = hf_model(tiny_model_dir, "sdpa")
    stage = build_stage(hf.config, 2, 4, partition_layers(6, 4)[2], model_dir=tiny_model_dir, seed=0)
    assert sorted(read) == sorted(k for k, _ in stage.named_parameters())
    assert all(k.startswith("model.layers.3.") or k.startswith("model.layers.4.") for k in read)


def test_preset_weights_do_not_depend_on_the_partition():
    cfg = preset_config("tiny")
    cfg.num_hidden_layers = 4
    cfg._attn_implementation = "sdpa"
    whole = build_stage(cfg, 0, 1, range(4), model_dir=None, seed=3).state_dict()
    parts = partition_layers(4, 3)
    split = {}
    for s in range(3):
        split.update(build_stage(cfg, s, 3, parts[s], model_dir=None, seed=3).state_dict())
    assert sorted(whole) == sorted(split)
    for k in whole:
        assert torch.equal(whole[k], split[k]), k
    assert sum(v.numel() for v in whole.values()) == stage_num_params(cfg, range(4), True, True)


@pytest.mark.parametrize("kept,last,expected", [(0, False, 3), (1, False, 2), (3, False, 0), (5, False, 0),
                                                (1, True, 3)])
def test_kept_layers_skip_their_recompute(monkeypatch, kept, last, expected):
    """With checkpointing, a stage recomputes its first ``len - kept`` layers (and, last, its
    head and loss); the kept layers run plainly."""
    import pipeline.stage.model as model_mod
    from transformers import LlamaConfig

    calls = []
    real = model_mod.checkpoint
    monkeypatch.setattr(model_mod, "checkpoint", lambda fn, *a, **kw: calls.append(fn) or real(fn, *a, **kw))
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      vocab_size=64)
    stage = model_mod.build_stage(cfg, 1 if last else 0, 2, range(3), model_dir=None, seed=0, checkpointing=True,
                                  kept_layers=kept)
    x = torch.randn(2, 8, 32, requires_grad=True) if last else torch.randint(64, (2, 8))
    out = stage(x, torch.randint(64, (2, 8))) if last else stage(x)
    out.sum().backward()
    assert len(calls) == expected


@pytest.mark.parametrize("arch,num_stages", [("llama", 1), ("llama", 2), ("qwen2_tied", 1), ("mistral", 2)])
def test_fused_last_stage_equals_forward_then_backward(monkeypatch, arch, num_stages):
    """``forward_backward`` (no checkpoint, the loss in chunks of 7 tokens differentiated one by
    one) gives the loss and gradients of the checkpointed forward and its backward: for the
    first stage too (token ids in, tied embedding and head) and for a stage fed hidden states."""
    import pipeline.stage.model as model_mod

    monkeypatch.setattr(model_mod, "loss_chunk_tokens", lambda vocab: 7)
    (l0, x0, g0), (l1, x1, g1) = fused_and_plain(arch, num_stages)
    assert_close(l1, l0, 1e-6, "loss")
    assert (x0 is None) == (num_stages == 1)
    if x0 is not None:
        assert_close(x1, x0, 1e-5, "input gradient")
    assert_close(g1, g0, 1e-5, "gradient")


def test_fused_comparison_catches_a_lost_chunk(monkeypatch):
    """The mutation the comparison above must catch: one chunk of the fused loss differentiated
    as zero (its value still counted). It moves the gradients by about 0.2 of their norm,
    against the 2e-7 that the summation order does."""
    import pipeline.stage.model as model_mod

    monkeypatch.setattr(model_mod, "loss_chunk_tokens", lambda vocab: 7)
    real_forward_backward, real_loss = model_mod.Stage.forward_backward, model_mod.Stage._loss

    def forward_backward(stage, *args, **kw):
        calls = []

        def lossy(stage, h, targets):
            calls.append(1)
            loss = real_loss(stage, h, targets)
            return loss.detach() + 0 * loss if len(calls) == 2 else loss

        with monkeypatch.context() as m:
            m.setattr(model_mod.Stage, "_loss", lossy)
            return real_forward_backward(stage, *args, **kw)

    monkeypatch.setattr(model_mod.Stage, "forward_backward", forward_backward)
    (l0, x0, g0), (l1, x1, g1) = fused_and_plain("mistral", 2)
    assert_close(l1, l0, 1e-6, "loss")  # the loss is right ...
    for got, want in ((x1, x0), (g1, g0)):  # ... its gradients are not
        with pytest.raises(AssertionError, match="relative difference"):
            assert_close(got, want, 1e-5)
