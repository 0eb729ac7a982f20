"""L2: sliding-window architectures (Mistral, Qwen2 with sliding layers) over torchrun and gloo
train as plain Hugging Face training, the windowed layers on both ranks (in one process:
tests/one_process/test_architectures.py)."""
from __future__ import annotations

import pytest

from tests.helpers.architectures import arch_cfg, make_model
from tests.helpers.reference import assert_same_training, reference_train


@pytest.mark.slow
@pytest.mark.parametrize("arch,impl", [("mistral", "eager"), ("qwen2_sliding", "sdpa")])
def test_torchrun_sliding_window_matches_hf(models_root, tmp_path, arch, impl):
    """2 processes x 2 stages: the windowed layers sit on both ranks."""
    from tests.helpers.runs import torchrun_training

    cfg = arch_cfg(make_model(arch, models_root), attn_implementation=impl, schedule="interleaved", num_stages=4,
               save_dir=str(tmp_path / "out"), save_params=True, save_results=str(tmp_path / "results.json"))
    losses, params, _ = torchrun_training(2, cfg)
    assert_same_training(losses, params, *reference_train(cfg, cfg.model))
