"""L2: tied embeddings over torchrun and gloo: the embedding's and the head's ranks differ, and
TIE's all-reduce on their own group keeps two and four processes training as plain Hugging Face
training (in one process: tests/one_process/test_tied.py)."""
from __future__ import annotations

import pytest

from tests.helpers.architectures import arch_cfg, make_model
from tests.helpers.reference import assert_same_training, reference_train


@pytest.mark.slow
@pytest.mark.parametrize("nproc,num_stages,schedule,offload", [(2, 4, "interleaved", True), (2, 2, "1f1b", False),
                                                               (4, 4, "gpipe", True)])
def test_torchrun_tied_matches_hf(models_root, tmp_path, nproc, num_stages, schedule, offload):
    """The embedding's and the head's ranks differ: TIE is an all-reduce on their own group."""
    from tests.helpers.runs import torchrun_training

    cfg = arch_cfg(make_model("qwen2_tied", models_root), schedule=schedule, num_stages=num_stages, use_offload=offload,
               save_dir=str(tmp_path / "out"), save_params=True, save_results=str(tmp_path / "results.json"))
    losses, params, _ = torchrun_training(nproc, cfg, timeout=300)
    assert "lm_head.weight" not in params
    assert_same_training(losses, params, *reference_train(cfg, cfg.model))
