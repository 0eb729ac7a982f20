"""L2: the pipeline over torchrun and gloo (2 and 4 processes, every schedule, offload, activation
offload, resident stages) trains exactly like the single-process reference: the transport
checks beside the one-process matrix of tests/one_process/test_equivalence.py."""
from __future__ import annotations

import pytest

from tests.helpers.reference import assert_same_training
from tests.helpers.runs import reference_result, tiny_cfg, torchrun_training


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
@pytest.mark.parametrize("offload", [False, True])
def test_torchrun_matches_reference(tiny_model_dir, tmp_path, nproc, schedule, offload):
    cfg = tiny_cfg(tiny_model_dir, schedule=schedule, num_stages=2 * nproc, use_offload=offload,
               save_dir=str(tmp_path), save_params=True, save_results=str(tmp_path / "results.json"))
    losses, params, _ = torchrun_training(nproc, cfg)
    assert_same_training(losses, params, *reference_result(str(tiny_model_dir)))


@pytest.mark.slow
@pytest.mark.parametrize("schedule,offload", [("gpipe", False), ("1f1b", True), ("interleaved", True)])
def test_torchrun_activation_offload_matches_reference(tiny_model_dir, tmp_path, schedule, offload):
    """activation_offload over gloo: stage inputs received from the other rank wait in the stash,
    outputs are kept only until sent, and the training is the same."""
    cfg = tiny_cfg(tiny_model_dir, schedule=schedule, num_stages=4, use_offload=offload, activation_offload=True,
                   save_dir=str(tmp_path), save_params=True, save_results=str(tmp_path / "results.json"))
    losses, params, _ = torchrun_training(2, cfg)
    assert_same_training(losses, params, *reference_result(str(tiny_model_dir)))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved"])
def test_torchrun_resident_stages_match_reference(tiny_model_dir, tmp_path, schedule):
    """Two processes, each keeping its first stage resident and offloading its second."""
    cfg = tiny_cfg(tiny_model_dir, schedule=schedule, num_stages=4, use_offload=True, resident_stages=1,
               save_dir=str(tmp_path), save_params=True, save_results=str(tmp_path / "results.json"))
    losses, params, proc = torchrun_training(2, cfg)
    assert "offload: 1 of 2 stages per GPU stay resident" in proc.stdout, proc.stdout[-2000:]
    assert_same_training(losses, params, *reference_result(str(tiny_model_dir)))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_torchrun_receives_posted_ahead_match_reference(tiny_model_dir, tmp_path, schedule):
    """Receives posted two computes before the compute that takes them (``receive_ahead``): the
    same messages in the same order per channel, so the same training."""
    cfg = tiny_cfg(tiny_model_dir, schedule=schedule, num_stages=4, use_offload=True, receive_ahead=2,
                   save_dir=str(tmp_path), save_params=True, save_results=str(tmp_path / "results.json"))
    losses, params, _ = torchrun_training(2, cfg)
    assert_same_training(losses, params, *reference_result(str(tiny_model_dir)))
