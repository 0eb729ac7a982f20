"""Helpers the tests share: the tiny training configuration the in-process and torchrun tests
start from, its single-process reference result (cached), the check that a mutated run fails the
comparison with it, and torchrun runs of main.py."""
from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.config import make_config
from tests.helpers.paths import ROOT, env_without_dist, scratch_save_dir
from tests.helpers.reference import assert_same_training, reference_train, train_in_process

ITERS = 3


def tiny_cfg(model_dir, **kw):
    # adam_eps 1e-6, not 1e-8: AdamW divides by sqrt(v) + eps, so with 1e-8 a weight whose
    # gradient is near float noise (|g| ~ 1e-9) takes an lr-sized step of either sign, and the
    # summation order of two correct implementations decides which. A lost gradient, a skipped
    # layer or wrong labels still move the weights by orders of magnitude more than the tolerance.
    base = dict(model=str(model_dir), dataset="sample", seq_length=64, batch_size=8, num_chunks=4,
                num_iterations=ITERS, num_stages=4, dtype="float32", device="cpu", lr=1e-3, warmup_iterations=1,
                weight_decay=0.01, grad_clip=1.0, attn_implementation="eager", save_model=False, adam_eps=1e-6,
                save_metrics=False, save_dir=scratch_save_dir())
    base.update(kw)
    return make_config(base)


@functools.lru_cache(maxsize=None)
def reference_result(model_dir: str, num_layers: int = 0):
    return reference_train(tiny_cfg(model_dir, num_layers=num_layers), model_dir)


def expect_mismatch(model_dir, monkeypatch, patch, **kw) -> None:
    """``patch(monkeypatch)`` applied, a run of ``tiny_cfg(model_dir, **kw)`` (interleaved and
    offloaded unless ``kw`` says otherwise) fails the comparison with the reference: the
    comparison can see the fault ``patch`` makes."""
    patch(monkeypatch)
    cfg = tiny_cfg(model_dir, **{"schedule": "interleaved", "use_offload": True, **kw})
    losses, params = train_in_process(cfg).outcome
    with pytest.raises(AssertionError):
        assert_same_training(losses, params, *reference_result(str(model_dir)))


def run_torchrun(nproc: int, args: list[str], timeout: float = 240, env: dict | None = None
                 ) -> subprocess.CompletedProcess:
    """main.py on ``nproc`` processes, with ``env`` added to the environment."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "main.py"), "--config", "", *args]
    return subprocess.run(cmd, cwd=ROOT, env={**env_without_dist(), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def flags(settings: dict) -> list[str]:
    """main.py's flags for ``settings`` (config keys -> values): ``--use_x``/``--x`` for true,
    ``--no_x`` for false (``use_`` dropped), ``--key value`` otherwise; empty strings left out."""
    out = []
    for k, v in settings.items():
        if isinstance(v, bool):
            out.append(f"--{k}" if v else ("--no_" + k[4:] if k.startswith("use_") else f"--no_{k}"))
        elif v != "":
            out += [f"--{k}", str(v)]
    return out


def cli_flags(cfg) -> list[str]:
    # the launch keys are train.sh's, not main.py's business
    return flags({k: v for k, v in cfg.to_dict().items() if k not in ("nproc", "master_port", "cuda_visible_devices")})


def run_results(path) -> dict:
    """A finished run's ``results.json`` (``save_results``)."""
    return json.loads(Path(path).read_text())


def run_losses(path) -> list[float]:
    """The loss of each iteration in a run's ``results.json``."""
    return [row["loss"] for row in run_results(path)["iterations"]]


def run_outcome(save_dir, results=None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``(losses, final weights)`` of a finished run (``save_params`` set), the shape of
    ``reference_train``'s result: ``save_dir`` holds its ``params.pt``, ``results`` is its
    ``results.json`` (default: the one in ``save_dir``)."""
    losses = run_losses(Path(save_dir) / "results.json" if results is None else results)
    return losses, torch.load(Path(save_dir) / "params.pt", weights_only=True)


def torchrun_training(nproc: int, cfg, timeout: float = 240
                      ) -> tuple[list[float], dict[str, torch.Tensor], subprocess.CompletedProcess]:
    """Train ``cfg`` (``save_params`` and ``save_results`` set) on ``nproc`` processes: its
    losses, final weights and the finished process (for its log)."""
    proc = run_torchrun(nproc, cli_flags(cfg), timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return (*run_outcome(cfg.save_dir, cfg.save_results), proc)


def text_records(path, lo: int, hi: int, n: int = 48) -> str:
    """A text dataset whose records have ``lo..hi-1`` words: batches of different widths, rows
    right-padded within a batch."""
    words = ("the match ended with three goals to one after a long season of rain and sun in the north "
             "council plans new homes near the river while fans cheer the home side").split()
    g = torch.Generator().manual_seed(3)
    with open(path, "w") as fh:
        for _ in range(n):
            k = int(torch.randint(lo, hi, (1,), generator=g))
            fh.write(json.dumps({"text": " ".join(words[int(j)] for j in torch.randint(len(words), (k,), generator=g))})
                     + "\n")
    return str(path)
