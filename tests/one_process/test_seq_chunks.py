"""``seq_chunks``: the trainer with sequence segments (Seq1F1B) trains exactly like whole rows.

In one process (every stage in it): K segments give the Hugging Face reference's losses and
weights (float32) for gpipe, 1f1b and interleaved, with and without offload, with rows of
different lengths (padding, -100), packed rows, a batch narrower than K, and activation
checkpointing. Mutations (a segment given another segment's labels, a segment's carried
keys/values dropped) fail the same comparison. The configuration checks and the memory plan
(segment activations, advice of a seq_chunks value) are checked without training. Over torchrun,
two processes with segments crossing ranks: tests/multi_process/test_gloo_seq_chunks.py; the
refusal through main.py --check_only: tests/multi_process/test_prelaunch.py.
"""
from __future__ import annotations


import pytest
import torch

import pipeline.spec.shapes as shapes
import pipeline.stage.segments as segments
from pipeline.config import ConfigError, make_config
from pipeline.plan.preflight import check_config
from tests.helpers.reference import (assert_same_training, in_process_trainer, reference_train, train_in_process,
                                    trained)
from tests.helpers.runs import ITERS, expect_mismatch, reference_result, text_records, tiny_cfg


@pytest.mark.parametrize("schedule,offload", [
    ("interleaved", True), pytest.param("1f1b", False, marks=pytest.mark.slow),
    pytest.param("gpipe", False, marks=pytest.mark.slow), pytest.param("gpipe", True, marks=pytest.mark.slow),
    pytest.param("1f1b", True, marks=pytest.mark.slow), pytest.param("interleaved", False, marks=pytest.mark.slow),
])
def test_segments_match_reference(tiny_model_dir, schedule, offload):
    """3 segments of 64 columns (balanced: later ones shorter), 4 stages, 4 micro-batches."""
    cfg = tiny_cfg(tiny_model_dir, schedule=schedule, use_offload=offload, seq_chunks=3)
    trainer = in_process_trainer(cfg)
    assert {a.seg for a in trainer.actions if a.op.value in ("F", "B")} == {0, 1, 2}
    assert_same_training(*trained(trainer).outcome, *reference_result(str(tiny_model_dir)))


@pytest.mark.parametrize("packing", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_rows_of_different_lengths(tiny_model_dir, tmp_path, packing):
    """Records of 2..29 words: batches of different widths (each cut into 4 segments of its own
    width), padding labelled -100 inside a batch; packed, records cross segment boundaries."""
    cfg = tiny_cfg(tiny_model_dir, dataset=text_records(tmp_path / "var.jsonl", 2, 30), packing=packing,
                   seq_chunks=4, batch_size=4, num_chunks=2, num_stages=2, schedule="1f1b", use_offload=True)
    trainer = in_process_trainer(cfg)
    widths = {trainer.stream.next_batch().input_ids.shape[1] for _ in range(cfg.num_iterations)}
    assert len(widths) > 1 or packing, widths
    assert_same_training(*train_in_process(cfg).outcome, *reference_train(cfg, cfg.model))


@pytest.mark.slow
def test_batch_narrower_than_the_segments(tiny_model_dir, tmp_path):
    """Rows of one or two words: a batch narrower than seq_chunks (12) gets padding columns."""
    cfg = tiny_cfg(tiny_model_dir, dataset=text_records(tmp_path / "short.jsonl", 1, 3), seq_chunks=12,
                   batch_size=4, num_chunks=2, num_stages=2, schedule="1f1b")
    trainer = in_process_trainer(cfg)
    mbs = trainer.microbatches(trainer.stream.next_batch())
    assert mbs[0].input_ids.shape[1] == 12, mbs[0].input_ids.shape
    assert_same_training(*train_in_process(cfg).outcome, *reference_train(cfg, cfg.model))


@pytest.mark.slow
def test_checkpointing_with_segments(tiny_model_dir, monkeypatch):
    """Recomputed layers (all but one a stage) re-run their key/value update per segment; the
    last stage's head and loss run checkpointed in chunks of tokens (7 here) within a segment."""
    import pipeline.stage.model as model_mod

    calls = []
    real = model_mod.checkpoint
    monkeypatch.setattr(model_mod, "loss_chunk_tokens", lambda vocab: 7)
    monkeypatch.setattr(model_mod, "checkpoint",
                        lambda fn, *a, **kw: calls.append(getattr(fn, "__name__", "")) or real(fn, *a, **kw))
    cfg = tiny_cfg(tiny_model_dir, schedule="interleaved", use_offload=True, activation_checkpointing=True,
                   keep_layers=1, seq_chunks=3)
    assert_same_training(*train_in_process(cfg).outcome, *reference_result(str(tiny_model_dir)))
    rows = cfg.batch_size // cfg.num_chunks
    lengths = shapes.segment_lengths(cfg.seq_length, 3, shapes.model_key_cost(_tiny_config(tiny_model_dir)))
    assert calls.count("_loss") == ITERS * cfg.num_chunks * sum(-(-rows * n // 7) for n in lengths)


def _tiny_config(model_dir):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


@pytest.mark.slow
def test_evaluation_with_segments(tiny_model_dir, capsys):
    """The forward-only program with segments gives the same validation loss (with
    activation_offload too: evaluation keeps no stash and recomputes nothing)."""
    lines = []
    for k, actoff in ((1, False), (3, False), (3, True)):
        in_process_trainer(tiny_cfg(tiny_model_dir, seq_chunks=k, eval_every=3, eval_batches=2,
                                    activation_offload=actoff)).train()
        lines.append([x.split(" time ")[0] for x in capsys.readouterr().out.splitlines() if x.startswith("eval step")])
    assert lines[0] and lines[0] == lines[1] == lines[2], lines


@pytest.mark.slow
@pytest.mark.parametrize("kw,rtol", [(dict(dtype="float16"), 1e-2),
                                     (dict(dtype="float16", activation_offload=True), 1e-2),
                                     (dict(delayed_update=True, use_offload=True, resident_stages=0), 1e-5)])
def test_segments_equal_whole_rows(tiny_model_dir, kw, rtol):
    """What the Hugging Face reference does not model (float16 with loss scaling, the delayed
    update): 3 segments train as whole rows do (float16: within its rounding)."""
    whole, split = (train_in_process(tiny_cfg(tiny_model_dir, seq_chunks=k, **kw)).outcome for k in (1, 3))
    assert_same_training(*split, *whole, rtol=rtol)


# --- activation_offload: segments' inputs in host memory, recomputed at their backward -----------
@pytest.mark.parametrize("schedule,offload", [
    ("interleaved", True), pytest.param("1f1b", False, marks=pytest.mark.slow),
    pytest.param("gpipe", False, marks=pytest.mark.slow), pytest.param("gpipe", True, marks=pytest.mark.slow),
    pytest.param("1f1b", True, marks=pytest.mark.slow), pytest.param("interleaved", False, marks=pytest.mark.slow),
])
def test_activation_offload_with_segments(tiny_model_dir, schedule, offload):
    """Each (stage, micro-batch, segment) forward builds no graph, its input waits in the stash
    and its backward recomputes it against the keys/values the earlier segments carried."""
    cfg = tiny_cfg(tiny_model_dir, schedule=schedule, use_offload=offload, activation_offload=True, seq_chunks=3)
    trainer = in_process_trainer(cfg)
    assert all(stage.recomputed == 0 for stage in trainer.stages.values())
    run = trained(trainer)
    assert len(trainer.executor.runners.stash) == 0  # every segment's input went back to its backward
    assert_same_training(*run.outcome, *reference_result(str(tiny_model_dir)))


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True])
def test_activation_offload_rows_of_different_lengths(tiny_model_dir, tmp_path, packing):
    cfg = tiny_cfg(tiny_model_dir, dataset=text_records(tmp_path / "var.jsonl", 2, 30), packing=packing,
                   seq_chunks=4, batch_size=4, num_chunks=2, num_stages=2, schedule="1f1b", use_offload=True,
                   activation_offload=True, activation_checkpointing=True)
    assert_same_training(*train_in_process(cfg).outcome, *reference_train(cfg, cfg.model))


def _equal_segments(monkeypatch) -> None:
    """Cut rows into equal segments (64 columns: 4 of 16), so that another segment's input has
    this one's shape and a mix-up shows in the numbers, not as a shape error."""
    import pipeline.runners as runners

    monkeypatch.setattr(runners, "segment_lengths", lambda width, k, key_cost=0.0: shapes.segment_lengths(width, k))


def _expect_offload_mismatch(tiny_model_dir, monkeypatch, patch) -> None:
    _equal_segments(monkeypatch)
    expect_mismatch(tiny_model_dir, monkeypatch, patch, schedule="gpipe", activation_offload=True, seq_chunks=4)


@pytest.mark.slow
def test_equal_segments_still_match(tiny_model_dir, monkeypatch):
    """The control of the mutations below: the same run unpatched equals the reference."""
    _equal_segments(monkeypatch)
    cfg = tiny_cfg(tiny_model_dir, schedule="gpipe", use_offload=True, activation_offload=True, seq_chunks=4)
    assert_same_training(*train_in_process(cfg).outcome, *reference_result(str(tiny_model_dir)))


def test_activation_offload_detects_another_segment_input(tiny_model_dir, monkeypatch):
    """A backward whose recompute gets the input of another segment of its micro-batch."""
    from offload.activations import ActivationStash

    original = ActivationStash.restore

    def swapped(self, key):
        own = original(self, key)
        held = [k for k in [*self._host, *self._back] if k[:2] == key[:2] and k != key]
        return self.peek(held[0]) if held else own

    _expect_offload_mismatch(tiny_model_dir, monkeypatch, lambda mp: mp.setattr(ActivationStash, "restore", swapped))


def test_first_layer_keys_are_made_again_not_kept(tiny_model_dir, monkeypatch):
    """With activation_offload the first layer of a stage keeps no carried keys/values in host memory
    between its forwards and backwards: its backward makes them again from the segments' inputs
    (which wait there anyway). Stages of one layer keep none at all; training is exact."""
    from offload.kv import CarriedKV

    held = []
    original = CarriedKV.offload

    def counting(self, key, leaves):
        held.append(sum(t.numel() for t in leaves))
        return original(self, key, leaves)

    monkeypatch.setattr(CarriedKV, "offload", counting)
    cfg = tiny_cfg(tiny_model_dir, schedule="1f1b", use_offload=True, activation_offload=True, seq_chunks=4,
                   num_stages=6)  # one layer a stage
    assert_same_training(*train_in_process(cfg).outcome, *reference_result(str(tiny_model_dir)))
    assert held and not any(held), held


@pytest.mark.parametrize("tiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_activation_offload_with_segments_and_more_stages_than_layers(tiny_model_dir, tiled):
    """8 stages of 6 layers (the plan's own choice for long rows can be so: 3B at 256K tokens is 28
    stages of 26 layers): the first stage holds only the embedding and the last only the norm and
    the head, which carry no keys/values, so there are none to make again; training is exact."""
    cfg = tiny_cfg(tiny_model_dir, schedule="1f1b", use_offload=True, activation_offload=True, seq_chunks=3,
                   num_stages=8, tiled_mlp=str(tiled).lower())
    trainer = in_process_trainer(cfg)
    layers = {s: len(getattr(st.model, "layers", ())) for s, st in trainer.stages.items()}
    assert layers[0] == 0 and layers[7] == 0, layers
    assert_same_training(*trained(trainer).outcome, *reference_result(str(tiny_model_dir)))


def test_activation_offload_detects_first_layer_keys_made_from_another_input(tiny_model_dir, monkeypatch):
    """The first layer's carried keys/values made again from a neighbouring segment's input."""
    original = segments.SegmentStage._remake_first_kv

    def shifted(self, mb, seg, position_ids=None, doc_ids=None):
        source = self.kv_source
        self.kv_source = lambda m, j: source(m, j - 1 if j else j + 1)
        try:
            original(self, mb, seg, position_ids, doc_ids)
        finally:
            self.kv_source = source

    _expect_offload_mismatch(tiny_model_dir, monkeypatch,
                             lambda mp: mp.setattr(segments.SegmentStage, "_remake_first_kv", shifted))


@pytest.mark.slow
def test_activation_offload_detects_dropped_keys_and_values(tiny_model_dir, monkeypatch):
    """The recompute (and only it) attends to zeros instead of segment 0's carried keys/values."""
    class DropInRecompute(segments._KVCarry):
        def __init__(self, past):
            super().__init__(past)
            if torch.is_grad_enabled():
                for kvs in self.past.values():
                    if kvs:
                        kvs[0] = (torch.zeros_like(kvs[0][0]), torch.zeros_like(kvs[0][1]))

    _expect_offload_mismatch(tiny_model_dir, monkeypatch, lambda mp: mp.setattr(segments, "_KVCarry", DropInRecompute))


@pytest.mark.slow
def test_activation_offload_detects_dropped_key_value_gradients(tiny_model_dir, monkeypatch):
    """The later segments' gradients of a segment's carried keys/values not fed to its backward."""
    _expect_offload_mismatch(tiny_model_dir, monkeypatch,
                             lambda mp: mp.setattr(segments, "kv_gradients", lambda new, carry, seg: ([], [])))


# --- the comparison must be able to fail -------------------------------------------------------
@pytest.mark.slow
def test_detects_wrong_segment_labels(tiny_model_dir, monkeypatch):
    original = segments.SegmentStage.forward

    def shifted(self, mb, seg, x, targets=None, **kw):  # the last segment (the trained summary) gets its
        if targets is not None and seg == self.num_segments - 1:  # columns' targets rolled by one
            targets = targets.roll(1, dims=1)
        return original(self, mb, seg, x, targets, **kw)

    expect_mismatch(tiny_model_dir, monkeypatch, lambda mp: mp.setattr(segments.SegmentStage, "forward", shifted),
                    seq_chunks=3)


def test_detects_dropped_keys_and_values(tiny_model_dir, monkeypatch):
    class DropOne(segments._KVCarry):
        """Segment 0's carried keys/values replaced by zeros where later segments read them."""

        def __init__(self, past):
            super().__init__(past)
            for kvs in self.past.values():
                if kvs:
                    kvs[0] = (torch.zeros_like(kvs[0][0]), torch.zeros_like(kvs[0][1]))

    expect_mismatch(tiny_model_dir, monkeypatch, lambda mp: mp.setattr(segments, "_KVCarry", DropOne), seq_chunks=3)


# --- configuration and plan ------------------------------------------------------------------------
@pytest.mark.parametrize("kw,needle", [
    (dict(seq_chunks=0), "seq_chunks (0) must be between 1 (whole rows) and seq_length (64)"),
    (dict(seq_chunks=65), "seq_chunks (65) must be between 1 (whole rows) and seq_length (64)"),
    (dict(seq_chunks=2, compile_layers="true"), "compile_layers true does not work with seq_chunks > 1 yet"),
    (dict(seq_chunks=2, fuse_last_stage="true"), "fuse_last_stage true does not work with seq_chunks > 1"),
])
def test_config_refuses(kw, needle):
    cfg = make_config(dict(seq_length=64, num_stages=2, device="cpu", **kw))
    with pytest.raises(ConfigError) as e:
        check_config(cfg, 2)
    assert needle in str(e.value)


def _plan_cfg(**kw):
    base = dict(model="tiny", seq_length=2048, batch_size=4, num_chunks=4, num_stages=4, device="cuda",
                use_offload=True, dtype="bfloat16", schedule="1f1b")
    return make_config({**base, **kw})


def test_memory_plan_counts_segments():
    """One stage per rank, 1F1B: rank 0 holds 4 micro-batches' activations whole, N - 1 + K
    segments' with segments (their carried keys/values beside): the estimate falls with K."""
    from pipeline.plan.source import preset_config
    from pipeline.plan.fit import memory_plan
    from schedule import round_robin

    hf = preset_config("tiny")
    peaks = []
    for k in (1, 2, 4, 8):
        ranks, program = memory_plan(_plan_cfg(seq_chunks=k), hf, round_robin(4, 4), "cuda")
        assert {a.seg for a in program[0] if a.op.value == "F"} == ({None} if k == 1 else set(range(k)))
        peaks.append(ranks[0].parts["activations"])
    assert peaks == sorted(peaks, reverse=True) and peaks[-1] < 0.6 * peaks[0], peaks


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_memory_plan_counts_segments_with_activation_offload(schedule):
    """activation_offload with segments: a backward recomputes one segment, so the peak falls
    with K and stays under the plan without activation_offload; the carried keys/values stay on
    the device (activations above zero, at most every micro-batch's whole rows' keys/values and
    their gradients); the stash's inputs are host memory, under gpipe the same whatever K."""
    from pipeline.plan.source import preset_config
    from pipeline.plan.fit import memory_plan, report
    from schedule import round_robin

    hf = preset_config("tiny")
    layers_per_stage = hf.num_hidden_layers // 4
    kv_dim = hf.num_key_value_heads * (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    whole_kv = 4 * layers_per_stage * 2 * 2 * kv_dim * 2048  # 4 micro-batches of one 2048-column row, bf16
    peaks, hosts = [], set()
    for k in (1, 2, 4, 8):
        # the even split for every K: the cost partition's differs with the fused last stage (K = 1 only)
        cfg = _plan_cfg(schedule=schedule, seq_chunks=k, activation_offload=True, partition="layers")
        ranks, _ = memory_plan(cfg, hf, round_robin(4, 4), "cuda")
        plain, _ = memory_plan(_plan_cfg(schedule=schedule, seq_chunks=k), hf, round_robin(4, 4), "cuda")
        worst = max(r.device_peak for r in ranks)
        assert worst < max(r.device_peak for r in plain), k
        acts = max(r.parts["activations"] for r in ranks)
        assert (acts == 0) if k == 1 else (0 < acts <= 2 * whole_kv), (k, acts, whole_kv)
        peaks.append(worst)
        hosts.add(ranks[1].host_parts["stash"])  # stage 1's inputs in the stash, in segments or whole
    assert peaks == sorted(peaks, reverse=True) and peaks[-1] < 0.6 * peaks[0], peaks
    assert len(hosts) == 1 or schedule != "gpipe", hosts  # gpipe: every input stashed before any backward
    text = report(_plan_cfg(schedule=schedule, seq_chunks=4, activation_offload=True), hf, round_robin(4, 4), 4)
    assert "in 4 sequence segments of [" in text and "activation_offload=True" in text, text


def test_plan_advises_seq_chunks(monkeypatch):
    """A long seq_length that does not fit: the advice names the smallest seq_chunks that does."""
    from pipeline.plan import fit as plan
    from pipeline.plan.source import preset_config
    from schedule import round_robin

    monkeypatch.setattr(plan, "host_available", lambda: None)  # the GPU is what is checked here
    hf = preset_config("tiny")
    need = {k: plan.assess(_plan_cfg(seq_chunks=k), hf, round_robin(4, 4)).worst.device_peak for k in (1, 2, 4)}
    cap = (need[2] + need[4]) / 2 / plan.USABLE_FRACTION  # 4 segments fit, 2 do not
    cfg = _plan_cfg(gpu_memory_gb=cap / 2**30)
    tips = plan.advice(cfg, hf, 4)
    assert [t for t in tips if t.startswith("seq_chunks")] == [f"seq_chunks: 4 (sequence segments) -> "
                                                              f"{plan.gib(need[4])} per GPU"], tips
    text = plan.report(cfg, hf, round_robin(4, 4), 4)
    assert "DOES NOT FIT" in text and "seq_chunks: 4 (sequence segments)" in text.split("would fit with:")[1]
    text = plan.report(_plan_cfg(gpu_memory_gb=cap / 2**30, seq_chunks=4), hf, round_robin(4, 4), 4)
    assert "in 4 sequence segments of [" in text and "GPU: " in text and "DOES NOT FIT" not in text.split("host:")[0]


@pytest.mark.slow
def test_timeline_with_segments(tiny_model_dir, tmp_path):
    """The recorded iteration names each segment's actions; the cost model is calibrated per
    segment (a stage's micro-batch is the sum of its segments)."""
    from pipeline.run.timeline import read_chrome_trace

    cfg = tiny_cfg(tiny_model_dir, seq_chunks=3, use_offload=True, timeline=True, num_iterations=2,
                   save_dir=str(tmp_path))
    trainer = in_process_trainer(cfg)
    trainer.train()
    trainer.write_optional()  # the timeline is an optional output, written after the model
    measured, predicted = (read_chrome_trace(tmp_path / name) for name in ("timeline.json", "timeline_predicted.json"))
    for events in (measured, predicted):
        assert {e["seg"] for e in events if e["op"] == "F"} == {0, 1, 2}
    # each predicted segment compute is near its measured median, not a whole micro-batch's
    f_meas = sorted(e["end"] - e["start"] for e in measured if e["op"] == "F")
    f_pred = sorted(e["end"] - e["start"] for e in predicted if e["op"] == "F")
    ratio = f_pred[len(f_pred) // 2] / f_meas[len(f_meas) // 2]
    assert 0.5 < ratio < 2, (ratio, f_pred, f_meas)
