"""Whole causal rows through sdpa's cuDNN kernel on a GPU (``pytest -m gpu``; skipped without CUDA).

* One attention call, forward and backward, at Llama-3B's heads (head_dim 100: zero-padded to
  104), Llama-3-8B's (grouped keys, 128) and a small one: the output and the query, key and value
  gradients are as close to float32 attention as flash-2's are (at most twice as far: bf16
  noise, and a key attended one too many or too few is far outside it), and the kernel counter
  says cuDNN ran. On Hopper, Llama-3B's shapes must take cuDNN: the speed the bench reports
  depends on it, and a silent fallback to flash would only be slower.
* A bf16 stage with compiled layers, where the probe runs before compilation: its loss and
  gradients equal the eager stage's, and both equal the flash stage's within bf16 noise.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.segments import AttentionModule
from tests.helpers.tolerance import rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 32, 100), (32, 8, 128), (4, 4, 64)])
def test_whole_rows_take_cudnn_as_exact_as_flash(heads, kv_heads, head_dim):
    import torch.nn.functional as F

    from pipeline.stage import attention

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(heads + head_dim)
    rows, t = 2, 1024
    q = torch.randn(rows, heads, t, head_dim, device=dev, generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(rows, kv_heads, t, head_dim, device=dev, generator=gen, dtype=torch.bfloat16)
            for _ in range(2))
    up = torch.randn(rows, t, heads, head_dim, device=dev, generator=gen)  # the output's gradient

    def run(fn, dtype):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        (out.float() * up).sum().backward()
        return [out.detach()] + [x.grad for x in leaves]

    def exact(q_, k_, v_):
        groups = heads // kv_heads
        k_, v_ = (x.repeat_interleave(groups, dim=1) for x in (k_, v_))
        return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True).transpose(1, 2)

    def through(backend):
        def fn(q_, k_, v_):
            attention.use_backend(backend)
            try:
                return attention.attention(AttentionModule(heads // kv_heads), q_, k_, v_, None, scaling=head_dim ** -0.5)[0]
            finally:
                attention.use_backend("auto")
        return fn

    ref = run(exact, torch.float32)
    flash = run(through("flash"), torch.bfloat16)
    attention.KERNEL_CALLS.clear()
    cudnn = run(through("auto"), torch.bfloat16)
    takes = attention.cudnn_takes(dev, torch.bfloat16, heads, kv_heads, head_dim)
    print(f"{heads}x{head_dim} (kv heads {kv_heads}): cuDNN {'taken' if takes else 'not taken'}; distance to "
          f"float32 (out, dq, dk, dv): flash {[round(rel_err(a, b), 5) for a, b in zip(flash, ref)]}, "
          f"auto {[round(rel_err(a, b), 5) for a, b in zip(cudnn, ref)]}")
    assert attention.KERNEL_CALLS == ({"cudnn": 1} if takes else {}), attention.KERNEL_CALLS
    if (heads, kv_heads, head_dim) == (32, 32, 100) and torch.cuda.get_device_capability() >= (9, 0):
        assert takes, "Llama-3B's heads should take cuDNN on Hopper"
    for name, a, f, r in zip(("out", "dq", "dk", "dv"), cudnn, flash, ref):
        assert rel_err(a, r) <= 2 * rel_err(f, r) + 1e-3, (name, rel_err(a, r), rel_err(f, r))


def test_compiled_bf16_stage_takes_cudnn_like_eager_and_flash():
    """A Llama stage (grouped keys) in bf16, two of four layers recomputed: compiled with cuDNN,
    eager with cuDNN and eager with flash give one loss and one set of gradients within bf16 noise."""
    import copy

    from tests.helpers.segments import make_batch, make_config, make_stages

    from pipeline.stage import attention
    from pipeline.stage.model import compile_layers

    torch._dynamo.reset()
    eager = make_stages(make_config("llama", "sdpa"))[0].cuda().to(torch.bfloat16)
    eager.checkpointing, eager.recomputed = True, 2
    compiled = copy.deepcopy(eager)
    compile_layers(compiled)
    x, targets = (t.cuda() for t in make_batch(eager.lm_head.out_features, rows_len=(160, 90, 40)))
    results = {}
    for name, stage, backend in (("flash", eager, "flash"), ("eager", eager, "auto"), ("compiled", compiled, "auto")):
        attention.use_backend(backend)
        attention.KERNEL_CALLS.clear()
        try:
            stage.zero_grad(set_to_none=True)
            loss = stage(x, targets)
            loss.backward()
        finally:
            attention.use_backend("auto")
        results[name] = (loss.detach().float(), {n: p.grad.float() for n, p in stage.named_parameters()})
        if name == "eager":
            assert attention.KERNEL_CALLS["cudnn"] > 0, attention.KERNEL_CALLS
    for name in ("eager", "compiled"):
        loss, grads = results[name]
        assert rel_err(loss, results["flash"][0]) <= 1e-2, (name, loss, results["flash"][0])
        bad = [(n, rel_err(g, results["flash"][1][n])) for n, g in grads.items() if rel_err(g, results["flash"][1][n]) > 5e-2]
        assert not bad, (name, bad)
