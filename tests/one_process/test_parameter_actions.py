"""L1: the memory plan's parameter actions against what the stores move, on the CPU in one process.

The plan (``pipeline.spec.footprint.Ledger``) assumes, per stage: LOAD takes a buffer of the
stage's compute-dtype weights from the device pool, the first gradient-making compute of the
iteration takes one for the gradients, DROP gives the weights' back and OFFLOAD_GRADS both (a
LoRA stage's: the frozen weights' only); resident stages hold their copies, gradients, masters
and AdamW moments on the device, offloaded ones their masters, gradients, moments and pinned
compute copy in host memory. Here one iteration of a tiny model runs with every LOAD, DROP,
OFFLOAD_GRADS and compute recorded, and each action's takes and gives from the pool, each
stage's parameter count and each kind of static parameter memory must be the plan's, byte for
byte. The activations' side of the plan has its own check against measured peaks
(``tests/one_process/test_memory_measured.py``)."""
from __future__ import annotations

import pytest
import torch

import schedule as sched
from pipeline.spec import footprint
from tests.helpers.reference import in_process_trainer
from tests.helpers.runs import tiny_cfg

# one per way a stage's parameters can live: offloaded (float32: the compute copy is the master;
# bfloat16 or a delayed update: a pinned copy of its own), resident beside offloaded, LoRA's frozen
# weights offloaded and resident, the fused last stage (its forward takes the gradient buffer),
# resident in bfloat16 (no fp32 copy of the gradient: the norm and the step convert it), an
# offloaded stage stepped on the device (its AdamW moments there), a 4-bit base offloaded (its packed
# bytes in a buffer of their own beside the compute-dtype weights')
CASES = {
    "offloaded": dict(use_offload=True, resident_stages=0, schedule="gpipe"),
    "offloaded-bf16": dict(use_offload=True, resident_stages=0, dtype="bfloat16", schedule="1f1b"),
    "offloaded-delayed": dict(use_offload=True, resident_stages=0, delayed_update=True, schedule="gpipe"),
    "resident-and-offloaded": dict(use_offload=True, resident_stages=1, num_stages=6, schedule="interleaved"),
    "fused-last": dict(use_offload=True, resident_stages=0, fuse_last_stage="true", schedule="1f1b"),
    "lora-offloaded": dict(use_offload=True, resident_stages=1, lora_rank=4, num_stages=3, schedule="gpipe"),
    "resident": dict(use_offload=False, schedule="gpipe"),
    "resident-bf16": dict(use_offload=False, dtype="bfloat16", schedule="1f1b"),
    "lora-bf16": dict(use_offload=True, resident_stages=1, lora_rank=4, num_stages=3, dtype="bfloat16",
                      schedule="gpipe"),
    "device-step": dict(use_offload=True, resident_stages=1, device_steps=1, schedule="1f1b"),
    "qlora-offloaded": dict(use_offload=True, resident_stages=1, lora_rank=4, num_stages=3, load_in_4bit=True,
                            schedule="gpipe"),
}


def _trainer(tiny_model_dir, case: str):
    """A one-iteration run of ``case`` on short synthetic rows (what moves does not depend on them)."""
    return in_process_trainer(tiny_cfg(tiny_model_dir, num_iterations=1, dataset="synthetic", seq_length=32,
                                       batch_size=4, num_chunks=2, **CASES[case]))


class ActionRecorder:
    """The executor's timeline hook (``begin``/``end`` around most actions; ``span`` after a
    FORWARD or BACKWARD, drawn from its compute spans; ``add`` after a LOAD or STEP, whose work may
    run on another thread) and the pool's takes and gives in between."""

    def __init__(self):
        self.pending: list[tuple[str, int]] = []
        self.actions: list[str] = []
        self.moves: list[list[tuple[str, int]]] = []  # per action, in order: (take|give, bytes)

    def begin(self, action) -> None:
        pass  # the pool is used only inside actions: what comes before ``end`` or ``add`` is theirs

    def end(self, action) -> None:
        self._close(action)

    def span(self, action, start, end) -> None:  # FORWARD and BACKWARD: their pool use came before
        self._close(action)

    def add(self, action, span) -> None:  # LOAD and STEP: their pool use came just before
        self._close(action)

    def _close(self, action) -> None:
        self.actions.append(str(action))
        self.moves.append(self.pending)
        self.pending = []

    def note(self, what: str, buf: torch.Tensor) -> None:
        self.pending.append((what, buf.numel() * buf.element_size()))


def _measured(trainer) -> ActionRecorder:
    """One training iteration with every pool take and give recorded under its action."""
    rec = ActionRecorder()
    pools = {id(st.pool): st.pool for st in trainer.stores.values()}
    assert len(pools) == 1, "the stages of a rank share one buffer pool"
    pool = next(iter(pools.values()))
    take, give = pool.take, pool.give

    def recorded_take(numel, dtype):
        buf, ready = take(numel, dtype)
        rec.note("take", buf)
        return buf, ready

    def recorded_give(buf, done_event):
        rec.note("give", buf)
        give(buf, done_event)

    pool.take, pool.give = recorded_take, recorded_give
    ex = trainer.executor
    batch = trainer.stream.next_batch()
    ex.timeline = rec
    try:
        ex.run(trainer.actions, trainer.microbatches(batch), batch.num_targets, lr=1e-3)
    finally:
        ex.timeline = None
        ex.finish()
    return rec


def _planned(monkeypatch, trainer):
    """The memory plan of the same run (its resolved settings, this rank's mapping): the last walk's
    ledger, with each action's takes and gives from the pool it models."""
    from pipeline.plan.fit import memory_plan
    from pipeline.plan.resolve import resolve

    hf = trainer.rank.source.config
    resolved = resolve(trainer.cfg, 1, hf)
    assert resolved.cfg == trainer.cfg
    ledgers = []
    init, take, give = footprint.Ledger.__init__, footprint.Ledger.take, footprint.Ledger.give
    parameters, arrive = footprint.Ledger.parameters, footprint.Ledger.arrive

    def tracked_init(self, *args, **kw):
        init(self, *args, **kw)
        self.actions, self.moves = [], []
        ledgers.append(self)

    def at(method):
        def run(self, a, *args):
            self.actions.append(str(a))
            self.moves.append([])
            return method(self, a, *args)
        return run

    def noted(what, method):
        def run(self, key):  # (elements, bytes each)
            self.moves[-1].append((what, key[0] * key[1]))
            return method(self, key)
        return run

    monkeypatch.setattr(footprint.Ledger, "__init__", tracked_init)
    monkeypatch.setattr(footprint.Ledger, "parameters", at(parameters))
    monkeypatch.setattr(footprint.Ledger, "arrive", at(arrive))  # every FORWARD and BACKWARD, before its account
    monkeypatch.setattr(footprint.Ledger, "take", noted("take", take))
    monkeypatch.setattr(footprint.Ledger, "give", noted("give", give))
    memory_plan(resolved.replica, hf, sched.round_robin(trainer.cfg.num_stages, 1), "cpu", resolved.spec.kept)
    return ledgers[-1]  # the walk that starts with the pool the first one left


def _storages(tensors) -> int:
    """Bytes of the distinct storages under ``tensors`` (a master that is also the compute copy counts once)."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(seen.values())


def _static(store) -> tuple[int, int]:
    """(device, host) bytes of a store's parameters that live from start-up to the end: its flat
    buffers that are not the pool's and AdamW's moments (their per-leaf step counters aside, a
    few bytes the plan leaves out); the frozen weights (LoRA) where they live."""
    moments = [state[k] for state in store.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    flat = [store.master, store.master_grad, *moments]
    if store.offload and store.residency.device_step:
        host, device = _storages([store.master, store.master_grad, store.work]), _storages(moments)
    elif store.offload:
        host, device = _storages(flat + [store.work]), 0
    else:
        host, device = 0, _storages(flat + [store.dev, store.grad])
    if store.frozen is not None:  # its compute-dtype buffer and a 4-bit base's packed bytes
        nbytes = store.frozen.nbytes
        host, device = (host + nbytes, device) if store.frozen.offload else (host, device + nbytes)
    return device, host


def assert_plan_moves_what_runs(case: str, trainer, measured: ActionRecorder, plan) -> None:
    assert plan.actions == measured.actions, "the plan walks another program than the rank runs"
    inp, stores = plan.inp, trainer.stores
    for s, st in sorted(stores.items()):
        trained = st.numel if st.frozen is None else st.frozen.numel  # a 4-bit base's packed weights apart
        planned = inp.stages[s].numel - inp.stages[s].quantized.numel
        assert (planned, inp.stages[s].adapter) == \
            ((trained, 0) if st.frozen is None else (trained, st.numel)), f"stage {s}: parameter counts"
        offloaded = st.offload if st.frozen is None else st.frozen.offload
        assert (s in plan.offloaded) == offloaded, f"stage {s}: offloaded in the plan, not in the run, or back"
    for action, ran, planned in zip(measured.actions, measured.moves, plan.moves):
        assert sorted(planned) == sorted(ran), (
            f"{case}: {action} moves {ran} in the run (take/give, bytes) but {planned} in the plan")
    device, host = (sum(parts) for parts in zip(*(_static(st) for st in stores.values())))
    # a 4-bit base's dequantized weight: a compute's transient, which the plan holds throughout
    device += footprint.dequantized_bytes([inp.stages[s] for s in stores], inp.dtype_bytes)
    assert (plan.params_static, plan.out.host_parts["parameters"]) == (device, host), (
        f"{case}: static parameter bytes (device, host): plan {plan.params_static, plan.out.host_parts} "
        f"against the stores' {device, host}")


@pytest.mark.parametrize("case", list(CASES))
def test_plan_moves_the_parameters_the_stores_move(tiny_model_dir, monkeypatch, case):
    trainer = _trainer(tiny_model_dir, case)
    measured = _measured(trainer)
    assert any(measured.moves) == (case not in ("resident", "resident-bf16"))
    assert_plan_moves_what_runs(case, trainer, measured, _planned(monkeypatch, trainer))


def test_a_plan_that_forgets_a_gradient_buffer_is_caught(tiny_model_dir, monkeypatch):
    """Mutation: a plan whose OFFLOAD_GRADS gives back only the weights' buffer and whose first
    backward takes none (a LoRA stage's) disagrees with a full fine-tuning store, which takes and
    gives back the gradients' too."""
    trainer = _trainer(tiny_model_dir, "offloaded")
    measured = _measured(trainer)
    real_init = footprint.Ledger.__init__

    def as_lora(self, *args, **kw):
        real_init(self, *args, **kw)
        self.lora = True

    monkeypatch.setattr(footprint.Ledger, "__init__", as_lora)
    with pytest.raises(AssertionError, match=r"offloaded: \d+[FBO]"):
        assert_plan_moves_what_runs("offloaded", trainer, measured, _planned(monkeypatch, trainer))
