"""A stage's frozen weights (LoRA's base model): one flat buffer in the compute dtype, with no
gradient, no fp32 master and no optimizer state. Offloaded, it lives in host memory (pinned on
CUDA) and a LOAD copies it into a device buffer of the rank's pool, which DROP and OFFLOAD_GRADS
give back; resident, the device buffer is made once and the actions move nothing.

Owned like the ``StageStore`` that holds it: the store's thread (the main one) writes its fields
and issues its copies on the load stream, and the compute stream waits for a copy through the
event the copy leaves (``wait``), never through a host sync."""
from __future__ import annotations

from concurrent.futures import Future

import torch
from torch import nn

from offload import loader
from offload.loader import LoadSpan
from offload.streams import BufferPool, Streams, flat_views, host_empty


class FrozenWeights:
    """The frozen parameters ``named`` of a stage (their values are copied in, converted to
    ``dtype``); ``offload``: host memory, loaded on LOAD."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], *, offload: bool, device: torch.device,
                 dtype: torch.dtype, streams: Streams, pool: BufferPool):
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shapes = [p.shape for p in self.params]
        self.numel = sum(p.numel() for p in self.params)
        self.offload, self.device, self.dtype, self.streams, self.pool = offload, device, dtype, streams, pool
        cuda = device.type == "cuda"
        self.host = host_empty(self.numel, dtype, cuda) if offload else None
        self.dev = None if offload else torch.empty(self.numel, dtype=dtype, device=device)
        with torch.no_grad():
            for p, view in zip(self.params, flat_views(self.host if offload else self.dev, self.shapes)):
                view.copy_(p.detach())
                p.requires_grad_(False)
        self._ready = None  # load stream: the copy into ``dev`` is done
        # Offloaded, nothing stays bound until the first LOAD: the module's own float32 tensors go now.
        self._bind(self.dev)

    @property
    def loaded(self) -> bool:
        return self.dev is not None

    def _bind(self, dev: torch.Tensor | None) -> None:
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        views = flat_views(dev, self.shapes) if dev is not None else (empty for _ in self.params)
        for p, v in zip(self.params, views):
            p.data = v

    def load(self) -> Future | None:
        """LOAD: the weights into a pool buffer on the load stream (issued here, not waited for);
        a future of its ``LoadSpan``, None when resident."""
        if not self.offload:
            return None
        dev, ready = self.pool.take(self.numel, self.dtype)
        self.streams.wait("load", ready)  # the buffer's previous user is done with it
        start = self.streams.mark("load")
        with self.streams.on("load"):
            dev.copy_(self.host, non_blocking=True)
        end = self.streams.mark("load")
        self._ready = self.streams.event("load")
        self.dev = dev
        self._bind(dev)
        return loader.done(LoadSpan(start, end, None))

    def wait(self, clock=None) -> None:
        """Before a compute: the compute stream waits for the last LOAD's copy (device-side);
        ``clock`` gets the wait as ``load_wait`` (``StageStore.before_compute``)."""
        if self._ready is not None:
            before = self.streams.mark() if clock is not None and self.streams.cuda else None
            self.streams.wait("compute", self._ready)
            if before is not None:
                clock.span("load_wait", before, self.streams.mark())
            self._ready = None

    def drop(self) -> None:
        """DROP (and OFFLOAD_GRADS): the device copy back to the pool once the compute stream's
        queued work is done with it; nothing goes back to the host, the weights did not change."""
        if not self.offload or self.dev is None:
            return
        self.pool.give(self.dev, self.streams.event("compute"))
        self.dev = None
        self._bind(None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The frozen weights under the stage's parameter names (views of the host or device buffer)."""
        flat = self.host if self.offload else self.dev
        return dict(zip(self.names, flat_views(flat, self.shapes)))


__all__ = ["FrozenWeights"]
