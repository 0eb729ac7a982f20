"""Where each GPU hangs off the host: PCIe root complex (or switch) group, NUMA node, link speed.

The mapping planner (``schedule/mapping.py``) needs one fact per GPU: which GPUs share an
uplink to host memory, because their parameter loads and gradient offloads then share its
bandwidth. Three sources, in order of trust:

* a small override file (``load_topology_file``), for boxes where discovery is wrong or the
  bandwidths were measured;
* ``nvidia-smi topo -m`` (``parse_nvidia_smi_topo``): GPUs that are PIX / PXB (same PCIe
  switch) or PHB (same host bridge) to each other share a root group; NODE and SYS do not;
* sysfs: the PCI host bridge a GPU sits under (``/sys/devices/pci<domain>:<bus>/...``).

GPU indices are nvidia-smi's (PCI bus order). CUDA numbers devices the same way only with
``CUDA_DEVICE_ORDER=PCI_BUS_ID``; whoever sets ``CUDA_VISIBLE_DEVICES`` from a plan must set it too.
"""
from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from inputs import read_json, read_yaml

# Nominal GB/s per lane and direction, by PCIe generation (after line encoding).
PCIE_GBPS_PER_LANE = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
_GEN_OF_GTS = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}
# What a Gen4 x16 link delivers in practice for large pinned copies; used when nothing is known.
DEFAULT_LINK_GBPS = 25.0
# Matrix entries meaning "same uplink to the host": same switch (PIX, PXB) or same host bridge (PHB).
SHARED_ROOT = frozenset({"PIX", "PXB", "PHB"})
KNOWN_LINKS = SHARED_ROOT | {"X", "NODE", "SYS", "SOC"}  # SOC: older drivers' name for SYS
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_HEADER_NAMES = re.compile(r"GPU NUMA ID|CPU Affinity|NUMA Affinity|\S+")


@dataclass(frozen=True)
class GpuLink:
    """One GPU's connection to the host.

    Attributes:
        index: nvidia-smi index (PCI bus order).
        root: root group id (0, 1, ... in order of first appearance); GPUs with the same id
            share their uplink to host memory.
        numa: NUMA node of the GPU's host bridge, None if unknown.
        bandwidth_gbps: host link bandwidth per direction, GB/s (nominal or measured).
    """

    index: int
    root: int
    numa: int | None
    bandwidth_gbps: float


@dataclass
class Topology:
    gpus: list[GpuLink]
    source: str = "unknown"  # where it came from: "nvidia-smi", "sysfs", "file <path>", "manual"
    nvlink: bool = False     # some GPU pairs are NVLink-connected (p2p does not use PCIe)
    notes: list[str] = field(default_factory=list)

    def groups(self) -> list[int]:
        """Root group of each GPU, in the order of ``gpus``."""
        return [g.root for g in self.gpus]

    def indices(self) -> list[int]:
        return [g.index for g in self.gpus]

    def link_gbps(self) -> list[float]:
        return [g.bandwidth_gbps for g in self.gpus]

    def describe(self) -> str:
        """One line per root group: ``root 0 (NUMA 0): GPU 0, 2 @ 25.0 GB/s``."""
        lines = [f"topology from {self.source}" + (" (NVLink between some GPUs)" if self.nvlink else "")]
        for root in sorted(set(self.groups())):
            members = [g for g in self.gpus if g.root == root]
            numa = {g.numa for g in members}
            numa_s = "?" if numa == {None} else ",".join(str(n) for n in sorted(n for n in numa if n is not None))
            gbps = ", ".join(f"{g.bandwidth_gbps:g}" for g in members)
            lines.append(f"  root {root} (NUMA {numa_s}): GPU {', '.join(str(g.index) for g in members)} @ {gbps} GB/s")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def _renumber(keys: list) -> list[int]:
    """Map arbitrary group keys to 0, 1, ... in order of first appearance."""
    ids: dict = {}
    return [ids.setdefault(k, len(ids)) for k in keys]


def nominal_gbps(gen: int, width: int) -> float:
    """Nominal per-direction bandwidth of a PCIe link, GB/s."""
    if gen not in PCIE_GBPS_PER_LANE or width < 1:
        raise ValueError(f"unknown PCIe link gen {gen} x{width}: gen must be one of {sorted(PCIE_GBPS_PER_LANE)}")
    return round(PCIE_GBPS_PER_LANE[gen] * width, 2)


# --- nvidia-smi topo -m -------------------------------------------------------------------------
def parse_nvidia_smi_topo(text: str, bandwidth_gbps: float | list[float] = DEFAULT_LINK_GBPS) -> Topology:
    """Parse the matrix printed by ``nvidia-smi topo -m``.

    Root groups are the connected components of the "shares an uplink" relation (PIX, PXB,
    PHB) over GPUs and NICs: two GPUs each PXB to one NIC sit in that NIC's switch tree. NV#
    hides the PCIe path of a GPU pair, so NVLink pairs are merged only through such NICs
    (``discover`` then asks sysfs). The matrix carries no link speeds: ``bandwidth_gbps`` (one value, or one
    per GPU) fills them in.
    """
    lines = [_ANSI.sub("", line).rstrip() for line in text.splitlines()]
    header_at = next((i for i, line in enumerate(lines) if re.match(r"^\s+GPU0\b", line)), None)
    if header_at is None:
        first = next((line for line in lines if line.strip()), "")
        raise ValueError(f"no nvidia-smi topo matrix found: expected a header line starting with GPU0, "
                         f"first line is {first!r}")
    columns = _HEADER_NAMES.findall(lines[header_at])
    num_devices = next((i for i, c in enumerate(columns) if not re.match(r"^(GPU\d+|NIC\d+|mlx\S+)$", c)),
                       len(columns))
    devices, extra = columns[:num_devices], columns[num_devices:]
    gpu_cols = [i for i, c in enumerate(devices) if re.match(r"^GPU\d+$", c)]
    rows: dict[str, dict[str, str]] = {}
    for line in lines[header_at + 1:]:
        tokens = line.split()
        if not tokens or not re.match(r"^GPU\d+$", tokens[0]):
            if rows and tokens and not re.match(r"^(NIC\d+|mlx\S+)$", tokens[0]):
                break  # the legend after the matrix
            continue
        if len(tokens) < 1 + num_devices:
            raise ValueError(f"nvidia-smi topo row {tokens[0]} has {len(tokens) - 1} entries, expected at least "
                             f"{num_devices} (columns {devices}): {line.strip()!r}")
        row = dict(zip(devices, tokens[1:1 + num_devices]))
        row.update(zip(extra, tokens[1 + num_devices:]))
        rows[tokens[0]] = row
    names = [devices[i] for i in gpu_cols]
    if sorted(rows) != sorted(names):
        raise ValueError(f"nvidia-smi topo matrix has GPU columns {names} but GPU rows {list(rows)}")
    parent = {n: n for n in names}

    def find(n: str) -> str:
        while parent[n] != n:
            n = parent[n]
        return n

    nvlink = False
    for a in names:
        for b in devices:
            link = rows[a][b]
            if link.startswith("NV"):
                nvlink = True
            elif link not in KNOWN_LINKS:
                raise ValueError(f"unknown nvidia-smi topo entry {link!r} between {a} and {b}; "
                                 f"expected one of {sorted(KNOWN_LINKS)} or NV#")
            if link in SHARED_ROOT:
                # A NIC column links GPUs too: two GPUs under the NIC's switch or host bridge share it.
                parent.setdefault(b, b)
                parent[find(a)] = find(b)
    names.sort(key=lambda n: int(n[3:]))
    roots = _renumber([find(n) for n in names])
    bws = bandwidth_gbps if isinstance(bandwidth_gbps, list) else [bandwidth_gbps] * len(names)
    if len(bws) != len(names):
        raise ValueError(f"bandwidth_gbps has {len(bws)} values ({bws}) for {len(names)} GPUs")
    gpus = []
    for n, root, bw in zip(names, roots, bws):
        numa = rows[n].get("NUMA Affinity", "N/A")
        gpus.append(GpuLink(int(n[3:]), root, int(numa) if numa.isdigit() else None, float(bw)))
    return Topology(gpus, source="nvidia-smi", nvlink=nvlink)


def _query_link_gbps(num_gpus: int, timeout_s: float) -> list[float] | None:
    """Nominal link bandwidth per GPU from nvidia-smi's PCIe fields, None if unavailable."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,pcie.link.gen.max,pcie.link.width.max",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=timeout_s, check=True).stdout
        rows = [[int(x) for x in line.split(",")] for line in out.strip().splitlines()]
        bws = [nominal_gbps(gen, width) for _, gen, width in sorted(rows)]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return bws if len(bws) == num_gpus else None


# --- sysfs --------------------------------------------------------------------------------------
def read_sysfs(sysfs_root: str | os.PathLike = "/sys") -> Topology | None:
    """NVIDIA display / 3D controllers under ``<sysfs_root>/bus/pci/devices``, in PCI bus order.

    A GPU's root group is the PCI host bridge (``pci<domain>:<bus>`` in its resolved device
    path); its NUMA node and link speed come from the device's own files.
    """
    devices = Path(sysfs_root) / "bus" / "pci" / "devices"
    if not devices.is_dir():
        return None
    found = []
    for dev in sorted(devices.iterdir()):
        try:
            vendor = (dev / "vendor").read_text().strip()
            cls = (dev / "class").read_text().strip()
        except OSError:
            continue
        if vendor != "0x10de" or not cls.startswith(("0x0300", "0x0302")):
            continue
        bridge = next((p for p in dev.resolve().parts if p.startswith("pci")), "?")
        numa = _read_int(dev / "numa_node")
        found.append((bridge, None if numa is None or numa < 0 else numa, _sysfs_gbps(dev)))
    if not found:
        return None
    roots = _renumber([b for b, _, _ in found])
    gpus = [GpuLink(i, root, numa, bw) for i, (root, (_, numa, bw)) in enumerate(zip(roots, found))]
    return Topology(gpus, source="sysfs")


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _sysfs_gbps(dev: Path) -> float:
    try:
        gts = float((dev / "max_link_speed").read_text().split()[0])
        width = int((dev / "max_link_width").read_text().strip())
        return nominal_gbps(_GEN_OF_GTS[gts], width)
    except (OSError, ValueError, KeyError, IndexError):
        return DEFAULT_LINK_GBPS


def discover(timeout_s: float = 5.0, sysfs_root: str | os.PathLike = "/sys") -> Topology | None:
    """This machine's GPU topology: ``nvidia-smi topo -m``, else sysfs; None if neither works.

    Where nvidia-smi shows NVLink (which hides the PCIe path) and sysfs sees as many GPUs,
    the root groups come from sysfs instead.
    """
    topo = None
    try:
        text = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                              timeout=timeout_s, check=True).stdout
        topo = parse_nvidia_smi_topo(text)
    except (OSError, subprocess.SubprocessError, ValueError):
        topo = None
    sysfs = read_sysfs(sysfs_root)
    if topo is None:
        return sysfs
    bws = _query_link_gbps(len(topo.gpus), timeout_s)
    if bws is None and sysfs is not None and len(sysfs.gpus) == len(topo.gpus):
        bws = sysfs.link_gbps()
    if bws is not None:
        topo.gpus = [GpuLink(g.index, g.root, g.numa, bw) for g, bw in zip(topo.gpus, bws)]
    if topo.nvlink and sysfs is not None and len(sysfs.gpus) == len(topo.gpus):
        topo.gpus = [GpuLink(g.index, s.root, g.numa, g.bandwidth_gbps) for g, s in zip(topo.gpus, sysfs.gpus)]
        topo.notes.append("NVLink hides PCIe paths in nvidia-smi topo; root groups from sysfs host bridges")
    return topo


# --- override file ------------------------------------------------------------------------------
_FILE_KEYS = {"index", "root", "numa", "bandwidth_gbps"}


def load_topology_file(path: str | os.PathLike) -> Topology:
    """Read a topology override (YAML or JSON)::

        gpus:
          - {index: 0, root: 0, numa: 0, bandwidth_gbps: 25}
          - {index: 1, root: 1, numa: 0, bandwidth_gbps: 25}

    ``numa`` and ``bandwidth_gbps`` are optional (unknown, and ``DEFAULT_LINK_GBPS``).
    GPUs are returned sorted by index; root ids are renumbered 0, 1, ... in that order.
    """
    data = (read_json if str(path).endswith(".json") else read_yaml)(path, "topology file")
    if not isinstance(data, dict) or set(data) != {"gpus"} or not isinstance(data["gpus"], list) or not data["gpus"]:
        raise ValueError(f"topology file {path}: expected a mapping with one key 'gpus' holding a non-empty list, "
                         f"got {data!r}")
    entries = []
    for i, g in enumerate(data["gpus"]):
        if not isinstance(g, dict):
            raise ValueError(f"topology file {path}: gpus[{i}] must be a mapping like "
                             f"{{index: 0, root: 0, numa: 0, bandwidth_gbps: 25}}, got {g!r}")
        unknown, missing = set(g) - _FILE_KEYS, {"index", "root"} - set(g)
        if unknown or missing:
            raise ValueError(f"topology file {path}: gpus[{i}] = {g}: unknown keys {sorted(unknown)}, missing keys "
                             f"{sorted(missing)}; allowed keys are {sorted(_FILE_KEYS)}")
        for key in ("index", "root", "numa"):
            v = g.get(key, 0)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"topology file {path}: gpus[{i}].{key} = {v!r} must be an integer >= 0")
        bw = g.get("bandwidth_gbps", DEFAULT_LINK_GBPS)
        if not isinstance(bw, (int, float)) or isinstance(bw, bool) or not bw > 0:
            raise ValueError(f"topology file {path}: gpus[{i}].bandwidth_gbps = {bw!r} must be a number > 0 (GB/s)")
        entries.append((g["index"], g["root"], g.get("numa"), float(bw)))
    indices = [e[0] for e in entries]
    if len(set(indices)) != len(indices):
        raise ValueError(f"topology file {path}: duplicate GPU indices in {indices}")
    entries.sort()
    roots = _renumber([e[1] for e in entries])
    gpus = [GpuLink(idx, root, numa, bw) for (idx, _, numa, bw), root in zip(entries, roots)]
    return Topology(gpus, source=f"file {path}")
