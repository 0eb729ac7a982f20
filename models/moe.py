"""The routers of a mixture-of-experts stage: the same routing in a recompute as in the forward,
and the statistics of Hugging Face's router (load-balancing) loss.

**Routing replay.** Activation checkpointing and ``activation_offload`` run a stage's forward
again before its backward. A token routed to another expert the second time (a near tie that
rounds the other way on a GPU) would make the backward differentiate a function the forward
never computed. Each router's top-k indices of a pass are recorded under the pass's key
(stage, micro-batch, segment), set by the executor around every forward, backward and
recompute (``Routing.pass_``); a later pass under the same key routes as recorded, and every
pass takes its routing weights from ``MoeSpec.scores`` (bitwise what the router computes), so a
forward and its recompute run the same operations, as checkpointing requires.

**The router loss**, as Hugging Face's ``load_balancing_loss_func`` computes it for one forward
over every routed layer of the model (here: one micro-batch)::

    aux = E * sum_e (T_e / N) * (P_e / N)

``T_e``: how often expert e is among a token's top-k of ``softmax(logits)``, summed over the
routed layers (no gradient); ``P_e``: the softmax probabilities of e summed over tokens and
layers; ``N``: tokens times routed layers. It couples every layer of the model, on every stage:
the executor sends a micro-batch's partial sums (T, P) forward with its activations, and the
last stage's totals back with its gradients, so each stage's backward adds the gradient of its
own layers' ``P`` (``coef * E / N^2 * T``) exactly (``Routing.stats``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from models.spec import ArchSpec, submodule

Key = tuple


@dataclass
class RouterStats:
    """One pass's router statistics on this stage: the top-k counts per expert (summed over
    its routed layers and tokens) and each layer's summed probabilities (with a graph)."""

    counts: torch.Tensor
    rows: int = 0
    probs: dict[int, torch.Tensor] = field(default_factory=dict)

    def probs_sum(self) -> torch.Tensor:
        return torch.stack(list(self.probs.values())).sum(0)


class Routing:
    """The routed layers of one stage (``layers``: decoder layer index -> module)."""

    def __init__(self, spec: ArchSpec, config, layers: dict[int, nn.Module]):
        self.moe = spec.moe
        self.routers: dict[int, nn.Module] = {}
        if self.moe is not None:
            self.routers = {i: submodule(layer, self.moe.router) for i, layer in layers.items()
                            if self.moe.sparse(config, i)}
            self.num_experts, self.top_k = self.moe.experts(config), self.moe.top_k(config)
            self.coef = self.moe.aux_coef(config)
        self.key: Key | None = None
        self.routes: dict[tuple[Key, int], torch.Tensor] = {}
        self.stats: dict[Key, RouterStats] = {}
        for i, router in self.routers.items():
            router.forward = self._wrap(i, router, router.forward)

    @property
    def aux(self) -> bool:
        """Whether the router loss is part of the training loss."""
        return bool(self.routers) and self.coef > 0

    @contextlib.contextmanager
    def pass_(self, key: Key | None):
        """Record (first pass) or replay (later passes) the routing under ``key``; None: neither
        (evaluation, and forwards nobody differentiates)."""
        before, self.key = self.key, key
        try:
            yield
        finally:
            self.key = before

    def release(self, key: Key) -> RouterStats | None:
        """Forget ``key``'s routing (its backward is done); returns its statistics."""
        for i in self.routers:
            self.routes.pop((key, i), None)
        return self.stats.pop(key, None)

    def _wrap(self, i: int, router: nn.Module, forward):
        def routed(hidden_states):
            logits, scores, indices = forward(hidden_states)
            if self.key is None:
                return logits, scores, indices
            recorded = self.routes.get((self.key, i))
            if recorded is None:
                self.routes[(self.key, i)] = indices.detach()
            else:
                indices = self.replay(i, recorded)
            scores = self.moe.scores(router, logits, indices)
            if self.aux:
                self._note(i, logits, first=recorded is None)
            return logits, scores, indices

        return routed

    def replay(self, layer: int, recorded: torch.Tensor) -> torch.Tensor:
        """The routing a later pass of ``layer`` under the same key takes: the first pass's."""
        return recorded

    def _note(self, i: int, logits: torch.Tensor, first: bool) -> None:
        """One routed layer's share of the router loss, as ``load_balancing_loss_func`` reads
        its logits: the softmax in their dtype, the top-k of it counted, the probabilities
        summed in float32. The same operations on every pass (a checkpoint's recompute must save
        what its forward saved); the counts come from the first pass, the probabilities from
        the first pass that has a graph (``activation_offload`` forwards without one)."""
        probs = torch.softmax(logits, dim=-1)
        chosen = torch.topk(probs, self.top_k, dim=-1).indices
        summed = probs.float().sum(dim=0)
        st = self.stats.get(self.key)
        if st is None:
            st = self.stats[self.key] = RouterStats(torch.zeros(self.num_experts, device=logits.device))
        if first:
            st.counts += torch.bincount(chosen.reshape(-1), minlength=self.num_experts).float()
            st.rows += probs.shape[0]
        held = st.probs.get(i)
        if held is None or (held.grad_fn is None and summed.grad_fn is not None):
            st.probs[i] = summed


def aux_scale(coef: float, num_experts: int, rows: int) -> float:
    """d aux_loss / d P_e = coef * E / N^2 * T_e: the factor of T."""
    return coef * num_experts / rows ** 2


__all__ = ["RouterStats", "Routing", "aux_scale"]
