"""No module of the project is longer than ``MAX_LINES``: past that a file holds more than one
idea, and a reader looking for one of them pages through the others. The package, the entry
points, bench/ and tests/ all count; the remedy is a split along a seam (one idea a module)."""
from __future__ import annotations

from pathlib import Path

from tests.helpers.paths import ROOT
from tests.helpers.sources import package_files

MAX_LINES = 550
SCRIPT_FOLDERS = ("bench", "tests")


def project_files(root: Path = ROOT) -> list[Path]:
    """The package's files and entry points (``package_files``), and every Python file of bench/ and tests/."""
    return package_files(root) + [p for folder in SCRIPT_FOLDERS for p in sorted((root / folder).rglob("*.py"))]


def long_modules(sources: dict[str, str], max_lines: int = MAX_LINES) -> list[str]:
    """``name (N lines)`` for each source longer than ``max_lines``, longest first."""
    lengths = {name: len(text.splitlines()) for name, text in sources.items()}
    return [f"{name} ({n} lines)" for name, n in sorted(lengths.items(), key=lambda kv: (-kv[1], kv[0]))
            if n > max_lines]


def test_no_module_is_longer_than_its_limit():
    files = [p for p in project_files() if p.exists()]  # generate.py is optional
    names = {str(p.relative_to(ROOT)) for p in files}
    assert {"main.py", "schedule/ir.py", "bench/plan_matrix.py",
            "tests/pure/test_module_length.py"} <= names, "the scan missed part of the project"
    found = long_modules({str(p.relative_to(ROOT)): p.read_text() for p in files})
    assert not found, (f"modules longer than {MAX_LINES} lines ({len(found)}); split each along a seam, "
                       f"one idea a module:\n  " + "\n  ".join(found))


def test_the_check_finds_a_planted_long_module():
    lines = lambda n: "".join(f"x{i} = {i}\n" for i in range(n))  # noqa: E731
    found = long_modules({"short.py": lines(3), "at_the_limit.py": lines(MAX_LINES), "empty.py": "",
                          "over.py": lines(MAX_LINES + 1), "far_over.py": lines(MAX_LINES + 40) + "\n"})
    assert found == [f"far_over.py ({MAX_LINES + 41} lines)", f"over.py ({MAX_LINES + 1} lines)"]
