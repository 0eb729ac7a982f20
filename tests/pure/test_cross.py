"""Cross mapping wired into training: mapping choice (L0), load stagger (L0), --plan text (L0).
The 2-process run whose planner picks a permuted stage -> rank mapping (it must still train
exactly like one process, and write a well-formed measured and predicted timeline):
tests/multi_process/test_gloo_cross.py."""
from __future__ import annotations

import itertools

import pytest

import schedule as sched
from schedule.costmodel import predict
from schedule.ir import Action
from schedule.mapping import (MAPPING_MODES, choose_mapping, compare_mappings, describe_plan, plan_stagger,
                              position_mapping)
from schedule.spec import ProgramSpec

GB = 10**9


# --- L0: arbitrary stage -> rank mappings ---------------------------------------------------------
ARBITRARY = [[1, 0, 1, 0], [2, 0, 1, 2, 0, 1], [0, 1, 1, 0], [1, 1, 0, 0], [1, 0, 2, 2, 0, 1], [3, 1, 0, 2] * 2]


@pytest.mark.parametrize("mapping", ARBITRARY, ids=str)
@pytest.mark.parametrize("name", sched.SCHEDULE_NAMES)
def test_builders_accept_arbitrary_mappings(mapping, name):
    for num_mbs, (offload, prefetch), clip in itertools.product((1, 3, 8), ((False, False), (True, True)),
                                                                 (False, True)):
        program = sched.build(name, len(mapping), num_mbs, mapping, offload=offload, prefetch=prefetch, clip=clip)
        assert sorted(program) == sorted(set(mapping))  # build() validated it


@pytest.mark.parametrize("name", sched.SCHEDULE_NAMES)
def test_permuted_positions_relabel_round_robin(name):
    # A rank taking over position p runs exactly what rank p runs under round-robin.
    perm = [2, 0, 3, 1]
    mapping = position_mapping(perm, 8)
    assert mapping == [2, 0, 3, 1, 2, 0, 3, 1]
    permuted = sched.build(name, 8, 8, mapping, offload=True, prefetch=True, clip=True)
    plain = sched.build(name, 8, 8, sched.round_robin(8, 4), offload=True, prefetch=True, clip=True)
    assert all(permuted[perm[p]] == plain[p] for p in range(4))


def test_position_mapping_errors():
    with pytest.raises(ValueError, match=r"position_rank \[0, 0\] must be a permutation of ranks 0..1"):
        position_mapping([0, 0], 4)
    with pytest.raises(ValueError, match=r"num_stages \(3\) must be a positive multiple of the 2 ranks"):
        position_mapping([1, 0], 3)


# --- L0: choosing the mapping -----------------------------------------------------------------------
def _choose(mode, groups, offload=True, **kw):
    n = 4 if groups is None else len(groups)
    program = ProgramSpec("interleaved", 2 * n, 8, offload=offload, prefetch=True)
    base = dict(rank_groups=groups, stage_bytes=[GB] * 2 * n, stage_compute_s={s: (0.01, 0.02) for s in range(2 * n)})
    return choose_mapping(mode, n, program, **{**base, **kw})


def test_modes():
    from pipeline.config import TrainConfig, make_config

    field = TrainConfig.__dataclass_fields__["mapping"]
    assert MAPPING_MODES == field.metadata["choices"] == ("planned", "round_robin")
    rr = sched.round_robin(8, 4)
    c = _choose("round_robin", [0, 0, 1, 1], visible_devices="3,1,2,0")
    assert c.stage_to_rank == rr and c.plan is None and "planner not run" in c.reason
    assert "CUDA_VISIBLE_DEVICES=3,1,2,0" in c.reason
    # Two GPUs per root in PCI order: ranks 0, 1 share a root, so positions go 0, 2, 1, 3.
    c = _choose("planned", [0, 0, 1, 1], stagger=False)
    assert c.position_rank == [0, 2, 1, 3] and c.stage_to_rank == [0, 2, 1, 3, 0, 2, 1, 3]
    assert c.plan.step_time < c.plan.sequential_step_time and "saved" in c.reason
    # planned falls back to round-robin without GPUs, offload or a topology, and says why; a
    # topology given plans without GPUs too.
    assert _choose("planned", None, has_gpus=False).reason == "mapping planned -> round_robin: no GPUs"
    assert _choose("planned", [0, 0, 1, 1], has_gpus=False, stagger=False).position_rank == [0, 2, 1, 3]
    assert "use_offload is off" in _choose("planned", [0, 0, 1, 1], offload=False).reason
    c = _choose("planned", None)
    assert c.stage_to_rank == rr and c.reason.startswith("mapping planned -> round_robin: GPU topology unknown")
    with pytest.raises(ValueError, match=r"mapping 'zigzag': choose one of planned, round_robin"):
        _choose("zigzag", [0, 1])
    # The earlier names still work, as the mode they meant.
    assert [make_config({"mapping": old}).mapping for old in ("auto", "cross", "sequential", "manual")] == \
        ["planned", "planned", "round_robin", "round_robin"]


# --- L0: load stagger -------------------------------------------------------------------------------
def test_cost_model_start_offset():
    program = {0: [Action.parse(t) for t in "0L 0F0 0SEND_F0".split()],
               1: [Action.parse(t) for t in "1L 1RECV_F0 1F0".split()]}
    compute = {0: (0.1, 0.2), 1: (0.1, 0.2)}
    # One 20 GB/s root, two 2 GB loads: shared, both end at 0.2 s; rank 1 held back 0.1 s:
    # rank 0's load ends at 0.1 s, rank 1's at 0.2 s, still before its forward can start.
    shared = predict(program, [0, 1], [0, 1], [0, 0], compute, [2 * GB] * 2, 20.0, 20.0)
    held = predict(program, [0, 1], [0, 1], [0, 0], compute, [2 * GB] * 2, 20.0, 20.0, start_offset_s=[0.0, 0.1])
    assert shared.step_time == pytest.approx(0.4) and held.step_time == pytest.approx(0.3)
    load = {str(a): (s, e) for s, e, a in held.timeline[1]}["1L"]
    assert load == pytest.approx((0.1, 0.2))
    st = plan_stagger(program, [0, 1], [0, 1], [0, 0], compute, [2 * GB] * 2, 20.0, 20.0)
    assert st.offsets == pytest.approx([0.0, 0.1]) and st.step_time == pytest.approx(0.3)
    # Under different roots nothing is shared: no offsets.
    st = plan_stagger(program, [0, 1], [0, 1], [0, 1], compute, [2 * GB] * 2, 20.0, 20.0)
    assert st.offsets == [0.0, 0.0] and st.step_time == st.base_step_time


def test_compare_and_describe_plan():
    plan, rows = compare_mappings([0, 0, 1, 1], [GB] * 8,
                                  ProgramSpec("interleaved", 8, 8, offload=True, prefetch=True, clip=True),
                                  stage_compute_s={s: (0.01, 0.02) for s in range(8)})
    by = {r.name: r for r in rows}
    assert by["cross"].gpu_of_rank == [0, 2, 1, 3] and by["sequential"].gpu_of_rank == [0, 1, 2, 3]
    assert by["cross"].step_time < by["sequential"].step_time <= by["worst"].step_time
    assert all(r.staggered_step_time <= r.step_time for r in rows)
    program = ProgramSpec("interleaved", 8, 16, offload=True, prefetch=True, clip=True)
    text = describe_plan([0, 1, 0, 1], [840_000_000] * 8, program, 1024, 1, gpu_ids=[4, 5, 6, 7])
    assert "CUDA_VISIBLE_DEVICES=4,5,6,7" in text and "GPU4:A GPU5:B GPU6:A GPU7:B" in text
    for name in ("cross", "sequential", "worst"):
        assert f"\n  {name} " in text
    assert "bubble" in text and "exposed xfer s" in text and "60 TFLOP/s" in text


# --- L1: which GPU each rank is on; the --plan helper -------------------------------------------------
def test_rank_topology_follows_visible_devices(monkeypatch):
    from pipeline.plan.topology import GpuLink, Topology
    from pipeline.dist import DistEnv
    from pipeline.plan.placement import rank_topology

    topo = Topology([GpuLink(i, root, 0, bw) for i, root, bw in [(0, 0, 25.0), (1, 0, 25.0), (2, 1, 12.0),
                                                                  (3, 1, 25.0)]], source="test")
    env = DistEnv(0, 4, 0, 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert rank_topology(topo, env)[:2] == ([0, 0, 1, 1], [25.0, 25.0, 12.0, 25.0])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0,3,1")
    assert rank_topology(topo, env)[:2] == ([1, 0, 1, 0], [12.0, 25.0, 25.0, 25.0])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,5")
    groups, _, why = rank_topology(topo, DistEnv(0, 2, 0, 2))
    assert groups is None and "has GPUs [0, 1, 2, 3], ranks need 2 of visible GPUs [0, 5]" in why
    assert rank_topology(topo, DistEnv(0, 8, 0, 4))[2] == "8 ranks over several hosts: topology is per host"


def test_local_gpus_follow_visible_devices(monkeypatch):
    """The optimizer's cores follow the NUMA node of the GPU a local rank really runs on."""
    from pipeline.plan.topology import GpuLink, Topology
    from pipeline.plan.placement import local_gpus

    topo = Topology([GpuLink(i, i // 2, i // 2, 25.0) for i in range(4)], source="test")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [g.numa for g in local_gpus(topo, 2)] == [0, 0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert [g.index for g in local_gpus(topo, 2)] == [2, 0] and [g.numa for g in local_gpus(topo, 2)] == [1, 0]
    assert local_gpus(topo, 3) is None  # three local ranks, two visible GPUs
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    assert local_gpus(topo, 1) is None  # a GPU the topology does not know


def test_plan_text_for_a_config():
    from pipeline.plan.topology import GpuLink, Topology
    from pipeline.config import make_config
    from pipeline.plan.source import preset_config
    from pipeline.plan.placement import plan_text
    from pipeline.spec.run_spec import build_run_spec

    topo = Topology([GpuLink(i, i % 2, 0, 25.0) for i in range(4)], source="test")
    # the even partition: the GPU order this expects is the planner's answer for its stage sizes
    cfg = make_config({"num_stages": 8, "schedule": "interleaved", "num_chunks": 8, "batch_size": 8,
                       "seq_length": 512, "use_offload": True, "partition": "layers"})
    text = plan_text(build_run_spec(cfg, preset_config("llama-2-7b"), 4, "cuda"), topo)
    assert "8 stages on 4 GPUs" in text and "8 micro-batches of 1x512 tokens" in text
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3" in text


def test_timeline_replays_a_run_with_resident_stages():
    """A hybrid run (offload with resident_stages -1, one of four stages kept per GPU) replayed
    offline from its committed files: the program is rebuilt with the stages the trace never
    loads as resident, and the prediction is the one the run logged (2.745 s). Rebuilt with
    every stage offloaded, the replay had predicted 3.062 s."""
    from tests.helpers.bench import load_bench
    from tests.helpers.paths import ROOT

    row = ROOT / "bench/results/2026-11-23_7b_two_gpus_chunked_steps_and_loads/callD/pcie48-hybrid+cross"
    logged = load_bench("offload_bench").parse_log(row.with_suffix(".log").read_text())
    got = load_bench("timeline_vs_model").compare(row, row.with_suffix(".json"), [0, 0])
    assert logged["resident_stages"] == "1/4"
    assert got["steady_state"]["host_end_s"] == pytest.approx(logged["predicted_step_s"], abs=1e-3)
