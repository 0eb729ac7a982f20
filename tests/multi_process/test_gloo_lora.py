"""L2: LoRA over torchrun and gloo, 2 processes x 4 stages, every registered family (all-linear
adapters: a mixture-of-experts model's attention and dense layers; its experts are no linear
layers): the adapters and losses equal peft's on the plain Hugging Face model (one process), and
the saved adapter is peft's format. One torchrun per offload mode trains every family in turn
(``tests/helpers/lora_runs.py``); the schedule varies with the family."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.families import FAMILY_TYPES, MODES, family_cfg, family_model
from tests.helpers.paths import ROOT, env_without_dist
from tests.helpers.reference import assert_same_training, reference_train
from tests.helpers.runs import run_losses

LORA = dict(lora_rank=4, lora_alpha=8.0, lora_target_modules="all-linear", adam_eps=1e-4)  # eps: test_lora.py


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("lora_families"))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["plain", "offload"], ids=["resident", "offloaded"])
def test_every_family_trains_peft_adapters(root, tmp_path, mode):
    from safetensors.torch import load_file

    runs, cfgs = [], {}
    for i, family in enumerate(FAMILY_TYPES):
        path = family_model(family, root)
        out = tmp_path / family
        cfg = family_cfg(path, schedule=["gpipe", "1f1b", "interleaved"][i % 3], save_dir=str(out), save_model=True,
                         save_results=str(out / "results.json"), **LORA, **MODES[mode])
        cfgs[family] = (cfg, path)
        runs.append(cfg.to_dict())
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "helpers" / "lora_runs.py"), str(tmp_path / "runs.json")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env_without_dist(), capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for family, (cfg, path) in cfgs.items():
        out = Path(cfg.save_dir)
        losses = run_losses(cfg.save_results)
        adapters = load_file(str(out / "adapter" / "adapter_model.safetensors"))
        assert (out / "adapter" / "adapter_config.json").is_file()
        assert any(".self_attn." in k for k in adapters), family
        ref = reference_train(family_cfg(path, **LORA), Path(path))
        try:
            assert_same_training(losses, adapters, *ref)
        except AssertionError as e:
            raise AssertionError(f"{family}: {e}") from None


@pytest.mark.slow
def test_data_parallel_trains_peft_adapters(tiny_model_dir, tmp_path):
    """data_parallel 2 x a 1-rank pipeline of 2 stages (one offloaded): the replicas sum the
    adapters' gradients before the device step; the adapters are one pipeline's on the whole batch."""
    from safetensors.torch import load_file

    from tests.helpers.runs import cli_flags, run_torchrun, tiny_cfg

    cfg = tiny_cfg(tiny_model_dir, num_stages=2, data_parallel=2, use_offload=True, resident_stages=1,
                   save_dir=str(tmp_path / "out"), save_model=True, save_results=str(tmp_path / "results.json"),
                   **LORA)
    proc = run_torchrun(2, cli_flags(cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = run_losses(cfg.save_results)
    adapters = load_file(str(tmp_path / "out" / "adapter" / "adapter_model.safetensors"))
    assert_same_training(losses, adapters, *reference_train(tiny_cfg(tiny_model_dir, **LORA), tiny_model_dir))
