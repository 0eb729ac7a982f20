"""Record when each action of a rank ran, and write the result as a Chrome trace or a Gantt PNG.

The executor calls ``begin(action)`` / ``end(action)`` around every action. On the CPU that
is wall-clock time. On CUDA a pair of timing events is recorded on the action's stream (the
current stream, or the one given for its lane) and resolved at ``flush()``, so recording
adds no host sync to the iteration.

An event is a dict ``{rank, name, op, stage, mb, lane, start, end}`` with times in seconds
(``time.perf_counter`` scale, comparable across processes of one host).
``schedule.costmodel.Prediction.events()`` gives the same dicts, so predicted and measured
timelines are written by the same functions.
"""
from __future__ import annotations

import json
import struct
import time
import zlib
from pathlib import Path
from typing import Iterable, Mapping

from schedule.ir import Action, Op

LANES = ("compute", "load", "offload", "comm", "optimizer")
LANE_OF_OP = {
    Op.FORWARD: "compute", Op.BACKWARD: "compute",
    Op.LOAD: "load", Op.DROP: "load", Op.OFFLOAD: "offload",
    Op.SEND_F: "comm", Op.RECV_F: "comm", Op.SEND_B: "comm", Op.RECV_B: "comm", Op.NORM: "comm",
    Op.STEP: "optimizer",
}
# Box colours of the Gantt chart (RGB); ops not listed (SEND, RECV, DROP) are not drawn.
COLOURS = {
    "F": (76, 159, 112), "B": (224, 122, 63), "L": (59, 125, 216), "O": (155, 89, 182),
    "S": (110, 110, 110), "NORM": (212, 172, 13),
}
# Where in a rank's row a lane is drawn: (top, bottom) as fractions of the row height.
_BAND = {"load": (0.08, 0.3), "offload": (0.08, 0.3), "compute": (0.34, 0.72), "comm": (0.76, 0.92),
         "optimizer": (0.76, 0.92)}
_BG, _GRID = (255, 255, 255), (225, 225, 225)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class Timeline:
    """Per-rank recorder of action start / end times.

    Args:
        rank: the rank whose actions are recorded.
        device_type: "cpu" (wall clock) or "cuda" (timing events).
        streams: on CUDA, the stream to time a lane on (e.g. ``{"load": load_stream}``);
            lanes not given are timed on the current stream.
    """

    def __init__(self, rank: int, device_type: str = "cpu", streams: Mapping[str, object] | None = None):
        self.rank, self.cuda = rank, device_type == "cuda"
        self.streams = dict(streams or {})
        self._open: dict[Action, object] = {}
        self._pending: list[tuple[Action, object, object]] = []  # CUDA event pairs not yet resolved
        self._deferred: list[tuple[Action, object]] = []  # (action, future of a (start, end, ...) span)
        self._events: list[dict] = []

    def _mark(self, action: Action, begin: bool = False):
        if not self.cuda:
            return time.perf_counter()
        import torch

        ev = torch.cuda.Event(enable_timing=True)
        stream = self.streams.get(LANE_OF_OP[action.op])
        if stream is not None and begin and action.op is Op.OFFLOAD:
            # The offload copy starts once the backward before it is done: the store makes the
            # offload stream wait on the compute stream at this same point, so this wait adds no
            # dependency, and the start is the copy's start, not when the stream went idle.
            stream.wait_stream(torch.cuda.current_stream())
        ev.record(stream) if stream is not None else ev.record()
        return ev

    def begin(self, action: Action) -> None:
        self._open[action] = self._mark(action, begin=True)

    def end(self, action: Action) -> None:
        start = self._open.pop(action, None)
        if start is None:
            raise ValueError(f"rank {self.rank}: end({action}) without a matching begin({action})")
        stop = self._mark(action)
        if self.cuda:
            self._pending.append((action, start, stop))
        else:
            self._events.append(self._event(action, start, stop))

    def add(self, action: Action, span) -> None:
        """An action whose work another thread runs or issues (a STEP on the optimizer thread,
        a LOAD that waits for its stage's step): ``span`` is a future of ``(start, end, ...)``,
        CUDA events or wall-clock times, read at ``flush()`` (which waits for it)."""
        self._deferred.append((action, span))

    def flush(self) -> None:
        """Turn recorded CUDA events into times. Host sync: waits for all recorded work."""
        for action, future in self._deferred:
            span = future.result()
            if span is None:
                continue
            if isinstance(span[0], float):  # wall clock
                self._events.append(self._event(action, span[0], span[1]))
            else:
                self._pending.append((action, span[0], span[1]))
        self._deferred.clear()
        if not self._pending:
            return
        import torch

        torch.cuda.synchronize()  # host sync: every recorded event must have completed
        # An event recorded on an idle device completes at once: it ties GPU time to the host clock.
        anchor = torch.cuda.Event(enable_timing=True)
        anchor.record()
        anchor.synchronize()
        host_now = time.perf_counter()
        for action, start, stop in self._pending:
            t0 = host_now - start.elapsed_time(anchor) / 1e3
            t1 = host_now - stop.elapsed_time(anchor) / 1e3
            self._events.append(self._event(action, t0, t1))
        self._pending.clear()

    def _event(self, action: Action, start: float, end: float) -> dict:
        return {"rank": self.rank, "name": str(action), "op": action.op.value, "stage": action.stage,
                "mb": action.mb, "lane": LANE_OF_OP[action.op], "start": start, "end": end}

    def events(self) -> list[dict]:
        """All events recorded so far (resolving CUDA events first)."""
        self.flush()
        return list(self._events)

    def clear(self) -> None:
        self._open.clear()
        self._pending.clear()
        self._deferred.clear()
        self._events.clear()


def _flatten(all_ranks_events: Iterable[dict] | Mapping[int, Iterable[dict]]) -> list[dict]:
    if isinstance(all_ranks_events, Mapping):
        return [e for r in sorted(all_ranks_events) for e in all_ranks_events[r]]
    return list(all_ranks_events)


def _lane(e: dict) -> str:
    return e.get("lane") or LANE_OF_OP[Op(e["op"])]


def write_chrome_trace(path: str | Path, all_ranks_events: Iterable[dict] | Mapping[int, Iterable[dict]]) -> Path:
    """Write a Chrome trace (chrome://tracing, Perfetto): one process per rank, one thread per lane.

    Times start at 0 at the earliest event, in microseconds.
    """
    events = _flatten(all_ranks_events)
    t0 = min((e["start"] for e in events), default=0.0)
    trace = []
    for r in sorted({e["rank"] for e in events}):
        trace.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        trace += [{"name": "thread_name", "ph": "M", "pid": r, "tid": i, "args": {"name": lane}}
                  for i, lane in enumerate(LANES)]
    for e in events:
        lane = _lane(e)
        trace.append({"name": e["name"], "cat": lane, "ph": "X", "ts": (e["start"] - t0) * 1e6,
                      "dur": max(0.0, e["end"] - e["start"]) * 1e6, "pid": e["rank"], "tid": LANES.index(lane),
                      "args": {"stage": e.get("stage"), "mb": e.get("mb")}})
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
    return path


def read_chrome_trace(path: str | Path) -> list[dict]:
    """The events of a trace ``write_chrome_trace`` wrote (times in seconds from its start)."""
    events = []
    for e in json.loads(Path(path).read_text())["traceEvents"]:
        if e.get("ph") != "X":
            continue
        a = Action.parse(e["name"])
        events.append({"rank": e["pid"], "name": e["name"], "op": a.op.value, "stage": a.stage, "mb": a.mb,
                       "lane": e.get("cat", LANE_OF_OP[a.op]), "start": e["ts"] / 1e6,
                       "end": (e["ts"] + e["dur"]) / 1e6})
    return events


def gantt_size(num_ranks: int, width: int = 1200, row_height: int = 40) -> tuple[int, int]:
    """(width, height) in pixels of the PNG ``write_gantt_png`` draws for ``num_ranks`` rows."""
    return width, 2 * _margin(row_height) + num_ranks * row_height


def _margin(row_height: int) -> int:
    return max(4, row_height // 2)


def write_gantt_png(path: str | Path, all_ranks_events: Iterable[dict] | Mapping[int, Iterable[dict]], *,
                    width: int = 1200, row_height: int = 40, backend: str = "auto") -> tuple[int, int]:
    """Draw one row per rank (GPU): loads / offloads on top, F / B in the middle, optimizer
    steps and NORM at the bottom. Returns the image size, ``gantt_size(num_ranks, ...)``.

    ``backend``: "matplotlib" (labelled axes), "numpy" (boxes only, no text, needs nothing
    beyond numpy), or "auto" (matplotlib when importable).
    """
    events = _flatten(all_ranks_events)
    ranks = sorted({e["rank"] for e in events})
    size = gantt_size(len(ranks), width, row_height)
    if backend not in ("auto", "matplotlib", "numpy"):
        raise ValueError(f"backend {backend!r}: choose 'auto', 'matplotlib' or 'numpy'")
    if backend in ("auto", "matplotlib"):
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError:
            if backend == "matplotlib":
                raise
        else:
            _gantt_matplotlib(Path(path), events, ranks, size, row_height, Figure, FigureCanvasAgg)
            return size
    Path(path).write_bytes(_png_bytes(_gantt_pixels(events, ranks, size, row_height)))
    return size


def _boxes(events: list[dict], ranks: list[int], size: tuple[int, int], row_height: int):
    """(op, x0, x1, y0, y1) pixel boxes; time runs over the inner width."""
    width, _ = size
    margin = _margin(row_height)
    t0 = min((e["start"] for e in events), default=0.0)
    t1 = max((e["end"] for e in events), default=1.0)
    scale = (width - 2 * margin) / max(t1 - t0, 1e-12)
    for e in events:
        if e["op"] not in COLOURS:
            continue
        top, bottom = _BAND[_lane(e)]
        y = margin + ranks.index(e["rank"]) * row_height
        x0 = margin + int((e["start"] - t0) * scale)
        x1 = max(x0 + 1, margin + int((e["end"] - t0) * scale))  # at least one pixel wide
        yield e["op"], x0, x1, y + int(top * row_height), y + max(int(bottom * row_height), int(top * row_height) + 1)


def _gantt_pixels(events: list[dict], ranks: list[int], size: tuple[int, int], row_height: int):
    import numpy as np

    width, height = size
    img = np.empty((height, width, 3), dtype=np.uint8)
    img[:] = _BG
    margin = _margin(row_height)
    for i in range(len(ranks) + 1):
        img[min(margin + i * row_height, height - 1), margin:width - margin] = _GRID
    for op, x0, x1, y0, y1 in _boxes(events, ranks, size, row_height):
        img[y0:y1, x0:min(x1, width)] = COLOURS[op]
    return img


def _png_bytes(img) -> bytes:
    """Encode an (H, W, 3) uint8 array as an RGB PNG (filter 0 on every scanline)."""
    import numpy as np

    h, w, _ = img.shape
    raw = np.concatenate([np.zeros((h, 1), dtype=np.uint8), img.reshape(h, w * 3)], axis=1).tobytes()

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8-bit RGB, deflate, no interlace
    return PNG_SIGNATURE + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")


def _gantt_matplotlib(path: Path, events, ranks, size, row_height, Figure, FigureCanvasAgg) -> None:
    width, height = size
    fig = Figure(figsize=(width / 100, height / 100), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.06, 0.12, 0.92, 0.84))
    t0 = min((e["start"] for e in events), default=0.0)
    for e in events:
        if e["op"] not in COLOURS:
            continue
        top, bottom = _BAND[_lane(e)]
        y = ranks.index(e["rank"])
        ax.broken_barh([(e["start"] - t0, max(e["end"] - e["start"], 1e-9))], (y + top, bottom - top),
                       facecolors=tuple(c / 255 for c in COLOURS[e["op"]]))
    ax.set_ylim(len(ranks), 0)
    ax.set_yticks([i + 0.5 for i in range(len(ranks))], [f"rank {r}" for r in ranks])
    ax.set_xlabel("seconds")
    fig.savefig(path, dpi=100)  # no bbox_inches="tight": the image keeps exactly ``size``


# --- one recorded iteration: measured vs predicted -------------------------------------------------
def measured_step_time(events: Iterable[dict]) -> float:
    """Span of one recorded iteration: first start to last end over every rank, optimizer steps
    left out. They may end after the iteration (they overlap the next one's forwards), and the
    recorded iteration began waiting for the previous iteration's steps; the cost model's
    steady-state iteration (``predict_steady``) is measured the same way (its ``host_end``)."""
    events = [e for e in events if e["op"] != "S"]
    if not events:
        return 0.0
    return max(e["end"] for e in events) - min(e["start"] for e in events)


def calibrated_prediction(events: Iterable[dict], schedule: Mapping[int, list[Action]], mapping: list[int],
                          stage_bytes: list[int], rank_groups: list[int] | None = None, steady: bool = True):
    """The cost model's timeline for ``schedule``, fed with the op durations measured in ``events``.

    Compute per stage is the median measured F (B) of that stage: a measured F may also hold a
    wait for its input activation (the cost model adds waits itself), and on shared CPU cores
    single durations vary several-fold; the median resists both. A rank's host link is
    its fastest measured LOAD (bytes / seconds); root groups are ``rank_groups`` (each rank its
    own when unknown), a root's uplink the fastest link under it. STEP takes the median
    measured STEP of the offloaded stages (the CPU optimizer's; the model takes a GPU step as
    instant), NORM the shortest measured NORM (the last rank to arrive waits least). So the
    prediction error measures how the cost model composes durations (overlap, waiting,
    contention), not how well it guesses them. The iteration predicted is one in a steady
    state (``schedule.costmodel.predict_steady``): it starts with the previous iteration's
    optimizer steps still running, as the recorded one did (``steady=False``: one iteration
    from a clean start, ending with its own steps).
    """
    from schedule.costmodel import cpu_stepped_stages, predict, predict_steady

    events = list(events)
    ranks = sorted(schedule)
    num_stages = len(mapping)
    durations: dict[tuple[str, int], list[float]] = {}
    for e in events:
        durations.setdefault((e["op"], e["stage"]), []).append(max(0.0, e["end"] - e["start"]))
    missing = [s for s in range(num_stages) if ("F", s) not in durations or ("B", s) not in durations]
    if missing:
        raise ValueError(f"timeline has no F or B events for stages {missing}: cannot calibrate the cost model")
    compute = {s: (_median(durations[("F", s)]), _median(durations[("B", s)])) for s in range(num_stages)}
    links = []
    for r in ranks:
        rates = [stage_bytes[e["stage"]] / (e["end"] - e["start"]) / 1e9 for e in events
                 if e["rank"] == r and e["op"] == "L" and e["end"] > e["start"]]
        links.append(max(rates, default=25.0))
    groups = list(rank_groups) if rank_groups is not None else list(ranks)
    roots = {g: max(link for link, gg in zip(links, groups) if gg == g) for g in set(groups)}
    offloaded = cpu_stepped_stages(schedule)
    steps = [d for (op, s), ds in durations.items() if op == "S" and s in offloaded for d in ds]
    norms = [d for (op, _), ds in durations.items() if op == "NORM" for d in ds]
    return (predict_steady if steady else predict)(dict(schedule), mapping, ranks, groups, compute, stage_bytes,
                                                   links, roots, step_s=_median(steps) if steps else 0.0,
                                                   norm_s=min(norms, default=0.0))


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def write_run_timeline(save_dir: str | Path, events: list[dict], schedule: Mapping[int, list[Action]],
                       mapping: list[int], stage_bytes: list[int], rank_groups: list[int] | None = None
                       ) -> tuple[dict[str, Path], str]:
    """Write ``timeline.json`` / ``timeline.png`` (measured) and ``timeline_predicted.json`` /
    ``timeline_predicted.png`` (``calibrated_prediction``) into ``save_dir``.

    Returns the paths and one log line with both step times and the prediction error.
    """
    out = Path(save_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"timeline": write_chrome_trace(out / "timeline.json", events)}
    write_gantt_png(out / "timeline.png", events)
    paths["gantt"] = out / "timeline.png"
    measured = measured_step_time(events)
    pred = calibrated_prediction(events, schedule, mapping, stage_bytes, rank_groups)
    paths["predicted"] = write_chrome_trace(out / "timeline_predicted.json", pred.events())
    write_gantt_png(out / "timeline_predicted.png", pred.events())
    paths["predicted_gantt"] = out / "timeline_predicted.png"
    err = (pred.host_end - measured) / measured if measured > 0 else 0.0
    line = (f"timeline: measured step {measured:.4f}s, cost model (measured op durations, steady state) "
            f"{pred.host_end:.4f}s, prediction error {err:+.1%}; wrote {paths['timeline']}, {paths['gantt']}, "
            f"{paths['predicted']}")
    return paths, line
