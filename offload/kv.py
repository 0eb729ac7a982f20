"""A sequence segment's carried keys and values in host memory between a stage's forwards and its
backwards (``activation_offload`` with ``seq_chunks``).

The carried keys/values of a micro-batch at a stage (``pipeline.stage.segments``: one leaf per layer
and segment, whose ``.grad`` collects the later segments' gradients) are read by that stage's
later forwards of the micro-batch and then not before its backwards. After the micro-batch's
last forward at the stage they go to pinned host memory; before its first backward they come
back, the copy started one backward earlier (``prefetch``) so that it overlaps that backward.
The leaves stay the same autograd objects: only their storage moves (``leaf.data``), so every
reference to them (a segment's snapshot of the earlier keys, which activation checkpointing's
recompute reads again) sees the keys wherever they are.

Streams and ownership (CUDA): one instance per rank, used by the thread that interprets the
action list only. Its copies, host-bound and device-bound, run on its own stream, which nothing
else uses, so a device-bound copy follows the host-bound one that filled its source in stream
order. Every hand-off with the compute stream is an event, never a host sync:

* ``offload``: the copies wait for the compute stream (where the keys were made); each device
  tensor is marked as used by this stream, so the caching allocator hands its memory out again
  only after the copy has read it; the leaf then points at the host copy.
* ``prefetch``: device buffers made on this stream and filled there; ``restore`` makes the
  compute stream wait for the copies, marks the buffers as used by the compute stream (they are
  freed after the last backward that reads them) and points the leaves back at them.

On the CPU the same hand-offs are plain copies (so a test sees a leaf that was moved and
brought back, not one that never left).
"""
from __future__ import annotations

import torch

from offload.streams import HostBuffers

Key = tuple  # (stage, micro-batch)


class CarriedKV:
    """Carried keys/values by (stage, micro-batch): in host memory from ``offload`` until
    ``prefetch`` (or ``restore``) starts their copy back."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.buffers = HostBuffers(pin=self.cuda)  # page-locked, exact sizes, for this stream's copies
        self._host: dict[Key, list[tuple[torch.Tensor, torch.Tensor]]] = {}          # (leaf, host copy)
        self._back: dict[Key, tuple[list[tuple[torch.Tensor, torch.Tensor]], object]] = {}  # (leaf, device), event

    def __contains__(self, key: Key) -> bool:
        return key in self._host or key in self._back

    def host_bytes(self) -> int:
        """Bytes of keys/values now in host memory."""
        return sum(h.nbytes for pairs in self._host.values() for _, h in pairs)

    def offload(self, key: Key, leaves: list[torch.Tensor]) -> None:
        """Move the storage of ``leaves`` (``key``'s carried keys/values) to host memory."""
        if key in self:
            raise RuntimeError(f"carried keys/values of {key} are already in host memory (a second offload)")
        if not self.cuda:
            pairs = [(leaf, leaf.detach().clone()) for leaf in leaves]
        else:
            produced = torch.cuda.current_stream(self.device).record_event()
            pairs = []
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(produced)  # the keys/values are written on the compute stream
                for leaf in leaves:
                    host = self.buffers.take(leaf.shape, leaf.dtype)
                    host.copy_(leaf.detach(), non_blocking=True)
                    # memory release: the device copy is reused only after this copy has read it
                    leaf.data.record_stream(self.stream)
                    pairs.append((leaf, host))
        for leaf, host in pairs:
            leaf.data = host  # the device memory goes back to the allocator (after the copy, see above)
        self._host[key] = pairs

    def prefetch(self, key: Key) -> None:
        """Start copying ``key``'s keys/values back; nothing if they are not in host memory."""
        pairs = self._host.pop(key, None)
        if pairs is None:
            return
        if not self.cuda:
            self._back[key] = ([(leaf, host.clone()) for leaf, host in pairs], None)
            return
        back = []
        with torch.cuda.stream(self.stream):
            for leaf, host in pairs:
                # made on this stream: its memory's previous user is this stream, in stream order
                dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
                dev.copy_(host, non_blocking=True)  # stream order: after the copy that filled ``host``
                back.append((leaf, dev))
            done = self.stream.record_event()
        for _, host in pairs:
            self.buffers.give(host, done)  # its next user is a copy on this stream, after the one just issued
        self._back[key] = (back, done)

    def restore(self, key: Key) -> None:
        """``key``'s keys/values back on the device, ready for the compute stream (which waits for
        their copy, device-side); nothing if they never left."""
        self.prefetch(key)
        entry = self._back.pop(key, None)
        if entry is None:
            return
        back, done = entry
        if done is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(done)
        for leaf, dev in back:
            if done is not None:
                dev.record_stream(compute)  # memory release: after the backwards that read it
            leaf.data = dev

    def forget(self, key: Key) -> None:
        """Drop ``key``'s entry wherever it is (its micro-batch ended without a backward)."""
        self._give_back(self._host.pop(key, None) or [])
        self._back.pop(key, None)

    def clear(self) -> None:
        """Forget every entry (the end of an iteration that was cut short)."""
        for pairs in self._host.values():
            self._give_back(pairs)
        self._host.clear()
        self._back.clear()

    def _give_back(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if self.cuda:
            done = self.stream.record_event()  # after every copy issued on this stream
            for _, host in pairs:
                self.buffers.give(host, done)


__all__ = ["CarriedKV"]
