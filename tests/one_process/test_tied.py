"""Tied embeddings (``tie_word_embeddings``: Llama-3.2-1B, Qwen2.5-0.5B) over several stages.

The first stage's embedding and the last stage's head are two copies of one matrix. The TIE
action (``schedule.ir``, placed by ``add_tie``) sums their gradients before either copy's
OFFLOAD, the NORM and the STEPs; the norm counts the tied gradient once; both copies take the
same AdamW step and stay bitwise equal; only the embedding is saved. Checked here: the schedule
rules (L0), training equal to plain Hugging Face training in one process over every schedule,
with and without offload (L1), and that the comparison fails without the exchange. The same
over 2 and 4 processes: tests/multi_process/test_gloo_tied.py; over NCCL: tests/gpu/test_gpu_tied.py.
"""
from __future__ import annotations

import json

import pytest
import torch

import schedule as sched
from pipeline.config import ConfigError
from schedule import ScheduleError, simulate, validate
from schedule.ir import Action, Op
from tests.helpers.architectures import arch_cfg, make_model
from tests.helpers.reference import assert_same_training, in_process_trainer, reference_train, train_in_process


@pytest.fixture(scope="module")
def models_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("tied_models"))


# --- L0: the schedule ----------------------------------------------------------------------------
CASES = [(name, S, W) for name in sched.SCHEDULE_NAMES if name in ("gpipe", "1f1b", "interleaved")
         for S, W in ((2, 1), (4, 1), (2, 2), (4, 2), (6, 2), (4, 4), (8, 4))]


@pytest.mark.parametrize("name,S,W", CASES)
@pytest.mark.parametrize("offload,resident", [(False, 0), (True, 0), (True, -1)])
@pytest.mark.parametrize("clip", [True, False])
def test_tie_is_placed_before_offload_norm_and_step(name, S, W, offload, resident, clip):
    mapping = sched.round_robin(S, W)
    resident = S // W if resident < 0 else resident  # all resident, or none
    program = sched.build(name, S, 4, mapping, offload=offload, prefetch=True, clip=clip, resident=resident, tied=True)
    ties = [(r, i, a) for r, acts in program.items() for i, a in enumerate(acts) if a.op is Op.TIE]
    expected = [Action(0, Op.TIE)] + ([Action(S - 1, Op.TIE)] if mapping[0] != mapping[-1] else [])
    assert sorted(a for *_, a in ties) == sorted(expected)
    for r, i, a in ties:
        acts = program[r]
        for s in (0, S - 1):
            if mapping[s] != r:
                continue
            assert max(j for j, b in enumerate(acts) if b.stage == s and b.op is Op.BACKWARD) < i
            assert acts.index(Action(s, Op.STEP)) > i
            if Action(s, Op.OFFLOAD_GRADS) in acts:
                assert acts.index(Action(s, Op.OFFLOAD_GRADS)) > i
        if clip:
            assert acts.index(Action(-1, Op.NORM)) > i


def test_tie_prints_and_parses():
    assert str(Action(3, Op.TIE)) == "3T" and Action.parse("0T") == Action(0, Op.TIE)
    with pytest.raises(ValueError):
        Action.parse("T")


def _program(name="interleaved", S=4, W=2, offload=True, clip=True):
    mapping = sched.round_robin(S, W)
    return mapping, sched.build(name, S, 4, mapping, offload=offload, prefetch=True, clip=clip, tied=True)


@pytest.mark.parametrize("W", [1, 2])
def test_validator_rejects_a_tie_after_an_offload(W):
    """The gradient would already have left the device buffer: the other copy's share is lost."""
    mapping, program = _program(W=W)
    r = mapping[-1]
    acts = program[r]
    tie = next(a for a in acts if a.op is Op.TIE)
    acts.remove(tie)
    acts.insert(acts.index(Action(len(mapping) - 1, Op.OFFLOAD_GRADS)) + 1, tie)
    with pytest.raises(ScheduleError, match=rf"{tie} comes after {len(mapping) - 1}O .* must come first"):
        validate(program, mapping, len(mapping), 4, tied=True)


def test_validator_rejects_a_missing_or_stray_tie():
    mapping, program = _program()
    with pytest.raises(ScheduleError, match="in a schedule without tied embeddings"):
        validate(program, mapping, 4, 4)
    program[1] = [a for a in program[1] if a.op is not Op.TIE]
    with pytest.raises(ScheduleError, match=r"no 3T: the tied gradient .* never exchanged"):
        validate(program, mapping, 4, 4, tied=True)


def test_validator_rejects_a_tie_after_the_norm():
    mapping, program = _program(W=1)
    acts = program[0]
    acts.remove(Action(0, Op.TIE))
    acts.insert(acts.index(Action(-1, Op.NORM)) + 1, Action(0, Op.TIE))
    with pytest.raises(ScheduleError):
        validate(program, mapping, 4, 4, tied=True)


def test_a_tie_right_after_the_last_stage_backward_deadlocks():
    """Why add_tie waits for the rank's last compute: the last stage's rank still owes stage 1's
    gradients (interleaved, 2 ranks) to the first stage's rank, which waits in its TIE."""
    mapping, program = _program(offload=False)
    acts = program[1]
    acts.remove(Action(3, Op.TIE))
    last_b = max(i for i, a in enumerate(acts) if a == Action(3, Op.BACKWARD, 3))
    acts.insert(last_b + 2, Action(3, Op.TIE))  # after 3B3 and its SEND
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(program, mapping)


def test_every_consumer_reasons_about_the_program_with_its_tie(monkeypatch):
    """``program_spec`` decides ``tied`` once, from the config and the model config: the run, the
    memory plan, the cost partition and the mapping planner all get the program with its TIE."""
    from pipeline.plan import fit as plan, placement
    from pipeline.spec import partition
    from pipeline.config import make_config
    from pipeline.dist import DistEnv
    from pipeline.plan.source import preset_config
    from pipeline.spec.programs import program_spec, tied_across_stages

    hf = preset_config("qwen3-4b")  # tie_word_embeddings
    cfg = make_config({"num_stages": 4, "num_chunks": 4, "batch_size": 4, "seq_length": 64, "use_offload": True,
                       "device": "cpu", "mapping": "planned", "topology": ""})
    assert tied_across_stages(4, hf) and not tied_across_stages(1, hf)
    assert not tied_across_stages(4, preset_config("llama-3b"))
    spec = program_spec(cfg, hf)
    assert spec.tied and any(a.op is Op.TIE for acts in spec.build([0, 1, 0, 1]).values() for a in acts)
    _, program = plan.memory_plan(cfg, hf, [0, 1, 0, 1], "cpu")
    assert any(a.op is Op.TIE for acts in program.values() for a in acts)
    assert partition._inputs(cfg, hf, 2)[4] == spec
    seen = []
    monkeypatch.setattr(placement, "choose_mapping", lambda mode, n, s, **kw: seen.append(s) or
                        sched.round_robin(4, n))
    placement.decide_placement(plan.plan_spec(cfg, hf, 2, "cpu"), DistEnv(0, 2, 0, 2), torch.device("cpu"))
    assert seen == [spec]


# --- L1: one process holds every stage -------------------------------------------------------------
def _train_tied(cfg):
    """Train ``cfg`` in one process; the two copies of the tied matrix must end bitwise equal."""
    run = train_in_process(cfg)
    first, last = run.trainer.stores[0], run.trainer.stores[cfg.num_stages - 1]
    copies = first.master[:first.tied_numel], last.master[:last.tied_numel]
    assert first.tied_numel == last.tied_numel > 0
    assert torch.equal(*copies), "the two copies of the tied matrix drifted apart"
    return run.outcome


@pytest.mark.parametrize("arch,num_stages", [("llama3_tied", 2), ("qwen2_tied", 4)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
@pytest.mark.parametrize("offload", [False, True])
def test_tied_training_matches_hf(models_root, arch, num_stages, schedule, offload):
    cfg = arch_cfg(make_model(arch, models_root), num_stages=num_stages, schedule=schedule, use_offload=offload,
               use_prefetch=offload)
    assert cfg.grad_clip > 0
    losses, params = _train_tied(cfg)
    assert "lm_head.weight" not in params  # saved once, as the embedding
    assert_same_training(losses, params, *reference_train(cfg, cfg.model))


@pytest.mark.parametrize("resident", [0, 2])
def test_tied_unclipped_and_resident_match_hf(models_root, resident):
    """No NORM (an offloaded stage steps right after its OFFLOAD, behind the TIE); and with
    every stage resident (both copies step on the device)."""
    cfg = arch_cfg(make_model("qwen2_tied", models_root), num_stages=2, schedule="1f1b", use_offload=True,
               resident_stages=resident, grad_clip=0.0 if resident == 0 else 1.0)
    losses, params = _train_tied(cfg)
    assert_same_training(losses, params, *reference_train(cfg, cfg.model))


def test_without_the_exchange_the_comparison_fails(models_root, monkeypatch):
    from pipeline.run.executor import Executor

    monkeypatch.setattr(Executor, "_tie", lambda self, a: None)
    cfg = arch_cfg(make_model("llama3_tied", models_root), num_stages=4, schedule="interleaved", use_offload=True)
    run = train_in_process(cfg)
    with pytest.raises(AssertionError):
        assert_same_training(*run.outcome, *reference_train(cfg, cfg.model))


def test_copies_stepping_apart_are_refused(models_root):
    """resident_stages 1 of 2 keeps stage 0 on the GPU and offloads stage 1 (the head's copy)."""
    cfg = arch_cfg(make_model("qwen2_tied", models_root), num_stages=2, use_offload=True, resident_stages=1)
    with pytest.raises(ConfigError, match=r"tied embeddings: resident_stages 1 keeps stage 0 on the GPU but "
                                          r"offloads stage 1") as e:
        in_process_trainer(cfg)
    assert "\n" not in str(e.value)


def test_saved_model_stores_the_matrix_once(models_root, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = arch_cfg(make_model("qwen2_tied", models_root), num_stages=2, schedule="gpipe", use_offload=True,
               num_iterations=1, save_model=True, save_dir=str(tmp_path))
    trainer = in_process_trainer(cfg)
    trainer.save(trainer.train())
    out = tmp_path / "model"
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.embed_tokens.weight" in index and "lm_head.weight" not in index
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(model.lm_head.weight, trainer.stores[1].master[:trainer.stores[1].tied_numel]
                               .view_as(model.lm_head.weight), rtol=0, atol=0)


def test_resume_from_a_checkpoint_is_exact(models_root, tmp_path):
    """The checkpoint holds the embedding only; the head's copy is rebuilt from it and its AdamW
    state comes from the last stage's own state file: training goes on bit for bit."""
    common = dict(num_stages=4, schedule="interleaved", use_offload=True, num_iterations=4, save_dir=str(tmp_path))
    path = make_model("llama3_tied", models_root)
    straight = in_process_trainer(arch_cfg(path, **common, checkpoint_every=2))
    losses = [h["loss"] for h in straight.train()]
    resumed = in_process_trainer(arch_cfg(path, **common, resume=str(tmp_path / "checkpoints" / "step_00000002")))
    assert [h["loss"] for h in resumed.train()] == losses[2:]
    for s in (0, 3):
        assert torch.equal(resumed.stores[s].master, straight.stores[s].master)
