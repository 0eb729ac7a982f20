"""Where the tests run: the repository root, the environment of a process they start, and the
scratch save_dir of the running test (set by the autouse fixture in tests/conftest.py)."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"

_SAVE_DIR: list[Path] = []  # the running test's scratch save_dir


def set_scratch_save_dir(path: Path) -> None:
    """The autouse fixture of tests/conftest.py gives each test a fresh directory here."""
    _SAVE_DIR[:] = [path]


def scratch_save_dir() -> str:
    """This test's scratch save_dir (see _scratch_save_dir); a fixture of wider scope, set up
    before it, gets a directory of its own."""
    if not _SAVE_DIR:
        import tempfile

        return tempfile.mkdtemp(prefix="mmoc-save_dir-")
    return str(_SAVE_DIR[0])


def env_without_dist() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return env


__all__ = ["ROOT", "TESTS", "env_without_dist", "scratch_save_dir", "set_scratch_save_dir"]
