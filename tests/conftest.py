"""Shared fixtures: a tiny Llama model (GQA, 6 layers) and tokenizer built locally once per session,
the same with a wide vocabulary (the cost partition's tests); and the skip of the ``gpu`` mark."""
from __future__ import annotations

import gc
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT, set_scratch_save_dir


@pytest.hookimpl(tryfirst=True)  # before any fixture is set up: a skipped GPU test builds nothing
def pytest_runtest_setup(item):
    """A test marked ``gpu`` (or ``gpu(n)``) is skipped unless this machine has one CUDA GPU (or
    ``n``): the largest count any of its ``gpu`` marks asks for (pytest.ini registers the marks)."""
    needed = max((mark.args[0] if mark.args else 1 for mark in item.iter_markers("gpu")), default=0)
    if needed:
        import torch

        if torch.cuda.device_count() < needed:
            pytest.skip(f"needs {needed} CUDA GPU{'s' if needed > 1 else ''}, this machine has "
                        f"{torch.cuda.device_count()}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from data import SAMPLE_TRAIN, ensure_tiny_model

    path = tmp_path_factory.mktemp("models") / "tiny"
    return ensure_tiny_model(path, data_files=[SAMPLE_TRAIN], hidden_size=64, intermediate_size=128, num_layers=6,
                             num_heads=4, num_kv_heads=2, vocab_size=512, max_position_embeddings=256, seed=1)


@pytest.fixture(scope="session")
def wide_vocab_model_dir(tmp_path_factory) -> Path:
    """The tiny model with a vocabulary of 4096: its head costs about six decoder layers."""
    from data import SAMPLE_TRAIN, ensure_tiny_model

    path = tmp_path_factory.mktemp("models") / "wide_vocab"
    return ensure_tiny_model(path, data_files=[SAMPLE_TRAIN], hidden_size=64, intermediate_size=128, num_layers=6,
                             num_heads=4, num_kv_heads=2, vocab_size=4096, max_position_embeddings=256, seed=1)


@pytest.fixture(scope="module")
def models_root(tmp_path_factory) -> str:
    """Where a module's tiny models of other architectures go (tests.helpers.architectures.make_model)."""
    return str(tmp_path_factory.mktemp("arch_models"))


@pytest.fixture(autouse=True)
def _single_thread(monkeypatch):
    """Every test runs like a torchrun rank: ``OMP_NUM_THREADS=1`` for the processes it starts,
    and one intra-op thread for this process's main thread (the variable alone changes nothing
    here: torch read it at import). The optimizer thread of an offloading trainer still takes the
    rank's share of the cores, as under torchrun, so offload and resident runs compare across
    different thread counts whatever the shell that started pytest sets."""
    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="session")
def _collected_objects_frozen():
    """What collection built (torch's, transformers' and the test modules' objects, some 500k)
    is moved out of the cyclic GC's reach once: a full collection during the tests then walks only
    what the tests made (it walked it all, 0.3 s each, a few dozen times a session). It stays
    frozen to the end: pytest's last check for unraisable exceptions runs five full collections,
    which would walk it all again, and nothing frozen is garbage the process must free."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(autouse=True)
def _trainer_leaves_the_gc_alone(request, monkeypatch):
    """The trainer's ``freeze_survivors`` (a full collection, then the survivors frozen) and the
    ``gc.unfreeze()`` that ends its ``train()`` are no-ops in a test: each in-process run would
    otherwise walk the whole process (0.1-0.3 s a run, a third of a tiny training) and thaw what
    ``_collected_objects_frozen`` froze. It changes no result. The tests marked ``gc_freeze`` (the
    one that checks the freeze) and ``gpu`` (their timings) keep both, and start with nothing
    frozen, as a run does; after them the survivors are frozen again."""
    if request.node.get_closest_marker("gc_freeze") is not None or request.node.get_closest_marker("gpu") is not None:
        gc.unfreeze()
        yield
        gc.collect()
        gc.freeze()
        return
    from pipeline.run import trainer

    monkeypatch.setattr(trainer, "freeze_survivors", lambda: None)
    monkeypatch.setattr(gc, "unfreeze", lambda: None)
    yield


_SAMPLE_TOKENIZED: dict[tuple, tuple] = {}


@pytest.fixture(autouse=True)
def _bundled_sample_tokenized_once(monkeypatch):
    """The bundled sample (a file of the repository, never written) is tokenized once per
    tokenizer (its files and their times) and seq_length: every in-process trainer and reference
    tokenized its 300 records again, 80 ms each, hundreds of times a session. The examples are only
    read (``BatchStream`` indexes them), so the trainers share them; each still gets its own
    list and its own stream. Other datasets, and the tests of the tokenization, tokenize each time."""
    import data
    import data.tokenization
    from pipeline.run import build

    real_build, real_tokenize = build.build_stream, data.tokenization.tokenize_records

    def build_stream(cfg, source):
        if cfg.dataset != "sample" or source.tokenizer_dir is None:
            return real_build(cfg, source)
        files = sorted((f.name, f.stat().st_mtime_ns) for f in Path(source.tokenizer_dir).iterdir() if f.is_file())
        key = (str(source.tokenizer_dir), tuple(files), cfg.dataset_split, cfg.seq_length)

        def tokenize_records(records, tokenizer, seq_length, *, fmt=None, stats=None):
            if key not in _SAMPLE_TOKENIZED:
                counted: dict[str, int] = {}
                _SAMPLE_TOKENIZED[key] = (*real_tokenize(records, tokenizer, seq_length, fmt=fmt, stats=counted),
                                          counted)
            examples, skipped, counted = _SAMPLE_TOKENIZED[key]
            if stats is not None:
                stats.update(counted)
            return list(examples), skipped

        with monkeypatch.context() as m:  # build_stream imports it from data when called
            m.setattr(data, "tokenize_records", tokenize_records, raising=False)
            return real_build(cfg, source)

    monkeypatch.setattr(build, "build_stream", build_stream)
    yield


def _user_outputs() -> list[tuple[str, float]]:
    out = ROOT / "outputs"
    return sorted((str(p), p.stat().st_mtime) for p in out.rglob("*")) if out.exists() else []


@pytest.fixture(autouse=True, scope="session")
def _user_outputs_untouched():
    """Fails the session if any test wrote under the repository's outputs/ (a user's runs)."""
    before = _user_outputs()
    yield
    after = _user_outputs()
    assert after == before, f"tests wrote under {ROOT / 'outputs'}: {sorted(set(after) - set(before))[:5]}"


@pytest.fixture(autouse=True)
def _scratch_save_dir(tmp_path_factory):
    """A fresh empty directory per test: tests write runs there, never into the user's outputs/run."""
    set_scratch_save_dir(tmp_path_factory.mktemp("save_dir"))
    yield


def _process_state() -> dict:
    import torch

    from pipeline.stage import attention

    return {"grad mode": torch.is_grad_enabled(), "compiling": torch.compiler.is_compiling(),
            "torch-function modes": torch._C._len_torch_function_stack(),
            "dispatch modes": torch._C._len_torch_dispatch_stack(), "attention kernels": attention._MODE[0],
            "saved-tensor hooks": torch._C._autograd._top_saved_tensors_default_hooks(False)}


@pytest.fixture(autouse=True)
def _process_state_restored():
    """A test that leaves process-wide state changed (grad mode off, a compile or dispatch mode
    still entered, the attention kernels forced, saved-tensor hooks still pushed) fails here by
    name, and the state is put back: otherwise every later test in the process fails without
    saying why. (A checkpoint frame whose hooks outlived a failed test once packed every later
    test's saved tensors and replayed the failed layer in their backward.)"""
    import torch

    from pipeline.stage import attention

    before = _process_state()
    yield
    after = _process_state()
    torch.set_grad_enabled(before["grad mode"])
    for _ in range(64):  # hooks pushed by the test and never popped
        if torch._C._autograd._top_saved_tensors_default_hooks(False) == before["saved-tensor hooks"]:
            break
        torch._C._autograd._pop_saved_tensors_default_hooks()
    attention._MODE[0] = before["attention kernels"]
    changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    assert not changed, f"the test left process-wide state changed (before, after): {changed}"
