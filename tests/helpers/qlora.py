"""An offloaded 4-bit weight's backward after its pool buffer changed hands: the check that the
backward reads the bytes loaded at backward time (tests/one_process/test_qlora.py on the CPU,
tests/gpu/test_gpu_qlora.py with CUDA's kernels and streams)."""
from __future__ import annotations

import torch
from torch import nn


def streamed_grad(device: torch.device, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The input gradient of one 4-bit linear layer whose stage store (offloaded, its saved-tensor
    hooks on) gives its device buffer back after the forward, where another stage's LOAD takes it
    and fills it with its own bytes, while the layer loads again into a new buffer for the
    backward; and the gradient bitsandbytes' own module computes from the same bytes, resident.
    ``compiled``: the layer through torch.compile."""
    import bitsandbytes as bnb

    from offload.adamw import OptimSettings
    from offload.store import make_store
    from offload.streams import BufferPool, Streams
    from pipeline.spec.lora import Base4bit
    from pipeline.stage.quantized import Packed4bit, quantized_linear

    torch.manual_seed(0)
    w = torch.randn(32, 64)
    q = quantized_linear(nn.Linear(64, 32, bias=False), w, Base4bit(), device, torch.float32)
    expected_module = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.float32, compress_statistics=False,
                                        quant_type="nf4", device="meta")
    expected_module.weight = bnb.nn.Params4bit(w.to(device), requires_grad=False, quant_type="nf4",
                                               compress_statistics=False, module=expected_module).to(device)
    x = torch.randn(3, 64, device=device, requires_grad=True)
    expected_module(x).square().sum().backward()
    expected, x.grad = x.grad, None
    pool = BufferPool(device)
    store = make_store(nn.ModuleDict({"q": q}), offload=True, frozen=True, packed=[Packed4bit(q)], device=device,
                       compute_dtype=torch.float32, optim=OptimSettings(), streams=Streams(device), pool=pool)
    forward = torch.compile(q) if compiled else q
    store.load()
    store.before_compute(backward=False)
    with store.saved_tensor_hooks():
        y = forward(x)
    store.drop()
    other, _ = pool.take(store.frozen.packed_bytes, torch.uint8)  # another stage's LOAD
    other.copy_(torch.randint(0, 256, other.shape, dtype=torch.uint8))
    store.load()  # into a new buffer
    store.before_compute(backward=True)
    y.square().sum().backward()
    return x.grad, expected
