"""A bench script loaded as a module (bench/ is no package), for the tests of its pure parts."""
from __future__ import annotations

import importlib.util
import sys

from tests.helpers.paths import ROOT


def load_bench(name: str):
    """bench/<name>.py as the module ``name``."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # NamedTuple / dataclass lookups need the module registered
    spec.loader.exec_module(module)
    return module
