"""GPU checks (``pytest -m gpu``; skipped without CUDA): offload + prefetch (every stage
offloaded, or some kept resident) gives the same training as resident stages in bf16, stays
within the memory the planner computes from the stage sizes, and the step makes no host
synchronisation outside the documented places."""
from __future__ import annotations

import threading
import traceback
import warnings

import pytest
import torch

from tests.helpers.paths import ROOT
from tests.helpers.runs import flags, run_losses, run_outcome, run_results, run_torchrun

pytestmark = pytest.mark.gpu  # one GPU at least; gpu(n) on a test asks for more


def _settings(nproc: int, mode: str) -> dict:
    return {"model": "tiny", "dataset": "synthetic", "device": "cuda", "dtype": "bfloat16", "seq_length": 128,
            "batch_size": 16, "num_chunks": 4, "num_stages": 2 * nproc, "num_iterations": 6, "lr": 1e-3,
            "schedule": "gpipe", "use_offload": mode != "resident",
            "use_prefetch": mode in ("prefetch", "hybrid", "actoff", "device"),
            "resident_stages": 1 if mode in ("hybrid", "device") else 0,
            "device_steps": 1 if mode == "device" else 0, "activation_offload": mode == "actoff"}


def _run(tmp_path, nproc: int, mode: str) -> dict:
    out = tmp_path / mode
    proc = run_torchrun(nproc, ["--no_save_model", "--save_params", "--save_dir", str(out), "--save_results",
                                str(out / "r.json"), *flags(_settings(nproc, mode))])
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses, params = run_outcome(out, out / "r.json")
    return {"losses": losses, "peaks": run_results(out / "r.json")["iterations"][-1]["peak_mem_bytes"],
            "params": params}


def _estimated_peaks(nproc: int, mode: str) -> list[int]:
    from pipeline.config import make_config
    from pipeline.plan.source import preset_config
    from pipeline.plan.fit import memory_plan
    from schedule import round_robin

    cfg = make_config(_settings(nproc, mode))
    ranks, _ = memory_plan(cfg, preset_config("tiny"), round_robin(cfg.num_stages, nproc), "cuda")
    return [r.device_peak for r in ranks]


@pytest.mark.parametrize("nproc", [pytest.param(n, marks=pytest.mark.gpu(n)) for n in (2, 4)])
def test_offload_prefetch_matches_resident(tmp_path, nproc):
    """bf16 tolerance: both runs compute in bf16 from the same fp32 masters and differ only in
    where AdamW runs (fused CPU vs fused CUDA kernel). Last-bit differences in the masters flip
    bf16 roundings, and Adam turns near-zero gradients (rarely seen embedding rows) into
    lr-sized steps, so after 6 steps: losses agree to 1e-3 relative, weights to 5e-3 relative
    norm (measured on 2 H200s: 2.4e-3 for the embedding). Exact equivalence of the offload
    logic is what the float32 CPU tests check."""
    resident = _run(tmp_path, nproc, "resident")
    for mode in ("prefetch", "noprefetch", "hybrid", "actoff", "device"):
        run = _run(tmp_path, nproc, mode)
        for a, b in zip(run["losses"], resident["losses"]):
            assert abs(a - b) <= 1e-3 * abs(b), (mode, run["losses"], resident["losses"])
        for k, ref in resident["params"].items():
            rel = (run["params"][k] - ref).norm() / ref.norm()
            assert rel <= 5e-3, (mode, k, float(rel))
        # Offload keeps at most two offloaded stages' weights+grads on the GPU (hybrid: besides
        # its one resident stage), never every stage's weights, grads, fp32 masters and AdamW state.
        assert max(run["peaks"]) < max(resident["peaks"]), (mode, run["peaks"], resident["peaks"])
        # The bound the planner computes from the stage sizes and the action list. The slack is
        # per-process memory the plan leaves out (cuBLAS workspaces of the compute and side
        # streams, NCCL, allocator rounding): on 2 H200s the tiny model's ranks peaked 15.6 and
        # 9.5 MiB above 1.25x the estimate + 64 MiB.
        bound = [1.25 * b + 192 * 2**20 for b in _estimated_peaks(nproc, mode)]
        assert all(p <= b for p, b in zip(run["peaks"], bound)), (mode, run["peaks"], bound)


@pytest.mark.parametrize("mode", ["prefetch", "hybrid", "resident", "actoff", "device"])
def test_step_has_no_host_sync(tmp_path, mode):
    """No clipping; every stage offloaded (with prefetch), one kept resident, or none offloaded:
    inside an iteration the host waits for the device only where the executor documents it
    (the loss it returns at the end) and inside autograd's own kernels (the embedding's
    backward counts its unique tokens on the host). Loads, offloads
    and the CPU optimizer are ordered by events and worker threads. Each sync the debug mode
    reports is attributed to the innermost frame of this repository on its stack, so a sync in
    a saved-tensor hook, or a torch.cuda call made by our code, is caught too."""
    from pipeline.config import make_config
    from tests.helpers.reference import in_process_trainer

    cfg = make_config({**_settings(1, mode), "num_stages": 4, "grad_clip": 0.0, "max_skipped_steps": -1,
                       "save_dir": str(tmp_path), "save_model": False, "save_metrics": False})
    trainer = in_process_trainer(cfg)
    batch = trainer.stream.next_batch()
    mbs = trainer.microbatches(batch)  # the inputs' copies to the GPU happen before the step
    run = lambda: trainer.executor.run(trainer.actions, mbs, batch.num_targets, 1e-3)  # noqa: E731
    run()  # warm-up: allocations, cuBLAS handles
    torch.cuda.synchronize()
    repo = str(ROOT)
    seen: list[tuple[str, int, str]] = []  # innermost repo frame of each reported sync

    def record(message, category, filename, lineno, file=None, line=None):
        # torch's text for a sync it caught (torch 2.11 also warns, with another text, that the
        # debug mode itself is a prototype when it is switched on)
        if "called a synchronizing CUDA operation" in str(message):
            frames = [f for f in traceback.extract_stack() if f.filename.startswith(repo)
                      and "/tests/" not in f.filename]
            if frames:
                seen.append((frames[-1].filename, frames[-1].lineno, frames[-1].line))
            else:  # no frame of ours: name the thread and the stack's last frames, to see where it came from
                tail = " <- ".join(f"{f.filename}:{f.lineno} {f.name}" for f in reversed(traceback.extract_stack()[-6:-1]))
                seen.append((filename, lineno, f"[{threading.current_thread().name}] {message} | {tail}"))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    trainer.executor.finish()
    assert seen, "the sync debug mode reported nothing: the check itself is not working"
    # the loss at the iteration's end (the executor) and autograd's own (a runner's backward)
    allowed = {"pipeline/run/executor.py": ("float(torch.stack(it.losses)",),
               "pipeline/runners/": ("torch.autograd.backward(",)}
    unexpected = {(f, n, code) for f, n, code in seen
                  if not any(where in f and any(a in code for a in codes) for where, codes in allowed.items())}
    assert not unexpected, sorted(unexpected)


def _one_rank_trainer(tmp_path, mode: str, num_chunks: int):
    """Every stage in this process, micro-batches of 2 x 128 tokens, and one iteration run to warm up."""
    from pipeline.config import make_config
    from tests.helpers.reference import in_process_trainer

    cfg = make_config({**_settings(1, mode), "num_stages": 4, "num_chunks": num_chunks, "batch_size": 2 * num_chunks,
                       "save_dir": str(tmp_path), "save_model": False, "save_metrics": False})
    trainer = in_process_trainer(cfg)
    batch = trainer.stream.next_batch()
    mbs = trainer.microbatches(batch)
    run = lambda: trainer.executor.run(trainer.actions, mbs, batch.num_targets, 1e-3)  # noqa: E731
    run()
    torch.cuda.synchronize()
    return trainer, run


def test_activation_offload_memory_does_not_grow_with_microbatches(tmp_path):
    """GPipe on one GPU (every forward before any backward): without activation_offload the peak
    grows by every added micro-batch's activations of every stage; with it, by the hand-offs
    between stages of this GPU only (a hidden state each, 128 KiB here)."""
    growth = {}
    for mode in ("prefetch", "actoff"):
        peaks = []
        for chunks in (4, 16):
            trainer, run = _one_rank_trainer(tmp_path / f"{mode}{chunks}", mode, chunks)
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            run()
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - base)
            trainer.executor.finish()
            if mode == "actoff":
                assert len(trainer.executor.runners.stash) == 0
            del trainer, run
        growth[mode] = peaks[1] - peaks[0]
    io = 2 * 128 * 256 * 2  # one micro-batch's hidden state (tiny preset, bf16)
    assert growth["prefetch"] > 12 * 10 * io, growth  # the plain run keeps 12 more micro-batches' activations
    # outputs and input gradients between stages of this GPU; blocks freed while a copy still reads
    # them count until it is done
    assert growth["actoff"] <= 2 * 12 * io + 4 * 2**20, growth  # outputs and input gradients between local stages


def test_activation_offload_copies_on_their_own_stream(tmp_path):
    """The stage inputs go to host memory and come back on a stream of their own, which runs no
    kernel: the copies overlap compute instead of queueing behind it. Seen by the profiler: the
    one stream with device-to-pinned copies and no kernel (the gradient offload's stream converts
    to fp32 on the device) copies each stage input out once and back once."""
    from torch.profiler import ProfilerActivity, profile

    trainer, run = _one_rank_trainer(tmp_path, "actoff", 4)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    trainer.executor.finish()
    streams: dict[int, dict[str, int]] = {}
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name()
        kind = ("out" if "Device -> Pinned" in name else "back" if "Pinned -> Device" in name else "copy") \
            if name.startswith("Memcpy") else "set" if name.startswith("Memset") else "kernel"
        counts = streams.setdefault(e.device_resource_id(), {})
        counts[kind] = counts.get(kind, 0) + 1
    stash = [sid for sid, c in streams.items() if c.get("out") and not c.get("kernel")]
    assert len(stash) == 1, streams
    inputs = 3 * 4  # stages 1..3 (gpipe with activation_offload fuses no last stage), 4 micro-batches
    assert streams[stash[0]] == {"out": inputs, "back": inputs}, streams


def _schedule_flags(schedule: str, offload: bool, out) -> list[str]:
    """Llama-2-7B's layer shapes, 8 stages of one layer, 16 micro-batches of 4 x 512 tokens: every
    p2p message is 16 MiB, larger than NCCL's buffers, so a send completes only once the peer's
    receive runs (the tiny preset's messages are buffered and never showed the 1F1B hang)."""
    return ["--model", "llama-2-7b", "--num_layers", "8", "--num_stages", "8", "--dataset", "synthetic",
            "--device", "cuda", "--dtype", "bfloat16", "--seq_length", "512", "--batch_size", "64",
            "--num_chunks", "16", "--num_iterations", "2", "--schedule", schedule, "--activation_checkpointing",
            "--use_offload" if offload else "--no_offload", "--resident_stages", "0", "--comm_timeout_s", "90",
            "--no_save_model", "--save_dir", str(out), "--save_results", str(out / "r.json")]


@pytest.mark.parametrize("nproc", [pytest.param(n, marks=pytest.mark.gpu(n)) for n in (2, 4)])
@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offload"])
def test_every_schedule_runs_under_nccl(tmp_path, nproc, offload):
    """gpipe, 1f1b and interleaved each finish two iterations under NCCL (a hang fails at the
    communication timeout), and their losses agree with gpipe's: the first iteration computes
    the same forward (bf16 rounding of a different accumulation order aside), the second one
    after the same AdamW step."""
    losses = {}
    for schedule in ("gpipe", "1f1b", "interleaved"):
        out = tmp_path / schedule
        proc = run_torchrun(nproc, _schedule_flags(schedule, offload, out), timeout=400)
        assert proc.returncode == 0, (schedule, proc.stderr[-3000:])
        losses[schedule] = run_losses(out / "r.json")
    for schedule, got in losses.items():
        for a, b in zip(got, losses["gpipe"]):
            assert abs(a - b) <= 2e-3 * abs(b), (schedule, got, losses["gpipe"])


@pytest.mark.gpu(2)
def test_seq_chunks_run_across_two_gpus_under_nccl(tmp_path):
    """Sequence pipelining across devices: the 1F1B job above with every row cut into 4 segments
    (each p2p message a segment's 4 MiB, so a send completes only once its receive runs), every
    stage offloaded, finishes two iterations under NCCL and its losses agree with whole rows'
    (the same forward and AdamW step; bf16 roundings of another attention order aside)."""
    losses = {}
    for k in (1, 4):
        out = tmp_path / f"seg{k}"
        proc = run_torchrun(2, _schedule_flags("1f1b", True, out) + ["--seq_chunks", str(k)], timeout=400)
        assert proc.returncode == 0, (k, proc.stderr[-3000:])
        losses[k] = run_losses(out / "r.json")
    for a, b in zip(losses[4], losses[1]):
        assert abs(a - b) <= 2e-3 * abs(b), losses


@pytest.mark.gpu(2)
@pytest.mark.parametrize("mode", ["resident", "prefetch"])
def test_replicas_under_nccl_train_like_one_pipeline(tmp_path, mode):
    """data_parallel 2 on two GPUs (two one-GPU pipelines, each half of the micro-batches; the
    offloaded stages' CPU AdamW sharded between the replicas and their gradients summed in host
    memory over gloo beside NCCL) trains like one pipeline on one GPU: losses and weights within
    the bf16 tolerance of ``test_offload_prefetch_matches_resident``."""
    runs = {}
    for nproc in (1, 2):
        out = tmp_path / f"{mode}{nproc}"
        settings = {**_settings(1, mode), "data_parallel": nproc}
        proc = run_torchrun(nproc, ["--no_save_model", "--save_params", "--save_dir", str(out), "--save_results",
                                    str(out / "r.json"), *flags(settings)])
        assert proc.returncode == 0, (nproc, proc.stderr[-3000:])
        runs[nproc] = run_outcome(out, out / "r.json")
    (one, one_params), (two, two_params) = runs[1], runs[2]
    for a, b in zip(two, one):
        assert abs(a - b) <= 1e-3 * abs(b), (two, one)
    for k, ref in one_params.items():
        assert (two_params[k] - ref).norm() / ref.norm() <= 5e-3, k


def test_a_new_pool_buffer_is_written_after_the_kernels_that_used_its_memory():
    """The pool's new buffer is made on the compute stream, where the caching allocator may hand
    out memory that queued kernels still read. A LOAD writes it on the load stream: waiting for
    ``take``'s event, the write comes after them (without it, the fill below lands first and the
    product reads 5 instead of 1)."""
    from offload.streams import BufferPool

    dev = torch.device("cuda", torch.cuda.current_device())
    load = torch.cuda.Stream(dev, priority=-1)
    n = 1 << 22
    a = torch.ones(n, device=dev)
    torch.cuda._sleep(200_000_000)  # the compute stream is busy for a while (~0.1 s)
    b = a * 2  # queued behind the sleep; reads a's memory
    ptr = a.data_ptr()
    del a  # free for the allocator at once, while ``b``'s kernel has not run yet
    buf, ready = BufferPool(dev).take(n, torch.float32)
    assert buf.data_ptr() == ptr, "the allocator did not reuse the freed block: the test proves nothing"
    with torch.cuda.stream(load):
        if ready is not None:
            load.wait_event(ready)
        buf.fill_(5.0)
    torch.cuda.synchronize()
    assert torch.all(b == 2), b.unique()


def test_host_empty_pins_exactly():
    """A stage's pinned host buffers take their size, not the caching allocator's next power of two,
    and copies through them are asynchronous and intact."""
    from offload.streams import host_empty
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    n = 3 * 2**20 + 5  # 12 MiB and a bit: rounding would take 16 MiB
    t = host_empty(n, torch.float32, pin=True)
    assert t.is_pinned() and t.numel() == n
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before  # not the caching allocator
    t.copy_(torch.arange(n, dtype=torch.float32))
    back = host_empty(n, torch.float32, pin=True)
    back.copy_(t.cuda(non_blocking=True), non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, t)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2_sliding"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_compiled_layers_match_eager(arch, packed):
    """compile_layers on the GPU (Triton kernels): a stage's loss and every gradient equal the
    eager stage's in float32 (fusion changes rounding only: 1.5e-4 relative was seen), for GQA,
    sliding windows and q/k/v biases, with a plain causal mask or packed rows. transformers 5.17's
    layers compile in several graphs (graph breaks), so only that something compiled is checked.
    Rows of 160 tokens: windows and records go through flex (it takes passes of 128 keys and more)."""
    import copy

    import torch._dynamo.utils as dynamo_utils
    from tests.helpers.segments import make_batch, make_config, make_stages

    from pipeline.stage import attention
    from pipeline.stage.model import compile_layers

    torch._dynamo.reset()
    dynamo_utils.counters.clear()  # reset() keeps them: the parametrized cases would add up
    eager = make_stages(make_config(arch, "sdpa"))[0].cuda()
    eager.checkpointing, eager.recomputed = True, 2  # two of four layers recomputed
    compiled = copy.deepcopy(eager)
    compile_layers(compiled)
    x, targets = (t.cuda() for t in make_batch(eager.lm_head.out_features, rows_len=(160, 90, 40)))
    kw = {}
    if packed:  # two records a row, positions restarting at the second
        seg = (torch.arange(x.shape[1], device="cuda") >= 70).long().expand_as(x)
        kw = {"segment_ids": seg, "position_ids": torch.where(seg == 0, torch.arange(x.shape[1], device="cuda"),
                                                              torch.arange(x.shape[1], device="cuda") - 70)}
    attention.KERNEL_CALLS.clear()
    results = []
    for stage in (eager, compiled):
        loss = stage(x, targets, **kw)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in stage.named_parameters()}))
    (l0, g0), (l1, g1) = results
    assert torch.allclose(l0, l1, rtol=1e-5), (l0, l1)
    for name, g in g0.items():
        assert (g1[name] - g).norm() <= 1e-3 * g.norm() + 1e-7, name
    assert dynamo_utils.counters["stats"]["unique_graphs"] >= 1
    if packed or arch != "llama":  # the eager stage's windows and records took flex, not the explicit mask
        assert attention.KERNEL_CALLS["flex"] > 0 and not attention.KERNEL_CALLS["reference"], attention.KERNEL_CALLS


def test_fused_last_stage_matches_forward_then_backward_on_gpu():
    """The fused last stage on CUDA kernels, float32: loss, input gradient and weight gradients
    equal the checkpointed forward and backward's up to the chunks' summation order."""
    from tests.helpers.segments import fused_and_plain

    (l0, x0, g0), (l1, x1, g1) = fused_and_plain("llama", 2, "cuda")
    assert torch.allclose(l0, l1, rtol=1e-5), (l0, l1)
    assert (x1 - x0).norm() <= 1e-4 * x0.norm()
    for name, g in g0.items():
        assert (g1[name] - g).norm() <= 1e-4 * g.norm() + 1e-7, name


LORA_LAYOUTS = {
    "resident": dict(use_offload=False),
    "hybrid": dict(resident_stages=2),
    "actoff": dict(activation_offload=True),
    "segments": dict(activation_offload=True, seq_chunks=2),
    "tiled": dict(activation_offload=True, tiled_mlp="true"),
}


@pytest.mark.parametrize("layout", list(LORA_LAYOUTS))
def test_lora_with_more_stages_than_layers_trains_like_two_stages(tmp_path, layout):
    """LoRA of the tiny preset's 8 layers in 10 stages (the first holds only the frozen embedding,
    the last only the frozen head) under each runner, in bf16 on one GPU: every step's loss as the
    run in two resident stages gives (bf16 noise), and the peak within the plan."""
    from pipeline.config import make_config
    from pipeline.plan.fit import memory_plan
    from pipeline.plan.source import preset_config
    from schedule import round_robin

    base = {"model": "tiny", "dataset": "synthetic", "device": "cuda", "dtype": "bfloat16", "seq_length": 256,
            "batch_size": 4, "num_chunks": 2, "num_iterations": 4, "lr": 1e-3, "lora_rank": 8,
            "lora_target_modules": "all-linear", "schedule": "1f1b"}
    runs = {}
    for name, kw in (("two", dict(num_stages=2, use_offload=False)),
                     (layout, {"num_stages": 10, "use_offload": True, "resident_stages": 0, **LORA_LAYOUTS[layout]})):
        out = tmp_path / name
        settings = {**base, **kw}
        proc = run_torchrun(1, ["--no_save_model", "--save_dir", str(out), "--save_results", str(out / "r.json"),
                                *flags(settings)])
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = (run_losses(out / "r.json"), run_results(out / "r.json")["iterations"][-1]["peak_mem_bytes"][0],
                      settings)
    (want, _, _), (got, peak, settings) = runs["two"], runs[layout]
    assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(got, want)), (got, want)
    cfg = make_config(settings)
    ranks, _ = memory_plan(cfg, preset_config("tiny"), round_robin(10, 1), "cuda")
    assert peak <= ranks[0].device_peak, (peak, ranks[0].device_peak)
