"""L2: QLoRA (``load_in_4bit``) over torchrun and gloo, 2 processes x 4 stages, resident and
offloaded, and 2 replicas of a 1-rank pipeline of 2 stages (``data_parallel``): the adapters and
losses equal peft's on the Hugging Face model transformers loads with
``BitsAndBytesConfig(load_in_4bit=True)`` (one process, bitsandbytes' CPU path), and the adapter
directory records the 4-bit base. One torchrun trains every configuration in turn
(``tests/helpers/lora_runs.py``)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT, env_without_dist
from tests.helpers.reference import assert_same_training, reference_train
from tests.helpers.runs import run_losses, tiny_cfg

QLORA = dict(lora_rank=4, lora_alpha=8.0, lora_target_modules="all-linear", adam_eps=1e-4,  # eps: test_lora.py
             load_in_4bit=True)
RUNS = {
    "resident": dict(schedule="1f1b"),
    "offloaded": dict(use_offload=True, schedule="interleaved", num_stages=4, bnb_4bit_use_double_quant=True),
    "data_parallel": dict(num_stages=2, data_parallel=2, use_offload=True, resident_stages=1),
}


@pytest.mark.slow
def test_qlora_over_processes_trains_peft_adapters(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    cfgs = {name: tiny_cfg(tiny_model_dir, save_dir=str(tmp_path / name), save_model=True,
                           save_results=str(tmp_path / name / "results.json"), **QLORA, **kw)
            for name, kw in RUNS.items()}
    (tmp_path / "runs.json").write_text(json.dumps([cfg.to_dict() for cfg in cfgs.values()]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "helpers" / "lora_runs.py"), str(tmp_path / "runs.json")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env_without_dist(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, cfg in cfgs.items():
        out = Path(cfg.save_dir) / "adapter"
        quant = {k: v for k, v in RUNS[name].items() if k.startswith("bnb_")}
        record = json.loads((out / "base_quantization.json").read_text())
        assert record["bnb_4bit_use_double_quant"] == bool(quant), name
        ref = reference_train(tiny_cfg(tiny_model_dir, **QLORA, **quant), tiny_model_dir)
        try:
            assert_same_training(run_losses(cfg.save_results), load_file(str(out / "adapter_model.safetensors")),
                                 *ref)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
