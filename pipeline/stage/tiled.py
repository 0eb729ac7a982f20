"""Tiled MLPs: a long row's MLP run in tiles of tokens, each recomputed in the backward.

At 128K tokens one of a Llama-3B MLP's four intermediate tensors (gate, up, their activation and
product, each ``intermediate_size`` wide) is 2.3 GB in bf16, and a layer's backward holds them
all plus three gradients of that width. The MLP acts on each token alone, so it can run on
``tokens`` of them at a time: in training every tile runs under non-reentrant checkpointing (it
keeps only its input, a view of the MLP's input, which the untiled MLP's projections keep too)
and is recomputed alone in the backward; without a graph the tiles simply run one after another.
The intermediates then exist for one tile at a time, in the forward and in the backward. The
arithmetic per token is the MLP's own (Snowflake's Arctic Long Sequence Training tiles MLPs so).

The wrap replaces the forward of the layer's ``mlp`` module, so parameter names do not change.
Mixture-of-experts layers are not tiled: their routing replay (``models.moe``) is recorded per
pass, and a tile is a part of a pass.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class TiledForward:
    """An MLP's forward over tiles of ``tokens`` tokens (of every row of the batch, flattened)."""

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor], tokens: int):
        if tokens < 1:
            raise ValueError(f"tokens per MLP tile must be >= 1, got {tokens}")
        self.forward, self.tokens = forward, tokens

    def tiles(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(x.reshape(-1, x.shape[-1]).split(self.tokens))

    def run_tile(self, tile: torch.Tensor) -> torch.Tensor:
        # with a graph: only the tile's input is kept; its intermediates are made again in the backward
        return checkpoint(self.forward, tile, use_reentrant=False) if torch.is_grad_enabled() else self.forward(tile)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[:-1].numel() <= self.tokens:
            # one tile, still checkpointed: tiling promises the plan that no intermediate is kept,
            # and a fused last stage would otherwise keep every layer's (4-bit 70B at 4K-token rows,
            # shorter than one tile: 4.4 GiB of them on an H200, past the plan's peak)
            return self.run_tile(x)
        out = torch.cat([self.run_tile(t) for t in self.tiles(x)])
        return out.reshape(*x.shape[:-1], out.shape[-1])


def tile_mlps(layers: Iterable[nn.Module], tokens: int) -> None:
    """Run the ``mlp`` of each decoder layer in ``layers`` in tiles of ``tokens`` tokens."""
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is None:
            raise ValueError(f"{type(layer).__name__} has no mlp module to tile")
        forward = mlp.forward
        if isinstance(forward, TiledForward):
            forward = forward.forward
        mlp.forward = TiledForward(forward, tokens)


__all__ = ["TiledForward", "tile_mlps"]
