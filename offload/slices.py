"""How many elements the store moves or steps at a time (as in every ``*_NUMEL``: micro-batches are
chunks). Read at each use, so a test can set them."""
from __future__ import annotations

# Elements converted to fp32 at a time on the device at OFFLOAD_GRADS (64 MiB).
GRAD_SLICE_NUMEL = 16 * 2**20
# Elements a CPU step updates, and a LOAD from the masters copies, at a time (128 MiB fp32). A
# multiple of the fused kernel's vector width, so the chunked step is bit for bit the whole one.
MASTER_SLICE_NUMEL = 32 * 2**20
# Bytes: each part of a packed frozen weight (a 4-bit weight's bytes, scales, code) starts at a
# multiple of this in its stage's buffer (``offload.frozen``), so every part can be viewed as its
# dtype and the kernels read it aligned.
PACK_ALIGN = 16

__all__ = ["GRAD_SLICE_NUMEL", "MASTER_SLICE_NUMEL", "PACK_ALIGN"]
