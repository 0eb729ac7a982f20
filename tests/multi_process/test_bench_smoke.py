"""The benchmark scripts run end to end on the CPU, as subprocesses (bench/long_rows.py through
main.py and FSDP2 on gloo; bench/profile_step.py): their plumbing, JSON, tables and traces (their
pure parts: tests/pure/test_bench.py)."""
from __future__ import annotations

import sys

import pytest

from tests.helpers.paths import ROOT


@pytest.mark.slow
def test_long_rows_smoke_runs_on_the_cpu(tmp_path):
    """The bench's plumbing end to end on a CPU: this project's rows through main.py (whole rows
    and segments), FSDP2 on gloo, RoundPipe skipped; the JSON and the table written."""
    import json
    import subprocess

    from tests.helpers.paths import env_without_dist

    proc = subprocess.run([sys.executable, str(ROOT / "bench/long_rows.py"), "--smoke", "--out", str(tmp_path),
                           "--rows", "ours@128,ours@256/seg4,fsdp2@128,roundpipe@128"], cwd=ROOT,
                          env=env_without_dist(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {r["row"]: r for r in json.loads((tmp_path / "long_rows.json").read_text())["rows"]}
    assert [rows[r]["status"] for r in ("ours@128", "ours@256/seg4", "fsdp2@128")] == ["ok"] * 3, rows
    assert rows["ours@256/seg4"]["seq_chunks"] == 4 and rows["ours@128"]["step_time_s"] > 0
    assert rows["roundpipe@128"]["status"] == "skipped (needs CUDA)"
    assert "| ours@256/seg4 | ok |" in (tmp_path / "long_rows.md").read_text()


@pytest.mark.slow
def test_profile_step_smoke_runs_on_the_cpu(tmp_path):
    """The profiler's plumbing on a CPU: warm-up steps, one recorded step, its table and trace."""
    import json
    import subprocess

    from tests.helpers.paths import env_without_dist

    proc = subprocess.run([sys.executable, str(ROOT / "bench/profile_step.py"), "--smoke", "--warmup", "1",
                           "--out", str(tmp_path)], cwd=ROOT, env=env_without_dist(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "profile.json").read_text())
    assert result["step_s"] > 0 and result["model_flops"] > 0 and result["kinds"]["matmul"] > 0
    assert sum(v for k, v in result["kinds"].items() if k != "idle") > 0.5 * result["step_s"]
    assert (tmp_path / "trace.json").stat().st_size > 0 and "| **step (wall)** |" in (tmp_path / "profile.md").read_text()


def _peft_trainable(config, rank: int) -> int:
    """peft's own count of a LoRA model's trainable parameters (on the meta device: shapes only)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=rank, lora_alpha=8, target_modules="all-linear",
                                                                    task_type="CAUSAL_LM"))
    return model.get_nb_trainable_parameters()[0]


@pytest.mark.slow
def test_fsdp2_lora_runs_on_gloo(tmp_path):
    """bench/fsdp2_baseline.py --lora_rank on the CPU (2 ranks, gloo, CPU offload): the sweep runs,
    the optimizer holds exactly peft's adapters, and the JSON and each point say it is LoRA."""
    import json
    import subprocess

    from tests.helpers.bench import load_bench
    from tests.helpers.paths import env_without_dist

    fsdp2 = load_bench("fsdp2_baseline")
    out = tmp_path / "fsdp2.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(ROOT / "bench/fsdp2_baseline.py"), "--model", "tiny", "--batch_size", "4",
                           "--seq_length", "32", "--micro_batches", "1,2", "--iterations", "1", "--warmup", "1",
                           "--lora_rank", "4", "--lora_alpha", "8", "--json", str(out)],
                          cwd=ROOT, env=env_without_dist(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["status"] == "ok" and [p["status"] for p in res["points"]] == ["ok", "ok"]
    assert (res["lora_rank"], res["lora_alpha"], res["lora_target_modules"]) == (4, 8.0, "all-linear")
    assert res["trainable_params"] == _peft_trainable(fsdp2.llama_config("tiny"), 4)  # the optimizer's parameters
    assert res["num_params"] == 7_377_152  # the base model's: every row's N
    assert all(p["config"]["lora_rank"] == 4 for p in res["points"])


# The GPU's configuration (bf16 frozen weights and compute, float32 adapters and reduction, CPU
# offload) built by the script's own build_model, trained for two steps over gloo.
GPU_SETUP_ON_GLOO = """
import os
import sys
import torch
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import fsdp2_baseline as f
dist.init_process_group("gloo")
args = f.parse_args(["--model", "tiny", "--lora_rank", "4", "--lora_alpha", "8"])
config = f.llama_config("tiny")
model = f.build_model(config, torch.device("cpu"), True, args, bf16=True)
trainable = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(trainable, lr=1e-2)
before = {n: p.to_local().clone() for n, p in model.named_parameters()}
gen = torch.Generator().manual_seed(dist.get_rank())
for _ in range(2):
    loss = f.train_step(model, opt, trainable, config.vocab_size, 1, 2, False, 16, torch.device("cpu"), gen, 1.0)
changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p.to_local())}
adapters = {n for n, _ in model.named_parameters() if f.peer_lora.is_adapter(n)}
frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
assert changed == adapters, sorted(changed ^ adapters)[:4]
assert frozen == {torch.bfloat16} and {p.dtype for p in trainable} == {torch.float32}, (frozen,)
assert all(p.to_local().device.type == "cpu" for p in model.parameters())  # offloaded shards
sys.stdout.write(f"ok {dist.get_rank()} {len(adapters)} {loss}\\n")  # one write: print's pieces interleave between ranks
sys.stdout.flush()
dist.destroy_process_group()
os._exit(0)  # as the script does: gloo's teardown at exit sometimes aborts
"""


@pytest.mark.slow
def test_fsdp2_lora_gpu_setup_trains_only_adapters_on_gloo(tmp_path):
    """FSDP2 takes the GPU run's mixed units (frozen bf16 weights beside float32 adapters in one
    fully_shard unit, bf16 compute, CPU offload) and its steps move the adapters and nothing else."""
    import subprocess

    from tests.helpers.paths import env_without_dist

    script = tmp_path / "gpu_setup.py"
    script.write_text(GPU_SETUP_ON_GLOO)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script), str(ROOT / "bench")], cwd=ROOT, env=env_without_dist(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("ok ") == 2
