"""GPU checks of QLoRA (``load_in_4bit``; ``pytest -m gpu``, skipped without CUDA; bitsandbytes with
its CUDA library installed, bench/bnb_wheel.sh): bitsandbytes' CUDA kernels through the streamed
4-bit weights train as peft does on transformers' 4-bit model (float32); an offloaded 4-bit base
trains as the resident one, eager and through compiled layers; and an offloaded weight's
backward reads the bytes loaded at backward time on CUDA's streams, eager and compiled (whose
graph saves the weight's views for the backward)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.qlora import streamed_grad
from tests.helpers.reference import assert_same_training, reference_train
from tests.helpers.runs import cli_flags, flags, run_losses, run_torchrun, tiny_cfg

pytestmark = pytest.mark.gpu

QLORA = dict(lora_rank=8, lora_alpha=16.0, lora_target_modules="all-linear", adam_eps=1e-4, load_in_4bit=True)


def _adapters(save_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(save_dir / "adapter" / "adapter_model.safetensors"))


def _preset_run(tmp_path: Path, name: str, **kw) -> tuple[list[float], dict]:
    out = tmp_path / name
    settings = dict(model="tiny", dataset="synthetic", device="cuda", dtype="bfloat16", seq_length=128, batch_size=8,
                    num_chunks=4, num_stages=6, num_iterations=4, lr=1e-3, schedule="1f1b", **QLORA, **kw)
    proc = run_torchrun(1, ["--save_dir", str(out), "--save_results", str(out / "r.json"), *flags(settings)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_losses(out / "r.json"), _adapters(out)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_offloaded_backward_reads_the_bytes_loaded_now_on_cuda(compiled):
    import torch

    torch._dynamo.reset()
    grad, expected = streamed_grad(torch.device("cuda"), compiled=compiled)
    torch._dynamo.reset()
    assert (grad - expected).norm() <= 1e-5 * expected.norm()


@pytest.mark.parametrize("compiled", ["false", "true"])
def test_offloaded_4bit_base_trains_as_the_resident_one(tmp_path, compiled):
    """The same kernels on the same bytes: what differs is only where the 4-bit weights wait
    between computes (six stages of one rank, loaded, dropped and loaded again)."""
    resident = _preset_run(tmp_path, "resident", use_offload=False, compile_layers=compiled)
    offloaded = _preset_run(tmp_path, "offloaded", use_offload=True, resident_stages=0, compile_layers=compiled)
    assert_same_training(*offloaded, *resident, rtol=1e-6)


def test_qlora_matches_peft_on_the_gpu(tiny_model_dir, tmp_path):
    """float32 on the GPU, every stage offloaded: the adapters of peft on transformers' 4-bit model
    (bitsandbytes' CUDA quantization and kernels on both sides; 1e-4: the GPU's kernels sum in
    other orders than the CPU's)."""
    cfg = tiny_cfg(tiny_model_dir, device="cuda", use_offload=True, resident_stages=0, save_model=True,
                   save_dir=str(tmp_path / "run"), save_results=str(tmp_path / "r.json"), **QLORA)
    proc = run_torchrun(1, cli_flags(cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref_losses, ref_adapters = reference_train(tiny_cfg(tiny_model_dir, **QLORA), tiny_model_dir, device="cuda")
    assert_same_training(run_losses(cfg.save_results), _adapters(tmp_path / "run"), ref_losses, ref_adapters,
                         rtol=1e-4)
