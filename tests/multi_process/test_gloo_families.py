"""L2: every registered family over torchrun and gloo (2 processes x 4 stages) trains as its
own Hugging Face model trains (in one process: tests/one_process/test_families.py)."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.families import FAMILY_TYPES, MODES, family_cfg, family_model, family_reference
from tests.helpers.reference import assert_same_training
from tests.helpers.runs import cli_flags, run_torchrun


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
    proc = run_torchrun(2, cli_flags(cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [row["loss"] for row in json.loads((tmp_path / "results.json").read_text())["iterations"]]
    params = torch.load(tmp_path / "out" / "params.pt", weights_only=True)
    assert_same_training(losses, params, *family_reference(str(path)))
