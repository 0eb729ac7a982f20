"""The package's own source files (tests and bench scripts are not), for the tests that read its
code: layers, private fields, validation homes, function length."""
from __future__ import annotations

from pathlib import Path

from tests.helpers.paths import ROOT

PACKAGES = ("inputs", "schedule", "models", "data", "offload", "pipeline")
ENTRY_POINTS = ("main.py", "generate.py")


def package_files(root: Path = ROOT) -> list[Path]:
    """Every Python file of the package: its folders' and the entry points."""
    return [p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))] + [root / f for f in ENTRY_POINTS]


def module_name(path: Path, root: Path = ROOT) -> str:
    """``pipeline/run/executor.py`` -> ``pipeline.run.executor``; a package's ``__init__`` is the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_sources(root: Path = ROOT) -> dict[str, str]:
    """Module name -> source of every module of the package."""
    return {module_name(p, root): p.read_text() for p in package_files(root)}


__all__ = ["ENTRY_POINTS", "PACKAGES", "module_name", "package_files", "package_sources"]
