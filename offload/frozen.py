"""A stage's frozen weights (LoRA's base model): one flat buffer in the compute dtype, with no
gradient, no fp32 master and no optimizer state; and, for a 4-bit base (``load_in_4bit``), a
second flat buffer of bytes holding each packed weight's parts (its 4-bit bytes, its scales and
code), each part a view of its dtype and shape at an offset aligned to ``PACK_ALIGN``. Offloaded,
both live in host memory (pinned on CUDA) and a LOAD copies them into device buffers of the
rank's pool, which DROP and OFFLOAD_GRADS give back; resident, the device buffers are made once
and the actions move nothing.

Owned like the ``StageStore`` that holds it: the store's thread (the main one) writes its fields
and issues its copies on the load stream, and the compute stream waits for a copy through the
event the copy leaves (``wait``), never through a host sync."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol, Sequence

import torch
from torch import nn

from offload import loader
from offload.loader import LoadSpan
from offload.slices import PACK_ALIGN
from offload.streams import BufferPool, Streams, flat_views, host_empty


class PackedWeight(Protocol):
    """A frozen weight held as several tensors of their own dtypes and shapes (a 4-bit weight:
    its packed bytes and its quantization state), which the store keeps in its byte buffer."""

    param: nn.Parameter  # the module's parameter: left out of the compute-dtype buffer

    def parts(self) -> list[torch.Tensor]:
        """The tensors' values now (once, when the store is made)."""

    def bind(self, views: list[torch.Tensor]) -> None:
        """The weight computes with ``views`` from now on: views of the device buffer, or empty
        tensors while the stage is not loaded (a use then fails instead of reading stale bytes)."""


def byte_offsets(nbytes: Sequence[int]) -> tuple[list[int], int]:
    """The offset of each of parts of ``nbytes`` bytes laid one after another, each aligned to
    ``PACK_ALIGN``, and the bytes of the whole."""
    offsets, end = [], 0
    for n in nbytes:
        start = -(-end // PACK_ALIGN) * PACK_ALIGN
        offsets.append(start)
        end = start + n
    return offsets, -(-end // PACK_ALIGN) * PACK_ALIGN


class FrozenWeights:
    """The frozen parameters ``named`` of a stage (their values are copied in, converted to
    ``dtype``) and the ``packed`` weights (their parts copied in as they are); ``offload``: host
    memory, loaded on LOAD."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], *, offload: bool, device: torch.device,
                 dtype: torch.dtype, streams: Streams, pool: BufferPool, packed: Sequence[PackedWeight] = ()):
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shapes = [p.shape for p in self.params]
        self.numel = sum(p.numel() for p in self.params)
        self.offload, self.device, self.dtype, self.streams, self.pool = offload, device, dtype, streams, pool
        self.packed = list(packed)
        values = [w.parts() for w in self.packed]
        self.part_specs = [[(t.dtype, t.shape) for t in parts] for parts in values]
        flat = [t for parts in values for t in parts]
        self.offsets, self.packed_bytes = byte_offsets([t.numel() * t.element_size() for t in flat])
        cuda = device.type == "cuda"
        self.host = host_empty(self.numel, dtype, cuda) if offload else None
        self.dev = None if offload else torch.empty(self.numel, dtype=dtype, device=device)
        self.host_packed = host_empty(self.packed_bytes, torch.uint8, cuda) if offload and flat else None
        self.dev_packed = torch.empty(self.packed_bytes, dtype=torch.uint8, device=device) \
            if flat and not offload else None
        with torch.no_grad():
            for p, view in zip(self.params, flat_views(self.host if offload else self.dev, self.shapes)):
                view.copy_(p.detach())
                p.requires_grad_(False)
            if flat:
                for t, view in zip(flat, self._part_views(self.host_packed if offload else self.dev_packed)):
                    view.copy_(t)
        del values, flat  # the packed weights' own tensors go once they are bound below
        self._ready = None  # load stream: the copy into ``dev`` is done
        # Offloaded, nothing stays bound until the first LOAD: the module's own float32 tensors go now.
        self._bind(self.dev, self.dev_packed)

    @property
    def loaded(self) -> bool:
        return self.dev is not None

    @property
    def nbytes(self) -> int:
        """Bytes a LOAD copies."""
        return self.numel * self.dtype.itemsize + self.packed_bytes

    def _part_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        specs = [spec for parts in self.part_specs for spec in parts]
        return [flat[off:off + shape.numel() * dt.itemsize].view(dt).view(shape)
                for (dt, shape), off in zip(specs, self.offsets)]

    def _bind(self, dev: torch.Tensor | None, dev_packed: torch.Tensor | None) -> None:
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        views = flat_views(dev, self.shapes) if dev is not None else (empty for _ in self.params)
        for p, v in zip(self.params, views):
            p.data = v
        if not self.packed:
            return
        if dev_packed is not None:
            views = iter(self._part_views(dev_packed))
        else:
            views = iter([torch.empty(0, dtype=dt, device=self.device) for parts in self.part_specs for dt, _ in parts])
        for w, specs in zip(self.packed, self.part_specs):
            w.bind([next(views) for _ in specs])

    def load(self) -> Future | None:
        """LOAD: the weights into pool buffers on the load stream (issued here, not waited for);
        a future of its ``LoadSpan``, None when resident."""
        if not self.offload:
            return None
        copies = [(self.host, self.numel, self.dtype)]
        if self.host_packed is not None:
            copies.append((self.host_packed, self.packed_bytes, torch.uint8))
        start, devs = None, []
        for host, numel, dtype in copies:
            dev, ready = self.pool.take(numel, dtype)
            self.streams.wait("load", ready)  # the buffer's previous user is done with it
            start = start if start is not None else self.streams.mark("load")
            with self.streams.on("load"):
                dev.copy_(host, non_blocking=True)
            devs.append(dev)
        end = self.streams.mark("load")
        self._ready = self.streams.event("load")
        self.dev = devs[0]
        self.dev_packed = devs[1] if len(devs) > 1 else None
        self._bind(self.dev, self.dev_packed)
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
        """DROP (and OFFLOAD_GRADS): the device copies back to the pool once the compute stream's
        queued work is done with them; nothing goes back to the host, the weights did not change."""
        if not self.offload or self.dev is None:
            return
        done = self.streams.event("compute")
        for dev in (self.dev, self.dev_packed):
            if dev is not None:
                self.pool.give(dev, done)
        self.dev = self.dev_packed = None
        self._bind(None, None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The frozen weights in the compute dtype under the stage's parameter names (views of the
        host or device buffer); the packed weights are not among them."""
        flat = self.host if self.offload else self.dev
        return dict(zip(self.names, flat_views(flat, self.shapes)))


__all__ = ["FrozenWeights", "PackedWeight", "byte_offsets"]
