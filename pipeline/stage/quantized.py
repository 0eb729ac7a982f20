"""QLoRA's base (``load_in_4bit``): a stage's decoder-layer linear weights in bitsandbytes' 4-bit
blocks, quantized once at build, layer by layer as their full-precision values are read or drawn,
as transformers' ``BitsAndBytesConfig(load_in_4bit=True)`` loads a model: every ``nn.Linear`` of
the decoder layers (``replace_with_bnb_linear`` converts every linear module but the head and
tied matrices, which are no decoder layer's) becomes a ``bitsandbytes.nn.Linear4bit`` whose
weight is cast to the compute dtype and quantized (``Params4bit``, blocks of 64, uint8 storage) on
the run's device; the embedding, norms, biases and head stay in the compute dtype. The stage is
then marked ``is_loaded_in_4bit``, as transformers marks the model, so peft wraps those modules
with its 4-bit LoRA layers (``peft.tuners.lora.bnb.Linear4bit``), as on a model transformers loaded.

Streaming: the store holds each 4-bit weight's parts (``Packed4bit``: its packed bytes, absmax and
code, with double quantization the offset and the nested absmax and code) in one byte buffer
(``offload.frozen``) and binds views of it into the weight and its ``QuantState`` at each LOAD.
bitsandbytes' own autograd function keeps a view of the weight's bytes on its context for the
backward, out of reach of the stage's saved-tensor hooks, so after a DROP it would read a pool
buffer another stage has since filled. The modules here run bitsandbytes' forward and backward
kernels through a function that saves the bytes and scales with ``save_for_backward``: the
hooks pack those views and rebuild them from the buffer loaded at backward time (eager, and in a
compiled layer's graph, which saves them the same way).

bitsandbytes is imported only here, and only for a 4-bit run."""
from __future__ import annotations

import functools
import importlib.util
import logging
from typing import Callable

import torch
from torch import nn

from pipeline.spec.lora import Base4bit

INSTALL = ("python3 -m pip install bitsandbytes==0.50.2 (requirements.txt; a GPU machine without network: "
           "bench/bnb_wheel.sh makes its wheel)")


def _not_the_kernels_notice(record: logging.LogRecord) -> bool:
    return "kernels-community" not in record.getMessage()


def quiet_bitsandbytes() -> None:
    """bitsandbytes' CPU backend warns on import, in every process of a CPU with AVX512-BF16, that
    the optional ``kernels`` package is missing (it then runs its own kernels); peft imports
    bitsandbytes whenever it is installed, so a LoRA run without 4 bits printed it too. That one
    notice is dropped, bitsandbytes' other warnings stay. Before the first import (idempotent)."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_not_the_kernels_notice)


def bnb():
    """The bitsandbytes module."""
    quiet_bitsandbytes()
    import bitsandbytes

    return bitsandbytes


def unavailable(device_type: str) -> str | None:
    """Why ``load_in_4bit`` cannot run on ``device_type`` here (one line), or None: bitsandbytes
    is not installed, or (CUDA) has no native library for this torch's CUDA."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return f"load_in_4bit needs the bitsandbytes package, which is not installed: {INSTALL}"
    if device_type == "cuda":
        lib = bnb().cextension.lib
        if type(lib).__name__ == "ErrorHandlerMockBNBNativeLibrary":
            return (f"load_in_4bit: bitsandbytes {bnb().__version__} has no CUDA library for this torch (CUDA "
                    f"{torch.version.cuda}; bench/bnb_wheel.sh keeps one: BNB_CUDA=<version digits>)")
    return None


def quantized_modules(stage: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name in the stage, module) of every linear module ``load_in_4bit`` quantizes: each
    ``nn.Linear`` of the decoder layers (of that exact type, as transformers converts them)."""
    return [(f"model.layers.{i}.{n}", m) for i, layer in stage.model.layers.items()
            for n, m in layer.named_modules() if type(m) is nn.Linear]


def quantize_layers_(stage: nn.Module, base: Base4bit, weights: Callable[[list[str]], dict[str, torch.Tensor]],
                     device: torch.device | str, dtype: torch.dtype) -> None:
    """Each decoder layer of ``stage`` in turn: its linear weights' full-precision values from
    ``weights`` (names -> tensors; the modules' own weights are still on the meta device), cast to
    ``dtype``, quantized on ``device``, the modules replaced by 4-bit ones (their biases kept)."""
    by_layer: dict[str, list[tuple[str, nn.Linear]]] = {}
    for name, m in quantized_modules(stage):
        by_layer.setdefault(name.split(".")[2], []).append((name, m))
    for modules in by_layer.values():  # one layer's full-precision weights at a time
        values = weights([f"{name}.weight" for name, _ in modules])
        for name, m in modules:
            stage.set_submodule(name, quantized_linear(m, values.pop(f"{name}.weight"), base, device, dtype))
    stage.is_loaded_in_4bit = True  # peft's cue: its 4-bit LoRA layers (transformers sets it so)


def quantized_linear(m: nn.Linear, weight: torch.Tensor, base: Base4bit, device: torch.device | str,
                     dtype: torch.dtype) -> nn.Module:
    """The 4-bit module that replaces ``m``: ``weight`` (its full-precision value) cast to
    ``dtype`` and quantized on ``device`` as transformers' ``Bnb4bitQuantize`` does it; ``m``'s
    bias kept."""
    q = linear_class()(m.in_features, m.out_features, bias=m.bias is not None, compute_dtype=dtype,
                       compress_statistics=base.double_quant, quant_type=base.quant_type, quant_storage=torch.uint8,
                       device="meta")
    # eval on a CPU with AVX512-BF16 would repack the bytes in place, under the store's views
    q.support_avx512bf16_for_cpu = False
    q.weight = bnb().nn.Params4bit(weight.to(device=device, dtype=dtype), requires_grad=False,
                                   blocksize=base.blocksize, compress_statistics=base.double_quant,
                                   quant_type=base.quant_type, quant_storage=torch.uint8, module=q).to(device)
    if m.bias is not None:
        q.bias = m.bias
    return q


class Packed4bit:
    """One 4-bit linear's frozen state as the store holds it (``offload.frozen.PackedWeight``):
    the packed weight, its absmax and code, and with double quantization the offset and the
    nested absmax and code, bound into the weight and its ``QuantState``."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.param = module.weight

    def parts(self) -> list[torch.Tensor]:
        qs = self.param.quant_state
        nested = [qs.offset, qs.state2.absmax, qs.state2.code] if qs.nested else []
        return [self.param.data, qs.absmax, qs.code, *nested]

    def bind(self, views: list[torch.Tensor]) -> None:
        qs = self.param.quant_state
        self.param.data, qs.absmax, qs.code = views[:3]
        if qs.nested:
            qs.offset, qs.state2.absmax, qs.state2.code = views[3:]


def packed_weights(stage: nn.Module) -> list[Packed4bit]:
    """The stage's 4-bit weights, for its store (none unless ``quantize_layers_`` ran)."""
    if not getattr(stage, "is_loaded_in_4bit", False):
        return []
    Linear = linear_class()
    return [Packed4bit(m) for m in stage.modules() if isinstance(m, Linear)]


@functools.cache
def linear_class() -> type:
    """``bitsandbytes.nn.Linear4bit`` with its product through ``_MatMul4bit`` (made on first use:
    bitsandbytes is imported only for a 4-bit run)."""
    bnb_module = bnb()
    F = bnb_module.functional

    def state(meta: tuple, absmax, code, offset, nested_absmax, nested_code):
        """The weight's ``QuantState`` from its tensors (the store's views) and its fixed fields."""
        shape, blocksize, quant_type, dtype, nested_blocksize, nested_dtype = meta
        nested = None if nested_absmax is None else F.QuantState(absmax=nested_absmax, code=nested_code,
                                                                 blocksize=nested_blocksize, dtype=nested_dtype)
        return F.QuantState(absmax=absmax, shape=shape, code=code, blocksize=blocksize, quant_type=quant_type,
                            dtype=dtype, offset=offset, state2=nested)

    class _MatMul4bit(torch.autograd.Function):
        """bitsandbytes' 4-bit product (``matmul_4bit``'s kernels); the weight's bytes and scales
        are its inputs, saved for the backward through ``save_for_backward``, so a stage's
        saved-tensor hooks rebuild them from the buffer loaded at backward time."""

        @staticmethod
        def forward(ctx, A, weight, bias, meta, *tensors):
            ctx.meta, ctx.bias_dtype = meta, None if bias is None else bias.dtype
            ctx.save_for_backward(weight, *tensors)
            # grad mode is off in here: bitsandbytes' own forward path, the gemm its autograd
            # function runs too
            return bnb_module.matmul_4bit(A, weight, state(meta, *tensors), bias=bias)

        @staticmethod
        def backward(ctx, grad_output):
            weight, *tensors = ctx.saved_tensors
            grad_a = grad_bias = None
            if ctx.needs_input_grad[2]:
                grad_bias = grad_output.sum(0, dtype=ctx.bias_dtype)
            if ctx.needs_input_grad[0]:  # as bitsandbytes' MatMul4Bit.backward
                grad_a = torch.matmul(grad_output, F.dequantize_4bit(weight, state(ctx.meta, *tensors))
                                      .to(grad_output.dtype))
            return grad_a, None, grad_bias, None, *(None for _ in tensors)

    class Linear4bit(bnb_module.nn.Linear4bit):
        """bitsandbytes' Linear4bit, its compute dtype given, its product through ``_MatMul4bit``."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # bitsandbytes' Linear4bit.forward: the input (and bias) in the compute dtype, the
            # output back in the input's
            qs = self.weight.quant_state
            if qs.nested:
                nested, tensors = (qs.state2.blocksize, qs.state2.dtype), (qs.absmax, qs.code, qs.offset,
                                                                           qs.state2.absmax, qs.state2.code)
            else:
                nested, tensors = (None, None), (qs.absmax, qs.code, None, None, None)
            meta = (qs.shape, qs.blocksize, qs.quant_type, qs.dtype, *nested)
            bias = None if self.bias is None else self.bias.to(self.compute_dtype)
            return _MatMul4bit.apply(x.to(self.compute_dtype), self.weight, bias, meta, *tensors).to(x.dtype)

    return Linear4bit


__all__ = ["INSTALL", "Packed4bit", "bnb", "linear_class", "packed_weights", "quantize_layers_", "quantized_linear",
           "quantized_modules", "quiet_bitsandbytes", "unavailable"]
