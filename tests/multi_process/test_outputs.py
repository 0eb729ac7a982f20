"""What a run leaves behind: a Hugging Face directory that reloads and reproduces the trained
model, the whole state dict, and the per-iteration results of every rank."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.runs import cli_flags, reference_result, run_results, run_torchrun, tiny_cfg
from tests.helpers.tolerance import assert_close


@pytest.mark.slow
def test_saved_model_reloads_and_reproduces_logits(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = tiny_cfg(tiny_model_dir, schedule="1f1b", num_stages=4, save_model=True, save_params=True,
               save_dir=str(tmp_path), save_results=str(tmp_path / "results.json"))
    proc = run_torchrun(2, cli_flags(cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "model"
    assert not (tmp_path / "model.partial").exists()
    assert sorted(p.name for p in out.glob("*.safetensors")) == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    # every file with the run's mode (0644 under the usual umask), the shards too (safetensors makes them 0600)
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {oct((out / "config.json").stat().st_mode & 0o777)}

    saved = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    AutoTokenizer.from_pretrained(out)  # the tokenizer travels with the model
    _, ref_params = reference_result(str(tiny_model_dir))
    trained = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    trained.load_state_dict(ref_params)  # ordinary training's result
    x = torch.randint(3, saved.config.vocab_size, (2, 32))
    with torch.no_grad():
        assert_close(saved(x).logits, trained(x).logits, 1e-4, "logits")

    params = torch.load(tmp_path / "params.pt", weights_only=True)
    assert sorted(params) == sorted(saved.state_dict())
    results = run_results(cfg.save_results)
    assert results["world_size"] == 2 and len(results["iterations"]) == cfg.num_iterations
    for row in results["iterations"]:
        assert row["step_time_s"] > 0 and row["tokens_per_s"] > 0 and row["loss"] > 0
        assert len(row["peak_mem_bytes"]) == 2 and min(row["peak_mem_bytes"]) > 0
