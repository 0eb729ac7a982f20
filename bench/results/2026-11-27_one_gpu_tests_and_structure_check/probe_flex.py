"""Which shapes compiled flex attention (a sliding-window block mask) lowers on this GPU: one
case a process (``python3 probe_flex.py DTYPE HEAD_DIM Q_LEN KV_LEN RESET``), with inductor's
reasons for refusing its kernel choices logged."""
import logging
import sys

import torch

import pipeline.stage.attention as attention

logging.getLogger("torch._inductor.select_algorithm").setLevel(logging.INFO)
logging.getLogger("torch._inductor.kernel.flex.flex_attention").setLevel(logging.DEBUG)
logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")


class M:
    num_key_value_groups, is_causal, training = 2, True, True


dtype, hd, tq, tk, reset = (getattr(torch, sys.argv[1]), *map(int, sys.argv[2:6]))
if reset:
    torch._dynamo.reset()
q = torch.randn(3, 4, tq, hd, device="cuda", dtype=dtype, requires_grad=True)
k, v = (torch.randn(3, 2, tk, hd, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
try:
    out = attention.attention(M(), q, k, v, attention.AttnMask(tk - tq, tk, window=32), scaling=hd ** -0.5)[0]
    out.float().sum().backward()
    res = f"ok {attention.KERNEL_CALLS}"
except Exception as e:
    res = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
print(f"RESULT {sys.argv[1:]}: {res}", flush=True)
