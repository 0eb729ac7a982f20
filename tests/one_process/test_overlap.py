"""The CPU optimizer overlaps the next iteration: after NORM a stage's next compute waits for its
own AdamW step only, not for the steps of stages needed later, and training stays exact."""
from __future__ import annotations

import time

import pytest

from schedule.ir import Op
from tests.helpers.reference import assert_same_training, in_process_trainer, trainer_masters
from tests.helpers.runs import ITERS, reference_result, tiny_cfg

SLOW_S = 0.5


def test_next_iteration_starts_while_a_later_stage_steps(tiny_model_dir):
    trainer = in_process_trainer(tiny_cfg(tiny_model_dir, schedule="gpipe", use_offload=True, use_prefetch=True))
    slow = trainer.stores[3]  # the last stage: stepped last, computed last
    real_step, step_ends = slow.adamw.step_chunks, []

    def slow_step(*args, **kw):
        time.sleep(SLOW_S)
        out = real_step(*args, **kw)
        step_ends.append(time.perf_counter())
        return out

    slow.adamw.step_chunks = slow_step
    real_forward, first_forward = trainer.executor._handlers[Op.FORWARD], []

    def forward(a):
        if a.stage == 2 and a.mb == 0:  # issued after 3L (prefetch loads one interval ahead)
            first_forward.append(time.perf_counter())
        real_forward(a)

    trainer.executor._handlers[Op.FORWARD] = forward
    history = trainer.train()

    assert len(first_forward) == len(step_ends) == ITERS
    # In iteration k + 1, stage 2 computes while iteration k's step of stage 3 still runs, though
    # the list loads stage 3 before that compute ...
    assert all(first_forward[k + 1] < step_ends[k] for k in range(ITERS - 1)), (first_forward, step_ends)
    # ... stage 3's own compute waits for it, and the wait is reported as optimizer wait ...
    waits = [h["optimizer_wait_seconds"] for h in history]
    assert all(w > SLOW_S / 3 for w in waits[1:]), waits
    # ... and the training is still exactly ordinary training.
    assert_same_training([h["loss"] for h in history], trainer_masters(trainer), *reference_result(str(tiny_model_dir)))


@pytest.mark.slow
def test_training_runs_with_startup_objects_frozen_out_of_the_gc(tiny_model_dir):
    """While training, what start-up and the first step built is out of the cyclic GC's reach (a
    full collection would walk it all); the time the GC still takes is reported per iteration; afterwards the
    process collects as before."""
    import gc

    trainer = in_process_trainer(tiny_cfg(tiny_model_dir, schedule="gpipe", use_offload=True))
    frozen = []
    real_forward = trainer.executor._handlers[Op.FORWARD]

    def forward(a):
        frozen.append(gc.get_freeze_count())
        real_forward(a)

    trainer.executor._handlers[Op.FORWARD] = forward
    per_step, real_run = [], trainer.executor.run

    def run(*args, **kwargs):
        per_step.append(gc.get_freeze_count())
        return real_run(*args, **kwargs)

    trainer.executor.run = run
    history = trainer.train()
    assert min(frozen) > 10_000  # torch's, transformers' and the trainer's objects
    # what the first step built (on a GPU: the compiled layers) is frozen too (frozen objects
    # that die leave the count, so without that freeze it could only fall)
    assert per_step[1] > per_step[0], per_step
    assert gc.get_freeze_count() == 0 and trainer.gc_clock not in gc.callbacks
    assert all(h["gc_seconds"] >= 0.0 for h in history)


def test_gc_clock_sums_collections():
    from pipeline.run.trainer import GcClock

    clock = GcClock()
    clock("start", {})
    time.sleep(0.02)
    clock("stop", {})
    assert 0.02 <= clock.take() < 1.0 and clock.take() == 0.0


@pytest.mark.slow
def test_timeline_draws_compute_without_the_waits_before_it(tiny_model_dir, tmp_path):
    """A forward that waits for its stage's optimizer step is drawn from when it computes: the
    timeline's forward and backward bars add up to the iteration's compute time, not to compute
    plus that wait (the same holds for a wait for a received input)."""
    from pipeline.run.timeline import read_chrome_trace

    cfg = tiny_cfg(tiny_model_dir, schedule="gpipe", use_offload=True, use_prefetch=True, timeline=True,
                   save_dir=str(tmp_path))
    trainer = in_process_trainer(cfg)
    slow = trainer.stores[3]
    real_step = slow.adamw.step_chunks

    def slow_step(*args, **kw):
        time.sleep(SLOW_S)
        return real_step(*args, **kw)

    slow.adamw.step_chunks = slow_step
    history = trainer.train()
    last = history[-1]
    assert last["optimizer_wait_seconds"] > SLOW_S / 3  # the recorded iteration did wait
    bars = [e["end"] - e["start"] for e in read_chrome_trace(tmp_path / "timeline.json") if e["op"] in ("F", "B")]
    assert sum(bars) == pytest.approx(last["compute_seconds"], rel=0.05, abs=0.01), (sum(bars), last)
