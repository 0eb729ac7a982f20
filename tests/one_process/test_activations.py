"""``offload.activations.ActivationStash`` on its own: every (stage, micro-batch, segment) gets
its own input back, once; a second save of a key or a restore of a key never saved is an error."""
from __future__ import annotations

import pytest
import torch

from offload.activations import ActivationStash


def test_each_key_gets_its_own_input_back_once():
    stash = ActivationStash(torch.device("cpu"))
    inputs = {(s, m): torch.full((2, 3, 4), float(10 * s + m)) for s in (1, 2) for m in range(3)}
    for key, x in inputs.items():
        stash.save(key, x)
    assert len(stash) == 6 and stash.host_bytes() == 6 * inputs[(1, 0)].nbytes
    stash.prefetch((2, 1))
    stash.prefetch((2, 1))  # already on its way back: nothing more
    stash.prefetch((3, 0))  # not saved (its forward has not run): nothing
    for key in [(2, 1), (1, 0), (2, 2), (1, 2), (2, 0), (1, 1)]:
        assert torch.equal(stash.restore(key), inputs[key]), key
    assert len(stash) == 0
    with pytest.raises(RuntimeError, match="no input held for stage 1, micro-batch 0"):
        stash.restore((1, 0))


def test_a_second_save_of_a_key_is_an_error():
    stash = ActivationStash(torch.device("cpu"))
    stash.save((1, 0), torch.zeros(2))
    with pytest.raises(RuntimeError, match="stage 1, micro-batch 0 is already held"):
        stash.save((1, 0), torch.ones(2))
    stash.clear()
    stash.save((1, 0), torch.ones(2))
    assert torch.equal(stash.restore((1, 0)), torch.ones(2))


def test_segments_of_a_microbatch_are_keys_of_their_own():
    """seq_chunks: each segment of a micro-batch waits for its own backward (last segment first)."""
    stash = ActivationStash(torch.device("cpu"))
    inputs = {(1, 0, j): torch.full((2, 3 - j, 4), float(j)) for j in range(3)}
    for key, x in inputs.items():
        stash.save(key, x)
    stash.prefetch((1, 0, 1))
    for key in [(1, 0, 2), (1, 0, 1), (1, 0, 0)]:
        assert torch.equal(stash.restore(key), inputs[key]), key
    with pytest.raises(RuntimeError, match="no input held for stage 1, micro-batch 0, segment 2"):
        stash.restore((1, 0, 2))
    stash.save((1, 0, 2), torch.zeros(1))
    with pytest.raises(RuntimeError, match="stage 1, micro-batch 0, segment 2 is already held"):
        stash.save((1, 0, 2), torch.zeros(1))


@pytest.mark.gpu
def test_cuda_round_trip_through_pinned_memory():
    """On CUDA the input crosses to pinned host memory and back on the stash's stream; the
    device tensor may be dropped as soon as save returns: its memory is not handed out again
    before the copy has read it."""
    stash = ActivationStash(torch.device("cuda"))
    x = torch.randn(4, 64, 32, device="cuda")
    want = x.clone()
    stash.save((1, 0), x)
    del x
    junk = torch.full_like(want, 7.0)  # would take x's block if the copy's use of it were not recorded
    assert stash._host[(1, 0)].is_pinned()
    back = stash.restore((1, 0))
    torch.cuda.synchronize()
    assert back.device.type == "cuda" and torch.equal(back, want) and not torch.equal(junk, want)


def test_host_buffers_are_exact_and_reused_once_given_back():
    """``HostBuffers``: a buffer of exactly the bytes asked for (no power-of-two rounding), another
    while one is held, the same one again once given back (a later copy on the same stream); a
    narrower request takes a wider free buffer, and a wider one lets the narrowest free one go, so
    batches of changing widths hold no more than the widest asks for."""
    from offload.streams import HostBuffers

    buffers = HostBuffers(pin=False)
    a = buffers.take((3, 5, 7), torch.bfloat16)
    b = buffers.take((3, 5, 7), torch.bfloat16)
    assert a.shape == (3, 5, 7) and a.untyped_storage().nbytes() == 3 * 5 * 7 * 2
    assert a.data_ptr() != b.data_ptr() and buffers.held_bytes() == 2 * a.nbytes
    buffers.give(a)
    c = buffers.take((7, 15), torch.bfloat16)  # the same size in another shape
    assert c.data_ptr() == a.data_ptr() and buffers.held_bytes() == 2 * a.nbytes
    d = buffers.take((3, 5, 7), torch.float32)  # another dtype: a buffer of its own
    assert d.data_ptr() not in (a.data_ptr(), b.data_ptr())
    buffers.give(b)
    buffers.give(c)
    narrow = buffers.take((2, 5, 7), torch.bfloat16)  # a narrower batch: a free buffer that holds it
    assert narrow.data_ptr() in (a.data_ptr(), b.data_ptr()) and narrow.shape == (2, 5, 7)
    buffers.give(narrow)
    before = buffers.held_bytes()
    wide = buffers.take((3, 9, 7), torch.bfloat16)  # wider: a new buffer, the narrowest free one goes
    assert wide.untyped_storage().nbytes() == 3 * 9 * 7 * 2
    assert buffers.held_bytes() == before + wide.nbytes - 3 * 5 * 7 * 2


def test_host_buffers_take_a_free_buffer_that_is_not_the_first():
    """Two free buffers of different sizes, the wider given back last: a request only it holds
    takes it (the 3B 128K row's second step, whose segments' inputs are of two widths, failed
    here comparing the free buffers' tensors), and one wider than both lets the narrower go."""
    from offload.streams import HostBuffers

    buffers = HostBuffers(pin=False)
    small, big = buffers.take((4,), torch.float32), buffers.take((9,), torch.float32)
    big_ptr = big.data_ptr()
    buffers.give(small)
    buffers.give(big)
    again = buffers.take((8,), torch.float32)
    assert again.data_ptr() == big_ptr and buffers.held_bytes() == (4 + 9) * 4
    buffers.give(again)
    buffers.take((5,), torch.float32)  # the wider again (the narrower does not hold it)
    wider = buffers.take((12,), torch.float32)  # only the narrower is free: it goes
    assert wider.numel() == 12 and buffers.held_bytes() == (9 + 12) * 4


@pytest.mark.gpu
def test_cuda_stash_reuses_its_page_locked_buffers():
    """The next iteration's save of a key takes the buffer the previous restore gave back:
    page-locked, exactly the input's size, the data of the new input."""
    stash = ActivationStash(torch.device("cuda"))
    for i in range(2):
        x = torch.full((3, 1000, 7), float(i), device="cuda")
        stash.save((1, 0), x)
        host = stash._host[(1, 0)]
        assert host.is_pinned() and host.untyped_storage().nbytes() == x.nbytes
        ptr = host.data_ptr() if i == 0 else ptr
        assert host.data_ptr() == ptr
        assert torch.equal(stash.restore((1, 0)), x)
    torch.cuda.synchronize()
