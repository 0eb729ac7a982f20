"""``--plan``: what a configuration needs (GPU and host memory, the action lists) and whether it fits,
before any weight is loaded; and the same check as training's first step, so a run that cannot
fit stops with advice instead of an out-of-memory error after minutes of loading."""
from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

import torch

import schedule as sched
from schedule.ir import offloaded_stages, tied_stages
from pipeline.config import ConfigError, TrainConfig, partition_counts
from pipeline.spec.lora import adapted_per_layer, adapter_numel, adapts_mlp_width, quantized
from pipeline.plan.memory import MemoryInputs, ModelShape, RankMemory, StagePlan, estimate, estimate_rank, gib
from pipeline.spec.partition import predicted_step_time
from pipeline.plan.layout import shards_step
from pipeline.spec.programs import tied_across_stages, trains_tied_copies
from pipeline.spec.run_spec import RunSpec, build_run_spec
from pipeline.spec.shapes import partition_layers, stage_param_counts

# Share of the GPU memory the estimate may use: the CUDA context, NCCL buffers and the caching
# allocator's fragmentation take the rest (peak reserved runs a few percent above allocated).
USABLE_FRACTION = 0.9
# ``resident_stages: -1`` (and ``keep_layers: -1``) fill the GPU up to the bound the fit check
# holds every run to: the estimate's own error is what keeps a run in the card, as it is for any
# run the plan accepts (6-7.5% over the measured peak on the short llama-3b rows, whose sixth
# resident stage this bound admits and 0.8 did not: bench/results/2026-11-28_hybrid_row_optimizer_wait).
AUTO_RESIDENT_FRACTION = USABLE_FRACTION


def device_type(cfg: TrainConfig) -> str:
    return "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"


def planned_for(cfg: TrainConfig) -> TrainConfig:
    """The settings ``--plan`` plans: ``device: auto`` with ``gpu_memory_gb`` on a machine without a
    GPU means GPUs of that size (a plan for another machine), not this machine's CPU run, which
    would leave the cap unread."""
    if cfg.device == "auto" and cfg.gpu_memory_gb and not torch.cuda.is_available():
        return dataclasses.replace(cfg, device="cuda")
    return cfg


def machine_line(cfg: TrainConfig, world_size: int) -> str:
    """Which machine ``--plan`` plans for: this one's GPUs (or CPU), or another's that the settings
    describe, and where the host check's figure comes from."""
    other = device_type(cfg) == "cuda" and not torch.cuda.is_available()
    gpus = f"{world_size} GPU{'s' if world_size > 1 else ''}"
    if device_type(cfg) != "cuda":
        where = f"this machine's CPU, {world_size} process{'es' if world_size > 1 else ''}"
    elif not other:
        props = torch.cuda.get_device_properties(0)
        cap = f", capped at {cfg.gpu_memory_gb:g} GiB (gpu_memory_gb)" if cfg.gpu_memory_gb else ""
        where = (f"this machine, {gpus} of its {torch.cuda.device_count()} visible ({props.name}, "
                 f"{gib(props.total_memory)}{cap})")
    else:
        size = f"of {cfg.gpu_memory_gb:g} GiB (gpu_memory_gb)" if cfg.gpu_memory_gb else "of a size not given"
        where = f"another machine (this one has no GPU), {gpus} {size}, one process each (nproc)"
    host = f"{cfg.host_memory_gb:g} GiB of host memory (host_memory_gb)" if cfg.host_memory_gb else \
        "the host memory this machine has available now" + (" (host_memory_gb gives the other's)" if other else "")
    return f"machine: {where}; {host}"


def plan_spec(cfg: TrainConfig, hf_config, num_ranks: int, device: str | None = None,
              kept: tuple[int, ...] | None = None, data_parallel: int = 1) -> RunSpec:
    """The run spec of ``cfg`` (one replica's pipeline, of ``data_parallel``, on ``num_ranks``
    ranks) as the plan weighs it: on ``device`` (default: the one ``--plan`` plans for), the GPU
    asked whether cuDNN takes its rows. ``resolve`` builds the run's with it, the searches and
    the advice each candidate's."""
    return build_run_spec(cfg, hf_config, num_ranks, device or device_type(cfg), kept=kept,
                          data_parallel=data_parallel, cudnn_probe=cudnn_probe)


def cudnn_probe(dtype: torch.dtype, heads: int, kv: int, head_size: int) -> bool:
    """Whether sdpa's cuDNN kernel takes whole rows of these heads in ``dtype``, asked of the GPU
    itself (``pipeline.stage.attention``); no without a visible GPU. Otherwise the plan counts
    flash's buffers (the larger: a run the plan accepts must not run out of memory whichever
    kernel it meets)."""
    if not torch.cuda.is_available():
        return False
    from pipeline.stage import attention as kernels

    return kernels.cudnn_takes(torch.device("cuda", torch.cuda.current_device()), dtype, heads, kv, head_size)


def memory_plan(cfg: TrainConfig, hf_config, mapping: list[int], device: str,
                kept: tuple[int, ...] | None = None, data_parallel: int = 1) -> tuple[list[RankMemory], dict]:
    """Per-rank memory estimate of ``cfg`` and the schedule it runs (``resident_stages`` as
    resolved by ``resolve_resident``, ``kept`` by ``resolve_kept``; unresolved, -1 counts as 0).
    ``cfg`` is one replica's pipeline; ``data_parallel``: of how many (the replicas' gradient sum
    keeps an fp32 copy of each resident stage's gradient)."""
    spec = plan_spec(cfg, hf_config, len(set(mapping)), device, kept, data_parallel)
    inp, program = memory_inputs(spec, mapping)
    return estimate(inp, program, spec.modes), program


def memory_inputs(spec: RunSpec, mapping: list[int]) -> tuple[MemoryInputs, dict]:
    """What the memory plan walks for ``spec`` with the stages on ``mapping``, and every rank's
    program: read from the spec alone."""
    cfg, hf_config, S, adapters = spec.cfg, spec.model, spec.num_stages, spec.adapters
    counts = stage_param_counts(hf_config, S, list(spec.parts))
    base = adapters.base if adapters is not None else None
    stages = [StagePlan(counts[s], len(part), s == 0, s == S - 1, adapter_numel(hf_config, adapters, part),
                        quantized(hf_config, base, part)) for s, part in enumerate(spec.parts)]
    program = spec.program.build(mapping)
    inp = MemoryInputs(ModelShape.of(hf_config), stages, mapping, cfg.batch_size // cfg.num_chunks, cfg.seq_length,
                       spec.dtype.itemsize, cfg.use_offload, cfg.activation_checkpointing,
                       attn=spec.kernels.attention, cpu=spec.device == "cpu", kept=spec.kept,
                       segments=spec.segments, activation_offload=cfg.activation_offload,
                       mlp_tile_tokens=spec.kernels.mlp_tile_tokens, compiled=spec.kernels.compiled,
                       cudnn=spec.kernels.cudnn,
                       lora_rank=adapters.rank if adapters is not None else 0,
                       lora_modules=adapted_per_layer(hf_config, adapters),
                       lora_mlp=adapts_mlp_width(hf_config, adapters), delayed=cfg.delayed_update,
                       summed=spec.data_parallel > 1, device_stepped=spec.program.device_stepped(mapping))
    return inp, program


def gpu_capacity(cfg: TrainConfig) -> int | None:
    """Bytes a rank may allocate on its GPU (the cap if set), None without a GPU."""
    if cfg.gpu_memory_gb:
        return int(cfg.gpu_memory_gb * 2**30)
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return None


def auto_capacity(cfg: TrainConfig, key: str, set_to: str) -> int:
    """The GPU bytes an automatic choice (``key`` at -1) is sized against; ConfigError without
    a GPU or ``gpu_memory_gb`` (``--plan --device cuda`` on a machine without one), since any
    number picked then would be a guess the plan would print as if it were measured."""
    cap = gpu_capacity(cfg)
    if cap is None:
        raise ConfigError(f"--plan --device cuda without a visible GPU needs gpu_memory_gb (the card's memory "
                          f"in GiB, e.g. 80) to decide {key} -1 (auto); or set {key} to {set_to}")
    return cap


def host_capacity(cfg: TrainConfig) -> int | None:
    """Host bytes the run may use: ``host_memory_gb`` (the machine a plan is for), else what this
    machine has available now; None when that is unknown."""
    return int(cfg.host_memory_gb * 2**30) if cfg.host_memory_gb else host_available()


def host_available() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def resolve_resident(cfg: TrainConfig, hf_config, world_size: int, data_parallel: int = 1) -> tuple[TrainConfig, str]:
    """``cfg`` (one replica's pipeline, of ``data_parallel``) with ``resident_stages`` decided,
    and a log line saying what was kept resident.

    Auto (-1) keeps the most stages per GPU whose estimate stays within
    ``AUTO_RESIDENT_FRACTION`` of the GPU: every resident stage is one optimizer step less on
    the CPU and two loads less over PCIe. Without offload, or without a GPU, it is 0."""
    per_rank = cfg.num_stages // world_size
    if not cfg.use_offload:
        return dataclasses.replace(cfg, resident_stages=0), ""
    device = device_type(cfg)
    if cfg.delayed_update:
        k, why = 0, "delayed_update"
    elif cfg.resident_stages >= 0:
        k, why = cfg.resident_stages, "as set"
    elif device != "cuda":
        k, why = 0, "auto: no GPU"
    else:
        cap = auto_capacity(cfg, "resident_stages", f"0..{per_rank}")
        k, why = 0, "auto: no stage fits beside the offloaded ones"
        mapping = sched.round_robin(cfg.num_stages, world_size)
        for n in range(1, per_rank - cfg.device_steps + 1):  # the device-stepped stages stay offloaded
            ranks, _ = memory_plan(dataclasses.replace(cfg, resident_stages=n), hf_config, mapping, device,
                                   data_parallel=data_parallel)
            peak = max(r.device_peak for r in ranks)
            if peak > AUTO_RESIDENT_FRACTION * cap:
                break
            k, why = n, f"auto: estimated peak {gib(peak)} within {AUTO_RESIDENT_FRACTION:.0%} of {gib(cap)}"
        if 0 < k < per_rank and trains_tied_copies(cfg, hf_config):
            # the tied copies (first stage, resident from 1; last stage, only with all) must step alike
            k, why = 0, f"auto: {k} fit, but tied embeddings need 0 or all {per_rank} (both copies step alike)"
    kept = f": each rank's first {k}" if k else ""
    line = f"offload: {k} of {per_rank} stages per GPU stay resident, AdamW state included{kept} ({why})"
    return dataclasses.replace(cfg, resident_stages=k), line


def resolve_kept(cfg: TrainConfig, hf_config, world_size: int, data_parallel: int = 1) -> tuple[tuple[int, ...], str]:
    """Per stage (``cfg``: one replica's pipeline, of ``data_parallel``), the decoder layers that
    keep their activations under checkpointing
    (``keep_layers`` resolved), and a log line saying so; every layer of a stage is recomputed
    at 0, and nothing is without ``activation_checkpointing``.

    Auto (-1) gives one layer at a time to the stage whose rank's estimated peak grows least
    (stages with few micro-batches in flight cost little), while that peak stays within
    ``AUTO_RESIDENT_FRACTION`` of the GPU, after ``resolve_resident`` has spent its share: each
    kept layer saves one layer forward per micro-batch in backward. Without a GPU it is 0."""
    S = cfg.num_stages
    spec = plan_spec(cfg, hf_config, world_size, kept=(0,) * S, data_parallel=data_parallel)
    layers = [len(p) for p in spec.parts]
    if not cfg.activation_checkpointing:
        return (0,) * S, ""
    if cfg.activation_offload:
        # nothing to choose: the backward recomputes each stage whole, once, from its input
        return (0,) * S, f"recompute: activation_offload recomputes every stage whole in its backward, " \
                         f"0 of {sum(layers)} decoder layers checkpointed (keep_layers unused)"
    # The fused last stage recomputes nothing: every layer of it keeps its activations (for the
    # one micro-batch whose forward runs its backward), whatever keep_layers says.
    fused = spec.modes[-1].fused_last
    if cfg.keep_layers >= 0:
        kept, why = [min(cfg.keep_layers, n) for n in layers], "as set"
    elif spec.device != "cuda":
        kept, why = [0] * S, "auto: no GPU"
    else:
        cap = auto_capacity(cfg, "keep_layers", "0 or more (layers per stage)")
        limit, mapping = AUTO_RESIDENT_FRACTION * cap, sched.round_robin(S, world_size)
        inp, program = memory_inputs(spec, mapping)
        kept = [0] * (S - 1) + [layers[-1] if fused else 0]

        def peak_with(s: int) -> int:
            trial = dataclasses.replace(inp, kept=tuple(k + (i == s) for i, k in enumerate(kept)))
            return estimate_rank(trial, mapping[s], program[mapping[s]], spec.modes).device_peak

        peaks = {r: estimate_rank(inp, r, program[r], spec.modes).device_peak for r in program}
        trials = {s: peak_with(s) for s in range(S) if kept[s] < layers[s]}
        while True:
            fits = [(trials[s] - peaks[mapping[s]], -s) for s in trials if trials[s] <= limit]
            if not fits:
                break
            s = -min(fits)[1]
            kept[s] += 1
            peaks[mapping[s]] = trials[s]
            inp = dataclasses.replace(inp, kept=tuple(kept))
            # only the estimates of this stage's rank changed
            trials = {t: (peak_with(t) if mapping[t] == mapping[s] else peak) for t, peak in trials.items()
                      if kept[t] < layers[t]}
        why = f"auto: estimated peak {gib(max(peaks.values()))} within {AUTO_RESIDENT_FRACTION:.0%} of " \
              f"{gib(cap)}"
    if fused:
        kept[-1] = layers[-1]
        why += ", the fused last stage's all"
    line = f"recompute: {sum(kept)} of {sum(layers)} decoder layers keep their activations, per stage {kept} ({why})"
    return tuple(kept), line


def partition_line(spec: RunSpec) -> str:
    """The decoder layers per stage, and with ``partition: cost`` the step times it compared."""
    cfg, hf_config, num_ranks, parts = spec.cfg, spec.model, spec.num_ranks, list(spec.parts)
    line = f"decoder layers per stage: {[len(p) for p in parts]} (partition {cfg.partition}"
    if cfg.partition == "cost" and cfg.num_stages > 1:
        even = partition_layers(hf_config.num_hidden_layers, cfg.num_stages)
        line += (f": predicted step {predicted_step_time(cfg, hf_config, num_ranks, parts):.4g}s, the even split "
                 f"{predicted_step_time(cfg, hf_config, num_ranks, even):.4g}s at {cfg.plan_tflops:g} TFLOP/s")
    return line + ")"


def _alternatives(cfg: TrainConfig, num_layers: int) -> list[tuple[str, TrainConfig]]:
    """The levers a user has, each as the config it gives."""
    alts = []
    if cfg.partition == "cost":  # the cost partition may give a stage more layers than the even split
        alts.append(("partition: layers", dataclasses.replace(cfg, partition="layers")))
    if cfg.use_offload and cfg.resident_stages > 0:
        alts.append(("resident_stages: 0", dataclasses.replace(cfg, resident_stages=0)))
    if not cfg.activation_checkpointing:
        alts.append(("activation_checkpointing: true", dataclasses.replace(cfg, activation_checkpointing=True)))
    if not cfg.activation_offload:
        alts.append(("activation_offload: true", dataclasses.replace(cfg, activation_offload=True, keep_layers=0)))
    if cfg.tiled_mlp != "true" and cfg.compile_layers != "true":
        alts.append(("tiled_mlp: true", dataclasses.replace(cfg, tiled_mlp="true")))
    if not cfg.use_offload:
        alts.append(("use_offload: true", dataclasses.replace(cfg, use_offload=True)))
    if cfg.batch_size % (cfg.num_chunks * 2) == 0:
        alts.append((f"num_chunks: {cfg.num_chunks * 2} (smaller micro-batches)",
                     dataclasses.replace(cfg, num_chunks=cfg.num_chunks * 2)))
    if cfg.num_stages * 2 <= num_layers + 2:
        # counts given for num_stages do not fit twice the stages: those are cut by cost
        partition = cfg.partition if partition_counts(cfg.partition) is None else "cost"
        alts.append((f"num_stages: {cfg.num_stages * 2}",
                     dataclasses.replace(cfg, num_stages=cfg.num_stages * 2, partition=partition)))
    if cfg.schedule == "gpipe":
        alts.append(("schedule: 1f1b (fewer micro-batches in flight)", dataclasses.replace(cfg, schedule="1f1b")))
    # Sequence segments: a stage holds a few segments' activations instead of whole rows (the
    # carried keys/values stay); more segments, fewer tokens in flight. ``advice`` keeps the
    # smallest that fits.
    for k in (2 * cfg.seq_chunks, 4 * cfg.seq_chunks, 8 * cfg.seq_chunks):
        if k <= cfg.seq_length:
            alts.append((f"seq_chunks: {k} (sequence segments)", dataclasses.replace(cfg, seq_chunks=k)))
    return alts


@dataclass
class Assessment:
    """The estimate of one configuration against the memory this machine offers."""

    ranks: list[RankMemory]
    program: dict
    device: str
    gpu: int | None   # usable GPU bytes are USABLE_FRACTION of it; None: no GPU to check
    host: int | None  # available host bytes; None: unknown
    # data_parallel: the replicas whose processes share this host, of data_parallel, and the
    # AdamW state of one replica's sharded stages (each peer holds 1/data_parallel of it)
    replicas: int = 1
    data_parallel: int = 1
    sharded_adamw: int = 0

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.device_peak)

    @property
    def total_host(self) -> int:
        """Host bytes of every process on this host: each replica's ranks, the sharded AdamW state
        split over the replicas. Counted as private to each replica (the gloo version), which the
        shared host buffers of replicas on one node only lower (``offload.shared``)."""
        split = self.sharded_adamw * (self.data_parallel - 1) // self.data_parallel
        return self.replicas * (sum(r.host for r in self.ranks) - split)

    @property
    def gpu_fits(self) -> bool:
        return self.gpu is None or self.worst.device_peak <= USABLE_FRACTION * self.gpu

    @property
    def host_fits(self) -> bool:
        return self.host is None or self.total_host <= self.host

    @property
    def fits(self) -> bool:
        return self.gpu_fits and self.host_fits


def assess(cfg: TrainConfig, hf_config, mapping: list[int], kept: tuple[int, ...] | None = None,
           replicas: tuple[int, int] = (1, 1)) -> Assessment:
    """``cfg``'s memory against this machine's (``cfg`` of one pipeline; ``replicas``: with
    ``data_parallel``, how many replicas this host holds and of how many): a candidate's, whose
    spec ``plan_spec`` builds."""
    here, D = replicas
    return assess_spec(plan_spec(cfg, hf_config, len(set(mapping)), kept=kept, data_parallel=D), mapping, here)


def assess_spec(spec: RunSpec, mapping: list[int], here: int = 1) -> Assessment:
    """The memory of the run ``spec`` with its stages on ``mapping`` against this machine's
    (``here``: with ``data_parallel``, the replicas this host holds)."""
    cfg = spec.cfg
    inp, program = memory_inputs(spec, mapping)
    return Assessment(estimate(inp, program, spec.modes), program, spec.device,
                      gpu_capacity(cfg) if spec.device == "cuda" else None, host_capacity(cfg), here,
                      spec.data_parallel, _sharded_adamw(spec, inp, program))


def _sharded_adamw(spec: RunSpec, inp: MemoryInputs, program: dict) -> int:
    """AdamW bytes of the stages whose CPU step the replicas shard (``layout.shards_step``)."""
    cfg, D = spec.cfg, spec.data_parallel
    if D == 1:
        return 0
    whole = dataclasses.replace(cfg, data_parallel=D)  # ``cfg`` is one replica's
    tied = set(tied_stages(cfg.num_stages)) if tied_across_stages(cfg.num_stages, spec.model) else set()
    off = offloaded_stages(program)
    return sum(8 * inp.stages[s].numel for s in range(cfg.num_stages)
               if shards_step(whole, s in off, s in tied, inp.stages[s].numel))


def advice(cfg: TrainConfig, hf_config, world_size: int, replicas: tuple[int, int] = (1, 1)) -> list[str]:
    """The single changes that make ``cfg`` fit, each with its estimated peak; among them the
    plan's own choice of stages (num_stages -1) where that is another count and fits."""
    out, alts = [], _alternatives(cfg, hf_config.num_hidden_layers)
    alts += [alt for alt in _auto_stages(cfg, hf_config, world_size) if alt[1] not in [c for _, c in alts]]
    for label, alt in alts:
        if label.startswith("seq_chunks") and any(line.startswith("seq_chunks") for line in out):
            continue  # a larger seq_chunks than one that fits already
        a = assess(alt, hf_config, sched.round_robin(alt.num_stages, world_size), replicas=replicas)
        if a.fits:
            out.append(f"{label} -> {gib(a.worst.device_peak)} per GPU")
    return out


def _auto_stages(cfg: TrainConfig, hf_config, world_size: int) -> list[tuple[str, TrainConfig]]:
    """``num_stages: -1`` as the alternative the plan itself would take: the fewest stages that fit
    (``long_rows.resolve_long_rows``), where that is not ``cfg``'s count; none without a GPU size."""
    if cfg.num_stages == -1 or partition_counts(cfg.partition) is not None or gpu_capacity(cfg) is None \
            or device_type(cfg) != "cuda":
        return []
    from pipeline.plan.long_rows import resolve_long_rows  # it sizes its choices with this module's plan

    chosen, _ = resolve_long_rows(dataclasses.replace(cfg, num_stages=-1), hf_config, world_size)
    if chosen.num_stages == cfg.num_stages:
        return []
    return [(f"num_stages: -1 (the plan picks {chosen.num_stages})", chosen)]


def check_fits(spec: RunSpec, mapping: list[int], here: int = 1) -> None:
    """Raise ConfigError, with advice, when the estimate of ``spec`` on ``mapping`` exceeds the
    GPU (or host) memory (``here`` as for ``assess_spec``)."""
    cfg = spec.cfg
    a = assess_spec(spec, mapping, here)
    if a.fits:
        return
    if not a.gpu_fits:
        need = f"needs about {gib(a.worst.device_peak)} on GPU rank {a.worst.rank} (peak during {a.worst.at}) " \
               f"but {USABLE_FRACTION:.0%} of {gib(a.gpu)} is usable"
    else:
        need = f"needs about {gib(a.total_host)} of host memory but {gib(a.host or 0)} is " + \
            ("host_memory_gb" if cfg.host_memory_gb else "available")
    tips = advice(cfg, spec.model, spec.num_ranks, (here, spec.data_parallel))
    hint = "; try one of: " + "; ".join(tips) if tips else \
        "; no single change of checkpointing, offload, micro-batch size, stages, schedule or seq_chunks is enough"
    raise ConfigError(f"this configuration does not fit: it {need}{hint} (--plan shows each rank's memory)")


def out_of_memory_line(err, spec: RunSpec, mapping: list[int], here: int = 1) -> str:
    """One line for a run that ran out of GPU memory although the plan accepted it: the action
    and what it asked for (``executor.OutOfMemory``), the plan's peak for that rank, and the single
    changes whose plans leave the margin the run lacked (``here`` as for ``assess_spec``)."""
    cfg, hf_config, world_size, replicas = spec.cfg, spec.model, spec.num_ranks, (here, spec.data_parallel)
    a = assess_spec(spec, mapping, here)
    rank = next((r for r in a.ranks if r.rank == err.rank), a.worst)
    tried = err.tried or 0
    need = err.allocated + tried
    cap = f" of a {gib(a.gpu)} cap" if a.gpu else ""
    text = (f"rank {err.rank} ran out of GPU memory in action {err.action} ({err.text}): it asked for "
            f"{gib(tried) if err.tried is not None else 'more'} with {gib(err.allocated)} allocated and "
            f"{gib(err.reserved)} reserved{cap}; the plan's peak for this rank was {gib(rank.device_peak)} "
            f"(during {rank.at})")
    if err.reserved - err.allocated >= tried > 0:
        text += f"; {gib(err.reserved - err.allocated)} were reserved but free in pieces too small (fragmentation: " \
                "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)"
    short = max(0, need - rank.device_peak)  # at least what the plan left out
    limit = USABLE_FRACTION * a.gpu - short if a.gpu else None
    tips = []
    for label, alt in _alternatives(cfg, hf_config.num_hidden_layers):
        peak = assess(alt, hf_config, sched.round_robin(alt.num_stages, world_size),
                      replicas=replicas).worst.device_peak
        if limit is not None and peak <= limit:
            tips.append((peak, f"{label} (plan {gib(peak)})"))
    tips = [t for _, t in sorted(tips, reverse=True)[:3]]  # the ones that change least first
    return text + ("; to leave that margin, try " + "; or ".join(tips) if tips else
                   "; no single change leaves that margin: use a shorter seq_length or more GPUs")


def _lora_lines(spec: RunSpec) -> list[str]:
    """LoRA's line of the plan: what trains, and what the frozen base weights cost."""
    cfg, hf_config, adapters = spec.cfg, spec.model, spec.adapters
    if adapters is None:
        return []
    d, trained = spec.dtype.itemsize, spec.trained_adapters
    frozen = sum(stage_param_counts(hf_config, spec.num_stages, list(spec.parts)))
    q = quantized(hf_config, adapters.base, range(hf_config.num_hidden_layers))
    held = (f"{gib((frozen - q.numel) * d + q.nbytes)}: {q.numel / 1e9:.2f}B of them in {adapters.base.describe()} "
            f"with their scales ({gib(q.nbytes)}), the rest in the compute dtype" if adapters.base is not None
            else f"{gib(frozen * d)} in the compute dtype")
    return [f"lora: rank {adapters.rank} on {','.join(adapters.targets)}: {trained / 1e6:.1f}M adapter parameters "
            f"trained ({gib(trained * 16)} with their fp32 masters, gradients and AdamW state, on the GPUs); "
            f"{frozen / 1e9:.2f}B frozen base parameters, {held} "
            f"({'host memory, streamed' if cfg.use_offload else 'on the GPUs'}; resident stages' on the GPUs)"]


def report(cfg: TrainConfig, hf_config, mapping: list[int], world_size: int,
           kept: tuple[int, ...] | None = None) -> str:
    """The text ``--plan`` prints for a candidate ``cfg`` (one pipeline on ``world_size`` ranks)."""
    spec = plan_spec(cfg, hf_config, world_size, kept=kept)
    return assessment_report(assess_spec(spec, mapping), spec, mapping)


def assessment_report(a: Assessment, spec: RunSpec, mapping: list[int]) -> str:
    """The text ``--plan`` prints of the assessment ``a`` of ``spec`` on ``mapping``."""
    cfg, hf_config, world_size = spec.cfg, spec.model, spec.num_ranks
    tokens = cfg.batch_size // cfg.num_chunks * cfg.seq_length
    segs = f" in {cfg.seq_chunks} sequence segments of {list(spec.segments)} columns" if cfg.seq_chunks > 1 else ""
    lines = [f"plan: {cfg.num_stages} stages of {hf_config.num_hidden_layers} layers on {world_size} processes "
             f"({a.device}, {spec.dtype.itemsize * 8}-bit compute), schedule {cfg.schedule}, "
             f"{cfg.num_chunks} micro-batches of {cfg.batch_size // cfg.num_chunks}x{cfg.seq_length} "
             f"({tokens} tokens){segs}, offload={cfg.use_offload} prefetch={cfg.use_prefetch} "
             f"{f'resident_stages={cfg.resident_stages} ' if cfg.use_offload else ''}"
             f"checkpointing={cfg.activation_checkpointing} activation_offload={cfg.activation_offload}",
             f"stage -> rank: {mapping}",
             partition_line(spec),
             *_lora_lines(spec),
             "rank  stages      peak device  (params / activations / in flight / transient)  at     host"]
    for r in a.ranks:
        mine = [s for s, m in enumerate(mapping) if m == r.rank]
        dev = gib(r.device_peak) if a.device == "cuda" else "-"
        split = " / ".join(gib(r.parts.get(k, 0)) for k in ("parameters", "activations", "in_flight", "transient"))
        lines.append(f"{r.rank:4d}  {str(mine):10s}  {dev:>11s}  ({split})  {r.at:5s}  {gib(r.host)}")
    for r in sorted(a.program):
        counts = Counter(act.op.name for act in a.program[r])
        lines.append(f"rank {r} actions: {len(a.program[r])} (" +
                     ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + ")")
    if a.gpu is not None:
        lines.append(f"GPU: {gib(a.worst.device_peak)} of {gib(a.gpu)} ({USABLE_FRACTION:.0%} usable): "
                     f"{'fits' if a.gpu_fits else 'DOES NOT FIT'}")
    elif a.device == "cuda":
        lines.append(f"GPU: {gib(a.worst.device_peak)}, not checked (no GPU visible; gpu_memory_gb sets the card's size)")
    where = "host_memory_gb" if cfg.host_memory_gb else "available here"
    whose = f"the {a.replicas} replicas on this host" if a.replicas > 1 else "all ranks"
    lines.append(f"host: {gib(a.total_host)} for {whose}" +
                 (f" of {gib(a.host)} ({where}): {'fits' if a.host_fits else 'DOES NOT FIT'}" if a.host else ""))
    if not a.fits:
        tips = advice(cfg, hf_config, world_size, (a.replicas, a.data_parallel))
        lines.append("would fit with: " + ("; ".join(tips) if tips else "no single change"))
    return "\n".join(lines)


__all__ = ["Assessment", "advice", "assess", "assess_spec", "assessment_report", "check_fits", "cudnn_probe",
           "host_capacity", "machine_line", "memory_inputs", "memory_plan", "out_of_memory_line", "partition_line",
           "plan_spec", "report", "resolve_kept", "resolve_resident"]
