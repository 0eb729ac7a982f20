"""No module of tests/helpers/ or bench/ takes the name of an installed package or of the standard
library: a script started from its folder (a torchrun worker, a bench driver) has that folder first
on ``sys.path`` and would import the module in place of the package (a ``tests/helpers/tokenizers.py``
broke transformers' ``from tokenizers import Encoding`` in every worker)."""
from __future__ import annotations

import importlib.metadata
import sys

from tests.helpers.paths import ROOT

FOLDERS = ("tests/helpers", "bench")


def shadowing(stems: set[str], taken: set[str]) -> list[str]:
    return sorted(stems & taken)


def test_no_helper_module_shadows_a_package():
    taken = set(importlib.metadata.packages_distributions()) | set(sys.stdlib_module_names)
    assert {"tokenizers", "torch", "json"} <= taken, "the installed packages' names were not read"
    stems = {p.stem for folder in FOLDERS for p in (ROOT / folder).glob("*.py") if p.stem != "__init__"}
    assert "char_tokenizer" in stems and "plan_matrix" in stems, "the scan missed a folder"
    assert not shadowing(stems, taken), f"modules named as installed packages: {shadowing(stems, taken)}"
    assert shadowing(stems | {"tokenizers"}, taken) == ["tokenizers"]  # the check sees a planted one
