"""Optimizer cores: NUMA-local shares of the host's cores, one per local rank."""
from __future__ import annotations

import pytest

from offload.cpus import intra_op_threads, node_cpus, optimizer_cpus, parse_cpulist


def test_parse_cpulist():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("") == []


def test_node_cpus_from_sysfs(tmp_path):
    for n, text in ((0, "0-31,64-95"), (1, "32-63,96-127")):
        d = tmp_path / "devices/system/node" / f"node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(text + "\n")
    nodes = node_cpus(tmp_path)
    assert sorted(nodes) == [0, 1] and len(nodes[0]) == 64 and nodes[1][0] == 32


def test_two_nodes_split_among_the_gpus_of_each_node():
    nodes = {0: list(range(0, 32)), 1: list(range(32, 64))}
    numa = [0, 0, 1, 1]  # GPUs 0,1 under node 0; 2,3 under node 1
    shares = [optimizer_cpus(r, numa, nodes, list(range(64))) for r in range(4)]
    assert shares == [list(range(0, 16)), list(range(16, 32)), list(range(32, 48)), list(range(48, 64))]


def test_single_node_or_unknown_splits_all_allowed_cores():
    allowed = list(range(8))
    assert optimizer_cpus(1, [None, None], {}, allowed) == [4, 5, 6, 7]
    assert optimizer_cpus(0, [0, 0], {0: allowed}, allowed) == [0, 1, 2, 3]
    # fewer cores than ranks: every rank still gets one
    assert optimizer_cpus(2, [None] * 4, {}, [0, 1]) == [1]


def test_respects_the_allowed_set():
    nodes = {0: list(range(0, 8)), 1: list(range(8, 16))}
    assert optimizer_cpus(0, [1], nodes, [8, 9, 10, 3]) == [8, 9, 10]


def test_intra_op_threads_restores_the_count():
    import torch

    before = torch.get_num_threads()
    with intra_op_threads(before + 1):
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), intra_op_threads(0):  # at least one thread; restored on error too
        assert torch.get_num_threads() == 1
        raise RuntimeError
    assert torch.get_num_threads() == before
