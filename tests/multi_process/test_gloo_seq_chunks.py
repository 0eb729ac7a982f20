"""L2: sequence segments over torchrun and gloo (and with replicas) train exactly like the
reference: the transport checks beside tests/one_process/test_seq_chunks.py."""
from __future__ import annotations

import pytest

from tests.helpers.reference import assert_same_training
from tests.helpers.runs import reference_result, tiny_cfg, torchrun_training


@pytest.mark.slow
@pytest.mark.parametrize("schedule,offload,actoff", [("1f1b", False, False), ("interleaved", True, False),
                                                     ("interleaved", True, True)])
def test_torchrun_segments_match_reference(tiny_model_dir, tmp_path, schedule, offload, actoff):
    """Two processes: each segment's activation and gradient cross ranks in buffers of its length
    (activation_offload: a received segment input waits in the stash for its recompute)."""
    cfg = tiny_cfg(tiny_model_dir, schedule=schedule, num_stages=4, use_offload=offload, seq_chunks=3,
                   activation_offload=actoff,
                   save_dir=str(tmp_path), save_params=True, save_results=str(tmp_path / "results.json"))
    losses, params, _ = torchrun_training(2, cfg)
    assert_same_training(losses, params, *reference_result(str(tiny_model_dir)))


@pytest.mark.slow
def test_torchrun_replicas_with_segments(tiny_model_dir, tmp_path):
    """data_parallel: two one-rank pipelines, each summing its segments' gradients before the replicas do."""
    cfg = tiny_cfg(tiny_model_dir, num_stages=2, data_parallel=2, use_offload=True, seq_chunks=3,
                   save_dir=str(tmp_path), save_params=True, save_results=str(tmp_path / "results.json"))
    losses, params, _ = torchrun_training(2, cfg)
    assert_same_training(losses, params, *reference_result(str(tiny_model_dir)))
