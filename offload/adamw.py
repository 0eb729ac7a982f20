"""AdamW over a stage's flat fp32 masters: the optimizer's groups as leaf views, the fused kernel
run chunk by chunk so that a load can stream behind it (``step_chunks``: bit for bit the whole
step), and ZeRO-1 over data-parallel peers: this peer's range of the flat parameters steps here,
the peers exchange their updated ranges (``ShardPeers.exchange``, on the optimizer thread), and a
checkpoint gathers the state into the layout of an unsharded store."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from offload import slices
from offload.loader import StepProgress


@dataclass(frozen=True)
class OptimSettings:
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    fused: bool | None = None  # None: torch's default for the device


class ShardPeers(Protocol):
    """The D data-parallel peers of a stage that share its CPU optimizer step (``pipeline.run.replicas``)."""

    @property
    def index(self) -> int: ...

    def bounds(self, numel: int) -> list[tuple[int, int]]:
        """Each peer's range of the flat parameters, in peer order (this one's is ``[index]``)."""
        ...

    def exchange(self, flat: torch.Tensor) -> None:
        """Collective: every peer's range of ``flat`` from its owner to every peer, in place."""
        ...

    @property
    def shared(self) -> bool:
        """The peers map the stage's host buffers together (``offload.shared``): one copy of the
        masters and of ``work``, and each peer's gradient readable by the others."""
        ...

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Collective: a buffer every peer maps (shared), else None."""
        ...

    def grad_buffer(self, numel: int) -> torch.Tensor | None:
        """Collective: this peer's fp32 gradient buffer, zeroed, that the others map too (shared), else None."""
        ...

    def sum_grads(self, lo: int, hi: int) -> torch.Tensor:
        """Collective, shared: once every peer's gradient has landed (each calls it after its own
        has), ``[lo, hi)`` of this peer's gradient buffer replaced by the sum over the peers; returned."""
        ...

    def stepped(self, master: torch.Tensor) -> None:
        """Collective, after every peer's step of its range: the masters whole again on every peer
        (shared: a barrier; else ``exchange``)."""
        ...


class ChunkSource(Protocol):
    """Where ``FlatAdamW.step_chunks`` finds each chunk's fp32 masters and gradient, and where the
    stepped masters go (flat element ranges of the stage)."""

    def take(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The masters (updated in place by the kernel) and the fp32 gradient of ``[lo, hi)``."""
        ...

    def put(self, lo: int, hi: int, master: torch.Tensor) -> None:
        """After the kernel: ``master``, what ``take`` gave, back where the masters live."""
        ...


class ConvertedGrad:
    """The masters in place and a compute-dtype gradient converted to fp32 a chunk at a time (a
    transient of one chunk, the values an fp32 copy would hold): a resident stage's step."""

    def __init__(self, master: torch.Tensor, grad: torch.Tensor):
        self.master, self.grad = master, grad

    def take(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.master[lo:hi], self.grad[lo:hi].float()

    def put(self, lo: int, hi: int, master: torch.Tensor) -> None:
        pass  # stepped in place


# Elements of a flat gradient whose squares one thread sums in fp32 (``squared_norm``): below
# torch's grain size (32768), so a lone block is never split between threads either.
NORM_BLOCK = 2**14


def squared_norm(flat: torch.Tensor) -> torch.Tensor:
    """Sum of the squares of a flat gradient (the gradient norm that clipping needs), as fp32.

    Blocks of ``NORM_BLOCK`` elements are each summed by one thread, then their sums in float64:
    the same order for any thread count (the offloaded stages' norms come from the optimizer
    thread's cores, the resident ones' from torchrun's one, and both must clip alike), and
    accurate. ``vector_norm`` over a whole stage sums serially in fp32: a core's ~12 GB/s
    (80 ms for a 250M-parameter stage, ahead of the steps that wait for clipping), and at 30M
    elements 0.3% short of the float64 sum. A gradient in the compute dtype (a resident stage
    that keeps no fp32 copy) is converted ``MASTER_SLICE_NUMEL`` elements at a time, in whole
    blocks: the same blocks, so the same sum as of its fp32 copy."""
    n = flat.numel() - flat.numel() % NORM_BLOCK
    per = max(n, 1) if flat.dtype == torch.float32 else \
        max(NORM_BLOCK, slices.MASTER_SLICE_NUMEL // NORM_BLOCK * NORM_BLOCK)
    blocks = [torch.linalg.vector_norm(flat[lo:min(n, lo + per)].float().view(-1, NORM_BLOCK), dim=1)
              for lo in range(0, n, per)]
    tail = torch.linalg.vector_norm(flat[n:].float()).view(1)
    return torch.cat([*blocks, tail]).double().square().sum().float()


class FlatAdamW:
    """AdamW over ``master`` (flat fp32), with gradients in ``master_grad``: one group per
    (leaf ranges, weight decay) of ``group_bounds`` (the tied matrix, the decayed matrices, the
    undecayed 1-D weights), each leaf a view of the masters whose ``.grad`` is the same view of
    the gradient. Without ``master_grad`` (a resident stage that keeps no fp32 gradient) the
    leaves have none: ``step_chunks`` is given the gradient to convert. ``shard``: only this
    peer's range of the flat parameters is stepped (and has AdamW state) here. ``state_device``:
    where the moments live when not beside the masters (a device-stepped offloaded stage's).
    Built, like the store, on the thread that owns the store."""

    def __init__(self, master: torch.Tensor, master_grad: torch.Tensor | None,
                 group_bounds: list[tuple[tuple[int, ...], float]], optim: OptimSettings,
                 shard: ShardPeers | None = None, state_device: torch.device | None = None):
        self.master, self.master_grad, self.group_bounds, self.shard = master, master_grad, group_bounds, shard
        self.state_device = state_device or master.device
        self.numel = master.numel()
        self.shard_range = shard.bounds(self.numel)[shard.index] if shard is not None else (0, self.numel)
        groups = []
        for wd, ranges in self.leaf_ranges(*self.shard_range):
            leaves = []
            for lo, hi in ranges:
                leaf = self.master[lo:hi].requires_grad_()
                leaf.grad = self.master_grad[lo:hi] if self.master_grad is not None else None
                leaves.append(leaf)
            groups.append({"params": leaves, "weight_decay": wd})
        if not groups:  # nothing to train here (a LoRA stage without adapters): one empty leaf
            leaf = self.master[0:0].requires_grad_()
            leaf.grad = self.master_grad[0:0] if self.master_grad is not None else None
            groups.append({"params": [leaf], "weight_decay": 0.0})
        self.optimizer = torch.optim.AdamW(groups, lr=0.0, betas=optim.betas, eps=optim.eps, fused=optim.fused)
        if optim.fused:
            self.init_state()

    def leaf_ranges(self, lo_s: int, hi_s: int) -> list[tuple[float, list[tuple[int, int]]]]:
        """The optimizer's groups (weight decay, leaf ranges of the flat master) within
        ``[lo_s, hi_s)``: the tied matrix, the decayed matrices, the undecayed 1-D weights;
        groups with no leaf there are left out."""
        out = []
        for bounds, wd in self.group_bounds:
            ranges = [(max(lo, lo_s), min(hi, hi_s)) for lo, hi in zip(bounds, bounds[1:])]
            ranges = [(lo, hi) for lo, hi in ranges if hi > lo]
            if ranges:
                out.append((wd, ranges))
        return out

    def leaf_offset(self, leaf: torch.Tensor) -> int:
        """Where an optimizer leaf (a view of the flat master) starts in it."""
        return leaf.storage_offset() - self.master.storage_offset()

    def init_state(self) -> None:
        """AdamW's moments made (their pages touched) now, on this thread, instead of lazily in
        the first step on the optimizer thread: host memory is taken at start-up, not in the
        middle of training. torch's AdamW uses a state it finds (the fused kernel's step is a
        float32 tensor next to the parameter, as AdamW itself would make it)."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                dev = self.state_device
                self.optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=dev),
                                           "exp_avg": torch.zeros_like(p, device=dev),
                                           "exp_avg_sq": torch.zeros_like(p, device=dev)}

    def step_chunks(self, lr: float, grad_scale: torch.Tensor | None, progress: StepProgress | None = None,
                    source: ChunkSource | None = None) -> None:
        """What ``optimizer.step()`` does with ``fused=True`` (the same kernel, arguments and
        state; elementwise, so the result is bit for bit the same), ``MASTER_SLICE_NUMEL``
        elements of a leaf at a time, telling ``progress`` how far the flat master is written.
        ``source``: where each chunk's masters and gradient come from and the masters go back to
        (``ChunkSource``; default: the masters and the leaves' gradients in place)."""
        done = 0
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            beta1, beta2 = group["betas"]
            for leaf in group["params"]:
                state = self.optimizer.state[leaf]
                n, off = leaf.numel(), self.leaf_offset(leaf)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                for lo in range(0, n, slices.MASTER_SLICE_NUMEL):
                    hi = min(n, lo + slices.MASTER_SLICE_NUMEL)
                    p, g = (leaf.detach()[lo:hi], leaf.grad[lo:hi]) if source is None else \
                        source.take(off + lo, off + hi)
                    torch._fused_adamw_([p], [g], [m[lo:hi]], [v[lo:hi]], [], [state["step"]],
                                        amsgrad=False, lr=lr, beta1=beta1, beta2=beta2,
                                        weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
                                        grad_scale=grad_scale, found_inf=None)
                    if source is not None:
                        source.put(off + lo, off + hi, p)
                    if progress is not None:
                        progress.advance(done + hi)
                done += n

    def gather_state(self) -> dict:
        """Collective over the peers: the whole stage's AdamW state, in the layout of an unsharded
        store's ``state_dict``."""
        flat = {k: torch.zeros(self.numel, dtype=torch.float32) for k in ("exp_avg", "exp_avg_sq")}
        step = None
        for group in self.optimizer.param_groups:
            for leaf in group["params"]:
                lo, st = self.leaf_offset(leaf), self.optimizer.state[leaf]
                step = st["step"]
                for k in flat:
                    flat[k][lo:lo + leaf.numel()].copy_(st[k])
        for k in flat:
            self.shard.exchange(flat[k])
        template = {k: v for k, v in self.optimizer.state_dict()["param_groups"][0].items()
                    if k not in ("params", "weight_decay")}
        state, groups, i = {}, [], 0
        for wd, ranges in self.leaf_ranges(0, self.numel):
            ids = []
            for lo, hi in ranges:
                state[i] = {"step": step.clone(), **{k: v[lo:hi].clone() for k, v in flat.items()}}
                ids.append(i)
                i += 1
            groups.append({**template, "weight_decay": wd, "params": ids})
        return {"state": state, "param_groups": groups}

    def load_state(self, state: dict) -> None:
        """This peer's range of ``state`` (an unsharded store's layout) into its AdamW state."""
        flat = {k: torch.zeros(self.numel, dtype=torch.float32) for k in ("exp_avg", "exp_avg_sq")}
        i, step = 0, None
        for _, ranges in self.leaf_ranges(0, self.numel):
            for lo, hi in ranges:
                st = state["state"][i]
                step = st["step"]
                for k in flat:
                    flat[k][lo:hi].copy_(st[k])
                i += 1
        for group in self.optimizer.param_groups:
            for leaf in group["params"]:
                lo, st = self.leaf_offset(leaf), self.optimizer.state[leaf]
                st["step"] = step.clone().to(dtype=torch.float32, device=self.state_device)
                for k in flat:
                    st[k].copy_(flat[k][lo:lo + leaf.numel()])


__all__ = ["ChunkSource", "ConvertedGrad", "FlatAdamW", "NORM_BLOCK", "OptimSettings", "ShardPeers",
           "squared_norm"]
