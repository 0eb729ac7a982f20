"""L2: a cost partition that differs from the even split trains over torchrun and gloo exactly
like single-process training (in one process: tests/one_process/test_partition_training.py)."""
from __future__ import annotations

import pytest

from tests.helpers.partition import stage_counts


@pytest.mark.slow
def test_torchrun_cost_partition_matches_reference(wide_vocab_model_dir, tmp_path):
    """Two processes, four stages: rank 1 (stages 1 and 3, the head) gives a layer to rank 0."""
    from tests.helpers.reference import assert_same_training
    from tests.helpers.runs import reference_result, tiny_cfg, torchrun_training

    cfg = tiny_cfg(wide_vocab_model_dir, schedule="interleaved", num_stages=4, save_dir=str(tmp_path),
                   save_params=True, save_results=str(tmp_path / "results.json"))
    from transformers import AutoConfig

    counts = stage_counts(cfg, AutoConfig.from_pretrained(wide_vocab_model_dir), 2)
    assert counts == [2, 1, 2, 1], counts  # not the even [1, 2, 2, 1]
    losses, params, _ = torchrun_training(2, cfg)
    assert_same_training(losses, params, *reference_result(str(wide_vocab_model_dir)))
