"""L2: every registered family over torchrun and gloo (2 processes x 4 stages) trains as its
own Hugging Face model trains (in one process: tests/one_process/test_families.py)."""
from __future__ import annotations

import pytest

from tests.helpers.families import FAMILY_TYPES, MODES, family_cfg, family_model, family_reference
from tests.helpers.reference import assert_same_training
from tests.helpers.runs import torchrun_training


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("families"))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_TYPES)
def test_two_processes_match_hf(root, tmp_path, family):
    """2 processes x 4 stages over gloo, the schedule and offload varying with the family."""
    i = FAMILY_TYPES.index(family)
    kw = dict(schedule=["gpipe", "1f1b", "interleaved"][i % 3], **(MODES["offload"] if i % 2 else {}))
    path = family_model(family, root)
    cfg = family_cfg(path, save_dir=str(tmp_path / "out"), save_params=True,
                     save_results=str(tmp_path / "results.json"), **kw)
    losses, params, _ = torchrun_training(2, cfg)
    assert_same_training(losses, params, *family_reference(str(path)))
