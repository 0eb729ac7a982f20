"""A resident stage (no offload, or one of the ``resident_stages``): its weights, gradients, fp32
masters and AdamW state stay on the device for the whole run; LOAD, DROP and OFFLOAD_GRADS move
nothing, and its step is the fused CUDA AdamW, on the main thread."""
from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from offload import loader

if TYPE_CHECKING:
    from offload.loader import StepProgress
    from offload.store import StageStore


class Resident:
    """The ``Residency`` of a stage that stays on the device."""

    offload = False
    delayed = False

    def master(self, store: "StageStore") -> torch.Tensor:
        return torch.empty(store.numel, dtype=torch.float32, device=store.device)

    def master_grad(self, store: "StageStore") -> torch.Tensor:
        return torch.zeros(store.numel, dtype=torch.float32, device=store.device)

    def place(self, store: "StageStore") -> None:
        # device copies live for the whole run; with fp32 compute they are the masters themselves
        same_dtype = store.dtype == torch.float32
        store.work = None
        store.dev = store.master if same_dtype else store.master.to(store.dtype)
        store.grad = store.master_grad if same_dtype else torch.zeros(store.numel, dtype=store.dtype,
                                                                      device=store.device)
        store._bind(store.dev, store.grad)
        store.loaded = True

    def load(self, store: "StageStore") -> Future:
        return loader.done(None)

    def drop(self, store: "StageStore") -> None:
        pass

    def offload_grads(self, store: "StageStore", norm: bool = False) -> None:
        pass

    def grads_ready(self, store: "StageStore", grads_event=None) -> torch.Tensor:
        """The fp32 gradient next to the masters: the device gradient copied in (not over the
        replicas' sum ``reduce_grads`` put there; with fp32 compute it is the same buffer)."""
        if store.grad is not store.master_grad and not store._grads_summed:
            store.master_grad.copy_(store.grad)
        return store.master_grad

    def progress(self, store: "StageStore", fused: bool) -> "StepProgress | None":
        return None  # no load streams behind a device step

    def before_step(self, store: "StageStore") -> None:
        pass

    def after_step(self, store: "StageStore", progress: "StepProgress | None") -> None:
        """The compute copy from the stepped masters, and the gradients zeroed for the next iteration."""
        if store.dev is not store.master:
            store.dev.copy_(store.master)
        store.grad.zero_()
        if store.master_grad is not store.grad:
            store.master_grad.zero_()

    def discard(self, store: "StageStore") -> None:
        store.grad.zero_()
        if store.master_grad is not store.grad:
            store.master_grad.zero_()
        store._grads_summed = False


__all__ = ["Resident"]
