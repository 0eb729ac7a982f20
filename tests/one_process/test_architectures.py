"""The configurations people fine-tune today, each as a tiny model generated here: Llama-3
(GQA, llama3 rope scaling), Qwen2.5 (qkv bias; tied embeddings in the small sizes), Qwen2 with
sliding-window layers, Mistral with a sliding window shorter than the sequence. Stage forwards
equal the Hugging Face forward and pipeline training equals plain Hugging Face training (tied
embeddings over several stages: tests/one_process/test_tied.py; sliding windows over two
processes: tests/multi_process/test_gloo_architectures.py)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from pipeline.config import ConfigError
from pipeline.spec.shapes import stage_num_params
from pipeline.stage.model import build_stage
from tests.helpers.architectures import ARCHS, SEQ, WINDOW, arch_cfg, make_model
from tests.helpers.reference import (assert_same_training, hf_model, in_process_trainer, reference_train, stages_forward,
                                    train_in_process, trained, trainer_masters)
from tests.helpers.tolerance import assert_close, rel_err


def _full_causal(stage) -> None:
    """The bug the window tests guard against: every layer masked plain causal."""
    stage.kinds = [dataclasses.replace(k, window=None) for k in stage.kinds]


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("arch,num_stages", [("llama3", 3), ("llama3_tied", 1), ("qwen2_tied", 1),
                                             ("qwen2_sliding", 3), ("mistral", 1), ("mistral", 3)])
def test_stage_forward_equals_hf(models_root, arch, num_stages, impl):
    path = make_model(arch, models_root)
    hf = hf_model(path, impl)
    x = torch.randint(3, hf.config.vocab_size, (2, SEQ))
    with torch.no_grad():
        ref = hf(x).logits
    assert_close(stages_forward(hf.config, path, x, num_stages), ref, 1e-5, "logits")


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["mistral", "qwen2_sliding"])
def test_the_window_is_what_makes_it_equal(models_root, arch, impl):
    """Without the window (plain causal masks) the stages no longer match: the test above sees it."""
    path = make_model(arch, models_root)
    hf = hf_model(path, impl)
    x = torch.randint(3, hf.config.vocab_size, (1, SEQ))
    with torch.no_grad():
        ref = hf(x).logits
    full = stages_forward(hf.config, path, x, 2, _full_causal)
    assert rel_err(full[:, WINDOW:], ref[:, WINDOW:]) > 1e-2
    assert_close(full[:, :WINDOW], ref[:, :WINDOW], 1e-5, "logits")  # inside one window: same


def test_stage_param_counts(models_root):
    for arch in ARCHS:
        path = make_model(arch, models_root)
        config = hf_model(path, "sdpa").config
        stage = build_stage(config, 0, 1, range(config.num_hidden_layers), model_dir=path, seed=0)
        actual = sum(p.numel() for p in stage.parameters())
        assert actual == stage_num_params(config, range(config.num_hidden_layers), True, True), arch


# --- training equals plain Hugging Face training ---------------------------------------------
@pytest.mark.parametrize("arch,impl,kw", [
    ("mistral", "eager", dict(schedule="interleaved")),
    ("mistral", "sdpa", dict(schedule="1f1b", seq_length=160, use_offload=True)),
    ("qwen2_sliding", "eager", dict(schedule="gpipe", use_offload=True)),
    ("qwen2_sliding", "sdpa", dict(schedule="interleaved")),
    ("llama3", "sdpa", dict(schedule="interleaved", use_offload=True)),
    ("llama3_tied", "eager", dict(num_stages=1, schedule="gpipe")),
    ("qwen2_tied", "sdpa", dict(num_stages=1, schedule="1f1b", use_offload=True)),
    ("qwen2_tied", "eager", dict(num_stages=1, schedule="gpipe", use_offload=True, activation_checkpointing=True)),
])
def test_training_matches_hf(models_root, arch, impl, kw):
    cfg = arch_cfg(make_model(arch, models_root), attn_implementation=impl, **kw)
    assert_same_training(*train_in_process(cfg).outcome, *reference_train(cfg, cfg.model))


# --- tied embeddings --------------------------------------------------------------------------
def _with_head_saved(src: Path, dst: Path, noise: float = 0.0) -> Path:
    """A copy of the tied model whose checkpoint also stores lm_head.weight (as some exporters do)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embed + noise * torch.randn_like(embed)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_tied_checkpoint_with_head_trains_one_matrix(models_root, tmp_path):
    path = _with_head_saved(make_model("qwen2_tied", models_root), tmp_path / "with_head")
    cfg = arch_cfg(path, num_stages=1, schedule="gpipe", save_dir=str(tmp_path / "out"), save_model=True)
    trainer = in_process_trainer(cfg)
    stage = trainer.stages[0]
    assert stage.lm_head.weight is stage.model.embed_tokens.weight
    run = trained(trainer)
    trainer.save(run.history)
    assert_same_training(*run.outcome, *reference_train(cfg, make_model("qwen2_tied", models_root)))
    out = tmp_path / "out" / "model"
    saved = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in saved and "model.embed_tokens.weight" in saved  # one saved tensor
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    hf = hf_model(out, "sdpa")
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(hf.model.embed_tokens.weight, trainer_masters(trainer)["model.embed_tokens.weight"])


def test_tied_config_with_a_different_head_is_refused(models_root, tmp_path, monkeypatch):
    """transformers loads a tied model whose checkpoint holds a different lm_head.weight untied:
    the checks of the files refuse it before launch; the model source (and so ``--plan``) reads
    no tensor."""
    from pipeline.spec import weight_files
    from pipeline.plan.preflight import check_files
    from pipeline.plan.source import resolve_model

    path = _with_head_saved(make_model("qwen2_tied", models_root), tmp_path / "other_head", noise=0.01)
    cfg = arch_cfg(path, num_stages=1, save_dir=str(tmp_path / "out"))
    with pytest.raises(ConfigError, match="lm_head.weight differs from model.embed_tokens.weight") as e:
        check_files(cfg)
    assert "\n" not in str(e.value)
    monkeypatch.setattr(weight_files, "read_tensors", lambda *a: pytest.fail("the model source read a tensor"))
    resolve_model(cfg)


def test_sliding_layers_without_a_window_are_refused(models_root, tmp_path):
    from pipeline.plan.source import resolve_model

    src = make_model("qwen2_sliding", models_root)
    dst = tmp_path / "bad"
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((dst / "config.json").read_text())
    config.update(use_sliding_window=False)  # sliding_window becomes None, layer_types still say sliding
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="sliding_attention layers but sliding_window is None"):
        resolve_model(arch_cfg(dst))
