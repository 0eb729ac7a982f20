"""L0: broken schedules are rejected before any process runs them, each with the values and the
marked grid (schedule/validate.py, schedule/simulate.py)."""
from __future__ import annotations

import pytest

from schedule import Action, Op, ScheduleError, build, format_grid, generate, peer_recv, round_robin, simulate, validate

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
