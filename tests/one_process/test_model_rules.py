"""L1: the rules on the settings against the model (``pipeline.plan.model_rules``) run where the
model is read, before any process group; the model is read once per start and passed on; the
settings' own rules sit beside their fields (``pipeline.config``)."""
from __future__ import annotations

import dataclasses

import pytest

from pipeline.config import ConfigError, TrainConfig, make_config
from pipeline.plan.settings_rules import check_settings
from tests.helpers.architectures import arch_cfg, make_model


def test_tied_copies_stepping_apart_are_refused_before_launch(models_root):
    """With the processes known, resident_stages 1 of 2 per process (stage 0 on the GPU, the
    head's copy offloaded) is refused where the model is read: before any process group, as
    ``check_files`` does on every rank and under ``--check_only``."""
    from pipeline.plan.source import resolve_model

    path = make_model("qwen2_tied", models_root)
    cfg = arch_cfg(path, num_stages=4, use_offload=True, resident_stages=1)
    with pytest.raises(ConfigError, match=r"^tied embeddings: resident_stages 1 keeps stage 0 on the GPU but "
                                          r"offloads stage 3, .* use resident_stages 0 or 2 \(all\)$"):
        resolve_model(cfg, world_size=2)
    resolve_model(cfg)  # the processes unknown: the rule waits for them
    for ok in (dict(resident_stages=0), dict(resident_stages=2), dict(resident_stages=-1), dict(use_offload=False),
               dict(lora_rank=4)):
        resolve_model(dataclasses.replace(cfg, **ok), world_size=2)
    # device_steps: the head's copy (the process's last offloaded stage) would step on the GPU
    with pytest.raises(ConfigError, match=r"^tied embeddings: device_steps 1 steps stage 3's copy .* use "
                                          r"device_steps 0$"):
        resolve_model(dataclasses.replace(cfg, resident_stages=0, device_steps=1), world_size=2)


def test_resolve_checks_the_choices_it_made(models_root):
    """``-1`` stages with resident stages given: only ``resolve``'s answer says which stages the
    tied copies are on, so its rules run on that answer."""
    from pipeline.plan.model_rules import check_choices
    from pipeline.plan.source import resolve_model

    hf = resolve_model(arch_cfg(make_model("qwen2_tied", models_root))).config
    chosen = arch_cfg(make_model("qwen2_tied", models_root), num_stages=4, use_offload=True, resident_stages=1)
    with pytest.raises(ConfigError, match="tied embeddings: resident_stages 1"):
        check_choices(chosen, hf, 1)
    check_choices(dataclasses.replace(chosen, resident_stages=4), hf, 1)


def test_the_model_is_read_once_per_start(tiny_model_dir, tmp_path, monkeypatch):
    """``check_files`` (before the process group) reads the model and checks its rules; ``train``
    takes what it read instead of reading again (``--plan``: ``plan_report`` reads it once)."""
    import pipeline.plan.source as source_module
    from pipeline.dist import DistEnv
    from pipeline.plan.preflight import check_files
    from pipeline.train import plan_report, train
    from tests.helpers.runs import tiny_cfg

    reads = []
    check_model = source_module.check_model
    monkeypatch.setattr(source_module, "check_model", lambda view: reads.append(view) or check_model(view))
    cfg = tiny_cfg(tiny_model_dir, num_stages=2, num_iterations=1, save_dir=str(tmp_path / "run"))
    train(cfg, DistEnv(0, 1, 0, 1), check_files(cfg, world_size=1))
    assert len(reads) == 1 and reads[0].pipeline_size == 1
    reads.clear()
    plan_report(cfg, 1)
    assert len(reads) == 1


def test_field_rules_sit_beside_their_fields():
    """Each field's own rule is declared with the field; fields that break the same rule are
    named in one line; the launch keys are left to train.sh's ``launch_settings``."""
    from pipeline.config import _fields

    declared = {n for n, f in _fields().items() if f.metadata["check"] is not None}
    assert {"seq_length", "num_iterations", "lr", "keep_layers", "eval_every", "nproc", "master_port"} <= declared
    with pytest.raises(ConfigError, match=r"^eval_batches \(-2\) and eval_every \(-1\) must be >= 0$"):
        check_settings(make_config({"eval_every": -1, "eval_batches": -2}), 1)
    with pytest.raises(ConfigError, match=r"^max_skipped_steps \(-3\) must be >= -1$"):
        check_settings(make_config({"max_skipped_steps": -3}), 1)
    check_settings(make_config({"nproc": -1, "master_port": 0, "num_stages": 2}), 1)
    check_settings(TrainConfig(num_stages=2), 2)
