"""L0 tests of the forward-only (evaluation) program: generate -> lower -> validate -> simulate."""
from __future__ import annotations

import pytest

from schedule import Action, Op, ScheduleError, build, build_forward, format_schedule, round_robin, validate
from schedule.simulate import simulate

ALLOWED = {Op.FORWARD, Op.SEND_F, Op.RECV_F, Op.LOAD, Op.DROP}


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("per_rank", [1, 2, 3])
@pytest.mark.parametrize("num_mbs", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("offload,prefetch", [(False, False), (True, False), (True, True)])
def test_forward_only_sweep(num_ranks, per_rank, num_mbs, offload, prefetch):
    S = num_ranks * per_rank
    mapping = round_robin(S, num_ranks)
    sched = build_forward(S, num_mbs, mapping, offload=offload, prefetch=prefetch)  # validates
    ops = [a.op for acts in sched.values() for a in acts]
    assert set(ops) <= ALLOWED, format_schedule(sched)
    assert ops.count(Op.FORWARD) == S * num_mbs
    for s in range(S):
        acts = sched[mapping[s]]
        # stage-major: one residency interval per stage, so one LOAD / DROP with offload
        assert acts.count(Action(s, Op.LOAD)) == acts.count(Action(s, Op.DROP)) == int(offload)
    assert simulate(sched, mapping).makespan == pytest.approx(simulate(build_forward(
        S, num_mbs, mapping, offload=False, prefetch=False), mapping).makespan)


def test_golden_two_ranks_offload():
    sched = build_forward(4, 2, round_robin(4, 2), offload=True, prefetch=False)
    assert format_schedule(sched) == (
        "rank 0: 0L 0F0 0SEND_F0 0F1 0SEND_F1 0D 2RECV_F0 2L 2F0 2SEND_F0 2RECV_F1 2F1 2SEND_F1 2D\n"
        "rank 1: 1RECV_F0 1L 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 1D 3RECV_F0 3L 3F0 3RECV_F1 3F1 3D")


def test_validator_rejects_gradient_work_in_forward_only():
    mapping = round_robin(4, 2)
    train = build("gpipe", 4, 2, mapping, offload=True, prefetch=False, clip=True)
    with pytest.raises(ScheduleError, match="forward-only schedule"):
        validate(train, mapping, 4, 2, forward_only=True)
    fwd = build_forward(4, 2, mapping, offload=True, prefetch=False)
    fwd[0] = [Action(0, Op.OFFLOAD_GRADS) if a == Action(0, Op.DROP) else a for a in fwd[0]]
    with pytest.raises(ScheduleError, match=r"0O in a forward-only"):
        validate(fwd, mapping, 4, 2, forward_only=True)


def test_validator_rejects_missing_forward():
    mapping = round_robin(2, 2)
    fwd = build_forward(2, 2, mapping, offload=False, prefetch=False)
    fwd[1] = [a for a in fwd[1] if a not in (Action(1, Op.FORWARD, 1), Action(1, Op.RECV_F, 1))]
    fwd[0] = [a for a in fwd[0] if a != Action(0, Op.SEND_F, 1)]
    with pytest.raises(ScheduleError, match=r"missing compute actions: 1F1; every stage needs one F per"):
        validate(fwd, mapping, 2, 2, forward_only=True)


def test_forward_only_program_is_not_a_training_program():
    mapping = round_robin(2, 2)
    with pytest.raises(ScheduleError, match="needs one F and one B"):
        validate(build_forward(2, 2, mapping, offload=False, prefetch=False), mapping, 2, 2)
