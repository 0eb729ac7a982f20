"""L2: a 2-process run over gloo whose planner picks a permuted stage -> rank mapping (GPU 0's
host link slow in the topology file): it trains exactly like one process, writes a well-formed
measured and predicted timeline, and replays offline to the prediction it logged (the mapping
choice itself: tests/pure/test_cross.py)."""
from __future__ import annotations

import json

import pytest

import schedule as sched
from schedule.ir import Op


@pytest.fixture(scope="module")
def cross_run(tiny_model_dir, tmp_path_factory):
    from tests.helpers.runs import tiny_cfg, cli_flags, run_torchrun

    out = tmp_path_factory.mktemp("cross")
    topo = out / "topo.yaml"
    # GPU 0's host link is slow: the planner gives position 0 (first load exposed) to rank 1.
    topo.write_text("gpus:\n  - {index: 0, root: 0, bandwidth_gbps: 1}\n  - {index: 1, root: 1, bandwidth_gbps: 25}\n")
    cfg = tiny_cfg(tiny_model_dir, schedule="interleaved", num_stages=4, use_offload=True, save_dir=str(out),
               save_params=True, save_results=str(out / "results.json"), mapping="planned", topology=str(topo),
               timeline=True)
    proc = run_torchrun(2, cli_flags(cfg))
    return cfg, out, proc


@pytest.mark.slow
def test_torchrun_permuted_mapping_matches_reference(tiny_model_dir, cross_run):
    from tests.helpers.reference import assert_same_training
    from tests.helpers.runs import reference_result, run_outcome

    cfg, out, proc = cross_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mapping planned: stage -> rank [1, 0, 1, 0]" in proc.stdout
    assert_same_training(*run_outcome(out), *reference_result(str(tiny_model_dir)))


@pytest.mark.slow
def test_torchrun_writes_timeline(cross_run):
    from pipeline.run.timeline import timeline_size
    from tests.helpers.images import png_size

    cfg, out, proc = cross_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "prediction error" in proc.stdout
    program = sched.build("interleaved", 4, cfg.num_chunks, [1, 0, 1, 0], offload=True, prefetch=True, clip=True)
    for name in ("timeline.json", "timeline_predicted.json"):
        trace = json.loads((out / name).read_text())["traceEvents"]
        boxes = {(e["pid"], e["name"]) for e in trace if e["ph"] == "X"}
        want = {(r, str(a)) for r, acts in program.items() for a in acts if a.op in (Op.FORWARD, Op.BACKWARD)}
        assert want <= boxes, sorted(want - boxes)[:5]
        assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in trace if e["ph"] == "X")
    # One picture, measured over predicted (rows: load / offload, compute, comm, optimizer); the log names it.
    assert png_size(out / "timeline.png") == timeline_size(2, 4, 2) and not (out / "timeline_predicted.png").exists()
    assert f"{out / 'timeline_predicted.json'}, {out / 'timeline.png'}" in proc.stdout


@pytest.mark.slow
def test_timeline_replays_offline(cross_run):
    """bench/timeline_vs_model.py rebuilds the run's program from its files (config, trace) and
    gets the prediction the run logged (the rank groups are the topology file's)."""
    from tests.helpers.bench import load_bench

    cfg, out, proc = cross_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = load_bench("offload_bench").parse_log(proc.stdout)
    got = load_bench("timeline_vs_model").compare(out, out / "results.json", [0, 1], step_scales=(1.0, 0.0))
    assert got["measured_timeline_step_s"] == pytest.approx(logged["measured_timeline_step_s"], abs=1e-4)
    assert got["steady_state"]["host_end_s"] == pytest.approx(logged["predicted_step_s"], abs=1e-4)
    # Steps scaled by 1 change nothing; steps of no time leave the clean start's iteration.
    scaled = got["steady_state_with_steps_scaled_s"]
    assert scaled[1.0] == got["steady_state"]["host_end_s"]
    assert scaled[0.0] == pytest.approx(got["clean_start"]["host_end_s"])
