"""main.py --check_only and train.sh run as a user runs them, and their one-line refusal."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.paths import ROOT, env_without_dist, scratch_save_dir


def check_only(args, timeout: float = 180, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "main.py"), "--config", "", "--check_only", "--device", "cpu",
           "--num_stages", "2", "--seq_length", "64", *args]
    if "--save_dir" not in args:
        cmd += ["--save_dir", scratch_save_dir()]
    return subprocess.run(cmd, cwd=ROOT, env={**env_without_dist(), "WORLD_SIZE": "2", **(extra_env or {})},
                          capture_output=True, text=True, timeout=timeout)


# A sitecustomize that makes packages look uninstalled to every process of a run: importing one,
# or looking for it (importlib.util.find_spec), raises ModuleNotFoundError as for a package that
# is not there, whatever this machine has installed.
_MISSING = """import os
import sys

MISSING = set(filter(None, os.environ.get("MMOC_TEST_MISSING", "").split(",")))


class _Missing:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.split(".")[0] in MISSING:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _Missing)
"""


def without_packages(where: Path, *packages: str) -> dict[str, str]:
    """The environment variables of a process (and its children) that runs as where ``packages``
    are not installed (a venv with torch and transformers only, say); ``where``: a scratch folder."""
    hook = Path(where) / "missing_packages"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(_MISSING)
    path = env_without_dist()["PYTHONPATH"]  # the repository root first, as for every test's process
    return {"PYTHONPATH": os.pathsep.join([path, str(hook)]), "MMOC_TEST_MISSING": ",".join(packages)}


def fake_checkpoint(save_dir: Path, step: int, config: dict, data: dict) -> Path:
    """A complete checkpoint of ``step`` as the pre-launch checks read it: its COMPLETE marker and
    trainer_state.json (the run's ``config``, the batch stream's ``data``), no weights."""
    out = Path(save_dir) / "checkpoints" / f"step_{step:08d}"
    out.mkdir(parents=True)
    state = json.dumps({"iteration": step, "config": config, "data": data})
    (out / "trainer_state.json").write_text(state)
    (out / "COMPLETE").write_text(json.dumps({"step": step, "saved_at": time.time(),
                                              "files": {"trainer_state.json": len(state)}}))
    return out


def train_sh(args: list[str], extra_env: dict[str, str] | None = None,
             timeout: float = 180) -> tuple[subprocess.CompletedProcess, float]:
    """``bash train.sh args`` as a user runs it, and the seconds it took."""
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(ROOT / "train.sh"), *args], cwd=ROOT,
                          env={**env_without_dist(), **(extra_env or {})}, capture_output=True, text=True,
                          timeout=timeout)
    return proc, time.monotonic() - t0


def one_error(proc: subprocess.CompletedProcess, needle: str) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr[-2000:]
    assert needle in lines[0], lines[0]
    return lines[0]


def refused_before_launch(proc: subprocess.CompletedProcess, needle: str) -> str:
    """train.sh's refusal: one error line, exit 2, and no worker started (no start line, no launcher)."""
    line = one_error(proc, needle)
    assert "run: " not in proc.stdout and "launcher:" not in proc.stderr, (line, proc.stdout[-2000:])
    return line


def chat_file(path):
    """16 chat records (the tiny test model's tokenizer has no chat template)."""
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                                     {"role": "assistant", "content": "answer"}]}) + "\n"
                            for i in range(16)))
    return path
