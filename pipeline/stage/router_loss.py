"""The mixture-of-experts router loss across pipeline stages (``models.moe`` has the formula).

Hugging Face's load-balancing loss of a forward couples every routed layer of the model: the
gradient of a layer's summed probabilities ``P`` is ``coef * E / N^2 * T``, where ``T`` counts the
top-k choices of *all* routed layers. Per micro-batch (segment-free), the partial sums travel
with the activations, ``[T, P]`` (2E floats, float32) from each stage to the next; the last
stage then holds the totals and the loss's value; ``T`` travels back with the gradients, and
each stage's backward adds its own layers' ``P`` as one more root. A stage without routed
layers passes the vectors on unchanged.

The loss of a step is the mean over its micro-batches of each one's router loss (the mean over
all ``num_chunks`` of the global batch, every replica's): with one micro-batch, exactly what the
Hugging Face model adds to its loss for that batch; with several, the step does not grow with
the number of micro-batches, as a sum over gradient-accumulation steps would.
"""
from __future__ import annotations

import torch

from models.moe import aux_scale

Key = tuple


class RouterLoss:
    """One rank's share of the router loss. ``stages``: this rank's stages (each has a
    ``routing``); ``routed_layers``: the model's routed layers (all stages); ``microbatches``: of
    the global batch."""

    def __init__(self, stages: dict, num_experts: int, coef: float, routed_layers: int, microbatches: int,
                 device: torch.device):
        self.stages, self.E, self.coef = stages, num_experts, coef
        self.routed_layers, self.microbatches, self.device = routed_layers, microbatches, device
        self.reset()

    def reset(self) -> None:
        """Start an iteration: nothing carried."""
        self.fwd: dict[Key, torch.Tensor | tuple] = {}   # (stage, mb, seg) -> [T, P] its forward starts from
        self.bwd: dict[Key, torch.Tensor | tuple] = {}   # (stage, mb, seg) -> T of the whole model
        self.totals: dict[Key, torch.Tensor] = {}        # last stage: (mb, seg) -> its [T, P]
        self.losses: list[torch.Tensor] = []

    # --- forward ----------------------------------------------------------------------------
    def forward_done(self, key: Key, last: bool, tokens: int) -> None:
        """After stage ``key[0]``'s forward of micro-batch ``key[1]``: its [T, P] added to what it
        got, handed to the next stage (or, last, kept with the micro-batch's loss value)."""
        s, m, seg = key
        carried = self._take(self.fwd, key) if s > 0 else torch.zeros(2 * self.E, device=self.device)
        st = self.stages[s].routing.stats.get(key)
        if st is not None:
            carried = carried + torch.cat([st.counts, st.probs_sum().detach()])
        if not last:
            self.fwd[(s + 1, m, seg)] = carried
            return
        self.totals[(m, seg)] = carried
        rows = self.routed_layers * tokens
        counts, probs = carried[: self.E], carried[self.E:]
        self.losses.append(self.coef * self.E * torch.dot(counts / rows, probs / rows) / self.microbatches)

    # --- backward ---------------------------------------------------------------------------
    def roots(self, key: Key, last: bool, tokens: int, loss_scale: float) -> tuple[list, list]:
        """The (root, gradient) pairs stage ``key[0]``'s backward adds: its routed layers'
        summed probabilities against ``coef * E / N^2 * T`` (times the loss scale, over the
        micro-batches); T handed on to the previous stage."""
        s, m, seg = key
        counts = self.totals.pop((m, seg))[: self.E] if last else self._take(self.bwd, key)
        if s > 0:
            self.bwd[(s - 1, m, seg)] = counts
        st = self.stages[s].routing.stats.get(key)  # released after the backward (its recomputes replay)
        if st is None or not st.probs:
            return [], []
        scale = aux_scale(self.coef, self.E, self.routed_layers * tokens) * loss_scale / self.microbatches
        return [st.probs_sum()], [counts * scale]

    # --- between ranks ----------------------------------------------------------------------
    def send_forward(self, p2p, key: Key, dst: int):
        """With SEND_F of stage ``key[0]``: the [T, P] of the next stage's forward."""
        t = self._take(self.fwd, (key[0] + 1, key[1], key[2]))
        return p2p.send(t, dst), t

    def recv_forward(self, p2p, key: Key, src: int) -> None:
        """With RECV_F of stage ``key[0]``: the [T, P] its forward starts from."""
        buf = torch.empty(2 * self.E, device=self.device)
        self.fwd[key] = (buf, p2p.recv(buf, src))

    def send_backward(self, p2p, key: Key, dst: int):
        t = self._take(self.bwd, (key[0] - 1, key[1], key[2]))
        return p2p.send(t, dst), t

    def recv_backward(self, p2p, key: Key, src: int) -> None:
        buf = torch.empty(self.E, device=self.device)
        self.bwd[key] = (buf, p2p.recv(buf, src))

    @staticmethod
    def _take(table: dict, key: Key) -> torch.Tensor:
        value = table.pop(key)
        if isinstance(value, tuple):  # received: wait for it (device-side with NCCL)
            value[1].wait()
            return value[0]
        return value


__all__ = ["RouterLoss"]
