"""L0 tests of the schedule package: pure Python, no processes, a few seconds in all."""
from __future__ import annotations

import pytest

from schedule import (
    Action,
    Op,
    ScheduleError,
    add_load_offload,
    add_optimizer,
    add_send_recv,
    build,
    build_forward,
    format_grid,
    format_schedule,
    generate,
    list_schedule,
    peer_recv,
    resident_stages,
    round_robin,
    simulate,
    stages_of,
    validate,
)
from schedule.ir import channel, crosses, peer_stage, recv_for, remote_consumer, remote_producer, send_for

NAMES = ["gpipe", "1f1b", "interleaved"]
MICROBATCHES = [1, 2, 3, 4, 5, 8]
# (offload, prefetch, clip)
LOWERINGS = [(False, False, False), (True, False, False), (True, True, False), (False, False, True), (True, True, True)]


def parse_schedule(text: str) -> dict[int, list[Action]]:
    """Inverse of ``format_schedule``, so golden lists read like the printout."""
    out = {}
    for line in text.strip().splitlines():
        head, body = line.split(":")
        out[int(head.split()[1])] = [Action.parse(t) for t in body.split()]
    return out


def peak_in_flight(actions: list[Action]) -> int:
    """Most forwards whose backward has not run yet, i.e. activations held at once."""
    live = peak = 0
    for a in actions:
        if a.op is Op.FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.op is Op.BACKWARD:
            live -= 1
    return peak


def peak_resident(actions: list[Action]) -> int:
    resident, peak = set(), 0
    for a in actions:
        if a.op is Op.LOAD:
            resident.add(a.stage)
        elif a.op in (Op.DROP, Op.OFFLOAD_GRADS):
            resident.discard(a.stage)
        peak = max(peak, len(resident))
    return peak


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


# ---------------------------------------------------------------- broken schedules


def _lowered_1f1b(M: int = 4) -> dict[int, list[Action]]:
    return build("1f1b", 2, M, [0, 1], offload=False, prefetch=False, clip=False)


def _check_rejected(sched, mapping, S, M, match, compute_only=False):
    with pytest.raises(ScheduleError, match=match) as info:
        validate(sched, mapping, S, M, compute_only=compute_only)
    message = str(info.value)
    assert "rank 0 |" in message and "step" in message  # the grid comes along
    return message


def test_reject_missing_backward():
    sched = _lowered_1f1b()
    sched[1].remove(Action.parse("1B2"))
    _check_rejected(sched, [0, 1], 2, 4, "missing compute actions: 1B2")


def test_reject_forward_after_its_backward():
    sched = generate("1f1b", 2, 2, [0, 1])
    sched[1][0], sched[1][1] = sched[1][1], sched[1][0]
    message = _check_rejected(sched, [0, 1], 2, 2, "1B0 runs before its forward 1F0", compute_only=True)
    assert ">>1B0<<" in message and ">>1F0<<" in message


def test_reject_compute_on_wrong_rank():
    sched = generate("1f1b", 2, 2, [0, 1])
    sched[1].remove(Action.parse("1F1"))
    sched[0].append(Action.parse("1F1"))
    _check_rejected(sched, [0, 1], 2, 2, r"1F1 is on rank 0 but stage 1 belongs to rank 1", compute_only=True)


def test_reject_swapped_channel_order():
    sched = _lowered_1f1b()
    acts = sched[1]
    # Post both receives up front, but in the wrong order.
    acts.remove(Action.parse("1RECV_F1"))
    acts.insert(0, Action.parse("1RECV_F1"))
    message = _check_rejected(sched, [0, 1], 2, 4, "receives must be posted in the order of the sends")
    assert "0SEND_F0" in message and "1RECV_F1" in message and message.count(">>") == 2


def _1f1b_receives_by_kind(num_stages: int, num_microbatches: int) -> tuple[dict, list[int]]:
    """The 1F1B program as lowered when activations and gradients were separate FIFOs: each
    receive right before its consumer. This is the program that hung 2-GPU runs."""
    mapping = round_robin(num_stages, 2)
    sched = build("1f1b", num_stages, num_microbatches, mapping, offload=False, prefetch=False, clip=False)
    for acts in sched.values():
        recvs = [a for a in acts if a.op in (Op.RECV_F, Op.RECV_B)]
        for r in recvs:
            acts.remove(r)
        for r in recvs:
            consumer = Action(r.stage, Op.FORWARD if r.op is Op.RECV_F else Op.BACKWARD, r.mb)
            acts.insert(acts.index(consumer), r)
    return sched, mapping


def test_reject_gradient_received_ahead_of_sent_activations():
    """Rank 1 has sent stage 1's activation of micro-batch 3 when it sends its first gradient;
    rank 0 posts the gradient's receive first. On one FIFO per rank pair the gradient waits
    behind the activation, which waits for a receive rank 0 posts after the gradient's backward."""
    sched, mapping = _1f1b_receives_by_kind(4, 4)
    message = _check_rejected(sched, mapping, 4, 4, "channel rank 1 -> rank 0, message #3")
    assert "rank 1 sends 1SEND_F3" in message and "rank 0 posts 2RECV_B0" in message
    assert ">>1SEND_F3<<" in message and ">>2RECV_B0<<" in message


def test_lowering_posts_activations_and_gradients_in_one_send_order():
    mapping = round_robin(8, 2)
    sched = build("1f1b", 8, 16, mapping, offload=False, prefetch=False, clip=False)
    from_rank_1 = [a for a in sched[0] if a.op in (Op.RECV_F, Op.RECV_B)]
    sent_by_1 = [peer_recv(a) for a in sched[1] if a.op in (Op.SEND_F, Op.SEND_B)]
    assert from_rank_1 == sent_by_1
    # the activations of stage 5 (sent in rank 1's warm-up) are received before the first gradient
    assert from_rank_1.index(Action.parse("6RECV_F15")) < from_rank_1.index(Action.parse("6RECV_B0"))


def test_reject_mutual_recv_deadlock():
    sched = _lowered_1f1b(M=1)
    sched[0].remove(Action.parse("0SEND_F0"))
    sched[0].insert(sched[0].index(Action.parse("0B0")) + 1, Action.parse("0SEND_F0"))
    message = _check_rejected(sched, [0, 1], 2, 1, "deadlock")
    assert ">>0B0<<" in message and ">>1F0<<" in message


def test_reject_compute_on_dropped_stage():
    mapping = round_robin(6, 2)
    sched = build("gpipe", 6, 2, mapping, offload=True, prefetch=False, clip=False)
    loads = [i for i, a in enumerate(sched[0]) if a == Action(0, Op.LOAD)]
    del sched[0][loads[1]]  # the reload before stage 0's backward interval
    _check_rejected(sched, mapping, 6, 2, "0B0 runs while stage 0 is not resident")


def test_reject_release_of_a_stage_never_loaded():
    sched = build("1f1b", 2, 2, [0, 1], offload=True, prefetch=False, clip=False, resident=1)
    sched[0].insert(sched[0].index(Action(0, Op.STEP)), Action(0, Op.OFFLOAD_GRADS))
    with pytest.raises(ScheduleError, match="never loaded"):
        validate(sched, [0, 1], 2, 2)


def test_reject_drop_after_backward():
    sched = build("1f1b", 2, 2, [0, 1], offload=True, prefetch=False, clip=False)
    sched[1] = [Action(1, Op.DROP) if a == Action(1, Op.OFFLOAD_GRADS) else a for a in sched[1]]
    _check_rejected(sched, [0, 1], 2, 2, "gradients would be lost")


def test_reject_missing_step():
    sched = _lowered_1f1b()
    sched[0].remove(Action.parse("0S"))
    _check_rejected(sched, [0, 1], 2, 4, "stage 0 has no 0S")


def test_reject_step_before_norm_and_missing_norm():
    sched = build("1f1b", 2, 2, [0, 1], offload=False, prefetch=False, clip=True)
    sched[0].remove(Action.parse("0S"))
    sched[0].insert(sched[0].index(Action.parse("NORM")), Action.parse("0S"))
    _check_rejected(sched, [0, 1], 2, 2, "0S runs before NORM")
    sched = build("1f1b", 2, 2, [0, 1], offload=False, prefetch=False, clip=True)
    sched[1].remove(Action.parse("NORM"))
    _check_rejected(sched, [0, 1], 2, 2, r"ranks \[1\] have no NORM")


def test_reject_duplicate_and_out_of_range():
    sched = _lowered_1f1b()
    sched[0].insert(3, Action.parse("0F1"))
    _check_rejected(sched, [0, 1], 2, 4, "0F1 appears twice")
    sched = _lowered_1f1b()
    sched[0].append(Action.parse("0F9"))
    _check_rejected(sched, [0, 1], 2, 4, "micro-batch 9; micro-batches are 0..3")


def test_reject_missing_recv():
    sched = _lowered_1f1b()
    sched[1].remove(Action.parse("1RECV_F2"))
    _check_rejected(sched, [0, 1], 2, 4, "1F2 needs 1RECV_F2 posted before it")


def test_simulate_alone_reports_deadlock_at_the_end_of_a_list():
    # Rank 0 sends but rank 1 never posts the receive.
    sched = {0: [Action.parse("0F0"), Action.parse("0SEND_F0")], 1: []}
    with pytest.raises(ScheduleError, match="never posts 1RECV_F0") as info:
        simulate(sched, [0, 1])
    assert "<end>" in str(info.value)


def test_schedule_error_is_value_error_and_grid_marks():
    assert issubclass(ScheduleError, ValueError)
    grid = format_grid({0: [Action.parse("0F0")], 1: [Action.parse("1F0")]}, mark=(1, 0))
    assert grid.splitlines() == ["step   | 0", "rank 0 | 0F0", "rank 1 | >>1F0<<"]


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


def test_balanced_segments():
    from schedule.costmodel import attention_key_cost, balanced_segments, segment_costs

    assert balanced_segments(12, 3) == [4, 4, 4]
    assert balanced_segments(10, 3) == [3, 4, 3]  # equal split, at most one apart
    assert balanced_segments(3, 3) == [1, 1, 1]
    k = attention_key_cost(4096, 11008, 32, 32)  # Llama-2-7B
    assert 3.9e-5 < k < 4.2e-5
    lengths = balanced_segments(32768, 4, k)
    assert sum(lengths) == 32768 and lengths == sorted(lengths, reverse=True)
    shares = segment_costs(lengths, k)
    assert sum(shares) == pytest.approx(1) and max(shares) - min(shares) < 1e-3
    equal = segment_costs([8192] * 4, k)
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
