"""Stage inputs in host memory between a forward and its backward (``activation_offload``).

A stage in this mode runs its forward without building a graph and keeps only its input; the
backward brings the input back and recomputes the stage. ``ActivationStash`` holds those inputs,
keyed by (stage, micro-batch, segment), so a micro-batch (segment) only ever gets its own back;
the segment is None without ``seq_chunks``.

Streams and ownership (CUDA): one stash per rank, used by the thread that interprets the action
list only. Its copies, host-bound and device-bound, run on its own stream, which nothing else
uses; stream order puts a device-bound copy after the host-bound one that filled its source.
Every hand-off with the compute stream is an event, never a host sync:

* ``save``: the copy waits for the compute stream (where the input was made, or where the
  receive of it was waited for); the input's memory is marked as used by the copy's stream, so
  the caching allocator does not hand it out again before the copy has read it.
* ``prefetch`` / ``restore``: the device buffer is made on the stash's stream and filled there;
  ``restore`` makes the compute stream wait for that copy and marks the buffer as used by the
  compute stream. A host buffer goes back to the stash's ``HostBuffers`` once its copy back is
  issued: only a later copy on the same stream takes it again.

On the CPU there is nothing to copy: the input tensor itself is kept.
"""
from __future__ import annotations

import torch

from offload.streams import HostBuffers

Key = tuple[int, int, "int | None"]  # (stage, micro-batch, segment)


def _name(key: Key) -> str:
    return f"stage {key[0]}, micro-batch {key[1]}" + (f", segment {key[2]}" if len(key) > 2 and key[2] is not None
                                                      else "")


class ActivationStash:
    """Stage inputs waiting for their backward, by (stage, micro-batch, segment): in pinned host memory
    from ``save`` until ``prefetch`` (or ``restore``) starts their copy back to the device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.buffers = HostBuffers(pin=self.cuda)  # page-locked, exact sizes, for this stream's copies
        self._host: dict[Key, torch.Tensor] = {}                         # saved, not yet copied back
        self._back: dict[Key, tuple[torch.Tensor, object]] = {}          # copy back issued: (buffer, its end event)

    def __len__(self) -> int:
        return len(self._host) + len(self._back)

    def host_bytes(self) -> int:
        """Bytes of inputs now in host memory."""
        return sum(t.nbytes for t in self._host.values())

    def save(self, key: Key, x: torch.Tensor) -> None:
        """Keep ``x`` (the stage input of ``key``) for its backward; on CUDA start its copy to
        pinned host memory. The caller may drop ``x`` right after, but must not write it in
        place: the copy may still be reading it (the executor only reads a stage input)."""
        if key in self._host or key in self._back:
            raise RuntimeError(f"activation_offload: the input of {_name(key)} is already held (a second "
                               "forward before its backward)")
        x = x.detach()
        if not self.cuda:
            self._host[key] = x
            return
        host = self.buffers.take(x.shape, x.dtype)
        produced = torch.cuda.current_stream(self.device).record_event()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(produced)  # x is written (or received) on the compute stream
            host.copy_(x, non_blocking=True)
        x.record_stream(self.stream)  # memory release: not reused before this copy has read it
        self._host[key] = host

    def prefetch(self, key: Key) -> None:
        """Start copying ``key``'s input back to the device; nothing if it is not held (its
        forward has not run yet) or its copy back is already issued."""
        host = self._host.pop(key, None)
        if host is None:
            return
        if not self.cuda:
            self._back[key] = (host, None)
            return
        with torch.cuda.stream(self.stream):
            # made on this stream: its memory's previous user is this stream, in stream order
            x = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            x.copy_(host, non_blocking=True)  # stream order: after the copy that filled ``host``
            done = self.stream.record_event()
        self.buffers.give(host, done)  # its next user is a copy on this stream, after this one
        self._back[key] = (x, done)

    def peek(self, key: Key) -> torch.Tensor:
        """``key``'s input on the device, ready for the compute stream, while the stash keeps it
        for its own ``restore``: the copy back already issued, or a copy of its own."""
        if key in self._back:
            x, done = self._back[key]
        elif key in self._host:
            host = self._host[key]
            if not self.cuda:
                return host
            with torch.cuda.stream(self.stream):
                x = torch.empty(host.shape, dtype=host.dtype, device=self.device)
                x.copy_(host, non_blocking=True)
                done = self.stream.record_event()
        else:
            raise RuntimeError(f"activation_offload: no input held for {_name(key)} to read")
        if done is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(done)
            x.record_stream(compute)  # memory release: after the compute that reads it
        return x

    def restore(self, key: Key) -> torch.Tensor:
        """``key``'s input on the device, ready for the compute stream (which waits for its copy,
        device-side); it is no longer held here."""
        self.prefetch(key)
        if key not in self._back:
            raise RuntimeError(f"activation_offload: no input held for {_name(key)} "
                               f"(held: {sorted([*self._host, *self._back], key=str)})")
        x, done = self._back.pop(key)
        if done is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(done)
            x.record_stream(compute)  # memory release: freed only after the backward that reads it
        return x

    def clear(self) -> None:
        """Forget every held input (the end of an iteration that was cut short)."""
        if self.cuda:
            done = self.stream.record_event()  # after every copy issued on the stash's stream
            for host in self._host.values():
                self.buffers.give(host, done)
        self._host.clear()
        self._back.clear()


__all__ = ["ActivationStash"]
