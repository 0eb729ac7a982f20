"""L0 tests of the GPU topology, the cost model, the mapping planner and the timeline writers."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

import schedule as sched
from pipeline.plan.topology import GpuLink, discover, load_topology_file, parse_nvidia_smi_topo, read_sysfs
from pipeline.run.timeline import (STYLE, Timeline, read_chrome_trace, timeline_size, write_chrome_trace,
                                   write_run_timeline, write_timeline_png)
from schedule.costmodel import predict, predict_steady
from schedule.ir import Action, Op
from schedule.mapping import plan_mapping
from schedule.spec import ProgramSpec
from tests.helpers.images import distinct_colours, png_size
from tests.helpers.paths import TESTS

DATA = TESTS / "data"
GB = 1e9


def acts(text: str) -> list[Action]:
    return [Action.parse(t) for t in text.split()]


def spans(pred, rank: int) -> dict[str, tuple[float, float]]:
    return {str(a): (round(s, 9), round(e, 9)) for s, e, a in pred.timeline[rank]}


# --- topology ---------------------------------------------------------------------------------
def test_parse_l20_two_root_complexes():
    topo = parse_nvidia_smi_topo((DATA / "topo_4xL20_2roots.txt").read_text(), bandwidth_gbps=25.0)
    assert topo.indices() == [0, 1, 2, 3]
    assert topo.groups() == [0, 1, 0, 1]  # GPU0+GPU2 under root A (PHB), GPU1+GPU3 under root B
    assert [g.numa for g in topo.gpus] == [0, 0, 0, 0]
    assert topo.link_gbps() == [25.0] * 4 and not topo.nvlink


def test_parse_dual_socket_switches():
    topo = parse_nvidia_smi_topo((DATA / "topo_8gpu_dual_socket.txt").read_text())
    assert topo.groups() == [0, 0, 1, 1, 2, 2, 3, 3]  # PIX pairs; NODE / SYS do not share
    assert [g.numa for g in topo.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_parse_nvlink_box_groups_through_nics():
    topo = parse_nvidia_smi_topo((DATA / "topo_4gpu_nvlink.txt").read_text())  # header has ANSI codes
    assert topo.nvlink
    assert topo.groups() == [0, 0, 1, 1]  # GPU0, GPU1 are PXB to NIC0; GPU2, GPU3 to NIC1
    assert [g.numa for g in topo.gpus] == [0, 0, 1, 1]
    bare = "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\nGPU0\t X \tNV4\t0-7\t0\nGPU1\tNV4\t X \t0-7\tN/A\n"
    topo = parse_nvidia_smi_topo(bare)
    assert topo.groups() == [0, 1] and [g.numa for g in topo.gpus] == [0, None]


def test_parse_errors_carry_values():
    with pytest.raises(ValueError, match="no nvidia-smi topo matrix.*'Failed to initialize NVML'"):
        parse_nvidia_smi_topo("Failed to initialize NVML\n")
    with pytest.raises(ValueError, match="'FOO' between GPU0 and GPU1"):
        parse_nvidia_smi_topo("\tGPU0\tGPU1\nGPU0\t X \tFOO\nGPU1\tFOO\t X \n")


def test_topology_file_yaml_and_json(tmp_path):
    y = tmp_path / "topo.yaml"
    y.write_text("gpus:\n  - {index: 1, root: 7, numa: 0, bandwidth_gbps: 25}\n"
                 "  - {index: 0, root: 3, numa: 0, bandwidth_gbps: 24.5}\n  - {index: 2, root: 3}\n")
    topo = load_topology_file(y)
    assert topo.indices() == [0, 1, 2] and topo.groups() == [0, 1, 0]
    assert topo.gpus[0] == GpuLink(0, 0, 0, 24.5) and topo.gpus[2].numa is None
    j = tmp_path / "topo.json"
    j.write_text(json.dumps({"gpus": [{"index": 0, "root": 0, "numa": 1, "bandwidth_gbps": 12}]}))
    assert load_topology_file(j).gpus == [GpuLink(0, 0, 1, 12.0)]
    y.write_text("gpus:\n  - {index: 0, root: 0, bandwidth_gbps: 2.5e1}\n  - {index: 1, root: 0, bandwidth_gbps: 1e2}\n")
    assert [g.bandwidth_gbps for g in load_topology_file(y).gpus] == [25.0, 100.0]  # YAML 1.1 read 1e2 as text


@pytest.mark.parametrize("body, match", [
    ("gpus: []", "non-empty list"),
    ("gpus:\n  - {index: 0, root: 0, speed: 3}", r"unknown keys \['speed'\]"),
    ("gpus:\n  - {index: -1, root: 0}", r"gpus\[0\].index = -1"),
    ("gpus:\n  - {index: 0, root: 0}\n  - {index: 0, root: 1}", r"duplicate GPU indices in \[0, 0\]"),
    ("gpus:\n  - {index: 0, root: 0, bandwidth_gbps: 0}", r"bandwidth_gbps = 0 must be"),
    ("gpus: [", "is not valid YAML at line 1, column 8"),
])
def test_topology_file_errors(tmp_path, body, match):
    f = tmp_path / "t.yaml"
    f.write_text(body)
    with pytest.raises(ValueError, match=match) as err:
        load_topology_file(f)
    assert "\n" not in str(err.value)


def _fake_sysfs(root: Path) -> Path:
    devices = root / "bus" / "pci" / "devices"
    devices.mkdir(parents=True)
    for bridge, port, bdf, vendor, cls, numa in [
        ("pci0000:00", "0000:00:01.0", "0000:01:00.0", "0x10de", "0x030200", "0"),
        ("pci0000:00", "0000:00:02.0", "0000:02:00.0", "0x10de", "0x030000", "0"),
        ("pci0000:00", "0000:00:03.0", "0000:03:00.0", "0x8086", "0x020000", "0"),  # a NIC
        ("pci0000:80", "0000:80:01.0", "0000:81:00.0", "0x10de", "0x030200", "-1"),
    ]:
        d = root / "devices" / bridge / port / bdf
        d.mkdir(parents=True)
        for name, text in [("vendor", vendor), ("class", cls), ("numa_node", numa),
                           ("max_link_speed", "16.0 GT/s PCIe"), ("max_link_width", "16")]:
            (d / name).write_text(text + "\n")
        (devices / bdf).symlink_to(d)
    return root


def test_sysfs_and_discover_fallback(tmp_path, monkeypatch):
    root = _fake_sysfs(tmp_path / "sys")
    topo = read_sysfs(root)
    assert topo.groups() == [0, 0, 1] and [g.numa for g in topo.gpus] == [0, 0, None]
    assert topo.link_gbps() == [31.5] * 3  # Gen4 x16, nominal

    def no_nvidia_smi(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "run", no_nvidia_smi)
    assert discover(sysfs_root=root).groups() == [0, 0, 1]
    assert discover(sysfs_root=tmp_path / "empty") is None


# --- cost model -------------------------------------------------------------------------------
TWO = {0: acts("0L 0F0 0SEND_F0"), 1: acts("1L 1RECV_F0 1F0")}
COMPUTE = {0: (0.1, 0.2), 1: (0.1, 0.2)}


def test_shared_root_halves_bandwidth():
    # Two GPUs under one 20 GB/s root each load 10 GB at once: 10 GB/s each, 1.0 s.
    p = predict(TWO, [0, 1], [0, 1], [0, 0], COMPUTE, [10 * GB, 10 * GB], 100.0, 20.0)
    assert spans(p, 0) == {"0L": (0.0, 1.0), "0F0": (1.0, 1.1), "0SEND_F0": (1.1, 1.1)}
    assert spans(p, 1)["1L"] == (0.0, 1.0) and spans(p, 1)["1F0"] == (1.1, 1.2)
    assert p.step_time == pytest.approx(1.2)
    assert p.exposed_transfer_s == pytest.approx({0: 1.0, 1: 0.0})  # rank 1 waited on rank 0, not its load
    assert p.bubble_fraction == pytest.approx(1 - 0.2 / (2 * 1.2))
    # Under different roots each gets the full 20 GB/s: 0.5 s.
    p = predict(TWO, [0, 1], [0, 1], [0, 1], COMPUTE, [10 * GB, 10 * GB], 100.0, 20.0)
    assert spans(p, 0)["0L"] == (0.0, 0.5) and spans(p, 1)["1L"] == (0.0, 0.5)
    assert p.step_time == pytest.approx(0.7)


def test_processor_sharing_and_link_caps():
    # 10 GB and 5 GB under one 20 GB/s root: 10 GB/s each until the small one ends at 0.5 s,
    # then the big one's last 5 GB go at 20 GB/s: done at 0.75 s.
    p = predict(TWO, [0, 1], [0, 1], [0, 0], COMPUTE, [10 * GB, 5 * GB], 100.0, 20.0)
    assert spans(p, 0)["0L"] == (0.0, 0.75) and spans(p, 1)["1L"] == (0.0, 0.5)
    # Max-min fair with link caps 8 and 25 GB/s: GPU0 gets 8, GPU1 the other 12.
    p = predict(TWO, [0, 1], [0, 1], [0, 0], COMPUTE, [10 * GB, 10 * GB], [8.0, 25.0], 20.0)
    assert spans(p, 1)["1L"] == pytest.approx((0.0, 10 / 12)) and spans(p, 0)["0L"] == (0.0, 1.25)
    # Opposite directions do not share: an offload and a load under one root both take 0.5 s.
    p = predict({0: acts("0O"), 1: acts("1L")}, [0, 1], [0, 1], [0, 0], COMPUTE, [10 * GB] * 2, 20.0, 20.0)
    assert spans(p, 0)["0O"] == (0.0, 0.5) and spans(p, 1)["1L"] == (0.0, 0.5)


def test_one_rank_lanes_offload_and_step():
    program = {0: acts("0L 1L 0F0 1F0 1B0 1O 1S 0B0 0O 0S")}
    p = predict(program, [0, 0], [0], [0], COMPUTE, [10 * GB] * 2, 20.0, 20.0, step_s=0.3)
    assert spans(p, 0) == {
        "0L": (0.0, 0.5), "1L": (0.5, 1.0),        # one copy stream per direction: FIFO
        "0F0": (0.5, 0.6), "1F0": (1.0, 1.1), "1B0": (1.1, 1.3),
        "1O": (1.3, 1.8), "1S": (1.8, 2.1),        # the step waits for its offload
        "0B0": (1.3, 1.5), "0O": (1.8, 2.3),       # queued behind 1O on the d2h stream
        "0S": (2.3, 2.6),
    }
    assert p.step_time == pytest.approx(2.6)
    assert p.exposed_transfer_s[0] == pytest.approx(0.5 + 0.4)


def test_step_of_a_resident_stage_takes_no_cpu_time():
    # Stage 0 is never loaded (resident with offload): no wait for a load, and its STEP (on the
    # GPU) neither waits for the optimizer thread, busy with 1S, nor occupies it.
    program = {0: acts("1L 0F0 1F0 1B0 1O 1S 0B0 0S")}
    p = predict(program, [0, 0], [0], [0], COMPUTE, [10 * GB] * 2, 20.0, 20.0, step_s=0.3)
    assert spans(p, 0)["0F0"] == (0.0, 0.1) and spans(p, 0)["0S"] == (1.0, 1.0)
    assert spans(p, 0)["1S"] == (1.3, 1.6) and p.step_time == pytest.approx(1.6)


def test_load_waits_for_step_norm_and_p2p_latency():
    # The load streams behind the step (chunk by chunk as the step writes them): it starts with
    # the step and ends when its bytes went through, or, if they are quicker, with the step.
    p = predict({0: acts("0O 0S 0L 0F0")}, [0], [0], [0], {0: (0.1, 0.2)}, [10 * GB], 20.0, 20.0, step_s=0.3)
    assert spans(p, 0) == {"0O": (0.0, 0.5), "0S": (0.5, 0.8), "0L": (0.5, 1.0), "0F0": (1.0, 1.1)}
    p = predict({0: acts("0O 0S 0L 0F0")}, [0], [0], [0], {0: (0.1, 0.2)}, [2 * GB], 20.0, 20.0, step_s=0.3)
    assert spans(p, 0) == {"0O": (0.0, 0.1), "0S": (0.1, 0.4), "0L": (0.1, 0.4), "0F0": (0.4, 0.5)}
    program = {0: acts("0F0 0SEND_F0 NORM"), 1: acts("1O 1RECV_F0 1F0 NORM 1S")}
    p = predict(program, [0, 1], [0, 1], [0, 1], COMPUTE, [10 * GB] * 2, 20.0, 20.0,
                norm_s=0.05, step_s=0.1, p2p_latency_s=0.01)
    assert spans(p, 1)["1F0"] == (0.11, 0.21)  # 0F0 ends at 0.1, plus 0.01 latency
    assert spans(p, 0)["NORM"] == (0.1, 0.55) and spans(p, 1)["NORM"] == (0.21, 0.55)  # waits for 1O
    assert spans(p, 1)["1S"] == (0.55, 0.65)
    assert p.exposed_transfer_s == pytest.approx({0: 0.0, 1: 0.29})


def test_pending_step_delays_only_its_stage():
    # Stage 1's step of the previous iteration ends at 1.2 s: its LOAD is handed over (the rank
    # goes on to 0F0 at 0.5 instead of waiting for the step); its copy streams behind the step
    # from 0.5 (the copy stream is free after 0L) and ends with it.
    program = {0: acts("0L 1L 0F0 1F0")}
    p = predict(program, [0, 0], [0], [0], COMPUTE, [10 * GB] * 2, 20.0, 20.0, pending_steps={0: -0.1, 1: 1.2})
    assert spans(p, 0) == {"0L": (0.0, 0.5), "1L": (0.5, 1.2), "0F0": (0.5, 0.6), "1F0": (1.2, 1.3)}
    assert p.host_end == p.step_time == pytest.approx(1.3)
    # The previous steps also hold the rank's optimizer thread: a new step starts after them.
    p = predict({0: acts("0F0 1F0 1B0 1O 1S")}, [0, 0], [0], [0], COMPUTE, [10 * GB] * 2, 20.0, 20.0, step_s=0.3,
                pending_steps={0: 1.0})
    assert spans(p, 0)["1O"] == (0.4, 0.9) and spans(p, 0)["1S"] == (1.0, 1.3)
    assert p.host_end == pytest.approx(0.9)
    with pytest.raises(ValueError, match="pending_steps names stages \\[5\\]"):
        predict(program, [0, 0], [0], [0], COMPUTE, [10 * GB] * 2, 20.0, 20.0, pending_steps={5: 1.0})


def test_steady_state_overlaps_steps_with_the_next_iteration():
    # One stage: L 0.5, F 0.1, B 0.2, O 0.5, S 0.8. From a clean start the iteration's host part
    # ends at 1.3 (its step at 2.1); in a steady state each iteration starts 0.8 s before the
    # previous step ends, so its load, streaming behind that step, ends at 0.8, not 0.5, and
    # the host part at 1.6.
    program = {0: acts("0L 0F0 0B0 0O 0S")}
    args = (program, [0], [0], [0], {0: (0.1, 0.2)}, [10 * GB], 20.0, 20.0)
    clean = predict(*args, step_s=0.8)
    assert (clean.host_end, clean.step_time) == pytest.approx((1.3, 2.1))
    steady = predict_steady(*args, step_s=0.8)
    assert spans(steady, 0)["0L"] == pytest.approx((0.0, 0.8))
    assert (steady.host_end, steady.step_time) == pytest.approx((1.6, 2.4))
    # Without optimizer time the steady state is the clean start.
    assert predict_steady(*args).timeline == predict(*args).timeline


def test_chrome_trace_reads_back(tmp_path):
    pred = predict(TWO, [0, 1], [0, 1], [0, 0], COMPUTE, [10 * GB, 10 * GB], 100.0, 20.0)
    events = read_chrome_trace(write_chrome_trace(tmp_path / "t.json", pred.events()))
    want = sorted((e["rank"], e["name"], e["op"], e["stage"], e["mb"], round(e["start"], 6), round(e["end"], 6))
                  for e in pred.events())
    got = sorted((e["rank"], e["name"], e["op"], e["stage"], e["mb"], round(e["start"], 6), round(e["end"], 6))
                 for e in events)
    assert got == want


@pytest.mark.parametrize("name", sched.SCHEDULE_NAMES)
@pytest.mark.parametrize("num_ranks, per_rank, num_mbs", [(2, 1, 4), (4, 2, 8), (3, 2, 6)])
def test_free_transfers_match_simulator(name, num_ranks, per_rank, num_mbs):
    n = num_ranks * per_rank
    mapping = sched.round_robin(n, num_ranks)
    program = sched.build(name, n, num_mbs, mapping, offload=True, prefetch=True, clip=True)
    p = predict(program, mapping, list(range(num_ranks)), [0] * num_ranks, {s: (1.0, 2.0) for s in range(n)},
                [0] * n, 25.0, 25.0)
    sim = sched.simulate(program, mapping)
    assert p.step_time == pytest.approx(sim.makespan)
    assert p.bubble_fraction == pytest.approx(sim.bubble_fraction)


def test_deadlock_is_reported():
    with pytest.raises(ValueError, match=r"deadlocked.*\{1: '1F0'\}"):
        predict({0: [], 1: acts("1F0")}, [0, 1], [0, 1], [0, 1], COMPUTE, [0, 0], 1.0, 1.0)


# --- mapping planner --------------------------------------------------------------------------
def _plan(groups, per_rank, num_mbs, **kw):
    n = len(groups) * per_rank
    # 1 GB stages at 25 GB/s load in 0.04 s, as long as a stage's 4 forwards; backward twice that.
    return plan_mapping(groups, [GB] * n, ProgramSpec("interleaved", n, num_mbs, offload=True, prefetch=True),
                        stage_compute_s={s: (0.01, 0.02) for s in range(n)}, link_gbps=25.0, **kw)


def _alternates(groups, perm):
    return all(groups[perm[r]] != groups[perm[(r + 1) % len(perm)]] for r in range(len(perm)))


def test_two_roots_two_gpus_cross_mapping():
    groups = [0, 0, 1, 1]
    plan = _plan(groups, 4, 8)
    assert plan.method == "exhaustive"
    assert plan.gpu_of_rank == [0, 2, 1, 3]  # alternates roots; the closest such to the identity
    assert plan.step_time < plan.sequential_step_time == plan.worst_step_time
    assert plan.cuda_visible_devices == "0,2,1,3"
    assert "rank -> GPU [0, 2, 1, 3]" in plan.describe()


def test_two_roots_four_gpus_cross_mapping():
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    plan = _plan(groups, 4, 16)
    assert plan.gpu_of_rank == [0, 4, 2, 6, 1, 5, 3, 7] and _alternates(groups, plan.gpu_of_rank)
    assert plan.step_time < plan.sequential_step_time <= plan.worst_step_time
    assert not _alternates(groups, plan.worst_gpu_of_rank)
    assert plan.evaluated == 35  # 8!/(4!4!)/2 root patterns, each simulated once


def test_already_crossed_or_uncontended_keeps_identity():
    plan = _plan([0, 1, 0, 1], 4, 8)  # the L20 box: PCI order already alternates roots
    assert plan.gpu_of_rank == [0, 1, 2, 3] and plan.step_time == plan.sequential_step_time
    plan = _plan([0, 1, 2, 3], 2, 4, gpu_ids=[4, 5, 6, 7])
    assert plan.gpu_of_rank == [4, 5, 6, 7] and plan.worst_step_time == plan.step_time
    assert plan.evaluated == 1


def test_greedy_above_exhaustive_limit():
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    plan = _plan(groups, 4, 16, exhaustive_max=4)
    assert plan.method == "greedy" and _alternates(groups, plan.gpu_of_rank)
    assert plan.step_time == pytest.approx(_plan(groups, 4, 16).step_time)


def test_plan_mapping_refuses_a_stage_count_mismatch():
    with pytest.raises(ValueError, match=r"stage_bytes has 3 entries .* num_stages is 4"):
        plan_mapping([0, 1], [1, 2, 3], ProgramSpec("1f1b", 4, 4, offload=True, prefetch=True))


# --- timeline ---------------------------------------------------------------------------------
def _fake_events() -> list[dict]:
    rows = [(0, "0L", 0.0, 1.0), (0, "0F0", 1.0, 2.0), (0, "0B0", 3.0, 5.0), (0, "0O", 5.0, 6.0),
            (0, "0S", 6.0, 7.0), (1, "1L", 0.0, 1.0), (1, "1RECV_F0", 1.0, 1.0), (1, "1F0", 2.0, 3.0),
            (1, "1B0", 3.0, 4.0), (1, "NORM", 6.0, 6.5)]
    events = []
    for rank, name, s, e in rows:
        a = Action.parse(name)
        events.append({"rank": rank, "name": name, "op": a.op.value, "stage": a.stage, "mb": a.mb,
                       "start": 100.0 + s, "end": 100.0 + e})
    return events


def test_chrome_trace(tmp_path):
    path = write_chrome_trace(tmp_path / "trace.json", _fake_events())
    trace = json.loads(path.read_text())["traceEvents"]
    boxes = [e for e in trace if e["ph"] == "X"]
    assert len(boxes) == 10
    by_name = {e["name"]: e for e in boxes}
    assert by_name["0L"]["ts"] == 0 and by_name["0B0"]["ts"] == pytest.approx(3e6)
    assert by_name["0B0"]["dur"] == pytest.approx(2e6) and by_name["1F0"]["pid"] == 1
    lanes = {e["args"]["name"]: e["tid"] for e in trace if e["ph"] == "M" and e["name"] == "thread_name"}
    assert by_name["0F0"]["tid"] == lanes["compute"] and by_name["0L"]["tid"] == lanes["load"]
    assert by_name["0O"]["tid"] == lanes["offload"] and by_name["1RECV_F0"]["tid"] == lanes["comm"]
    assert by_name["0S"]["tid"] == lanes["optimizer"]


@pytest.mark.slow  # matplotlib rendering, seconds each
def test_timeline_png_measured_over_predicted(tmp_path):
    measured = _fake_events()
    predicted = [{**e, "start": e["start"] - 100.0, "end": e["end"] - 99.0} for e in measured]  # a slower model
    path = tmp_path / "timeline.png"
    # Rank 2 has no actions: it still gets its (empty, labelled) block.
    size = write_timeline_png(path, measured, predicted, ranks=[0, 1, 2])
    assert size == timeline_size(3, 4, 2) == png_size(path)  # rows: load / offload, compute, comm, optimizer
    assert 20_000 < path.stat().st_size < 300_000
    assert distinct_colours(path) > 50  # boxes, text and axes, not a blank canvas
    from PIL import Image

    with Image.open(path) as img:
        present = {c for _, c in img.convert("RGB").getcolors(maxcolors=1 << 20)}
    for op in ("F", "B", "L", "O", "S", "NORM", "RECV_F"):  # every op's box is drawn in its legend colour
        hex_colour = STYLE[op][0]
        assert tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)) in present, op
    # One panel (no prediction), ranks as a mapping; only the rows in use are drawn.
    size = write_timeline_png(tmp_path / "one.png",
                              {0: [e for e in measured if e["rank"] == 0 and e["op"] in ("F", "B")]})
    assert size == timeline_size(1, 1, 1) == png_size(tmp_path / "one.png")
    # Nothing recorded at all: an empty block per rank, still a picture.
    assert write_timeline_png(tmp_path / "empty.png", [], [], ranks=[0]) == png_size(tmp_path / "empty.png")


def test_run_timeline_writes_and_names_every_file(tmp_path):
    program = sched.build("1f1b", 2, 4, [0, 1], offload=True, prefetch=True, clip=True)
    measured = predict(program, [0, 1], [0, 1], [0, 0], COMPUTE, [GB, GB], 100.0, 20.0, step_s=0.05).events()
    paths, line = write_run_timeline(tmp_path, measured, program, [0, 1], [GB, GB])
    assert sorted(p.name for p in paths.values()) == ["timeline.json", "timeline.png", "timeline_predicted.json"]
    assert line.startswith("timeline: measured step 1.6500s, cost model (measured op durations, steady state) ")
    assert line.endswith("wrote " + ", ".join(str(p) for p in paths.values()))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths.values())
    assert png_size(paths["gantt"]) == timeline_size(2, 4, 2)


def test_cpu_timeline_and_prediction_share_the_writers(tmp_path):
    tl = Timeline(rank=3, device_type="cpu")
    for a in acts("3L 3F0 3B0"):
        tl.begin(a)
        time.sleep(0.001)
        tl.end(a)
    events = tl.events()
    assert [e["name"] for e in events] == ["3L", "3F0", "3B0"]
    assert [e["lane"] for e in events] == ["load", "compute", "compute"]
    assert all(e["end"] - e["start"] >= 0.001 and e["rank"] == 3 for e in events)
    with pytest.raises(ValueError, match="end\\(3F1\\) without a matching begin"):
        tl.end(Action(3, Op.FORWARD, 1))
    pred = predict(TWO, [0, 1], [0, 1], [0, 0], COMPUTE, [10 * GB, 10 * GB], 100.0, 20.0)
    trace = json.loads(write_chrome_trace(tmp_path / "t.json", pred.events() + events).read_text())
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1, 3}
    assert write_timeline_png(tmp_path / "p.png", events, pred.events()) == png_size(tmp_path / "p.png")
