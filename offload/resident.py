"""A resident stage (no offload, or one of the ``resident_stages``): its weights, gradients, fp32
masters and AdamW state stay on the device for the whole run; LOAD, DROP and OFFLOAD_GRADS move
nothing, and its step is the fused CUDA AdamW, on the main thread.

With 16-bit compute it keeps no fp32 copy of its gradient: the norm and the step convert the
compute-dtype gradient ``MASTER_SLICE_NUMEL`` elements at a time (the values the copy would
hold), so the stage costs 16 bytes a parameter on the device instead of 20, and the plan keeps
more stages resident (each one an optimizer step less for the host after the clipping norm).
The copy stays where something reads it whole: the replicas' sum (``summed``) and the non-fused
kernel."""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from offload import loader, owners

if TYPE_CHECKING:
    from offload.loader import StepProgress
    from offload.store import StageStore
    from offload.streams import Clock


class Resident:
    """The ``Residency`` of a stage that stays on the device. Its fields are written by the thread
    that made it (the store's), as the store's are."""

    offload = False
    delayed = False
    grads_event = None  # no gradient goes to the host

    def __init__(self, summed: bool = False):
        """``summed``: the gradient is summed over data-parallel replicas, in fp32 (``reduce_grads``)."""
        self._owner = threading.current_thread()
        self.summed = summed
        self.work: torch.Tensor | None = None  # nothing crosses PCIe
        self.dev: torch.Tensor | None = None   # from ``place`` on: the compute copy (the masters in fp32)
        self.grad: torch.Tensor | None = None  # from ``place`` on: its gradient (``master_grad`` in fp32)
        self.loaded = False

    def __setattr__(self, name: str, value) -> None:
        owners.check_field_write(self.__dict__.get("_owner"), "Resident", name)
        object.__setattr__(self, name, value)

    def master(self, store: "StageStore") -> torch.Tensor:
        return torch.empty(store.numel, dtype=torch.float32, device=store.device)

    def master_grad(self, store: "StageStore") -> torch.Tensor | None:
        """The fp32 gradient next to the masters; None with 16-bit compute, where nothing reads
        it whole (module docstring)."""
        if store.dtype != torch.float32 and store.fused and not self.summed:
            return None
        return torch.zeros(store.numel, dtype=torch.float32, device=store.device)

    def place(self, store: "StageStore") -> None:
        # device copies live for the whole run; with fp32 compute they are the masters themselves
        same_dtype = store.dtype == torch.float32
        self.dev = store.master if same_dtype else store.master.to(store.dtype)
        self.grad = store.master_grad if same_dtype else torch.zeros(store.numel, dtype=store.dtype,
                                                                     device=store.device)
        store.bind(self.dev, self.grad)
        self.loaded = True

    def load(self, store: "StageStore") -> Future:
        return loader.done(None)

    def before_compute(self, store: "StageStore", backward: bool, clock: "Clock | None") -> None:
        pass  # the weights and the gradient buffer are always there

    def drop(self, store: "StageStore") -> None:
        pass

    def offload_grads(self, store: "StageStore", norm: bool = False) -> None:
        pass

    def take_norm(self) -> Future | None:
        return None  # the norm is taken when NORM asks (``StageStore.grad_sq_norm``)

    def grads_ready(self, store: "StageStore", grads_event=None) -> torch.Tensor:
        """The gradient the norm and the step read: the fp32 copy next to the masters, the device
        gradient copied in (not over the replicas' sum ``reduce_grads`` put there; with fp32
        compute it is the same buffer); without a copy, the device gradient itself, which they
        convert a chunk at a time."""
        if store.master_grad is None:
            return self.grad
        if self.grad is not store.master_grad and not store.grads_summed:
            store.master_grad.copy_(self.grad)
        return store.master_grad

    def state_device(self, store: "StageStore") -> torch.device:
        return store.device  # beside the masters

    def step_here(self, store: "StageStore", lr: float, clip_coef: float | None) -> Future | None:
        return None  # the store's step, on this thread (no workers for a resident stage)

    def before_step(self, store: "StageStore", fused: bool) -> "StepProgress | None":
        return None  # no load streams behind a device step

    def after_step(self, store: "StageStore", progress: "StepProgress | None") -> None:
        """The compute copy from the stepped masters, and the gradients zeroed for the next iteration."""
        if self.dev is not store.master:
            self.dev.copy_(store.master)
        self.discard(store)

    def wait_refresh(self) -> None:
        pass  # no compute copy is refreshed on another thread

    def discard(self, store: "StageStore") -> None:
        self.grad.zero_()
        if store.master_grad is not None and store.master_grad is not self.grad:
            store.master_grad.zero_()


__all__ = ["Resident"]
