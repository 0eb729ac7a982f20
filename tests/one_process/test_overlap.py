"""The CPU optimizer overlaps the next iteration: after NORM a stage's next compute waits for its
own AdamW step only, not for the steps of stages needed later, and training stays exact: the
clipped steps overlapped with the next iteration give the weights of the plain order, every step
of an iteration done before the next starts."""
from __future__ import annotations

import functools
import time

import pytest

from offload import loader
from schedule.ir import Action, Op
from tests.helpers.reference import assert_same_training, in_process_trainer, trainer_masters
from tests.helpers.runs import ITERS, reference_result, tiny_cfg

SLOW_S = 0.5
CLIP = 0.05  # far below the tiny model's gradient norms (the test checks): every step is clipped


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
@pytest.mark.gc_freeze
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
    trainer.write_optional()  # the timeline is an optional output, written after the model
    last = history[-1]
    assert last["optimizer_wait_seconds"] > SLOW_S / 3  # the recorded iteration did wait
    bars = [e["end"] - e["start"] for e in read_chrome_trace(tmp_path / "timeline.json") if e["op"] in ("F", "B")]
    assert sum(bars) == pytest.approx(last["compute_seconds"], rel=0.05, abs=0.01), (sum(bars), last)


def _step_before_the_norm(trainer) -> None:
    """Fault: stage 3 steps right after its OFFLOAD_GRADS, where an unclipped list puts it: before
    NORM, so before the clip coefficient (and whether the gradients are finite) is known."""
    actions = trainer.actions
    actions.remove(Action(3, Op.STEP))
    actions.insert(actions.index(Action(3, Op.OFFLOAD_GRADS)) + 1, Action(3, Op.STEP))


def _unclipped_step(trainer, stage: int = 2) -> None:
    """Fault: ``stage`` steps with its unclipped gradients."""
    store = trainer.stores[stage]
    real = store.step
    store.step = lambda lr, clip_coef: real(lr, None)


def _load_ahead_of_its_step(monkeypatch):
    """Fault: a LOAD streaming behind its stage's step copies the masters as if every chunk were
    written already: the next iteration computes with weights the step has not updated yet."""
    monkeypatch.setattr(loader.StepProgress, "written", lambda self: (1 << 62, False))


def _clipped_training(tiny_model_dir, overlap: bool, fault=None, device_steps: int = 0):
    """Four clipped iterations of 1F1B with stage 0 resident and stages 1-3 offloaded (the last
    ``device_steps`` of them stepped on the device), each CPU step made slow: the trainer as it
    runs (``overlap``: iteration k + 1 starts while k's steps run) or in the plain order (every
    step of iteration k done before k + 1 starts). ``fault(trainer)`` is planted first. Returns
    the history, the masters and whether a first forward of some iteration started before the
    previous iteration's last CPU step had ended."""
    trainer = in_process_trainer(tiny_cfg(tiny_model_dir, schedule="1f1b", use_offload=True, use_prefetch=True,
                                          resident_stages=1, grad_clip=CLIP, num_iterations=4,
                                          device_steps=device_steps))
    offloaded = [st for st in trainer.stores.values() if st.offload and not st.residency.device_step]
    assert len(offloaded) == 3 - device_steps
    step_ends, first_forwards = [], []
    for st in offloaded:
        real_step = st.adamw.step_chunks

        def slow_step(*args, real=real_step, **kw):
            time.sleep(SLOW_S / 5)
            real(*args, **kw)
            step_ends.append(time.perf_counter())

        st.adamw.step_chunks = slow_step
    ex = trainer.executor
    real_forward, real_run = ex._handlers[Op.FORWARD], ex.run

    def forward(a):
        if a.stage == 0 and a.mb == 0:
            first_forwards.append(time.perf_counter())
        real_forward(a)

    def plain_run(*args, **kw):
        result = real_run(*args, **kw)
        ex.finish()  # the plain order: every STEP of this iteration done before the next starts
        return result

    ex._handlers[Op.FORWARD] = forward
    if not overlap:
        ex.run = plain_run
    if fault is not None:
        fault(trainer)
    history = trainer.train()
    n = len(offloaded)
    last_step = [max(step_ends[n * k:n * (k + 1)]) for k in range(len(history))]
    overlapped = any(first_forwards[k + 1] < last_step[k] for k in range(len(history) - 1))
    return history, trainer_masters(trainer), overlapped


@functools.lru_cache(maxsize=None)
def _plain_training(tiny_model_dir):
    """``_clipped_training`` in the plain order, which every comparison here is with: the same run
    whichever test asks (no fault is planted in it), so it is trained once (its sleeps alone are
    over a second)."""
    return _clipped_training(tiny_model_dir, overlap=False)


def _outcome(run):
    history, masters, _ = run
    return [h["loss"] for h in history], masters


@pytest.mark.parametrize("device_steps", [0, 1])
def test_overlapped_clipped_steps_give_the_plain_order_weights(tiny_model_dir, device_steps):
    """The clipped steps of iteration k run while iteration k + 1 computes its first stages (the
    resident stage 0 does not wait for the offloaded stages' steps), and the weights are those of
    stepping everything on the CPU before going on, bit for bit: each stage computes only after
    its own step of the clipped gradients, also the last one stepped on the device beside the
    CPU (``device_steps``; on the CPU the same kernel)."""
    plain = _plain_training(tiny_model_dir)
    overlapped = _clipped_training(tiny_model_dir, overlap=True, device_steps=device_steps)
    norms = [h["grad_norm"] for h in plain[0] + overlapped[0]]
    assert all(n > 2 * CLIP for n in norms), norms  # clipping bites: every coefficient is below 1/2
    assert overlapped[2] and not plain[2], "the overlapped run did not overlap, or the plain one did"
    assert_same_training(*_outcome(overlapped), *_outcome(plain), rtol=0.0)


@pytest.mark.parametrize("fault", ["unclipped", "before_norm", "load_ahead", "device_unclipped"])
@pytest.mark.slow
def test_overlapped_clipped_steps_with_a_fault_are_caught(tiny_model_dir, monkeypatch, fault):
    """Mutations: a stage stepped with its unclipped gradients (on the CPU, or on the device with
    ``device_steps``), a stage stepped before the norm is known (where an unclipped list steps
    it), and a next iteration's LOAD that does not wait for its own stage's step each train
    other weights than the plain order, far outside any noise."""
    plain = _plain_training(tiny_model_dir)
    if fault == "load_ahead":
        _load_ahead_of_its_step(monkeypatch)
    planted = {"unclipped": _unclipped_step, "before_norm": _step_before_the_norm,
               "device_unclipped": lambda trainer: _unclipped_step(trainer, 3)}.get(fault)
    faulty = _clipped_training(tiny_model_dir, overlap=True, fault=planted,
                               device_steps=1 if fault == "device_unclipped" else 0)
    with pytest.raises(AssertionError):
        assert_same_training(*_outcome(faulty), *_outcome(plain), rtol=1e-3)
