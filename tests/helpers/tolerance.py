"""How the tests compare float32 results that two code paths computed.

float32 sums round differently with the order of their terms, and the order differs between
CPUs (Intel and AMD run other SIMD widths and BLAS kernels), thread counts and code paths (a
loss in chunks, a sequence in segments, gradients summed over micro-batches or stages). Such a
difference is a few ulps of a tensor's *largest* elements, spread over all of them: an element
near zero can be off by more than itself. On an AMD EPYC, the fused last stage's gradients
agree with the checkpointed backward's to 1.2e-7 of their norm, yet 2 of 16,384 elements were
2.7e-9 apart where an element-wise ``rtol=1e-5, atol=1e-9`` allowed 2.3e-9.

So a tensor is compared as a whole: ``|actual - expected| / |expected| <= rtol`` in the 2-norm
(for a scalar, the plain relative error). A real bug (a lost micro-batch, a wrong gradient
scale, a skipped layer, wrong labels) moves that by orders of magnitude more than the 1e-5 the
tests allow; the mutation tests check that it does. Bit-exact comparisons (``torch.equal``,
``==``) stay where both sides run the same arithmetic in the same order: a resumed run against
one that never stopped, a copy, a skipped step.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch


def rel_err(actual, expected) -> float:
    """``|actual - expected| / |expected|`` in the 2-norm, computed in float64 (tensors or numbers)."""
    a = torch.as_tensor(actual).detach().double().cpu()
    e = torch.as_tensor(expected).detach().double().cpu()
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


def assert_close(actual, expected, rtol: float, what: str = "") -> None:
    """``actual`` equals ``expected`` to ``rtol`` relative to ``expected``'s norm; for mappings of
    tensors (gradients, state dicts), the same keys and each tensor alike."""
    if isinstance(expected, Mapping):
        assert sorted(actual) == sorted(expected), f"{what}: keys differ: {sorted(set(actual) ^ set(expected))}"
        for k, v in expected.items():
            assert_close(actual[k], v, rtol, f"{what}{'.' if what else ''}{k}")
        return
    a, e = torch.as_tensor(actual), torch.as_tensor(expected)
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(e.shape)}"
    err = rel_err(a, e)
    assert err <= rtol, f"{what or 'tensor'}: relative difference {err:.3e} > {rtol:g} (2-norm of the difference " \
                        f"over the expected's)"
