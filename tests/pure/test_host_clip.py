"""The peers' host-memory clipping (bench/host_clip.py) is torch's clip_grad_norm_: the same norm
and the same scaled gradients, to float32 noise relative to each gradient's largest element."""
from __future__ import annotations

import sys

import torch

from tests.helpers.paths import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from host_clip import BLOCK, clip_host_grads_  # noqa: E402


def test_host_clip_is_torchs_clip_grad_norm():
    g = torch.Generator().manual_seed(0)
    shapes = [(3 * BLOCK + 17,), (257, 300), (5,), (BLOCK,)]
    for max_norm in (0.5, 1e6):  # clipped, and left alone
        ours = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        ref = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        for a, b in zip(ours, ref):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        norm = clip_host_grads_(ours, max_norm)
        expected = float(torch.nn.utils.clip_grad_norm_(ref, max_norm))
        assert abs(norm - expected) <= 1e-6 * expected
        for a, b in zip(ours, ref):
            assert (a.grad - b.grad).abs().max() <= 1e-6 * b.grad.abs().max()
