"""L0 tests of the schedule package: the IR, the generators, sweeps that build, validate and
simulate every schedule, bubbles and peaks, and the lowering passes alone. Pure Python, no
processes, a few seconds in all."""
from __future__ import annotations

import pytest

from schedule import (Action, Op, add_load_offload, add_optimizer, add_send_recv, build, format_schedule, generate,
                      list_schedule, peer_recv, resident_stages, round_robin, simulate, stages_of, validate)
from schedule.ir import channel, crosses, peer_stage, recv_for, remote_consumer, remote_producer, send_for
from tests.helpers.schedules import LOWERINGS, MICROBATCHES, NAMES, parse_schedule, peak_in_flight, peak_resident

# ---------------------------------------------------------------- IR


@pytest.mark.parametrize("op", list(Op))
def test_action_str_parse_round_trip(op):
    if op is Op.NORM:
        a = Action(-1, op)
    elif op in (Op.LOAD, Op.DROP, Op.OFFLOAD_GRADS, Op.STEP, Op.TIE):
        a = Action(12, op)
    else:
        a = Action(3, op, 10)
    assert Action.parse(str(a)) == a
    assert Action.parse(f" {a} ") == a


@pytest.mark.parametrize("text", ["F0", "2F", "3L4", "1NORM", "2X0", ""])
def test_action_parse_rejects(text):
    with pytest.raises(ValueError, match="cannot parse"):
        Action.parse(text)


def test_crosses_is_the_one_neighbour_rule():
    mapping = [0, 0, 1, 0]  # stages 0 and 1 share rank 0; 1 -> 2 -> 3 cross ranks
    assert [crosses(mapping, s, s + 1) for s in range(4)] == [False, True, True, False]  # no stage 4
    assert [crosses(mapping, s, s - 1) for s in range(4)] == [False, False, True, True]  # no stage -1
    for s in range(4):
        f, b = Action(s, Op.FORWARD, 1), Action(s, Op.BACKWARD, 1)
        assert (remote_producer(f, mapping), remote_consumer(f, mapping)) == (crosses(mapping, s, s - 1),
                                                                              crosses(mapping, s, s + 1))
        assert (remote_producer(b, mapping), remote_consumer(b, mapping)) == (crosses(mapping, s, s + 1),
                                                                              crosses(mapping, s, s - 1))
        for a in (f, b):
            if remote_consumer(a, mapping):  # what this compute sends, the consumer's compute receives
                consumer = Action(peer_stage(send_for(a)), a.op, a.mb)
                assert peer_recv(send_for(a)) == recv_for(consumer)
                assert channel(send_for(a), mapping) == channel(recv_for(consumer), mapping)
                assert channel(send_for(a), mapping)[0] == mapping[s]
    with pytest.raises(ValueError, match="F or B"):
        recv_for(Action(1, Op.SEND_F, 0))


# ---------------------------------------------------------------- sweeps


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("stages_per_rank", [1, 2, 3])
@pytest.mark.parametrize("name", NAMES)
def test_sweep_build_validates_and_simulates(name, num_ranks, stages_per_rank):
    S = num_ranks * stages_per_rank
    mapping = round_robin(S, num_ranks)
    for M in MICROBATCHES:
        compute = generate(name, S, M, mapping)
        validate(compute, mapping, S, M, compute_only=True)
        for offload, prefetch, clip in LOWERINGS:
            sched = build(name, S, M, mapping, offload=offload, prefetch=prefetch, clip=clip)
            # Lowering only inserts actions: the compute order is the generator's.
            assert {r: [a for a in acts if a.op in (Op.FORWARD, Op.BACKWARD)] for r, acts in sched.items()} == compute
            result = simulate(sched, mapping)
            busy = sum(e - s for acts in result.timeline.values() for s, e, a in acts)
            assert busy == pytest.approx(3 * S * M)
            assert 0 <= result.bubble_fraction < 1
            assert result.makespan >= 3 * S * M / num_ranks
            if offload and name == "gpipe":
                # gpipe's intervals do not overlap: one resident stage, two with prefetch.
                limit = 2 if prefetch else 1
                assert max(peak_resident(acts) for acts in sched.values()) <= limit


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("stages_per_rank", [1, 2, 3, 4])
@pytest.mark.parametrize("name", ["1f1b", "interleaved"])
def test_steady_state_is_strict(name, num_ranks, stages_per_rank):
    """At most W_r + 1 forwards in flight, W_r the Megatron warm-up; never a stall."""
    N, v = num_ranks, stages_per_rank
    for M in range(1, 13):
        sched = generate(name, N * v, M, round_robin(N * v, N))
        for r in range(N):
            group = N if name == "interleaved" else M
            warmup = N - r - 1 if v == 1 else 2 * (N - r - 1) + (v - 1) * group
            assert peak_in_flight(sched[r]) <= min(warmup, v * M) + 1, (name, N, v, M, r)


@pytest.mark.parametrize(
    "mapping",
    [[1, 0], [0, 0, 1, 1], [0, 1, 1, 0], [0, 1, 0], [2, 0, 1, 1, 0, 2], [0, 1, 2, 3, 3, 2, 1, 0], [0, 0, 0]],
)
@pytest.mark.parametrize("name", NAMES)
def test_arbitrary_mappings(name, mapping):
    for M in MICROBATCHES:
        for offload, prefetch, clip in LOWERINGS:
            sched = build(name, len(mapping), M, mapping, offload=offload, prefetch=prefetch, clip=clip)
            simulate(sched, mapping)


# ---------------------------------------------------------------- generators


def test_1f1b_golden_with_send_recv():
    sched = build("1f1b", 2, 4, [0, 1], offload=False, prefetch=False, clip=False)
    assert sched == parse_schedule("""
        rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0F3 0SEND_F3 0RECV_B2 0B2 0RECV_B3 0B3 0S
        rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2 1RECV_F3 1F3 1B3 1SEND_B3 1S
    """)


def test_interleaved_golden_compute_order():
    # Megatron, N=2 v=2 M=4: rank 0 warms up with 4 forwards, rank 1 with 2.
    assert generate("interleaved", 4, 4, round_robin(4, 2)) == parse_schedule("""
        rank 0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3
        rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3
    """)


def test_gpipe_golden_offload_prefetch():
    # Stage 0's forward and backward intervals are separate; its reload is prefetched right
    # where it was dropped, so DROP+LOAD cancel. Stages 2/3 merge (nothing runs between).
    sched = build("gpipe", 4, 2, round_robin(4, 2), offload=True, prefetch=True, clip=False)
    assert sched == parse_schedule("""
        rank 0: 0L 2L 0F0 0SEND_F0 0F1 0SEND_F1 2RECV_F0 2F0 2SEND_F0 2RECV_F1 2F1 2SEND_F1 2RECV_B0 2B0 2SEND_B0 2RECV_B1 2B1 2SEND_B1 2O 2S 0RECV_B0 0B0 0RECV_B1 0B1 0O 0S
        rank 1: 1L 3L 1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 3RECV_F0 3F0 3RECV_F1 3F1 3B0 3SEND_B0 3B1 3SEND_B1 3O 3S 1RECV_B0 1B0 1SEND_B0 1RECV_B1 1B1 1SEND_B1 1O 1S
    """)


def test_gpipe_golden_offload_clip():
    sched = build("gpipe", 4, 2, round_robin(4, 2), offload=True, prefetch=False, clip=True)
    assert sched == parse_schedule("""
        rank 0: 0L 0F0 0SEND_F0 0F1 0SEND_F1 0D 2RECV_F0 2L 2F0 2SEND_F0 2RECV_F1 2F1 2SEND_F1 2RECV_B0 2B0 2SEND_B0 2RECV_B1 2B1 2SEND_B1 2O 0RECV_B0 0L 0B0 0RECV_B1 0B1 0O NORM 0S 2S
        rank 1: 1RECV_F0 1L 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 1D 3RECV_F0 3L 3F0 3RECV_F1 3F1 3B0 3SEND_B0 3B1 3SEND_B1 3O 1RECV_B0 1L 1B0 1SEND_B0 1RECV_B1 1B1 1SEND_B1 1O NORM 1S 3S
    """)


def test_gpipe_prefetch_three_chunks_keeps_two_resident():
    sched = build("gpipe", 6, 2, round_robin(6, 2), offload=True, prefetch=True, clip=False)
    assert format_schedule({0: sched[0]}) == (
        "rank 0: 0L 2L 0F0 0SEND_F0 0F1 0SEND_F1 0D 4L 2RECV_F0 2F0 2SEND_F0 2RECV_F1 2F1 2SEND_F1 "
        "4RECV_F0 4F0 4SEND_F0 4RECV_F1 4F1 4SEND_F1 4RECV_B0 4B0 4SEND_B0 4RECV_B1 4B1 4SEND_B1 4O 4S "
        "0L 2RECV_B0 2B0 2SEND_B0 2RECV_B1 2B1 2SEND_B1 2O 2S 0RECV_B0 0B0 0RECV_B1 0B1 0O 0S"
    )


@pytest.mark.parametrize("N", [1, 2, 3, 4])
@pytest.mark.parametrize("M", [1, 2, 4, 7])
def test_v1_interleaved_is_classic_1f1b(N, M):
    assert generate("interleaved", N, M, list(range(N))) == generate("1f1b", N, M, list(range(N)))


def test_gpipe_has_no_interleaving():
    sched = generate("gpipe", 6, 5, round_robin(6, 3))
    for r, acts in sched.items():
        stages = stages_of(r, round_robin(6, 3))
        expect = [Action(s, Op.FORWARD, m) for s in stages for m in range(5)]
        expect += [Action(s, Op.BACKWARD, m) for s in reversed(stages) for m in range(5)]
        assert acts == expect


def test_generate_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown schedule 'zb'.*gpipe"):
        generate("zb", 2, 2, [0, 1])
    with pytest.raises(ValueError, match=r"ranks without a stage: \[1\]"):
        generate("1f1b", 2, 2, [0, 2])
    with pytest.raises(ValueError, match="num_microbatches"):
        generate("1f1b", 2, 0, [0, 1])


def test_engine_raises_on_inconsistent_orders():
    f = {0: [Action(2, Op.FORWARD, 0), Action(0, Op.FORWARD, 0)], 1: [Action(1, Op.FORWARD, 0)]}
    b = {0: [Action(2, Op.BACKWARD, 0), Action(0, Op.BACKWARD, 0)], 1: [Action(1, Op.BACKWARD, 0)]}
    with pytest.raises(ValueError, match="stalled"):
        list_schedule(f, b, {0: 0, 1: 0}, 3)


# ---------------------------------------------------------------- bubbles and memory


@pytest.mark.parametrize("N", [1, 2, 3, 4])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_v1_makespan_is_analytic(name, N, M):
    sched = build(name, N, M, list(range(N)), offload=False, prefetch=False, clip=False)
    assert simulate(sched, list(range(N))).makespan == (M + N - 1) * (1 + 2)


@pytest.mark.parametrize("N", [2, 3, 4])
@pytest.mark.parametrize("M", [4, 8])
def test_interleaving_shrinks_the_bubble(N, M):
    plain = simulate(build("1f1b", N, M, list(range(N)), offload=False, prefetch=False, clip=False), list(range(N)))
    mapping = round_robin(2 * N, N)
    inter = simulate(build("interleaved", 2 * N, M, mapping, offload=False, prefetch=False, clip=False), mapping)
    assert inter.bubble_fraction < plain.bubble_fraction


@pytest.mark.parametrize("N", [1, 2, 3, 4])
@pytest.mark.parametrize("M", [4, 5, 8])
def test_peak_in_flight(N, M):
    one_f_one_b = generate("1f1b", N, M, list(range(N)))
    gpipe = generate("gpipe", N, M, list(range(N)))
    assert [peak_in_flight(one_f_one_b[r]) for r in range(N)] == [N - r for r in range(N)]
    assert [peak_in_flight(gpipe[r]) for r in range(N)] == [M] * N


def test_custom_cost():
    sched = build("1f1b", 2, 2, [0, 1], offload=False, prefetch=False, clip=False)
    result = simulate(sched, [0, 1], cost=lambda a: {Op.FORWARD: 1.0, Op.BACKWARD: 1.0}.get(a.op, 0.0))
    assert result.makespan == (2 + 2 - 1) * 2
    assert result.timeline[0][0] == (0.0, 1.0, Action(0, Op.FORWARD, 0))


# ---------------------------------------------------------------- lowering passes alone


def test_add_send_recv_posts_receives_in_send_order():
    # Rank 1 consumes micro-batch 1 before 0; the channel is FIFO, so both receives go up front.
    compute = {
        0: [Action(0, Op.FORWARD, 0), Action(0, Op.FORWARD, 1), Action(0, Op.BACKWARD, 0), Action(0, Op.BACKWARD, 1)],
        1: [Action(1, Op.FORWARD, 1), Action(1, Op.FORWARD, 0), Action(1, Op.BACKWARD, 0), Action(1, Op.BACKWARD, 1)],
    }
    lowered = add_send_recv(compute, [0, 1])
    assert lowered == parse_schedule("""
        rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1
        rank 1: 1RECV_F0 1RECV_F1 1F1 1F0 1B0 1SEND_B0 1B1 1SEND_B1
    """)
    simulate(lowered, [0, 1])


def test_add_send_recv_posts_receives_ahead():
    """``ahead`` computes early (so the transfer runs while they compute), still in send order,
    never above a SEND of the same micro-batch (0RECV_B0 comes after 0SEND_F0, whose activation
    that gradient is made from); a rank's first computes post theirs at the start."""
    compute = generate("1f1b", 2, 4, [0, 1])
    assert add_send_recv(compute, [0, 1], ahead=1) == parse_schedule("""
        rank 0: 0F0 0SEND_F0 0RECV_B0 0F1 0SEND_F1 0B0 0RECV_B1 0F2 0SEND_F2 0B1 0RECV_B2 0F3 0SEND_F3 0RECV_B3 0B2 0B3
        rank 1: 1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1RECV_F2 1B1 1SEND_B1 1F2 1RECV_F3 1B2 1SEND_B2 1F3 1B3 1SEND_B3
    """)
    # one stage per rank and one micro-batch: every receive waits for its micro-batch's send
    assert add_send_recv(generate("gpipe", 2, 1, [0, 1]), [0, 1], ahead=2) == parse_schedule("""
        rank 0: 0F0 0SEND_F0 0RECV_B0 0B0
        rank 1: 1RECV_F0 1F0 1B0 1SEND_B0
    """)
    with pytest.raises(ValueError, match="ahead"):
        add_send_recv(compute, [0, 1], ahead=-1)


@pytest.mark.parametrize("ahead", [1, 2])
@pytest.mark.parametrize("name", NAMES)
def test_sweep_receives_ahead_validate_and_simulate(name, ahead):
    """Every schedule, with and without offload, posts each receive at least ``ahead`` computes
    before its consumer (fewer only where the rank has not computed that many yet, or has sent
    something of the micro-batch since), and the program still validates and simulates."""
    for num_ranks, per_rank in ((2, 1), (2, 3), (3, 2), (4, 2)):
        S = num_ranks * per_rank
        mapping = round_robin(S, num_ranks)
        for M in MICROBATCHES:
            for offload, prefetch, clip in LOWERINGS:
                sched = build(name, S, M, mapping, offload=offload, prefetch=prefetch, clip=clip, receive_ahead=ahead)
                simulate(sched, mapping)
                for acts in sched.values():
                    computes = [i for i, a in enumerate(acts) if a.op in (Op.FORWARD, Op.BACKWARD)]
                    for n, i in enumerate(computes):
                        if remote_producer(acts[i], mapping):
                            posted = acts.index(recv_for(acts[i]))
                            sent = max([j for j in range(i) if acts[j].op in (Op.SEND_F, Op.SEND_B)
                                        and acts[j].mb == acts[i].mb], default=-1)
                            assert posted > sent, (acts[i], acts)
                            free = sum(sent < j < i for j in computes)
                            assert sum(posted < j < i for j in computes) >= min(ahead, n, free), (acts[i], acts)


def test_add_send_recv_same_rank_neighbours_pass_locally():
    lowered = add_send_recv(generate("1f1b", 2, 1, [0, 0]), [0, 0])
    assert lowered == parse_schedule("rank 0: 0F0 1F0 1B0 0B0")


def test_add_load_offload_without_prefetch():
    sched = add_load_offload(add_send_recv(generate("1f1b", 2, 2, [0, 1]), [0, 1]), [0, 1], prefetch=False)
    assert sched == parse_schedule("""
        rank 0: 0L 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0O
        rank 1: 1RECV_F0 1L 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1O
    """)


def test_add_optimizer_orders_steps():
    """Without clipping an offloaded stage steps right after its OFFLOAD, a stage on the device
    at the end of the list; with clipping, every stage after NORM. The steps at the end go in
    the order the next iteration needs the stages (their first compute)."""
    base = add_send_recv(generate("gpipe", 4, 2, round_robin(4, 2)), round_robin(4, 2))
    plain = add_optimizer(base, round_robin(4, 2), clip=False, offload=False)
    assert format_schedule({0: plain[0]}).endswith("2RECV_B1 2B1 2SEND_B1 0RECV_B0 0B0 0RECV_B1 0B1 0S 2S")
    offloaded = add_optimizer(add_load_offload(base, round_robin(4, 2), prefetch=False), round_robin(4, 2),
                              clip=False, offload=True)
    assert format_schedule({0: offloaded[0]}).endswith("2B1 2SEND_B1 2O 2S 0RECV_B0 0L 0B0 0RECV_B1 0B1 0O 0S")
    clipped = add_optimizer(base, round_robin(4, 2), clip=True, offload=False)
    assert [str(a) for a in clipped[1][-3:]] == ["NORM", "1S", "3S"]


def test_resident_stages_are_each_ranks_first():
    assert resident_stages(round_robin(8, 4), 1) == {0, 1, 2, 3}
    assert resident_stages([1, 0, 1, 0, 1, 0], 2) == {0, 1, 2, 3}
    assert resident_stages(round_robin(4, 2), 0) == frozenset()
    with pytest.raises(ValueError):
        resident_stages(round_robin(4, 2), -1)


def test_device_stepped_stages_are_each_ranks_last_offloaded():
    from schedule.lower import device_stepped_stages

    mapping = round_robin(12, 2)  # rank 0: 0 2 4 6 8 10; rank 1: 1 3 5 7 9 11
    resident = resident_stages(mapping, 2)
    assert device_stepped_stages(mapping, resident, 1) == {10, 11}
    assert device_stepped_stages(mapping, resident, 2) == {8, 9, 10, 11}
    assert device_stepped_stages(mapping, resident, 0) == frozenset()
    assert device_stepped_stages(mapping, resident, 9) == set(range(4, 12))  # at most the offloaded ones
    assert device_stepped_stages([1, 0, 1, 0], frozenset(), 1) == {2, 3}
    with pytest.raises(ValueError):
        device_stepped_stages(mapping, resident, -1)


@pytest.mark.parametrize("clip", [False, True])
def test_offload_with_resident_stages(clip):
    """Resident stages get no LOAD/DROP/OFFLOAD and step at the end of the list; the offloaded
    stages are lowered as before."""
    mapping = round_robin(8, 2)
    sched = build("interleaved", 8, 4, mapping, offload=True, prefetch=True, clip=clip, resident=2)
    full = build("interleaved", 8, 4, mapping, offload=True, prefetch=True, clip=clip)
    transfers = (Op.LOAD, Op.DROP, Op.OFFLOAD_GRADS)
    for r, acts in sched.items():
        moved = {a.stage for a in acts if a.op in transfers}
        assert moved == set(stages_of(r, mapping)[2:])
        same = (Op.LOAD, Op.DROP, Op.OFFLOAD_GRADS, Op.STEP)  # the compute and communication are unchanged
        assert [a for a in acts if a.op not in same] == [a for a in full[r] if a.op not in same]
        steps = [Action(s, Op.STEP) for s in stages_of(r, mapping)]
        assert acts[-4:] == steps if clip else acts[-2:] == steps[:2]
    everything = build("interleaved", 8, 4, mapping, offload=True, prefetch=True, clip=clip, resident=4)
    assert not any(a.op in transfers for acts in everything.values() for a in acts)


def test_build_ignores_prefetch_without_offload():
    a = build("1f1b", 4, 4, round_robin(4, 2), offload=False, prefetch=True, clip=False)
    assert a == build("1f1b", 4, 4, round_robin(4, 2), offload=False, prefetch=False, clip=False)
