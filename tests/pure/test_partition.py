"""The ``partition`` setting: decoder layers per stage by modelled cost (L0, pure), wired into
the memory plan, ``--plan`` and resume. That a cost partition that differs from the even split
trains exactly like single-process training: tests/one_process/test_partition_training.py (one
process) and tests/multi_process/test_gloo_partition.py (two)."""
from __future__ import annotations

import pytest

import schedule as sched
from pipeline.config import ConfigError, make_config
from pipeline.spec.partition import predicted_step_time, stage_costs, stage_layers
from pipeline.spec.shapes import partition_layers, stage_num_params
from pipeline.plan.source import preset_config
from schedule.partition import balance_layers, choose_counts
from tests.helpers.partition import stage_counts


def _llama(vocab: int, layers: int = 6, hidden: int = 64):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=vocab, tie_word_embeddings=False)


def _cfg(**kw):
    base = dict(num_stages=4, schedule="1f1b", seq_length=64, batch_size=8, num_chunks=4, dtype="float32", device="cpu")
    return make_config({**base, **kw})


# --- L0: the search ------------------------------------------------------------------------------
def test_balance_moves_layers_off_the_rank_with_the_head():
    # 4 stages on 2 ranks, the head costs 3 layers: rank 1 (stages 1 and 3) gives a layer to rank 0
    assert balance_layers([1, 2, 2, 1], 1.0, [0, 0, 0, 3.0], [0, 1, 0, 1]) == [2, 1, 2, 1]
    # one stage per rank: the head's stage gets the fewest layers, the others share its layers
    # (the embedding's scatter-add, next to nothing, still leaves the extra ones to the middle)
    assert balance_layers([8, 8, 8, 8], 1.0, [1e-3, 0, 0, 2.4], [0, 1, 2, 3]) == [8, 9, 9, 6]
    # a head cheaper than a layer cannot be balanced better by whole layers: unchanged
    assert balance_layers([8, 8, 8, 8], 1.0, [0, 0, 0, 0.6], [0, 1, 2, 3]) == [8, 8, 8, 8]


def test_balance_keeps_embedding_and_head_only_stages_and_one_layer_each():
    # more stages than layers: the stages without a layer keep none, the others at least one
    assert balance_layers([0, 1, 1, 1, 1, 0], 1.0, [0, 0, 0, 0, 0, 50.0], list(range(6))) == [0, 1, 1, 1, 1, 0]
    assert balance_layers([3, 3], 1.0, [0, 100.0], [0, 1]) == [5, 1]


def test_choose_counts_keeps_the_start_unless_predicted_strictly_faster():
    calls = []

    def equal(c):
        calls.append(c)
        return 1.0

    assert choose_counts([1, 2, 2, 1], 1.0, [0, 0, 0, 3.0], [0, 1, 0, 1], equal) == [1, 2, 2, 1]
    assert calls[0] == [1, 2, 2, 1] and [2, 1, 2, 1] in calls
    assert choose_counts([1, 2, 2, 1], 1.0, [0, 0, 0, 3.0], [0, 1, 0, 1], lambda c: sum(c[1::2])) == [2, 1, 2, 1]
    assert choose_counts([1, 2, 2, 1], 1.0, [0, 0, 0, 3.0], [0, 1, 0, 1], lambda c: -sum(c[1::2])) == [1, 2, 2, 1]


# --- L0: the run's partition ---------------------------------------------------------------------
def test_stage_costs_count_the_head_and_recompute():
    hf = preset_config("llama-2-7b")
    (f0, b0), (f1, b1) = stage_costs(hf, [1, 1], 4096, False)
    layer = 2 * stage_num_params(hf, range(1), False, False) + 2 * 4096 * (4096 + 1)  # keys: (T + 1) / 2 a query
    assert f0 == layer and b0 == 2 * layer + 4096  # the embedding: a lookup, a scatter-add backward
    assert f1 - f0 == 2 * (32000 * 4096 + 4096) and b1 == 2 * f1  # the head: 2*V*h a token (and the norm)
    assert stage_costs(hf, [1, 1], 4096, True)[1] == (f1, 3 * f1)  # checkpointed: the head's loss too
    # fused last stage: its forward runs its backward, recomputing nothing; its backward is empty
    assert stage_costs(hf, [1, 1], 4096, True, fused_last=True) == [(f0, b0 + f0), (3 * f1, 0.0)]


@pytest.mark.parametrize("stages,ranks,schedule", [(4, 2, "interleaved"), (4, 4, "1f1b"), (2, 1, "gpipe"),
                                                   (8, 2, "interleaved"), (3, 3, "1f1b"), (6, 2, "interleaved"),
                                                   (7, 1, "1f1b"), (8, 4, "interleaved")])
@pytest.mark.parametrize("vocab", [512, 4096])
@pytest.mark.parametrize("offload", [False, True])
def test_cost_partition_covers_every_layer_once(stages, ranks, schedule, vocab, offload):
    from pipeline.spec.partition import _cost_counts

    hf = _llama(vocab)
    cfg = _cfg(num_stages=stages, schedule=schedule, use_offload=offload)
    parts = stage_layers(cfg, hf, ranks)
    even = partition_layers(6, stages)
    assert [i for r in parts for i in r] == list(range(6))
    assert all(len(p) >= 1 for p, e in zip(parts, even) if len(e)) and all(not p for p, e in zip(parts, even) if not e)
    _cost_counts.cache_clear()
    assert stage_layers(cfg, hf, ranks) == parts  # deterministic, cached or not
    # never predicted slower than the even split
    assert predicted_step_time(cfg, hf, ranks, parts) <= predicted_step_time(cfg, hf, ranks, even)


def test_costly_head_gets_fewer_layers_and_layers_is_the_even_split():
    hf = _llama(4096, layers=8)
    for ranks in (1, 2, 4):
        for schedule in ("1f1b", "interleaved"):
            if schedule == "interleaved" and ranks == 4:
                continue
            for stages in (4, 8):
                cfg = _cfg(num_stages=stages, schedule=schedule)
                even = [len(p) for p in partition_layers(8, stages)]
                assert stage_counts(make_config({**cfg.to_dict(), "partition": "layers"}), hf, ranks) == even
    cost = stage_counts(_cfg(num_stages=4, schedule="1f1b"), hf, 4)
    assert sum(cost) == 8 and cost[-1] < 2 and cost != [2, 2, 2, 2], cost


@pytest.mark.parametrize("stages,ranks,schedule", [(16, 2, "interleaved"), (4, 4, "1f1b"), (8, 2, "1f1b")])
def test_llama_2_7b_is_predicted_faster(stages, ranks, schedule):
    """The 7B head is 0.6 of a layer's FLOPs: whole layers cannot balance the ranks, but a lighter
    first stage (the pipeline fills sooner) is predicted faster, with and without offload."""
    hf = preset_config("llama-2-7b")
    for offload in (False, True):
        cfg = _cfg(num_stages=stages, schedule=schedule, seq_length=4096, batch_size=8, num_chunks=8,
                   use_offload=offload)
        parts, even = stage_layers(cfg, hf, ranks), partition_layers(32, stages)
        assert predicted_step_time(cfg, hf, ranks, parts) <= predicted_step_time(cfg, hf, ranks, even)
        if offload:
            assert predicted_step_time(cfg, hf, ranks, parts) < 0.999 * predicted_step_time(cfg, hf, ranks, even)


def test_memory_plan_and_plan_report_use_the_partition():
    """Parameters per stage (memory, loads) follow the cost partition; --plan prints it."""
    from pipeline.plan import fit as plan

    hf = _llama(4096)
    cfg = _cfg(num_stages=4, schedule="interleaved")
    mapping = sched.round_robin(4, 2)
    counts = [len(p) for p in stage_layers(cfg, hf, 2)]
    assert counts != [1, 2, 2, 1] and sum(counts[1::2]) < 3, counts  # rank 1 (the head's) gives layers away
    parts = stage_layers(cfg, hf, 2)
    inp, _ = plan.memory_inputs(plan.plan_spec(cfg, hf, 2, "cpu"), mapping)
    assert [s.num_layers for s in inp.stages] == counts
    assert [s.numel for s in inp.stages] == [stage_num_params(hf, p, s == 0, s == 3) for s, p in enumerate(parts)]
    assert f"decoder layers per stage: {counts} (partition cost: predicted step " in plan.report(cfg, hf, mapping, 2)
    layers = make_config({**cfg.to_dict(), "partition": "layers"})
    assert "decoder layers per stage: [1, 2, 2, 1] (partition layers)" in plan.report(layers, hf, mapping, 2)


def test_resume_refuses_another_partition_of_the_same_stages(tmp_path):
    from pipeline.run.checkpoint import ResumePoint, check_resume_partition

    saved = ResumePoint(tmp_path, {"num_stages": 4, "parts": [[0, 1], [1, 3], [3, 5], [5, 6]], "config": {}})
    check_resume_partition(saved, 4, partition_layers(6, 4), "layers")  # the same: fine
    check_resume_partition(saved, 2, partition_layers(6, 2), "cost")  # other stages: a fresh AdamW state
    check_resume_partition(None, 4, [range(0, 2), range(2, 3), range(3, 5), range(5, 6)], "cost")
    with pytest.raises(ConfigError) as err:
        check_resume_partition(saved, 4, [range(0, 2), range(2, 3), range(3, 5), range(5, 6)], "cost")
    msg = str(err.value)
    assert "\n" not in msg and "partition: 1,2,2,1 " in msg and "[[0, 2], [2, 3], [3, 5], [5, 6]]" in msg, msg


def test_resume_keeps_the_checkpoints_partition():
    """Resumed on another process count, the cost partition may differ: the run takes the
    checkpoint's layers per stage (its AdamW state is per stage) and says so; not over counts
    given, nor for another number of stages or layers (those restart AdamW)."""
    from pipeline.plan.resolve import resolve, resume_partition

    hf = _llama(4096)
    cfg = _cfg(num_stages=4, schedule="interleaved")
    on_two = stage_counts(cfg, hf, 2)
    assert on_two != stage_counts(cfg, hf, 1)
    resolved = resolve(cfg, 1, hf, on_two)
    assert resolved.cfg.partition == ",".join(map(str, on_two)) and stage_counts(resolved.replica, hf, 1) == on_two
    assert f"partition: the checkpoint's decoder layers per stage {on_two}" in resolved.lines[0]
    assert resume_partition(cfg, hf, 2, on_two) == (cfg, "")  # the same partition: nothing to say
    for saved, given in ((on_two, "1,2,2,1"), ([3, 3], "cost"), ([1, 1, 1, 1], "cost"), (None, "cost")):
        other = make_config({**cfg.to_dict(), "partition": given})
        assert resume_partition(other, hf, 1, saved) == (other, "")


def test_explicit_counts_are_the_partition(tiny_model_dir):
    """``partition: 1,2,2,1`` (what the refusal above advises) gives those layers on any process
    count; counts that do not match the stages or layers are one error line."""
    from pipeline.plan.source import resolve_model

    hf = _llama(512)
    cfg = _cfg(partition="1,1,3,1")
    assert stage_counts(cfg, hf, 2) == stage_counts(cfg, hf, 4) == [1, 1, 3, 1]
    for bad in ("1,1,x", "", "2,-1,5", "[1, 2]"):
        with pytest.raises(ConfigError, match="partition must be one of cost, layers or the decoder layers"):
            _cfg(partition=bad)
    for bad in ("1,1,4", "1,2,2,1,0"):
        with pytest.raises(ConfigError, match=f"partition '{bad}' gives"):
            resolve_model(_cfg(model=str(tiny_model_dir), partition=bad))
    with pytest.raises(ValueError, match="this run has 4 stages and 6 layers"):
        stage_layers(_cfg(partition="1,1,4"), hf, 2)


def test_choose_counts_stays_within_its_budget():
    """The choice runs on every rank and for every memory-plan candidate: at most 4 * stages + 16
    predictions (about 20 ms each for a 16-stage 7B program), even when every move improves."""
    calls = []

    def always_better(counts):
        calls.append(counts)
        return -len(calls)

    start = partition_layers(40, 20)
    counts = choose_counts([len(r) for r in start], 1.0, [0.1] + [0] * 18 + [0.6], sched.round_robin(20, 2),
                           always_better)
    assert len(calls) == 4 * 20 + 16 and sum(counts) == 40 and min(counts) >= 1


def test_activation_offload_keeps_the_even_splits_largest_stage():
    """activation_offload's peak is one stage's activations: the cost partition gives no stage
    more layers than the even split's largest (a costly head on 4 GPUs: plain checkpointing
    gives the middle stages 3 of 8 layers)."""
    hf = _llama(4096, layers=8)
    cfg = _cfg(num_stages=4, schedule="1f1b", use_offload=True, activation_checkpointing=True)
    assert stage_counts(cfg, hf, 4) == [1, 3, 3, 1]
    assert stage_counts(make_config({**cfg.to_dict(), "activation_offload": True}), hf, 4) == [2, 2, 2, 2]


def test_one_gpu_keeps_the_even_split():
    """Every stage on one GPU: no balance between GPUs to gain, and a larger fused last stage only
    lengthens its host step, which clipping holds to the end (llama-3b: 4 of 26 layers there
    before); on two GPUs the same job still moves layers."""
    hf = preset_config("llama-3b")
    base = dict(model="llama-3b", schedule="1f1b", num_stages=13, num_chunks=4, batch_size=64, seq_length=512,
                use_offload=True, activation_checkpointing=True, device="cuda", dtype="bfloat16")
    assert [len(p) for p in stage_layers(make_config(base), hf, 1)] == [2] * 13
    two = make_config({**base, "num_stages": 14, "num_chunks": 16})
    assert stage_layers(two, hf, 2) != partition_layers(26, 14)
