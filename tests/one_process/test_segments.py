"""Sequence segments (pipeline/stage/segments.py), one process: a stage run segment by segment
(keys/values carried forward, their gradients carried back) gives the unsplit sequence's loss
and parameter gradients, for Llama (GQA), Mistral (sliding window), Qwen2 (q/k/v bias, sliding
layers) and tied embeddings, with eager and sdpa attention and rows of different lengths.
Mutations (keys of a segment dropped, key/value gradients lost, positions restarted, labels of
another segment) must fail the same comparison.

Tolerances: in float64 (sdpa) the gradients agree to 1e-10, so any difference of method shows.
In float32
the loss agrees to 2e-6 and each parameter's gradient to 2e-6 relative, or, where the unsplit
float32 gradient itself is further than that from the float64 one, to 4x that distance: a
k_proj bias's gradient is zero in exact arithmetic (softmax ignores a shift shared by all keys),
so its float32 value is summation noise (about 5e-5 relative), in either order."""
from __future__ import annotations

import pytest
import torch

import pipeline.stage.segments as segments
from pipeline.spec.shapes import segment_bounds
from pipeline.stage.model import build_stage
from pipeline.stage.segments import SegmentStage
from schedule.costmodel import balanced_segments
from tests.helpers.segments import (ARCHS, LENGTHS, SEQ, TOL, grads_of, make_batch, make_config, make_stages, mismatch,
                                    noise_floor, reference, run_segments)
from tests.helpers.tolerance import assert_close, rel_err as rel


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_segments_equal_the_unsplit_sequence(arch, impl):
    torch.manual_seed(0)
    config = make_config(arch, impl)
    (stage,) = make_stages(config)
    x, targets = make_batch(config.vocab_size)
    ref = reference(stage, x, targets)
    floor = noise_floor(stage, x, targets, ref)
    for name, lengths in LENGTHS.items():
        got = run_segments(stage, x, targets, lengths)
        assert not mismatch(ref, got, floor), (name, lengths, mismatch(ref, got, floor))
    if impl == "eager":
        return  # Hugging Face's eager softmax runs in float32 whatever the dtype: no float64 check
    # float64: a difference of method shows far above rounding. The stage's cross-entropy stays
    # float32 (the loss, summed per segment here, hence its 1e-6).
    stage.double()
    ref = reference(stage, x, targets)
    got = run_segments(stage, x, targets, LENGTHS["balanced"])
    assert not mismatch(ref, got, 1e-10, loss_tol=1e-6), mismatch(ref, got, 1e-10, loss_tol=1e-6)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_mutations_fail_the_comparison(impl, monkeypatch):
    """What the comparison must catch: each mutation alone makes it fail."""
    config = make_config("mistral", impl)  # GQA and a window that crosses segments
    (stage,) = make_stages(config)
    x, targets = make_batch(config.vocab_size)
    ref = reference(stage, x, targets)
    lengths = LENGTHS["equal"]
    assert not mismatch(ref, run_segments(stage, x, targets, lengths))

    assert mismatch(ref, run_segments(stage, x, targets, lengths, positions="restart"))
    assert mismatch(ref, run_segments(stage, x, targets, lengths, shift_labels=True))

    with monkeypatch.context() as m:  # the key/value gradients of later segments are lost
        m.setattr(segments, "kv_gradients", lambda new, carry, seg: ([], []))
        got = run_segments(stage, x, targets, lengths)
        assert rel(got[0], ref[0]) < TOL  # the forward is right ...
        assert any("k_proj" in line or "v_proj" in line for line in mismatch(ref, got))  # ... the gradients not

    class DropOne(segments._KVCarry):
        """Segment 1's carried keys/values replaced by zeros where later segments read them."""

        def __init__(self, past):
            super().__init__(past)
            for kvs in self.past.values():
                if len(kvs) > 1:
                    kvs[1] = (torch.zeros_like(kvs[1][0]), torch.zeros_like(kvs[1][1]))

    with monkeypatch.context() as m:
        m.setattr(segments, "_KVCarry", DropOne)
        got = run_segments(stage, x, targets, lengths)
        assert mismatch(ref, got) and rel(got[0], ref[0]) >= TOL


def test_forward_only_logits_equal():
    config = make_config("qwen2_sliding", "sdpa")
    (stage,) = make_stages(config)
    x, _ = make_batch(config.vocab_size)
    lengths = LENGTHS["balanced"]
    runner = SegmentStage(stage, lengths)
    with torch.no_grad():
        full = stage(x)
        parts = [runner.forward(0, j, x[:, a:b]) for j, (a, b) in enumerate(segment_bounds(lengths))]
    assert not runner.carry  # nothing kept for a backward
    assert_close(torch.cat(parts, dim=1), full, 1e-5, "logits")


def test_two_stages_by_hand():
    """The input gradient and the key/value gradients together, across a stage boundary."""
    config = make_config("llama_tied", "sdpa")
    (whole,) = make_stages(config)
    first, last = make_stages(config, 2)
    x, targets = make_batch(config.vocab_size)
    lengths = LENGTHS["balanced"]
    bounds = segment_bounds(lengths)
    r0, r1 = SegmentStage(first, lengths), SegmentStage(last, lengths)
    ref_loss = last(first(x), targets)
    ref_loss.backward()
    ref = {n: p.grad.clone() for st in (first, last) for n, p in st.named_parameters()}
    for st in (first, last):
        st.zero_grad(set_to_none=True)
    loss = 0
    for j, (a, b) in enumerate(bounds):
        loss = loss + r1.forward(0, j, r0.forward(0, j, x[:, a:b]), targets[:, a:b]).detach()
    for j in reversed(range(len(bounds))):
        r0.backward(0, j, r1.backward(0, j))
    assert rel(loss, ref_loss.detach()) < TOL
    for st in (first, last):
        for n, p in st.named_parameters():
            assert rel(p.grad, ref[n]) < TOL, n
    del whole


@pytest.mark.parametrize("arch", list(ARCHS))
def test_recompute_equals_the_unsplit_sequence(arch):
    """activation_offload's mode: forwards without a graph, each backward recomputing its
    segment against the earlier segments' carried keys/values (sliding windows included)."""
    torch.manual_seed(0)
    config = make_config(arch, "sdpa")
    (stage,) = make_stages(config)
    x, targets = make_batch(config.vocab_size)
    ref = reference(stage, x, targets)
    floor = noise_floor(stage, x, targets, ref)
    got = run_segments(stage, x, targets, LENGTHS["balanced"], recompute=True)
    assert not mismatch(ref, got, floor), mismatch(ref, got, floor)


def test_recompute_order_is_checked():
    config = make_config("llama", "eager")
    (stage,) = make_stages(config)
    x, targets = make_batch(config.vocab_size)
    with pytest.raises(RuntimeError, match="needs a SegmentStage made with recompute=True"):
        SegmentStage(stage, [48, 48]).recompute_forward(0, 0, x[:, :48], targets[:, :48])
    runner = SegmentStage(stage, [48, 48], recompute=True)
    with torch.no_grad():
        runner.forward(0, 0, x[:, :48], targets[:, :48])
        runner.forward(0, 1, x[:, 48:], targets[:, 48:])
    with pytest.raises(RuntimeError, match="the next backward is segment 1"):
        runner.recompute_forward(0, 0, x[:, :48], targets[:, :48])


def test_order_is_checked():
    config = make_config("llama", "eager")
    (stage,) = make_stages(config)
    x, targets = make_batch(config.vocab_size)
    runner = SegmentStage(stage, [48, 48])
    with pytest.raises(RuntimeError, match="forward of micro-batch 0 segment 1 out of order"):
        runner.forward(0, 1, x[:, 48:], targets[:, 48:])
    runner.forward(0, 0, x[:, :48], targets[:, :48])
    with pytest.raises(RuntimeError, match=r"backward of micro-batch 0 segment 0 out of order.*forwarded \(1 of 2\)"):
        runner.backward(0, 0)
    runner.forward(0, 1, x[:, 48:], targets[:, 48:])
    with pytest.raises(RuntimeError, match="the next backward is segment 1"):
        runner.backward(0, 0)
    with pytest.raises(ValueError, match="has 40 columns; lengths \\[48, 48\\] give it 48"):
        runner.forward(1, 0, x[:, :40])


@pytest.mark.parametrize("kept", [0, 2])
def test_activation_checkpointing(kept):
    """Recomputed layers (all, or the first two of four) re-enter the key/value update during the
    backward; the segments still give the unsplit gradients."""
    config = make_config("qwen2_sliding", "sdpa")
    (plain,) = make_stages(config)
    stage = build_stage(config, 0, 1, range(4), model_dir=None, seed=0, checkpointing=True, kept_layers=kept)
    stage.load_state_dict(plain.state_dict())
    assert stage.recomputed == 4 - kept
    x, targets = make_batch(config.vocab_size)
    ref = reference(plain, x, targets)
    floor = noise_floor(plain, x, targets, ref)
    got = run_segments(stage, x, targets, LENGTHS["balanced"])
    assert not mismatch(ref, got, floor), mismatch(ref, got, floor)


def test_refuses_flash():
    config = make_config("llama", "eager")
    (stage,) = make_stages(config)
    stage.attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="eager or sdpa"):
        SegmentStage(stage, [48, 48])


def run_program(program: dict, mapping: list[int], stages: list, x, targets, lengths, num_microbatches: int):
    """Interpret a lowered schedule in one process: every rank's list in its own order, the
    ranks interleaved as the validator's simulation runs them (so each compute finds its
    input); SEND/RECV become a hand-over through a dict. Returns the summed loss."""
    from schedule import simulate

    runners = [SegmentStage(st, lengths) for st in stages]
    bounds = segment_bounds(lengths)
    rows = x.shape[0] // num_microbatches
    timeline = simulate(program, mapping).timeline
    order = sorted(((start, r, i, a) for r, acts in timeline.items() for i, (start, _, a) in enumerate(acts)),
                   key=lambda e: e[:3])
    last = len(stages) - 1
    acts, grads, loss = {}, {}, 0
    seen = {r: [] for r in program}
    for _, r, _, a in order:
        seen[r].append(a)
        if a.op.value not in ("F", "B"):
            continue
        m, j = a.mb, a.seg
        (lo, hi), cols = (m * rows, (m + 1) * rows), slice(*bounds[j])
        if a.op.value == "F":
            inp = x[lo:hi, cols] if a.stage == 0 else acts.pop((a.stage - 1, m, j))
            out = runners[a.stage].forward(m, j, inp, targets[lo:hi, cols] if a.stage == last else None)
            if a.stage == last:
                loss = loss + out.detach()
            else:
                acts[(a.stage, m, j)] = out.detach()  # what SEND_F carries: no graph across stages
        else:
            g = runners[a.stage].backward(m, j, None if a.stage == last else grads.pop((a.stage + 1, m, j)))
            if a.stage > 0:
                grads[(a.stage, m, j)] = g
    assert seen == program  # every rank ran its whole list in its own order
    assert not acts and not grads and not any(rn.carry or rn.saved for rn in runners)
    return loss


@pytest.mark.parametrize("name,num_stages", [("1f1b", 2), ("gpipe", 2), ("interleaved", 4)])
def test_program_with_segments_equals_unsplit(name, num_stages):
    """A generated, lowered and validated program with segments (rows x segments, 2 ranks),
    executed through the stage-level API, trains like the unsplit batch: same loss, same
    gradients of every stage (tied: both copies, before their TIE sum)."""
    from schedule import build, round_robin

    config = make_config("llama_tied", "sdpa")
    stages = make_stages(config, num_stages)
    x, targets = make_batch(config.vocab_size, rows_len=(SEQ, 70, 41, 12))
    lengths = balanced_segments(SEQ, 3, key_cost=0.02)
    M = 2
    mapping = round_robin(num_stages, 2)
    program = build(name, num_stages, M, mapping, offload=True, prefetch=True, clip=True, num_segments=3)
    assert any(a.seg == 2 for acts in program.values() for a in acts)

    h = x
    for st in stages:
        h = st(h, targets) if st.is_last else st(h)
    h.backward()
    ref_loss, ref = h.detach(), {(i, n): p.grad.clone() for i, st in enumerate(stages) for n, p in st.named_parameters()}
    for st in stages:
        st.zero_grad(set_to_none=True)

    loss = run_program(program, mapping, stages, x, targets, lengths, M)
    assert rel(loss, ref_loss) < TOL
    for i, st in enumerate(stages):
        for n, p in st.named_parameters():
            assert rel(p.grad, ref[(i, n)]) < TOL, (i, n, rel(p.grad, ref[(i, n)]))


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_packed_rows(impl):
    """Packed rows (records one after another in a row, positions restarting, attention within a
    record): segments cut through records; each query still sees exactly its record's earlier
    keys, and the window counts columns (as the unsplit stage does)."""
    config = make_config("mistral", impl)
    (stage,) = make_stages(config)
    x, targets = make_batch(config.vocab_size, rows_len=(SEQ, SEQ))
    ends = [(30, 71, SEQ), (50, 90)]  # record ends per row; row 1 ends in padding (record id 0)
    doc = torch.zeros(2, SEQ, dtype=torch.long)
    pos = torch.zeros(2, SEQ, dtype=torch.long)
    for i, row_ends in enumerate(ends):
        start = 0
        for k, end in enumerate(row_ends):
            doc[i, start:end] = k + 1
            pos[i, start:end] = torch.arange(end - start)
            targets[i, end - 1] = -100  # a record's last token predicts nothing of the next
            start = end
        targets[i, start:] = -100
    stage.zero_grad(set_to_none=True)
    ref_loss = stage(x, targets, position_ids=pos, segment_ids=doc)
    ref_loss.backward()
    ref = (ref_loss.detach(), grads_of(stage))

    def run(doc_ids):
        stage.zero_grad(set_to_none=True)
        runner, loss = SegmentStage(stage, LENGTHS["equal"]), 0
        for j, (a, b) in enumerate(segment_bounds(LENGTHS["equal"])):
            loss = loss + runner.forward(0, j, x[:, a:b], targets[:, a:b], position_ids=pos[:, a:b],
                                         doc_ids=doc_ids[:, :b]).detach()
        for j in reversed(range(len(LENGTHS["equal"]))):
            runner.backward(0, j)
        return loss, grads_of(stage)

    assert not mismatch(ref, run(doc))
    assert mismatch(ref, run(torch.ones_like(doc)))  # records that see each other: caught
