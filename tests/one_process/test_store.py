"""offload/ on its own (store, residencies, AdamW, loader): the chunked CPU step is AdamW bit for bit, a load from the
masters streams behind a running step, and a failed step reaches the compute that needs it."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from offload import owners, slices
from offload.adamw import NORM_BLOCK, OptimSettings, squared_norm
from offload.loader import Workers
from offload.store import StageStore, make_store
from offload.streams import BufferPool, Streams
from tests.helpers.reference import assert_same_training, in_process_trainer, trainer_masters
from tests.helpers.runs import tiny_cfg

CPU = torch.device("cpu")


def _module(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(13, 29), nn.LayerNorm(29), nn.Linear(29, 7))


def _store(offload: bool, dtype=torch.float32, workers=None) -> StageStore:
    optim = OptimSettings(weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, fused=True)
    return make_store(_module(), device=CPU, compute_dtype=dtype, offload=offload, optim=optim,
                      streams=Streams(CPU), pool=BufferPool(CPU), workers=workers)


def _set_grads(stores, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(stores[0].numel, generator=g)
    for st in stores:
        st.master_grad.copy_(grad)


@pytest.mark.parametrize("chunk", [64, 192, 1 << 20])
def test_chunked_step_is_fused_adamw_bit_for_bit(monkeypatch, chunk):
    """The offloaded stage's step (``FlatAdamW.step_chunks``, chunk by chunk) against the resident
    one (``optimizer.step()`` with ``fused=True``): masters and AdamW state identical, with the
    clip coefficient folded in and without, over several steps, both parameter groups.
    (Chunks must start at multiples of the kernel's vector width: an element that falls in a
    scalar tail is rounded differently, chunks of 5 elements differ in the last bit.)"""
    monkeypatch.setattr(slices, "MASTER_SLICE_NUMEL", chunk)
    chunked, whole = _store(offload=True), _store(offload=False)
    for i, coef in enumerate([0.37, None, 0.81]):
        _set_grads([chunked, whole], seed=i)
        chunked.step(1e-2, coef).result()
        whole.step(1e-2, coef).result()
    _assert_same_state(chunked, whole)
    assert not torch.equal(chunked.master, _store(offload=False).master)  # it did train


def _assert_same_state(a: StageStore, b: StageStore) -> None:
    """Bit for bit the same masters and AdamW state."""
    assert torch.equal(a.master, b.master)
    for ga, gb in zip(a.optimizer.param_groups, b.optimizer.param_groups):
        for pa, pb in zip(ga["params"], gb["params"]):
            sa, sb = a.optimizer.state[pa], b.optimizer.state[pb]
            assert all(torch.equal(sa[k], sb[k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def _bf16_resident_pair():
    """Two resident bf16 stores of one module: one keeps an fp32 copy of its gradient (as with
    replicas), the other converts its bf16 gradient a chunk at a time."""
    optim = OptimSettings(weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, fused=True)
    return [make_store(_module(), device=CPU, compute_dtype=torch.bfloat16, offload=False, summed=summed,
                       optim=optim, streams=Streams(CPU), pool=BufferPool(CPU)) for summed in (True, False)]


@pytest.mark.parametrize("chunk", [64, 192, 1 << 20])
def test_resident_bf16_step_without_an_fp32_gradient_is_the_same(monkeypatch, chunk):
    """A resident bf16 stage without an fp32 gradient (the norm and the step convert the bf16 one a
    chunk at a time) against one with it: the same squared norm and, over several steps with
    and without clipping, the same masters, compute copy and AdamW state, bit for bit."""
    monkeypatch.setattr(slices, "MASTER_SLICE_NUMEL", chunk)
    copied, converted = _bf16_resident_pair()
    assert copied.master_grad is not None and converted.master_grad is None
    for i, coef in enumerate([0.37, None, 0.81]):
        g = torch.randn(copied.numel, generator=torch.Generator().manual_seed(i)).bfloat16()
        for st in (copied, converted):
            st.grad.copy_(g)
        assert torch.equal(copied.grad_sq_norm(), converted.grad_sq_norm())
        copied.step(1e-2, coef).result()
        converted.step(1e-2, coef).result()
        assert not converted.grad.any()  # zeroed for the next iteration's accumulation
    assert torch.equal(copied.master, converted.master) and torch.equal(copied.dev, converted.dev)
    for a, b in zip(copied.optimizer.param_groups, converted.optimizer.param_groups):
        for pa, pb in zip(a["params"], b["params"]):
            sa, sb = copied.optimizer.state[pa], converted.optimizer.state[pb]
            assert all(torch.equal(sa[k], sb[k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def test_resident_bf16_step_from_misplaced_chunks_is_caught(monkeypatch):
    """Mutation: a chunked step that takes each leaf's gradient from the start of the flat
    gradient (its offset forgotten) steps the second leaf with the first one's gradient."""
    monkeypatch.setattr(slices, "MASTER_SLICE_NUMEL", 64)
    copied, converted = _bf16_resident_pair()
    g = torch.randn(copied.numel, generator=torch.Generator().manual_seed(0)).bfloat16()
    for st in (copied, converted):
        st.grad.copy_(g)
    monkeypatch.setattr(converted.adamw, "leaf_offset", lambda leaf: 0)
    copied.step(1e-2, 0.5).result()
    converted.step(1e-2, 0.5).result()
    assert not torch.equal(copied.master, converted.master)


def test_load_copies_each_chunk_as_the_step_writes_it(monkeypatch):
    """With the step still running, the loader thread copies chunk by chunk behind it: the
    load has copied the first chunks before the step is done, and ends with the new weights."""
    monkeypatch.setattr(slices, "MASTER_SLICE_NUMEL", 64)
    workers = Workers(ThreadPoolExecutor(1), CPU)
    st = _store(offload=True, workers=workers)
    copied, step_done = [], threading.Event()
    real_kernel = torch._fused_adamw_

    def slow_kernel(*args, **kw):
        time.sleep(0.05)
        return real_kernel(*args, **kw)

    real_copy_chunk = st.residency.copy_chunk

    def copy_chunk(store, src, dev, lo, hi, timed):
        copied.append((hi, step_done.is_set()))
        real_copy_chunk(store, src, dev, lo, hi, timed)

    monkeypatch.setattr(torch, "_fused_adamw_", slow_kernel)
    st.residency.copy_chunk = copy_chunk
    _set_grads([st], seed=0)
    step = st.step(1e-2, None)
    step.add_done_callback(lambda _: step_done.set())
    span = st.load().result()
    st.before_compute(backward=False)
    assert len(copied) == -(-st.numel // 64) >= 3
    assert not copied[0][1], "the first chunk was copied only after the whole step"
    assert span.step_done is not None
    assert torch.equal(st.dev, st.master)
    workers.optimizer.shutdown()
    workers.loader.shutdown()


def test_failed_step_reaches_the_compute_instead_of_hanging(monkeypatch):
    monkeypatch.setattr(slices, "MASTER_SLICE_NUMEL", 64)
    workers = Workers(ThreadPoolExecutor(1), CPU)
    st = _store(offload=True, workers=workers)
    gate = threading.Event()
    calls = []

    def failing_kernel(*args, **kw):
        calls.append(1)
        gate.wait(5)
        if len(calls) == 2:
            raise RuntimeError("boom in the optimizer")

    monkeypatch.setattr(torch, "_fused_adamw_", failing_kernel)
    _set_grads([st], seed=0)
    st.step(1e-2, None)
    st.load()  # issued while the step runs: handed to the loader thread
    gate.set()
    with pytest.raises(RuntimeError, match="boom in the optimizer"):
        st.before_compute(backward=False)
    workers.optimizer.shutdown()
    workers.loader.shutdown()


def _on_threads(fn, counts) -> dict:
    """``fn()`` on a fresh thread per count, each with that many torch threads (its own pool
    only, as pin_current_thread sets the optimizer thread's): {count: result}."""
    results = {}

    def take(n: int) -> None:
        torch.set_num_threads(n)
        results[n] = fn()

    for n in counts:
        t = threading.Thread(target=take, args=(n,))
        t.start()
        t.join(timeout=60)
    return results


def test_squared_norm_does_not_depend_on_the_thread_count():
    """The offloaded stage's norm is taken on the optimizer thread (the rank's share of the
    cores), the resident one's on the main thread (torchrun's ``OMP_NUM_THREADS=1``): the sum
    must not be split by thread, else clipping differs in the last bit between the two (with
    ``torch.dot``, MKL's, it did: the bf16 comparison below failed under ``OMP_NUM_THREADS=1``)."""
    torch.manual_seed(0)
    st = make_store(nn.Linear(300, 400), device=CPU, compute_dtype=torch.float32, offload=False,
                    optim=OptimSettings(fused=True), streams=Streams(CPU), pool=BufferPool(CPU))
    st.master_grad.copy_(torch.randn(st.numel) * torch.rand(st.numel) * 10)  # 120k: above torch's grain
    norms = _on_threads(st.squared_grad_norm, (1, 2, 3, 4))
    assert len(norms) == 4 and all(torch.equal(norms[1], v) for v in norms.values()), norms
    assert torch.allclose(norms[1], torch.dot(st.master_grad, st.master_grad), rtol=1e-5)


@pytest.mark.parametrize("numel", [1, NORM_BLOCK - 1, NORM_BLOCK, 2 * NORM_BLOCK + 1, 3_000_001])
def test_squared_norm_is_the_same_sum_on_any_thread_count(numel):
    """A lone block, a block and a tail, many blocks: one sum whatever the threads."""
    g = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 10
    sums = _on_threads(lambda: squared_norm(g), (1, 2, 4))
    assert len(sums) == 3 and all(torch.equal(sums[1], v) for v in sums.values()), sums
    truth = g.double().square().sum()
    assert abs(sums[1].double() - truth) <= 1e-6 * truth


def test_squared_norm_of_a_large_stage_is_accurate():
    """A stage of tens of millions of parameters: a serial fp32 sum (``vector_norm`` of the whole
    buffer, what the norm was) comes out 0.3% short at 30M elements; clipping would scale every
    gradient by that much more than single-process training."""
    g = torch.randn(30_000_000, generator=torch.Generator().manual_seed(0))
    truth = g.double().square().sum()
    assert abs(squared_norm(g).double() - truth) <= 1e-6 * truth


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.slow
def test_bf16_offload_trains_like_bf16_resident(tiny_model_dir, monkeypatch, prefetch):
    """In bf16 the offloaded stages' loads convert the masters (first load after a step) or copy
    the refreshed ``work`` (later loads); resident stages convert on the device. Same numbers,
    whatever the main thread's and the optimizer thread's thread counts (the norm test above).
    On the even split: with the cost partition's [1, 2, 2, 1] the embedding's masters differed by
    1.1e-8 (relative) without prefetch, with one thread and unsliced steps too (cause not found;
    both stay within the reference tolerance)."""
    monkeypatch.setattr(slices, "MASTER_SLICE_NUMEL", 4096)
    runs = []
    for offload in (False, True):
        trainer = in_process_trainer(tiny_cfg(tiny_model_dir, dtype="bfloat16", use_offload=offload,
                                          use_prefetch=prefetch and offload, resident_stages=0,
                                          partition="layers"))
        history = trainer.train()
        runs.append(([h["loss"] for h in history], trainer_masters(trainer)))
    assert_same_training(*runs[1], *runs[0], rtol=0.0)


@pytest.mark.slow
def test_bf16_offload_without_the_refresh_is_caught(tiny_model_dir, monkeypatch):
    """Mutation: without the ``work`` refresh a stage's later loads (its backward's, after a
    DROP) compute with the previous iteration's weights, and the comparison fails."""
    runs = []
    for offload in (False, True):
        trainer = in_process_trainer(tiny_cfg(tiny_model_dir, dtype="bfloat16", use_offload=offload, resident_stages=0))
        if offload:
            for st in trainer.stores.values():
                st.residency.refresh_work = lambda *args: None
        history = trainer.train()
        runs.append(([h["loss"] for h in history], trainer_masters(trainer)))
    with pytest.raises(AssertionError):
        assert_same_training(*runs[1], *runs[0], rtol=1e-3)


def test_offloaded_stage_holds_no_weights_until_loaded():
    """The module's own weights go once the store has its masters: kept, they would double an
    offloaded model's host memory at start-up. A LOAD brings the masters' values back."""
    module = _module()
    want = [p.detach().clone() for p in module.parameters()]
    st = make_store(module, device=CPU, compute_dtype=torch.float32, offload=True,
                    optim=OptimSettings(), streams=Streams(CPU), pool=BufferPool(CPU))
    assert all(p.numel() == 0 for p in module.parameters())
    st.load().result()  # no workers: the copy is done when load returns
    assert all(torch.equal(p, w) for p, w in zip(module.parameters(), want))


# --- ownership (offload/owners.py; MMOC_DEBUG_THREADS=1) ----------------

@pytest.mark.parametrize("dtype, delayed", [("float32", False), ("bfloat16", False), ("float32", True)])
def test_offload_keeps_its_thread_owners(tiny_model_dir, monkeypatch, dtype, delayed):
    """Offload with prefetch under the debug checks (the CPU streams are no-ops; the checks of
    who issues on them and who writes the stores still run): every load goes through the loader
    thread, no other thread writes a store's fields, and the training is the one without them."""
    monkeypatch.setattr(owners, "CHECK_THREADS", True)
    monkeypatch.setattr(slices, "MASTER_SLICE_NUMEL", 4096)  # loads from the masters in chunks
    cfg = dict(dtype=dtype, use_offload=True, use_prefetch=True, resident_stages=0, delayed_update=delayed,
               num_iterations=2)
    checked = in_process_trainer(tiny_cfg(tiny_model_dir, **cfg))
    copiers = set()
    for st in checked.stores.values():
        real = st.residency.copy_chunk

        def copy_chunk(*args, real=real, **kw):
            copiers.add(threading.current_thread().name)
            real(*args, **kw)

        st.residency.copy_chunk = copy_chunk
    history = checked.train()
    assert copiers == {"param-loader"}, copiers
    monkeypatch.setattr(owners, "CHECK_THREADS", False)
    plain = in_process_trainer(tiny_cfg(tiny_model_dir, **cfg))
    ref = plain.train()
    assert_same_training([h["loss"] for h in history], trainer_masters(checked),
                         [h["loss"] for h in ref], trainer_masters(plain), rtol=0.0)


def test_a_second_producer_on_the_load_stream_is_caught(monkeypatch):
    """The loader thread owns the load stream: the main thread enqueueing there, or another
    thread writing a field of a store or of its residency, fails under the checks and passes
    without them."""
    workers = Workers(ThreadPoolExecutor(1), CPU)
    st = _store(offload=True, workers=workers)
    st.streams.event("load")  # unchecked
    monkeypatch.setattr(owners, "CHECK_THREADS", True)
    with pytest.raises(AssertionError, match="the load stream belongs to 'param-loader'"):
        st.streams.event("load")
    st.streams.event("compute")  # the main thread's
    err = workers.optimizer.submit(setattr, st, "grads_summed", True).exception(timeout=10)
    assert isinstance(err, AssertionError) and "StageStore.grads_summed" in str(err), err
    err = workers.optimizer.submit(setattr, st.residency, "loaded", True).exception(timeout=10)
    assert isinstance(err, AssertionError) and "Offloaded.loaded" in str(err), err
    workers.optimizer.shutdown()
    workers.loader.shutdown()
    with pytest.raises(RuntimeError, match="already belongs to 'param-loader'"):
        st.streams.hand_to("load", threading.current_thread())


class _StubEvent:
    """A CUDA event's stand-in on the CPU: recorded on a stream, 1 ms from any other event."""

    def __init__(self, enable_timing: bool = False, **_):
        self.timing, self.stream = enable_timing, None

    def record(self, stream=None) -> None:
        self.stream = stream

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "_StubEvent") -> float:
        assert self.timing and other.timing and self.stream is not None and other.stream is not None
        return 1.0


class _StubStream:
    def __init__(self) -> None:
        self.waited: list[_StubEvent] = []

    def wait_event(self, event: _StubEvent) -> None:
        assert event.stream is not None, "a wait for an event never recorded"
        self.waited.append(event)


def test_lora_frozen_loads_count_as_transfers_and_load_waits(monkeypatch):
    """What a LoRA run reports of its frozen weights' loads on a GPU (streams and events stubbed on
    the CPU): each LOAD's bytes and time among the step's host-to-device transfers, and the
    compute stream's wait for the copy as ``load_wait``, as for an offloaded stage's weights."""
    import contextlib

    monkeypatch.setattr(torch.cuda, "Event", _StubEvent)
    monkeypatch.setattr(Streams, "on", lambda self, which: contextlib.nullcontext())
    streams = Streams(CPU)
    streams.cuda = True
    streams.compute, streams.load, streams.offload = _StubStream(), _StubStream(), _StubStream()
    module = _module()
    module[0].requires_grad_(False)  # the frozen base; the rest trains
    st = make_store(module, device=CPU, compute_dtype=torch.float32, offload=True, frozen=True,
                    optim=OptimSettings(), streams=streams, pool=BufferPool(CPU))

    class Clock:
        def __init__(self):
            self.spans: list[str] = []

        def span(self, key, start, end):
            self.spans.append(key)

        def add(self, key, seconds):
            pass

    clock = Clock()
    st.load().result()
    st.before_compute(backward=False, clock=clock)
    frozen_bytes = sum(p.numel() for p in module[0].parameters()) * 4
    assert st.pop_transfer_stats() == {"h2d": (frozen_bytes, 1e-3)}
    assert clock.spans == ["load_wait"] and len(streams.compute.waited) == 1


class _TimedEvent(_StubEvent):
    """A stub event that also notes when it was recorded."""

    def record(self, stream=None) -> None:
        super().record(stream)
        self.at = time.perf_counter()


def test_cuda_path_load_waits_for_its_own_step_only(monkeypatch):
    """The next iteration's LOAD on the CUDA path (streams and events stubbed on the CPU): two
    offloaded stages step one after the other on the optimizer thread (the order the next
    forward needs them), the second slowly. The first one's load and compute go ahead while the
    second still steps: the compute stream waits for the first's own load event and nothing
    else. The second's load event is recorded only after its own step wrote the last chunk, and
    its compute waits for that event: the weights it computes with are the stepped ones."""
    import contextlib

    monkeypatch.setattr(torch.cuda, "Event", _TimedEvent)
    monkeypatch.setattr(Streams, "on", lambda self, which: contextlib.nullcontext())
    monkeypatch.setattr(slices, "MASTER_SLICE_NUMEL", 64)
    streams = Streams(CPU)
    streams.cuda = True
    streams.compute, streams.load, streams.offload = _StubStream(), _StubStream(), _StubStream()
    workers = Workers(ThreadPoolExecutor(1), CPU)
    optim = OptimSettings(weight_decay=0.1, fused=True)
    first, second = (make_store(_module(seed), device=CPU, compute_dtype=torch.float32, offload=True, optim=optim,
                                streams=streams, pool=BufferPool(CPU), workers=workers) for seed in (0, 1))
    gate, real_kernel, written = threading.Event(), torch._fused_adamw_, []
    lo = second.master.data_ptr()
    hi = lo + second.master.numel() * second.master.element_size()

    def kernel(params, *args, **kw):
        if lo <= params[0].data_ptr() < hi:  # a chunk of the second stage's masters
            assert gate.wait(10), "the first stage's compute never went ahead"
            real_kernel(params, *args, **kw)
            written.append(time.perf_counter())
            return
        real_kernel(params, *args, **kw)

    monkeypatch.setattr(torch, "_fused_adamw_", kernel)
    _set_grads([first], seed=0)
    _set_grads([second], seed=1)
    steps = [st.step(1e-2, 0.5) for st in (first, second)]
    spans = [st.load() for st in (first, second)]
    first.before_compute(backward=False)
    assert not steps[1].done(), "the first stage's compute waited for the second stage's step"
    assert streams.compute.waited == [spans[0].result().end]
    assert torch.equal(first.dev, first.master)
    gate.set()
    second.before_compute(backward=False)
    steps[1].result()
    end = spans[1].result().end
    assert streams.compute.waited[-1] is end and len(written) >= 2 and end.at >= written[-1]
    assert torch.equal(second.dev, second.master)
    workers.optimizer.shutdown()
    workers.loader.shutdown()


def _device_stepped_pair(dtype=torch.float32, workers=None, streams=None):
    """Two offloaded stores of one module: the second steps through the device (``device_step``)."""
    optim = OptimSettings(weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, fused=True)
    return [make_store(_module(), device=CPU, compute_dtype=dtype, offload=True, device_step=on, optim=optim,
                       streams=streams or Streams(CPU), pool=BufferPool(CPU), workers=workers) for on in (False, True)]


@pytest.mark.parametrize("chunk", [64, 192, 1 << 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_step_is_the_host_step(monkeypatch, chunk, dtype):
    """An offloaded stage stepped through the device (its masters and gradient a chunk at a time
    into the step buffers, AdamW against its moments there, the masters back) against the same
    stage stepped on the host: masters, AdamW state and the next loads' weights (from the
    masters, then from the refreshed ``work``), bit for bit on the CPU, over several steps with
    and without clipping."""
    monkeypatch.setattr(slices, "MASTER_SLICE_NUMEL", chunk)
    host, device = _device_stepped_pair(dtype)
    assert device.residency.device_step and not host.residency.device_step
    for i, coef in enumerate([0.37, None, 0.81]):
        _set_grads([host, device], seed=i)
        host.step(1e-2, coef).result()
        device.step(1e-2, coef).result()
        for _ in range(2):  # the first load after the step copies the masters, the second ``work``
            for st in (host, device):
                st.load().result()
                st.before_compute(backward=False)
            assert torch.equal(host.dev, device.dev) and torch.equal(device.dev, device.master.to(dtype))
            for st in (host, device):
                st.drop()
    _assert_same_state(host, device)
    assert not torch.equal(host.master, _store(offload=True).master)  # it did train


@pytest.mark.parametrize("apart", [False, True])
def test_device_step_state_resumes(apart):
    """A device-stepped stage's AdamW state saved and loaded into a fresh store steps on like the
    original; ``apart``: with the moments on another device than the masters (as on a GPU, here
    another CPU index), copied into where they live, not moved to the masters by torch's loader."""
    import copy

    a, b = (_device_stepped_pair()[1] for _ in range(2))
    if apart:
        b.adamw.state_device = torch.device("cpu", 0)  # != the masters' torch.device("cpu")
    _set_grads([a], seed=0)
    a.step(1e-2, 0.5).result()
    b.master.copy_(a.master)
    b.load_optimizer_state_dict(copy.deepcopy(a.optimizer_state_dict()))  # as a checkpoint holds it
    _set_grads([a, b], seed=1)
    a.step(1e-2, None).result()
    b.step(1e-2, None).result()
    assert torch.equal(a.master, b.master)


def test_cuda_path_device_step_hands_its_end_to_the_load_and_the_refresh(monkeypatch):
    """A device step on the CUDA path (streams and events stubbed on the CPU): issued on the step
    stream by the main thread, after the gradient's copy to the host and without a host wait;
    the next LOAD's copy waits for its end on the load stream, the next OFFLOAD_GRADS's on the
    offload stream, the bf16 ``work`` refresh (optimizer thread) and the checkpoint's read of the
    masters (``wait_step``) on the host; a later step's LOAD waits for that step's end."""
    import contextlib

    monkeypatch.setattr(torch.cuda, "Event", _TimedEvent)
    monkeypatch.setattr(Streams, "on", lambda self, which: contextlib.nullcontext())
    synced = []
    monkeypatch.setattr(_TimedEvent, "synchronize", lambda self: synced.append((self, threading.current_thread())))
    streams = Streams(CPU)
    streams.cuda = True
    streams.compute, streams.load, streams.offload, streams.step = (_StubStream() for _ in range(4))
    workers = Workers(ThreadPoolExecutor(1), CPU)
    st = _device_stepped_pair(torch.bfloat16, workers, streams)[1]
    st.load().result()
    st.before_compute(backward=True)
    for i in range(2):
        st.offload_grads(norm=True)
        st.grad_sq_norm()
        grads = st.residency.grads_event
        _set_grads([st], seed=i)
        synced.clear()
        start, end = st.step(1e-2, 0.5).result()
        assert streams.step.waited[-1] is grads and start.stream is end.stream is streams.step and not synced
        st.load().result()
        st.before_compute(backward=True)
        assert streams.load.waited[-1] is end, "the load's copy did not wait for the device step"
        assert torch.equal(st.dev, st.master.bfloat16())
        if i == 0:  # the next gradients' copy out waits for the step that read the last ones
            st.offload_grads(norm=True)
            assert streams.offload.waited[-1] is end
            st.grad_sq_norm()
            st.load().result()
            st.before_compute(backward=True)
        st.wait_step()  # the refresh of ``work`` queued by the load, and the masters' copies back
        # once on the optimizer thread (before the refresh), once here (before the masters are read)
        assert [e for e, _ in synced if e is end] == [end, end]
        assert sorted(t is threading.current_thread() for e, t in synced if e is end) == [False, True]
        assert torch.equal(st.work, st.master.bfloat16())
    workers.optimizer.shutdown()
    workers.loader.shutdown()
