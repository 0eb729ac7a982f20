"""Which decoder layers each stage of a run holds: the ``partition`` setting.

``layers`` splits the decoder layers evenly (``partition_layers``). ``cost`` moves layers away
from the stages (and ranks) whose embedding or head make them the slowest, as the cost model
predicts (``schedule.partition.choose_counts``): it keeps the even split unless another is
predicted at least 0.1% faster (``MIN_GAIN``), so it is never predicted slower, and always with
one GPU to a pipeline (``stage_layers`` says why). Given counts
("3,5,4,4") are taken as they are. Pure: every rank, the memory plan and ``--plan`` compute the
same answer from the same configuration.
"""
from __future__ import annotations

import functools

import schedule as sched
from pipeline.config import TrainConfig, partition_counts
from pipeline.spec.programs import program_spec
from pipeline.spec.settings import fuses_last_stage
from pipeline.spec.shapes import forward_flops_per_token, layer_ranges, partition_layers, stage_num_params
from schedule.costmodel import predict
from schedule.partition import choose_counts
from schedule.spec import ProgramSpec

# What the mapping planner assumes without a measured topology: a GPU's host link, GB/s.
ASSUMED_LINK_GBPS = 25.0


def stage_costs(hf_config, counts: list[int], seq_len: int, recompute: bool,
                fused_last: bool = False) -> list[tuple[float, float]]:
    """(forward, backward) FLOPs per token of each stage holding ``counts`` decoder layers.

    Backward is twice the forward; under checkpointing the forward runs again in backward, the
    head's too (``Stage.forward`` recomputes its loss chunks). The embedding's backward is a
    scatter-add of the gradient rows: h additions per token, next to nothing. ``fused_last``
    (``fuse_last_stage``): the last stage's forward runs its backward too, recomputing nothing,
    and its backward action computes nothing."""
    out = []
    for s, c in enumerate(counts):
        f = forward_flops_per_token(hf_config, c, s == len(counts) - 1, seq_len)
        embedding = hf_config.hidden_size if s == 0 else 0
        if fused_last and s == len(counts) - 1:
            out.append((3 * f + embedding, 0.0))
        else:
            out.append((f, (3 if recompute else 2) * f + embedding))
    return out


def given_counts(cfg: TrainConfig, num_layers: int) -> list[int] | None:
    """The decoder layers per stage ``cfg.partition`` gives explicitly (None for cost or layers);
    ValueError when they are not this run's stages and ``num_layers`` (``model_rules`` refuses
    such a run before launch)."""
    given = partition_counts(cfg.partition)
    if given is not None and (len(given) != cfg.num_stages or sum(given) != num_layers):
        raise ValueError(f"partition {cfg.partition!r} gives {len(given)} stages {sum(given)} decoder layers; "
                          f"this run has {cfg.num_stages} stages and {num_layers} layers")
    return given


def stage_layers(cfg: TrainConfig, hf_config, num_ranks: int) -> list[range]:
    """The decoder layers of every stage of ``cfg`` (one pipeline's, ``Resolved.replica``) on
    ``num_ranks`` ranks, stage s on rank s % num_ranks (a planned mapping only reorders the
    GPUs), by ``cfg.partition``. With checkpointing every layer counts as recomputed (the
    layers ``keep_layers`` spares are chosen after the partition)."""
    S, num_layers = cfg.num_stages, hf_config.num_hidden_layers
    given = given_counts(cfg, num_layers)
    if given is not None:
        return layer_ranges(given)
    even = partition_layers(num_layers, S)
    if cfg.partition == "layers" or S == 1 or num_ranks == 1:
        # One GPU runs every stage, so there is no balance between GPUs to gain; what the cost
        # model's moves would do there is give the fused last stage more layers, whose host
        # AdamW (held by clipping until the last backward) is then the next forward's longest
        # wait: 151-167 ms against the even split's 96 ms on llama-3b, never measured faster
        # (bench/results/2026-11-28_hybrid_row_optimizer_wait).
        return even
    counts = _cost_counts(tuple(len(p) for p in even), *_inputs(cfg, hf_config, num_ranks))
    if cfg.activation_offload and max(counts) > max(len(p) for p in even):
        # The low-memory mode's GPU peak is one stage's activations of one micro-batch: a larger
        # stage than the even split's raises it (the fused last stage's extra layers: 5.6 -> 6.9
        # GiB on llama-3b) for a predicted gain not seen on the GPU (bench/results/2026-11-23_3b_one_gpu_peers_and_switches).
        return even
    return layer_ranges(list(counts))


def predicted_step_time(cfg: TrainConfig, hf_config, num_ranks: int, parts: list[range]) -> float:
    """The step time the ``cost`` partition minimises, of ``parts`` (seconds, under its
    assumptions: see ``_predictor``)."""
    return _predictor(*_inputs(cfg, hf_config, num_ranks))([len(p) for p in parts])


def _inputs(cfg: TrainConfig, hf_config, num_ranks: int) -> tuple:
    """``_predictor``'s arguments, hashable (its answers are cached)."""
    S = cfg.num_stages
    # A stage's FLOPs are linear in its layer count: fixed[s] + count * layer[s].
    costs = functools.partial(stage_costs, hf_config, seq_len=cfg.seq_length,
                              recompute=cfg.activation_checkpointing, fused_last=fuses_last_stage(cfg))
    no_layer, one_layer = costs([0] * S), costs([1] * S)
    # per stage: the fused last is cheaper
    layer = tuple((f1 - f0, b1 - b0) for (f0, b0), (f1, b1) in zip(no_layer, one_layer))
    params = tuple(stage_num_params(hf_config, range(0), s == 0, s == S - 1) for s in range(S))
    return (layer, tuple(no_layer), params, stage_num_params(hf_config, range(1), False, False),
            program_spec(cfg, hf_config), num_ranks, cfg.batch_size // cfg.num_chunks * cfg.seq_length,
            cfg.plan_tflops)


@functools.lru_cache(maxsize=64)
def _predictor(layer: tuple[tuple[float, float], ...], fixed: tuple[tuple[float, float], ...], params: tuple[int, ...],
               per_layer: int, spec: ProgramSpec, num_ranks: int, tokens: int, tflops: float):
    """counts -> predicted step time (``schedule.costmodel.predict``) of ``spec``'s program on
    ``num_ranks`` round-robin ranks. As the mapping planner assumes: bf16 parameters,
    ``ASSUMED_LINK_GBPS`` per GPU, each GPU under its own root (the topology is not known yet),
    compute at ``tflops``; stage s computes ``fixed[s] + count * layer[s]`` FLOPs a token."""
    mapping = sched.round_robin(spec.num_stages, num_ranks)
    program = spec.build(mapping)
    gpus = list(range(num_ranks))
    per_s = tokens / (tflops * 1e12)  # seconds per FLOP per token of a micro-batch

    def step_time(counts: list[int]) -> float:
        stage_bytes = [2 * (p + c * per_layer) for p, c in zip(params, counts)]
        compute = {s: ((f + c * lf) * per_s, (b + c * lb) * per_s)
                   for s, (c, (f, b), (lf, lb)) in enumerate(zip(counts, fixed, layer))}
        return predict(program, mapping, gpus, gpus, compute, stage_bytes, ASSUMED_LINK_GBPS,
                       ASSUMED_LINK_GBPS).step_time

    return step_time


@functools.lru_cache(maxsize=64)
def _cost_counts(start: tuple[int, ...], *inputs) -> tuple[int, ...]:
    # Cached: the memory plan asks again for every candidate it weighs (resident stages, advice).
    layer, fixed, spec, num_ranks = inputs[0], inputs[1], inputs[4], inputs[5]
    loads = [f + b for f, b in fixed]
    return tuple(choose_counts(list(start), sum(layer[0]), loads, sched.round_robin(spec.num_stages, num_ranks),
                               _predictor(*inputs)))


__all__ = ["given_counts", "predicted_step_time", "stage_costs", "stage_layers"]
