"""Shared fixtures: a tiny Llama model (GQA, 6 layers) and tokenizer built locally once per session."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs (skipped without them)")
    config.addinivalue_line("markers", "slow: multi-process runs, subprocess launches and long in-process trainings "
                                       "(the fast layer, pytest -m 'not slow', leaves them out)")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from data import SAMPLE_TRAIN, ensure_tiny_model

    path = tmp_path_factory.mktemp("models") / "tiny"
    return ensure_tiny_model(path, data_files=[SAMPLE_TRAIN], hidden_size=64, intermediate_size=128, num_layers=6,
                             num_heads=4, num_kv_heads=2, vocab_size=512, max_position_embeddings=256, seed=1)


@pytest.fixture(autouse=True)
def _single_thread(monkeypatch):
    """Every test runs like a torchrun rank: ``OMP_NUM_THREADS=1`` for the processes it starts,
    and one intra-op thread for this process's main thread (the variable alone changes nothing
    here: torch read it at import). The optimizer thread of an offloading trainer still takes the
    rank's share of the cores, as under torchrun, so offload and resident runs compare across
    different thread counts whatever the shell that started pytest sets."""
    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_SAVE_DIR: list[Path] = []


def _user_outputs() -> list[tuple[str, float]]:
    out = ROOT / "outputs"
    return sorted((str(p), p.stat().st_mtime) for p in out.rglob("*")) if out.exists() else []


@pytest.fixture(autouse=True, scope="session")
def _user_outputs_untouched():
    """Fails the session if any test wrote under the repository's outputs/ (a user's runs)."""
    before = _user_outputs()
    yield
    after = _user_outputs()
    assert after == before, f"tests wrote under {ROOT / 'outputs'}: {sorted(set(after) - set(before))[:5]}"


@pytest.fixture(autouse=True)
def _scratch_save_dir(tmp_path_factory):
    """A fresh empty directory per test: tests write runs there, never into the user's outputs/run."""
    _SAVE_DIR[:] = [tmp_path_factory.mktemp("save_dir")]
    yield


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
