"""data_parallel: D replicas of a P-rank pipeline train exactly as one pipeline on the same global batch.

L0/L1: the layout of ranks, the replica's config and share of the batch, the pre-launch errors.
L2 (slow): 4 processes as 2 replicas x 2 ranks == 2 processes x the same stages (gloo, float32),
with and without offload; the same with two torchrun "nodes" on this machine.
"""
from __future__ import annotations

import functools
import json
import socket
import subprocess
import sys

import pytest

from pipeline.config import ConfigError, make_config
from pipeline.plan.layout import Layout, layout, replica_config, replica_share
from pipeline.plan.preflight import check_config
from tests.helpers.paths import ROOT, env_without_dist
from tests.helpers.reference import assert_same_training
from tests.helpers.runs import cli_flags, run_outcome, run_results, run_torchrun, tiny_cfg

RTOL = 1e-6  # only the order of two float32 sums differs (micro-batch gradients, replica losses)


# --- L0 / L1 ---------------------------------------------------------------------------------------
def test_layout_keeps_a_replica_on_consecutive_ranks():
    lay = Layout(rank=5, data_parallel=2, pipeline_size=4)
    assert (lay.replica, lay.position) == (1, 1)
    assert lay.global_rank(3) == 7 and lay.global_rank(3, replica=0) == 3
    assert lay.peers() == [1, 5] and lay.peers(0) == [0, 4]


def test_replica_config_and_share():
    cfg = make_config({"batch_size": 8, "num_chunks": 4, "data_parallel": 2})
    one = replica_config(cfg)
    assert (one.batch_size, one.num_chunks, one.data_parallel) == (4, 2, 1)
    assert one.batch_size // one.num_chunks == cfg.batch_size // cfg.num_chunks  # same micro-batch size
    assert replica_config(make_config({})) == make_config({})
    items = list(range(4))
    assert replica_share(items, Layout(0, 2, 2)) == [0, 1]
    assert replica_share(items, Layout(3, 2, 2)) == [2, 3]


@pytest.mark.parametrize("world,kw,match", [
    (4, {"data_parallel": 3}, r"data_parallel \(3\) must be >= 1 and divide the number of processes \(4\)"),
    (4, {"data_parallel": 0}, r"data_parallel \(0\) must be >= 1"),
    (4, {"data_parallel": 2, "num_chunks": 3, "batch_size": 9},
     r"num_chunks \(3\) must be divisible by data_parallel \(2\)"),
    (4, {"data_parallel": 2, "num_stages": 3},
     r"num_stages \(3\) must be a positive multiple .* per pipeline .* \(2\)"),
])
def test_check_config_refuses(world, kw, match):
    with pytest.raises(ConfigError, match=match):
        check_config(make_config({"device": "cpu", **kw}), world)


def test_check_config_accepts_replicas():
    check_config(make_config({"device": "cpu", "data_parallel": 2, "num_stages": 4, "num_chunks": 4}), 4)
    assert layout(make_config({"data_parallel": 2}), 0, 4).pipeline_size == 2


@pytest.mark.slow  # a main.py subprocess: the fast layer keeps one torchrun check
def test_prelaunch_error_is_one_line():
    """Before any process group: one error line, exit 2."""
    proc = subprocess.run([sys.executable, str(ROOT / "main.py"), "--config", "", "--data_parallel", "2",
                           "--device", "cpu", "--check_only"],
                          cwd=ROOT, env=env_without_dist(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: data_parallel (2)"), proc.stderr


@pytest.mark.slow  # a main.py subprocess: the fast layer keeps one torchrun check
def test_plan_describes_replicas(tiny_model_dir):
    proc = subprocess.run([sys.executable, str(ROOT / "main.py"), "--config", "", "--plan", "--model",
                           str(tiny_model_dir), "--device", "cpu", "--nproc", "4", "--data_parallel", "2",
                           "--num_stages", "4", "--batch_size", "8", "--num_chunks", "4"],
                          cwd=ROOT, env=env_without_dist(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "on 2 processes" in proc.stdout and "2 micro-batches of 2x" in proc.stdout, proc.stdout
    assert "data_parallel: 2 replicas of this 2-rank pipeline, 4 processes" in proc.stdout, proc.stdout


@pytest.mark.slow  # two plans of a 7B model: seconds
def test_plan_counts_every_replica_on_the_host():
    """The host check holds the replicas on one host: each its ranks' host memory, the sharded
    stages' AdamW state split between them (it counted one replica's, so --plan accepted a 7B
    data_parallel 2 run on 150 GiB that needs 176). A tied copy is not sharded."""
    from pipeline.config import make_config
    from pipeline.plan.fit import assess
    from pipeline.plan.layout import replica_config
    from pipeline.spec.partition import stage_layers
    from pipeline.spec.shapes import stage_param_counts
    from pipeline.plan.source import preset_config
    from schedule import round_robin

    for preset, tied in (("llama-2-7b", set()), ("tiny", {0, 3})):
        hf = preset_config(preset)
        hf.tie_word_embeddings = bool(tied)
        cfg = replica_config(make_config({"model": preset, "nproc": 2, "data_parallel": 2, "num_stages": 4,
                                          "use_offload": True, "resident_stages": 0, "device": "cuda",
                                          "gpu_memory_gb": 80, "batch_size": 16, "num_chunks": 4}))
        one = assess(cfg, hf, round_robin(4, 1))
        two = assess(cfg, hf, round_robin(4, 1), replicas=(2, 2))
        counts = stage_param_counts(hf, 4, stage_layers(cfg, hf, 1))
        sharded = sum(8 * counts[s] for s in range(4) if s not in tied)
        assert two.total_host == 2 * one.total_host - sharded, preset
        assert two.total_host < 2 * one.total_host


# --- L2: several processes ---------------------------------------------------------------------------
def _dp_cfg(model_dir, save_dir, **kw):
    return tiny_cfg(model_dir, **{"schedule": "gpipe", "num_stages": 4, "save_dir": str(save_dir), "save_params": True,
                              "save_results": str(save_dir / "results.json"), **kw})


@functools.lru_cache(maxsize=None)
def _one_pipeline(model_dir: str, save_dir: str, offload: bool):
    """2 processes x 2 stages each, the global batch in one pipeline."""
    from pathlib import Path

    out = Path(save_dir)
    proc = run_torchrun(2, cli_flags(_dp_cfg(model_dir, out, use_offload=offload)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_outcome(out)


def _assert_same(got, want):
    assert_same_training(*got, *want, rtol=RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("offload,share", [(False, "1"), (True, "1"), (True, "0")],
                         ids=["resident", "offload-shared-host", "offload-over-gloo"])
def test_two_replicas_match_one_pipeline(tiny_model_dir, tmp_path_factory, offload, share):
    """Offloaded stages sharded over the replicas: the peers on this machine share the masters and
    sum their gradients in host memory; with MMOC_SHARE_HOST=0 (and across nodes) over gloo."""
    ref = _one_pipeline(str(tiny_model_dir), str(tmp_path_factory.mktemp("one")), offload)
    out = tmp_path_factory.mktemp("dp")
    proc = run_torchrun(4, cli_flags(_dp_cfg(tiny_model_dir, out, use_offload=offload, data_parallel=2)),
                        env={"MMOC_SHARE_HOST": share})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "4 processes (2 replicas of 2)" in proc.stdout, proc.stdout[-2000:]
    assert ("CPU AdamW steps of stages [1, 3] are sharded over 2 replicas" in proc.stdout) == offload, \
        proc.stdout[-2000:]
    if offload:
        how = "share one copy of the masters" if share == "1" else "exchanged over gloo"
        assert how in proc.stdout, proc.stdout[-2000:]
    assert run_results(out / "results.json")["data_parallel"] == 2
    _assert_same(run_outcome(out), ref)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_on_one_machine(tiny_model_dir, tmp_path_factory):
    """Two torchrun commands, --nnodes 2 and distinct --node_rank, meet over c10d: each node runs
    one replica of the 2-rank pipeline, and the training is that of one pipeline."""
    ref = _one_pipeline(str(tiny_model_dir), str(tmp_path_factory.mktemp("one")), False)
    out = tmp_path_factory.mktemp("nodes")
    flags = cli_flags(_dp_cfg(tiny_model_dir, out, data_parallel=2))
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(n),
                               "--nproc_per_node", "2", "--rdzv_backend", "c10d", "--rdzv_id", "mmoc-test",
                               "--rdzv_endpoint", f"127.0.0.1:{port}", str(ROOT / "main.py"), "--config", "", *flags],
                              cwd=ROOT, env=env_without_dist(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
             for n in (0, 1)]
    try:
        outputs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    _assert_same(run_outcome(out), ref)


@pytest.mark.slow
def test_checkpoint_of_replicas_resumes_with_any_data_parallel(tiny_model_dir, tmp_path_factory):
    """2 replicas save a checkpoint after step 2 (written by replica 0 alone, the sharded AdamW
    state of the offloaded stages gathered); it resumes with 2 replicas (sharded again) and with 1
    alike, and step 3 then equals the uninterrupted one-pipeline run. A constant lr: the runs'
    num_iterations differ."""
    common = dict(lr_schedule="constant", warmup_iterations=0, use_offload=True)
    ref_dir = tmp_path_factory.mktemp("ref")
    proc = run_torchrun(2, cli_flags(_dp_cfg(tiny_model_dir, ref_dir, **common)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref_losses, ref_params = run_outcome(ref_dir)
    first = tmp_path_factory.mktemp("first")
    proc = run_torchrun(4, cli_flags(_dp_cfg(tiny_model_dir, first, data_parallel=2, num_iterations=2,
                                          checkpoint_every=2, **common)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = first / "checkpoints" / "step_00000002"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["data_parallel"] == 2 and state["world_size"] == 4
    assert sorted(p.name for p in (ckpt / "train_state").glob("rank*.pt")) == ["rank00000.pt", "rank00001.pt"]
    for nproc, dp in ((4, 2), (2, 1)):
        out = tmp_path_factory.mktemp(f"resumed{dp}")
        proc = run_torchrun(nproc, cli_flags(_dp_cfg(tiny_model_dir, out, data_parallel=dp, resume=str(ckpt), **common)))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "resumed from" in proc.stdout, proc.stdout[-2000:]
        losses, params = run_outcome(out)
        _assert_same((losses, params), (ref_losses[2:], ref_params))


def _eval_losses(save_dir) -> list[float]:
    rows = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "eval"]


@pytest.mark.slow
@pytest.mark.parametrize("model,kw", [
    ("tiny", dict(schedule="1f1b", use_offload=True, resident_stages=1, eval_every=3, eval_batches=2,
                  save_metrics=True)),
    ("qwen2_tied", dict(schedule="interleaved", use_offload=True, dataset="synthetic")),
    # no NORM: each stage's gradient is summed at its STEP, during the backward
    ("tiny", dict(schedule="1f1b", use_offload=True, grad_clip=0.0, max_skipped_steps=-1)),
])
def test_replicas_with_resident_stages_evaluation_tied_embeddings_no_norm(tiny_model_dir, tmp_path_factory, model,
                                                                         kw):
    """A resident stage's gradient (on the device) and an offloaded one's (in host memory) are
    summed alike; validation sums the replicas' token losses; tied copies on two ranks of each
    replica exchange their gradient within the replica, then each copy is summed over the replicas."""
    from tests.helpers.architectures import make_model

    model_dir = tiny_model_dir if model == "tiny" else make_model(model, str(tmp_path_factory.mktemp("models")))
    runs = {}
    for nproc, dp in ((2, 1), (4, 2)):
        out = tmp_path_factory.mktemp(f"dp{dp}")
        proc = run_torchrun(nproc, cli_flags(_dp_cfg(model_dir, out, data_parallel=dp, **kw)), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[dp] = out
    _assert_same(run_outcome(runs[2]), run_outcome(runs[1]))
    if kw.get("eval_every"):
        ref = _eval_losses(runs[1])
        got = _eval_losses(runs[2])
        assert len(got) == len(ref) == 1 and abs(got[0] - ref[0]) <= RTOL * ref[0], (got, ref)
