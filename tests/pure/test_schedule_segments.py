"""L0: sequence segments (Seq1F1B) in the schedule IR: segment actions, the key/value order,
sweeps, golden lists, bubbles and the rejections of a wrong segment order."""
from __future__ import annotations

import pytest

from schedule import Action, Op, ScheduleError, build, build_forward, generate, round_robin, simulate, validate
from tests.helpers.schedules import LOWERINGS, NAMES, parse_schedule, peak_in_flight

# ---------------------------------------------------------------- sequence segments (Seq1F1B)


def test_segment_actions_print_and_parse():
    a = Action(2, Op.SEND_B, 3, 1)
    assert str(a) == "2SEND_B3.1" and Action.parse("2SEND_B3.1") == a
    assert str(Action(0, Op.FORWARD, 0, 0)) == "0F0.0" and Action.parse("0F0.0") != Action(0, Op.FORWARD, 0)
    assert Action(1, Op.BACKWARD, 2) == Action(1, Op.BACKWARD, 2, None)  # without segments: as before
    for text in ["3L.1", "2F.1", "NORM.0", "2F0.", "2F0.1.2"]:
        with pytest.raises(ValueError, match="cannot parse"):
            Action.parse(text)


def test_kv_predecessor():
    from schedule.ir import kv_predecessor

    K = 3
    assert kv_predecessor(Action(1, Op.FORWARD, 4, 0), K) is None
    assert kv_predecessor(Action(1, Op.FORWARD, 4, 2), K) == Action(1, Op.FORWARD, 4, 1)
    assert kv_predecessor(Action(1, Op.BACKWARD, 4, 2), K) is None  # the last segment's backward comes first
    assert kv_predecessor(Action(1, Op.BACKWARD, 4, 0), K) == Action(1, Op.BACKWARD, 4, 1)
    assert kv_predecessor(Action(1, Op.FORWARD, 4), K) is None


@pytest.mark.parametrize("num_ranks,stages_per_rank", [(1, 1), (2, 1), (3, 1), (2, 2), (3, 2), (4, 1)])
@pytest.mark.parametrize("name", NAMES)
def test_segment_sweep_build_validates_and_simulates(name, num_ranks, stages_per_rank):
    S = num_ranks * stages_per_rank
    mapping = round_robin(S, num_ranks)
    for M in [1, 2, 3, 5]:
        for K in [2, 3, 4]:
            compute = generate(name, S, M, mapping, num_segments=K)
            validate(compute, mapping, S, M, compute_only=True, num_segments=K)
            for offload, prefetch, clip in LOWERINGS:
                sched = build(name, S, M, mapping, offload=offload, prefetch=prefetch, clip=clip, num_segments=K)
                assert {r: [a for a in acts if a.op in (Op.FORWARD, Op.BACKWARD)] for r, acts in sched.items()} == compute
                result = simulate(sched, mapping)
                busy = sum(e - s for acts in result.timeline.values() for s, e, a in acts)
                assert busy == pytest.approx(3 * S * M * K)
            fwd = build_forward(S, M, mapping, offload=True, prefetch=True, num_segments=K)
            assert sum(a.op is Op.FORWARD for acts in fwd.values() for a in acts) == S * M * K


@pytest.mark.parametrize("name", NAMES)
def test_one_segment_is_the_plain_schedule(name):
    mapping = round_robin(4, 2)
    assert generate(name, 4, 5, mapping, num_segments=1) == generate(name, 4, 5, mapping)
    assert build(name, 4, 5, mapping, offload=True, prefetch=True, clip=True, num_segments=1) == build(
        name, 4, 5, mapping, offload=True, prefetch=True, clip=True)


def test_seq1f1b_golden():
    # Seq1F1B (arXiv 2406.03488) on 2 ranks, 2 micro-batches of 3 segments: the last stage
    # backs up segment 2 right after its forward; the first stage warms up N - 1 + K - 1 = 3.
    assert generate("1f1b", 2, 2, [0, 1], num_segments=3) == parse_schedule("""
        rank 0: 0F0.0 0F0.1 0F0.2 0F1.0 0B0.2 0F1.1 0B0.1 0F1.2 0B0.0 0B1.2 0B1.1 0B1.0
        rank 1: 1F0.0 1F0.1 1F0.2 1B0.2 1F1.0 1B0.1 1F1.1 1B0.0 1F1.2 1B1.2 1B1.1 1B1.0
    """)
    assert generate("gpipe", 2, 1, [0, 1], num_segments=2) == parse_schedule("""
        rank 0: 0F0.0 0F0.1 0B0.1 0B0.0
        rank 1: 1F0.0 1F0.1 1B0.1 1B0.0
    """)


@pytest.mark.parametrize("N", [1, 2, 3, 4])
@pytest.mark.parametrize("M", [1, 2, 4])
@pytest.mark.parametrize("K", [2, 3, 4])
def test_segments_makespan_and_in_flight(N, M, K):
    """Segments are the pipeline's unit: (M K + N - 1) (1 + 2), and 1F1B holds at most
    N - r - 1 + K segments' activations on rank r (gpipe all M K)."""
    mapping = list(range(N))
    for name in ("gpipe", "1f1b"):
        sched = build(name, N, M, mapping, offload=False, prefetch=False, clip=False, num_segments=K)
        assert simulate(sched, mapping).makespan == (M * K + N - 1) * 3
    one_f_one_b = generate("1f1b", N, M, mapping, num_segments=K)
    assert [peak_in_flight(one_f_one_b[r]) for r in range(N)] == [min(M * K, N - r - 1 + K) for r in range(N)]


def test_segments_shrink_the_bubble():
    plain = simulate(build("1f1b", 4, 2, list(range(4)), offload=False, prefetch=False, clip=False), list(range(4)))
    seg = simulate(build("1f1b", 4, 2, list(range(4)), offload=False, prefetch=False, clip=False, num_segments=4),
                   list(range(4)))
    assert seg.bubble_fraction < plain.bubble_fraction / 2


def test_reject_segment_order():
    mapping = [0]
    ok = parse_schedule("rank 0: 0F0.0 0F0.1 0B0.1 0B0.0")
    validate(ok, mapping, 1, 1, compute_only=True, num_segments=2)
    with pytest.raises(ScheduleError, match=r"0F0\.1 runs before 0F0\.0 .*attends to its keys/values"):
        validate(parse_schedule("rank 0: 0F0.1 0F0.0 0B0.1 0B0.0"), mapping, 1, 1, compute_only=True, num_segments=2)
    with pytest.raises(ScheduleError, match=r"0B0\.0 runs before 0B0\.1 .*gradients of its keys/values"):
        validate(parse_schedule("rank 0: 0F0.0 0F0.1 0B0.0 0B0.1"), mapping, 1, 1, compute_only=True, num_segments=2)
    with pytest.raises(ScheduleError, match=r"segment order"):  # the simulator alone too
        simulate(parse_schedule("rank 0: 0F0.0 0F0.1 0B0.0 0B0.1"), mapping)
    # A lowered program: rank 0 takes the backward of segment 0 before that of segment 1.
    sched = build("1f1b", 2, 2, [0, 1], offload=True, prefetch=True, clip=True, num_segments=2)
    acts = sched[0]
    i, j = acts.index(Action.parse("0B0.1")), acts.index(Action.parse("0B0.0"))
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(ScheduleError, match=r"rank 0 step \d+: 0B0\.0 runs before 0B0\.1"):
        validate(sched, [0, 1], 2, 2, num_segments=2)


def test_reject_wrong_segments():
    mapping = [0]
    with pytest.raises(ScheduleError, match=r"names segment 0; expected no segment"):
        validate(parse_schedule("rank 0: 0F0.0 0B0.0"), mapping, 1, 1, compute_only=True)
    with pytest.raises(ScheduleError, match=r"names segment 2; expected a segment 0..1"):
        validate(parse_schedule("rank 0: 0F0.0 0F0.2 0B0.2 0B0.0"), mapping, 1, 1, compute_only=True, num_segments=2)
    with pytest.raises(ScheduleError, match=r"names segment None"):
        validate(parse_schedule("rank 0: 0F0 0B0"), mapping, 1, 1, compute_only=True, num_segments=2)
    with pytest.raises(ScheduleError, match=r"missing compute actions: 0F0\.2, 0B0\.2.*1 micro-batches x 3 segments"):
        validate(parse_schedule("rank 0: 0F0.0 0F0.1 0B0.1 0B0.0"), mapping, 1, 1, compute_only=True, num_segments=3)
    with pytest.raises(ValueError, match=r"num_segments \(0\) must be >= 1"):
        generate("1f1b", 2, 2, [0, 1], num_segments=0)


def _segment_costs(lengths: list[int], key_cost: float) -> list[float]:
    """Each segment's fraction of a causal sequence's compute: position p costs 1 plus key_cost
    for each of the p + 1 keys it attends."""
    cost = [1 + key_cost * (p + 1) for p in range(sum(lengths))]
    ends = [sum(lengths[:i + 1]) for i in range(len(lengths))]
    return [sum(cost[e - n:e]) / sum(cost) for n, e in zip(lengths, ends)]


def test_balanced_segments():
    from pipeline.plan.source import preset_config
    from pipeline.spec.shapes import model_key_cost
    from schedule.costmodel import balanced_segments

    assert balanced_segments(12, 3) == [4, 4, 4]
    assert balanced_segments(10, 3) == [3, 4, 3]  # equal split, at most one apart
    assert balanced_segments(3, 3) == [1, 1, 1]
    k = model_key_cost(preset_config("llama-2-7b"))
    assert 3.9e-5 < k < 4.2e-5
    lengths = balanced_segments(32768, 4, k)
    assert sum(lengths) == 32768 and lengths == sorted(lengths, reverse=True)
    shares = _segment_costs(lengths, k)
    assert sum(shares) == pytest.approx(1) and max(shares) - min(shares) < 1e-3
    equal = _segment_costs([8192] * 4, k)
    assert max(equal) / min(equal) > 1.8  # what balancing buys: the last segment is not 1.85x the first
    aligned = balanced_segments(32768, 4, k, multiple=64)
    assert sum(aligned) == 32768 and all(n % 64 == 0 for n in aligned[:-1])
    assert balanced_segments(200, 3, multiple=64) == [64, 64, 72]
    assert balanced_segments(5, 4, 10.0, multiple=64) == [2, 1, 1, 1]  # alignment would empty segments: tokens
    with pytest.raises(ValueError, match="cannot cut a sequence of 3 tokens into 4 segments"):
        balanced_segments(3, 4)
    with pytest.raises(ValueError, match="key_cost"):
        balanced_segments(8, 2, -1.0)


def test_costmodel_segments():
    from schedule.costmodel import predict

    mapping = [0, 1]
    kw = dict(gpu_of_rank=[0, 1], groups=[0, 0], stage_compute_s={0: (1.0, 2.0), 1: (1.0, 2.0)},
              stage_bytes=[1, 1], link_gbps=1.0, root_gbps=1.0)
    plain = predict(build("1f1b", 2, 2, mapping, offload=False, prefetch=False, clip=False), mapping, **kw)
    seg = build("1f1b", 2, 2, mapping, offload=False, prefetch=False, clip=False, num_segments=4)
    even = predict(seg, mapping, **kw)
    compute = [sum(e - s for s, e, a in rows if a.op in (Op.FORWARD, Op.BACKWARD)) for rows in even.timeline.values()]
    assert compute == pytest.approx([6.0, 6.0])  # a micro-batch's time, split over its segments
    assert even.step_time < plain.step_time  # the pipeline fills in segments
    skew = predict(seg, mapping, segment_share=[0.1, 0.2, 0.3, 0.4], **kw)
    first = [e - s for s, e, a in skew.timeline[0] if a == Action(0, Op.FORWARD, 0, 3)]
    assert first == pytest.approx([0.4])
    with pytest.raises(ValueError, match="segment_share has 2 values"):
        predict(seg, mapping, segment_share=[0.5, 0.5], **kw)
