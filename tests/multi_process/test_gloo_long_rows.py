"""L2: long rows over torchrun and gloo: segments crossing ranks with their keys/values in host
memory and tiled MLPs train exactly like the reference (in one process:
tests/one_process/test_long_rows.py)."""
from __future__ import annotations

import pytest

from tests.helpers.reference import assert_same_training
from tests.helpers.runs import reference_result, tiny_cfg
from tests.helpers.segments import LONG


@pytest.mark.slow
def test_torchrun_long_rows_match_reference(tiny_model_dir, tmp_path):
    """Two processes: segments crossing ranks with their keys/values in host memory, tiled MLPs
    (LONG's mlp_tile_mib: tiles of 10 tokens in the ranks too)."""
    from tests.helpers.runs import torchrun_training

    cfg = tiny_cfg(tiny_model_dir, schedule="interleaved", num_stages=4, use_offload=True, **LONG,
                   save_dir=str(tmp_path), save_params=True, save_results=str(tmp_path / "results.json"))
    losses, params, proc = torchrun_training(2, cfg)
    assert "tiled_mlp: each decoder layer's MLP runs in tiles of 10 tokens" in proc.stdout + proc.stderr
    assert_same_training(losses, params, *reference_result(str(tiny_model_dir)))
