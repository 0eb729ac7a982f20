"""Tied embeddings on 2 GPUs over NCCL (``pytest -m gpu``; skipped without them): TIE's
all-reduce neither hangs nor loses a copy's gradient (on the CPU: tests/one_process/test_tied.py,
tests/multi_process/test_gloo_tied.py)."""
from __future__ import annotations

import pytest

from tests.helpers.architectures import arch_cfg, make_model
from tests.helpers.reference import assert_same_training, reference_train


@pytest.mark.gpu(2)
@pytest.mark.parametrize("schedule,offload,resident", [("interleaved", True, 0), ("1f1b", True, 2),
                                                       ("gpipe", False, 0)])
def test_nccl_tied_matches_hf(models_root, tmp_path, schedule, offload, resident):
    """2 GPUs, float32: TIE's all-reduce over NCCL (no hang, both copies summed). GPU kernels
    against the CPU reference: 1e-3, not the CPU tests' 1e-5."""
    from tests.helpers.runs import torchrun_training

    cfg = arch_cfg(make_model("qwen2_tied", models_root), schedule=schedule, num_stages=4, use_offload=offload,
               use_prefetch=offload, resident_stages=resident, device="cuda",
               save_dir=str(tmp_path / "out"), save_params=True, save_results=str(tmp_path / "results.json"))
    losses, params, _ = torchrun_training(2, cfg, timeout=300)
    ref_cfg = arch_cfg(cfg.model, schedule=schedule, num_stages=4)
    assert_same_training(losses, params, *reference_train(ref_cfg, cfg.model), rtol=1e-3)
