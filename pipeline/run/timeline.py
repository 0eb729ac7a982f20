"""Record when each action of a rank ran, and write the result as a Chrome trace or a Gantt PNG
(matplotlib: measured and predicted timelines in two panels over one time axis).

The executor calls ``begin(action)`` / ``end(action)`` around every action. On the CPU that
is wall-clock time. On CUDA a pair of timing events is recorded on the action's stream (the
current stream, or the one given for its lane) and resolved at ``flush()``, so recording
adds no host sync to the iteration.

An event is a dict ``{rank, name, op, stage, mb, seg, lane, start, end}`` with times in seconds
(``time.perf_counter`` scale, comparable across processes of one host).
``schedule.costmodel.Prediction.events()`` gives the same dicts, so predicted and measured
timelines are written by the same functions.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

from schedule.ir import Action, Op

LANES = ("compute", "load", "offload", "comm", "optimizer")
LANE_OF_OP = {
    Op.FORWARD: "compute", Op.BACKWARD: "compute",
    Op.LOAD: "load", Op.DROP: "load", Op.OFFLOAD_GRADS: "offload",
    Op.SEND_F: "comm", Op.RECV_F: "comm", Op.SEND_B: "comm", Op.RECV_B: "comm", Op.NORM: "comm", Op.TIE: "comm",
    Op.STEP: "optimizer",
}
# How the timeline PNG draws an op: (colour, legend label); DROP is not drawn (it frees memory at once).
_COMM = ("#17becf", "send / recv (activations, gradients)")
STYLE = {
    "F": ("#2ca02c", "forward (F)"), "B": ("#ff7f0e", "backward (B)"),
    "L": ("#1f77b4", "load: host to GPU (L)"), "O": ("#9467bd", "offload: GPU to host (O)"),
    "S": ("#8c8c8c", "optimizer step (S)"), "NORM": ("#e6c229", "gradient-norm all-reduce (NORM)"),
    "T": ("#d62728", "tied-gradient exchange (T)"),
    "SEND_F": _COMM, "RECV_F": _COMM, "SEND_B": _COMM, "RECV_B": _COMM,
}
# The rows of a rank's block, top to bottom, with their names; lanes map onto them.
ROWS = (("copy", "load / offload"), ("compute", "compute"), ("comm", "communication"), ("optimizer", "optimizer"))
_ROW_OF_LANE = {"load": "copy", "offload": "copy", "compute": "compute", "comm": "comm", "optimizer": "optimizer"}
_ROW_PX, _GAP_PX = 22, 10  # pixels of one row, and between two ranks' blocks


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
        # A DROP enqueues nothing on the load stream (its buffer goes back to the pool behind a
        # compute event) and is not drawn: timed on the current stream, so the load stream keeps
        # its one producer, the store's loader thread (offload/loader.py).
        stream = self.streams.get(LANE_OF_OP[action.op]) if action.op is not Op.DROP else None
        if stream is not None and begin and action.op is Op.OFFLOAD_GRADS:
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
        self.span(action, start, self._mark(action))

    def span(self, action: Action, start, end) -> None:
        """An action timed elsewhere: ``start`` and ``end`` are this recorder's kind of time points
        (timing events on the action's stream on CUDA, ``time.perf_counter`` values otherwise)."""
        if self.cuda:
            self._pending.append((action, start, end))
        else:
            self._events.append(self._event(action, start, end))

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
                "mb": action.mb, "seg": action.seg, "lane": LANE_OF_OP[action.op], "start": start, "end": end}

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
                      "args": {"stage": e.get("stage"), "mb": e.get("mb"), "seg": e.get("seg")}})
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
                       "seg": a.seg, "lane": e.get("cat", LANE_OF_OP[a.op]), "start": e["ts"] / 1e6,
                       "end": (e["ts"] + e["dur"]) / 1e6})
    return events


def _row_of(e: dict) -> str | None:
    """Which row of a rank's block an event is drawn in (None: not drawn)."""
    return _ROW_OF_LANE[_lane(e)] if e["op"] in STYLE else None


def _shown_rows(panels: list[list[dict]]) -> list[str]:
    used = {_row_of(e) for events in panels for e in events}
    return [row for row, _ in ROWS if row in used] or ["compute"]


def timeline_size(num_ranks: int, num_rows: int, num_panels: int = 2, width: int = 1400) -> tuple[int, int]:
    """(width, height) in pixels of the PNG ``write_timeline_png`` draws: ``num_rows`` rows
    (of ``ROWS``) for each of ``num_ranks`` ranks in each of ``num_panels`` panels."""
    panel = 70 + num_ranks * (num_rows * _ROW_PX + _GAP_PX)
    return width, 130 + num_panels * panel


def write_timeline_png(path: str | Path, measured: Iterable[dict] | Mapping[int, Iterable[dict]],
                       predicted: Iterable[dict] | Mapping[int, Iterable[dict]] | None = None, *,
                       ranks: Iterable[int] | None = None, width: int = 1400) -> tuple[int, int]:
    """Draw one iteration as a Gantt chart, one block of rows per rank, and save it as a PNG.

    With ``predicted`` there are two panels sharing the time axis: measured on top, the cost
    model's prediction below. Each panel's time starts at 0 at its first action, in ms; a
    dashed line marks where the iteration ends (its last action other than an optimizer step:
    steps may run on, overlapping the next iteration). Boxes wide enough carry the action
    (``2F0``: stage 2, forward, micro-batch 0).

    Args:
        path: the PNG to write.
        measured: the recorded events (``Timeline.events()`` of every rank).
        predicted: the cost model's events (``Prediction.events()``), or None for one panel.
        ranks: the ranks to draw a block for, so that a rank with no actions still gets its
            (empty) block; default: the ranks that have events.
        width: image width in pixels; the height follows from the ranks and rows.

    Returns:
        The image size in pixels, ``timeline_size(...)``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [("Measured (one recorded iteration)", _flatten(measured))]
    if predicted is not None:
        panels.append(("Cost model, fed the measured op durations (steady state)", _flatten(predicted)))
    ranks = sorted(set(ranks or ()) | {e["rank"] for _, events in panels for e in events})
    rows = _shown_rows([events for _, events in panels])
    size = timeline_size(len(ranks), len(rows), len(panels), width)
    fig = Figure(figsize=(size[0] / 100, size[1] / 100), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    x_max = max([(e["end"] - min(x["start"] for x in events)) * 1e3 for _, events in panels for e in events],
                default=1.0)
    grid = _GanttGrid(ranks, rows, x_max, ms_per_px=x_max / (0.86 * width))  # about: the axes take most of the width
    spans = [measured_step_time(events) for _, events in panels]
    for ax, (title, events), span in zip(axes, panels, spans):
        grid.draw_boxes(ax, events)
        grid.draw_blocks(ax, events)
        if events:
            ax.axvline(span * 1e3, color="black", ls="--", lw=1.2)
        if panels[0][0] != title and spans[0] > 0:
            title += f": {span * 1e3:.1f} ms, {(span - spans[0]) / spans[0]:+.1%} vs measured"
        elif events:
            title += f": {span * 1e3:.1f} ms"
        ax.set_title(title, loc="left", fontsize=11)
        grid.label_axes(ax)
    axes[-1].set_xlabel("time since the iteration's first action (ms)")
    for ax in axes[:-1]:
        ax.tick_params(axis="x", labelbottom=True)  # each panel keeps its time labels
    _timeline_legend(fig, {e["op"] for _, events in panels for e in events if _row_of(e)})
    fig.suptitle(f"One training iteration, {len(ranks)} rank{'s' if len(ranks) != 1 else ''}: what each rank "
                 f"ran and when", fontsize=13)
    fig.savefig(path, dpi=100)  # no bbox_inches="tight": the image keeps exactly ``size``
    return size


@dataclass(frozen=True)
class _GanttGrid:
    """Where a panel of ``write_timeline_png`` puts things: a block of ``rows`` per rank, one y
    unit per row, time in ms on x up to ``x_max``."""

    ranks: list[int]
    rows: list[str]
    x_max: float
    ms_per_px: float

    @property
    def block(self) -> float:
        """y units of one rank's block: its rows and the gap below them."""
        return len(self.rows) + _GAP_PX / _ROW_PX

    def draw_boxes(self, ax, events: list[dict]) -> None:
        """One box per drawn event, labelled with its action where the box is wide enough."""
        t0 = min((e["start"] for e in events), default=0.0)
        for e in events:
            row = _row_of(e)
            if row is None:
                continue
            colour, _ = STYLE[e["op"]]
            x, w = (e["start"] - t0) * 1e3, max(e["end"] - e["start"], 0.0) * 1e3
            y = self.ranks.index(e["rank"]) * self.block + self.rows.index(row)
            # At least a pixel wide: an instant action stays visible. A white edge parts neighbours,
            # but would wash out a box a few pixels wide.
            ax.broken_barh([(x, max(w, self.ms_per_px))], (y + 0.1, 0.8), facecolors=colour, edgecolor="white",
                           linewidth=0.4 if w > 4 * self.ms_per_px else 0)
            if w / self.ms_per_px > 6.2 * len(e["name"]) + 4:
                ax.text(x + w / 2, y + 0.5, e["name"], ha="center", va="center", fontsize=7,
                        color="black" if e["op"] in ("S", "NORM", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
                        else "white", clip_on=True)

    def draw_blocks(self, ax, events: list[dict]) -> None:
        """A line between two ranks' blocks, and a note in the block of a rank with nothing drawn."""
        for i, r in enumerate(self.ranks):
            if not any(e["rank"] == r and _row_of(e) for e in events):
                ax.text(self.x_max / 2, i * self.block + len(self.rows) / 2, f"rank {r}: no actions", ha="center",
                        va="center", fontsize=9, color="0.45", style="italic")
            if i:
                ax.axhline(i * self.block - _GAP_PX / _ROW_PX / 2, color="0.75", lw=0.8)

    def label_axes(self, ax) -> None:
        """Rank names on the left, row names on the right, rank 0 on top, time on x."""
        ranks, rows, block = self.ranks, self.rows, self.block
        ax.set_ylim(len(ranks) * block - _GAP_PX / _ROW_PX, 0)  # rank 0 on top
        ax.set_yticks([i * block + len(rows) / 2 for i in range(len(ranks))], [f"rank {r}" for r in ranks],
                      fontsize=10, fontweight="bold")
        ax.tick_params(axis="y", length=0)
        lanes = ax.twinx()  # the row names on the right, the rank names on the left
        lanes.set_ylim(ax.get_ylim())
        lanes.set_yticks([i * block + k + 0.5 for i in range(len(ranks)) for k in range(len(rows))],
                         [dict(ROWS)[row] for _ in ranks for row in rows], fontsize=8, color="0.3")
        lanes.tick_params(axis="y", length=0)
        ax.grid(axis="x", alpha=0.3)
        ax.set_xlim(0, self.x_max * 1.01)


def _timeline_legend(fig, drawn: set[str]) -> None:
    """The legend of ``write_timeline_png``: one entry per colour of the ops drawn, and the end line."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    labels = {}  # one entry per label: the four send / recv ops share one
    for op, (colour, label) in STYLE.items():
        if op in drawn:
            labels.setdefault(label, colour)
    handles = [Patch(color=c, label=label) for label, c in labels.items()]
    if drawn:
        handles.append(Line2D([], [], color="black", ls="--", lw=1.2,
                              label="iteration end (optimizer steps may run on)"))
    fig.legend(handles=handles, loc="outside lower center", ncols=min(4, len(handles)), fontsize=9,
               title="box text: stage, action, micro-batch (2F0 = stage 2, forward, micro-batch 0)", title_fontsize=8)


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
    contention), not how well it guesses them. With sequence segments a stage's micro-batch
    compute is the sum of its segments' medians, and each segment's share of it
    (``segment_share``) the measured one, over every stage's forwards. The iteration
    predicted is one in a steady state (``schedule.costmodel.predict_steady``): it starts with the previous iteration's
    optimizer steps still running, as the recorded one did (``steady=False``: one iteration
    from a clean start, ending with its own steps).
    """
    from schedule.costmodel import cpu_stepped_stages, predict, predict_steady
    from schedule.ir import num_segments_of

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
    share = None
    num_segments = num_segments_of(schedule)
    if num_segments > 1:
        by_seg: dict[tuple[str, int, int], list[float]] = {}
        for e in events:
            if e["op"] in ("F", "B") and e.get("seg") is not None:
                by_seg.setdefault((e["op"], e["stage"], e["seg"]), []).append(max(0.0, e["end"] - e["start"]))
        median_s = {k: _median(v) for k, v in by_seg.items()}
        compute = {s: tuple(sum(median_s.get((op, s, j), 0.0) for j in range(num_segments)) for op in ("F", "B"))
                   for s in range(num_stages)}
        forward = [sum(median_s.get(("F", s, j), 0.0) for s in range(num_stages)) for j in range(num_segments)]
        share = [f / sum(forward) for f in forward] if sum(forward) > 0 else None
    links = []
    for r in ranks:
        rates = [stage_bytes[e["stage"]] / (e["end"] - e["start"]) / 1e9 for e in events
                 if e["rank"] == r and e["op"] == "L" and e["end"] > e["start"]]
        links.append(max(rates, default=25.0))
    groups = list(rank_groups) if rank_groups is not None else list(ranks)
    roots = {g: max(link for link, group in zip(links, groups) if group == g) for g in set(groups)}
    offloaded = cpu_stepped_stages(schedule)
    steps = [d for (op, s), ds in durations.items() if op == "S" and s in offloaded for d in ds]
    norms = [d for (op, _), ds in durations.items() if op == "NORM" for d in ds]
    return (predict_steady if steady else predict)(dict(schedule), mapping, ranks, groups, compute, stage_bytes,
                                                   links, roots, step_s=_median(steps) if steps else 0.0,
                                                   norm_s=min(norms, default=0.0), segment_share=share)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def write_run_timeline(save_dir: str | Path, events: list[dict], schedule: Mapping[int, list[Action]],
                       mapping: list[int], stage_bytes: list[int], rank_groups: list[int] | None = None,
                       png: bool = True) -> tuple[dict[str, Path], str]:
    """Write ``timeline.json`` (measured), ``timeline_predicted.json`` (``calibrated_prediction``)
    and, with ``png`` (matplotlib is there), ``timeline.png`` (both, measured above the
    prediction) into ``save_dir``.

    Returns the paths and one log line with both step times, the prediction error and every
    file written.
    """
    out = Path(save_dir)
    out.mkdir(parents=True, exist_ok=True)
    measured = measured_step_time(events)
    pred = calibrated_prediction(events, schedule, mapping, stage_bytes, rank_groups)
    paths = {"timeline": write_chrome_trace(out / "timeline.json", events),
             "predicted": write_chrome_trace(out / "timeline_predicted.json", pred.events())}
    if png:
        paths["gantt"] = out / "timeline.png"
        write_timeline_png(paths["gantt"], events, pred.events(), ranks=schedule)
    err = (pred.host_end - measured) / measured if measured > 0 else 0.0
    line = (f"timeline: measured step {measured:.4f}s, cost model (measured op durations, steady state) "
            f"{pred.host_end:.4f}s, prediction error {err:+.1%}; wrote {', '.join(str(p) for p in paths.values())}")
    return paths, line
