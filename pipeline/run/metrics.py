"""What a run reports while it trains: a progress bar, one fixed-format line and one JSONL row per
step, evaluation rows, the end-of-run summary and a PNG plot of loss and throughput.

Only the rank that computes the loss (the last stage's rank) speaks and writes files; the other
ranks take part in the summary's gather of peak memory and otherwise only warn. Files, in
``save_dir`` (with ``save_metrics``):

* ``metrics.jsonl``: one JSON object per line, ``"kind"`` is ``"train"`` (every step),
  ``"eval"`` (every evaluation, with ``"split"``) or ``"summary"`` (the last line).
  Non-finite numbers are written as ``null`` so every line is strict JSON.
* ``metrics.png``: a matplotlib figure of titled panels over the steps: training and validation
  loss, throughput (tokens/s, from zero), step time, and the gradient norm, peak memory and
  learning rate where the rows have them; skipped steps are shaded red in every panel.
* ``tensorboard/`` and Weights & Biases, as ``report_to`` asks: the same rows
  (``pipeline.run.sinks``).
"""
from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import IO, Sequence

import torch

from data.dataset import error_line
from pipeline.dist import DistEnv, Log, barrier, gather_objects
from pipeline.run.checkpoint import write_json_atomic
from pipeline.run.sinks import Sink, open_sink

GIB = 2**30
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"
# A training step's figures, as metrics.jsonl and results.json both name them (step counts from 1).
STEP_KEYS = ("step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s", "tflops_per_gpu", "step_time_s",
             "peak_mem_bytes", "skipped")


class TrainingError(RuntimeError):
    """Training cannot go on (too many non-finite steps): printed as one line, exit code 2."""


def optional_output(log: Log, failed: str, write) -> bool:
    """Run ``write``, which writes an output a user can do without (a plot, event files, a trace):
    a failure is one warning line (``failed``: what it means, then why), never the end of the run.
    True if it wrote."""
    try:
        write()
        return True
    except Exception as e:  # noqa: BLE001 - a full disk, a broken matplotlib or tensorboard install: any
        log.warn(f"{failed} ({error_line(e)}); the model, checkpoints and metrics.jsonl are not affected")
        return False


# --- one line per event ---------------------------------------------------------------------
def step_line(row: dict, num_steps: int) -> str:
    """``step    3/20 loss 2.3456 grad_norm 1.2345 lr 3.00e-04 tok/s 1234 tflops 0.012 mem 0.41GiB time 0.123s``."""
    gn = "n/a" if row.get("grad_norm") is None else f"{row['grad_norm']:.4f}"
    line = (f"step {row['step']:4d}/{num_steps} loss {row['loss']:.4f} grad_norm {gn} lr {row['lr']:.2e} "
            f"tok/s {row['tokens_per_s']:.0f} tflops {row['tflops_per_gpu']:.3f} "
            f"mem {row['peak_mem_bytes'] / GIB:.2f}GiB time {row['step_time_s']:.3f}s")
    return line + (" skipped" if row.get("skipped") else "")


def eval_line(row: dict) -> str:
    """``eval step    3 loss 2.3456 ppl 10.45 tokens 1234 batches 5 time 0.50s``."""
    return (f"eval step {row['step']:4d} loss {row['loss']:.4f} ppl {row['perplexity']:.2f} "
            f"tokens {row['num_tokens']} batches {row['num_batches']} time {row['time_s']:.2f}s")


def summary_line(row: dict) -> str:
    mems = " ".join(f"{m / GIB:.2f}" for m in row["peak_mem_bytes_per_rank"])
    first = row.get("resumed_after_step")
    steps = f"{row['num_steps']} steps" + (f" (resumed after step {first})" if first else "")
    line = (f"summary: {steps} in {row['total_time_s']:.2f}s, mean step "
            f"{row['mean_step_time_s']:.3f}s and {row['mean_tokens_per_s']:.0f} tok/s after the first step, "
            f"{row['skipped_steps']} skipped; peak memory per rank (GiB): {mems}")
    if row.get("eval_loss") is not None:
        line += f"; final eval loss {row['eval_loss']:.4f} ppl {row['eval_perplexity']:.2f}"
    return line


def steady_means(rows: Sequence[dict]) -> tuple[float, float]:
    """Mean step time (s) and tokens/s over the steps after the first, which pays for warm-up
    (allocations, caches); over the one step when there is only one."""
    steady = rows[1:] or rows
    step_time = sum(r["step_time_s"] for r in steady)
    return step_time / max(1, len(steady)), sum(r["tokens"] for r in steady) / step_time if step_time > 0 else 0.0


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf  # exp overflows a float past ~709


def _json_safe(row: dict) -> dict:
    """Non-finite floats -> None: json.dumps would write NaN / Infinity, which is not JSON."""
    out = {}
    for k, v in row.items():
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        elif isinstance(v, list):
            v = [None if isinstance(x, float) and not math.isfinite(x) else x for x in v]
        out[k] = v
    return out


# --- non-finite steps -----------------------------------------------------------------------
class SkipGuard:
    """Counts consecutive skipped steps; past ``max_skipped`` (>= 0) training stops.

    Every rank runs one: the skip decision comes from the all-reduced gradient norm, so all
    ranks count alike and raise at the same step (no rank is left waiting in a collective).
    ``max_skipped < 0`` never stops.
    """

    def __init__(self, max_skipped: int):
        self.max_skipped = max_skipped
        self.in_a_row = 0
        self.total = 0

    def update(self, step: int, skipped: bool) -> None:
        if not skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        if 0 <= self.max_skipped < self.in_a_row:
            first = step - self.in_a_row + 1
            raise TrainingError(
                f"stopping at step {step}: {self.in_a_row} steps in a row (steps {first}-{step}) had a non-finite "
                f"loss or gradient norm, more than max_skipped_steps={self.max_skipped}; lower lr, raise warmup_"
                f"iterations, use dtype float32 or check the data (max_skipped_steps -1 never stops)")


# --- the reporter ---------------------------------------------------------------------------
class Metrics:
    """Progress bar, step / eval lines, ``metrics.jsonl``, summary and plot of one rank.

    Args:
        log: the run's logger; it speaks on the loss rank.
        speaks: whether this rank computes the loss (and so reports and writes the files).
        num_steps: steps of the run (the bar's total).
        save_dir: where ``metrics.jsonl`` and ``metrics.png`` go; None writes no files.
        progress_bar: draw a tqdm bar (on stdout, only when it is a terminal).
        report_to: where the rows also go (``pipeline.config.report_targets``), with a save_dir.
        config: the run's settings, for a Weights & Biases run.
    """

    def __init__(self, log: Log, *, speaks: bool, num_steps: int, save_dir: str | Path | None,
                 progress_bar: bool, report_to: tuple[str, ...] = (), config: dict | None = None):
        self.log, self.speaks, self.num_steps = log, speaks, num_steps
        self.rows: list[dict] = []  # every step's row, those of the run this one resumed included
        self.evals: list[dict] = []
        self.first_step = 0  # the steps this run resumed after (their rows came from the file)
        self.path = Path(save_dir) / METRICS_FILE if save_dir is not None and speaks else None
        self.plot_path = Path(save_dir) / PLOT_FILE if save_dir is not None and speaks else None
        self._file: IO[str] | None = None
        self.report_to, self.config = report_to, config or {}
        self.sinks: list[Sink] = []
        self.bar = None
        if speaks and progress_bar and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=num_steps, desc="train", unit="step", file=sys.stdout, dynamic_ncols=True)
        self.t0 = time.perf_counter()

    def start(self, first_step: int = 0) -> None:
        """Start the clock of the summary's total time and open the metrics file: truncated for a
        new run; for a run resumed after ``first_step`` steps, the rows of steps up to it are
        kept (later ones belong to the abandoned continuation) and new rows are appended."""
        self.t0 = time.perf_counter()
        self.first_step = first_step
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if first_step and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a crash
                if row.get("kind") in ("train", "eval") and row.get("step", first_step + 1) <= first_step:
                    kept.append(row)
        self.rows = [r for r in kept if r["kind"] == "train"]
        self.evals = [r for r in kept if r["kind"] == "eval"]
        self._file = self.path.open("w")
        for row in kept:  # the sinks have them from the run that wrote them
            self._write(row)
        for name in self.report_to:  # one that cannot open is one warning; the run goes on without it
            optional_output(self.log, f"report_to {name}: no rows go to it", lambda: self.sinks.append(
                open_sink(name, self.path.parent, first_step, self.config)))
        if self.bar is not None:
            self.bar.update(first_step)

    def _write(self, row: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(_json_safe(row), allow_nan=False) + "\n")
            self._file.flush()  # a run that dies keeps every row written so far

    def _emit(self, row: dict, step: int) -> None:
        """A new row: to metrics.jsonl and to every sink, the same values. A sink that fails is
        dropped with one warning: metrics.jsonl has the rows, and the run goes on."""
        self._write(row)
        for sink in list(self.sinks):
            if not optional_output(self.log, f"report_to {sink.name}: no more rows go to it",
                                   lambda: sink.write(row, step)):
                self.sinks.remove(sink)

    def log_step(self, row: dict) -> None:
        """Report one step. ``row``: step (1-based), loss, grad_norm, lr, tokens, tokens_per_s,
        tflops_per_gpu, step_time_s, peak_mem_bytes, skipped."""
        if not self.speaks:
            return
        row = {"kind": "train", **row}
        self.rows.append(row)
        if row.get("skipped"):
            gn = row.get("grad_norm")
            self.log.warn(f"step {row['step']}: non-finite loss {row['loss']} or gradient norm {gn}; the optimizer "
                          f"step is skipped on every rank (weights and AdamW state unchanged)")
        self._emit(row, row["step"])
        self.log.info(step_line(row, self.num_steps))
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {row['loss']:.4f} tok/s {row['tokens_per_s']:.0f} "
                                     f"step {row['step_time_s']:.3f}s mem {row['peak_mem_bytes'] / GIB:.2f}GiB",
                                     refresh=False)
            self.bar.update(1)

    def log_eval(self, row: dict) -> None:
        """Report one evaluation. ``row``: step, loss, num_tokens, num_batches, time_s."""
        if not self.speaks:
            return
        row = {"kind": "eval", "split": "validation", **row, "perplexity": perplexity(row["loss"])}
        self.evals.append(row)
        self._emit(row, row["step"])
        self.log.info(eval_line(row))

    def finish(self, peak_mem_bytes: int) -> dict | None:
        """Summary line and row (the plot is ``write_plot``'s, once the model is saved). A
        collective: every rank calls it (the peak memory of every rank is gathered). Returns the
        summary on the speaking rank."""
        per_rank = gather_objects(peak_mem_bytes)
        total = time.perf_counter() - self.t0
        summary = None
        if self.speaks:
            # total_time_s is this run's: so are the steps it counts and averages
            ran = [r for r in self.rows if r["step"] > self.first_step]
            mean_step, mean_tps = steady_means(ran)
            summary = {"kind": "summary", "num_steps": len(ran), "total_time_s": total,
                       "mean_step_time_s": mean_step, "mean_tokens_per_s": mean_tps,
                       "skipped_steps": sum(1 for r in ran if r.get("skipped")),
                       "peak_mem_bytes_per_rank": per_rank}
            if self.first_step:
                summary["resumed_after_step"] = self.first_step
            if self.evals:
                summary["eval_loss"] = self.evals[-1]["loss"]
                summary["eval_perplexity"] = self.evals[-1]["perplexity"]
            self._close_bar()  # the bar goes before the summary line
            self._emit(summary, self.rows[-1]["step"] if self.rows else self.first_step)
            self.log.info(summary_line(summary))
        self.close()
        return summary

    def write_plot(self) -> None:
        """metrics.png of the rows so far, where matplotlib is there (the start-up notes say when
        it is not: ``preflight.start_notes``)."""
        from pipeline.plan.preflight import installed

        if self.plot_path is not None and self.rows and installed("matplotlib"):
            write_plot_png(self.plot_path, self.rows, self.evals)

    def close(self) -> None:
        """Close the bar and the file (no collective: safe on an error path)."""
        self._close_bar()
        if self._file is not None:
            self._file.close()
            self._file = None
        for sink in self.sinks:
            optional_output(self.log, f"report_to {sink.name}: its last rows may be lost", sink.close)
        self.sinks = []

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None




# --- the plot -------------------------------------------------------------------------------
_TRAIN, _EVAL, _SKIP, _MEAN = "tab:blue", "tab:red", "tab:red", "0.35"
# Panels after the loss: (row key, title, y label, factor applied to the values).
_PANELS = (
    ("tokens_per_s", "Throughput (whole pipeline)", "tokens / s", 1.0),
    ("step_time_s", "Step time (wall clock)", "seconds per step", 1.0),
    ("grad_norm", "Gradient norm (global L2, before clipping)", "L2 norm", 1.0),
    ("peak_mem_bytes", "Peak memory of the logging rank", "GiB (GPU: allocated, CPU: RSS)", 1 / GIB),
    ("lr", "Learning rate", "learning rate", 1.0),
)
_PANEL_W, _PANEL_H = 600, 300  # pixels per panel; two panels a row


def _values(rows: Sequence[dict], key: str, factor: float = 1.0) -> list[float]:
    """``key`` of every row as floats; missing and non-finite values become NaN (a gap in the line)."""
    out = []
    for r in rows:
        v = r.get(key)
        out.append(float(v) * factor if isinstance(v, (int, float)) and math.isfinite(v) else math.nan)
    return out


def _has(rows: Sequence[dict], key: str) -> bool:
    return any(not math.isnan(v) for v in _values(rows, key))


def plot_size(rows: Sequence[dict], width: int = 2 * _PANEL_W) -> tuple[int, int]:
    """(width, height) in pixels of the figure ``write_plot_png`` draws for ``rows``."""
    num_panels = 2 + sum(1 for key, *_ in _PANELS[1:] if _has(rows, key))  # loss and throughput always
    return width, 60 + _PANEL_H * math.ceil(num_panels / 2)


def write_plot_png(path: str | Path, rows: Sequence[dict], evals: Sequence[dict] = (), *,
                   width: int = 2 * _PANEL_W) -> tuple[int, int]:
    """Draw the run's metrics over the steps and save them as a PNG; returns its size in pixels.

    Panels: loss (training line, validation squares, with a legend), throughput in tokens/s
    (y from zero, dashed mean after the first step), and step time, gradient norm, peak memory
    and learning rate when the rows have them. Skipped steps are shaded red.

    Args:
        path: the PNG to write.
        rows: ``"train"`` rows (``step``, ``loss``, ``tokens_per_s`` at least).
        evals: ``"eval"`` rows (``step``, ``loss``).
        width: image width in pixels; the height follows from the number of panels.
    """
    # The Agg canvas directly, not pyplot: no global backend or figure state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    size = plot_size(rows, width)
    panels = [p for p in _PANELS if p[0] == "tokens_per_s" or _has(rows, p[0])]
    fig = Figure(figsize=(size[0] / 100, size[1] / 100), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    num_rows = size[1] // _PANEL_H
    axes = fig.subplots(num_rows, 2, squeeze=False).ravel()
    steps = [r["step"] for r in rows]
    skipped = [r["step"] for r in rows if r.get("skipped")]
    marker = "o" if len(rows) <= 60 else None  # with few steps the points are the data
    _plot_loss(axes[0], rows, evals, marker, bool(skipped))
    mean_step, mean_tps = steady_means(rows) if rows and all("tokens" in r and "step_time_s" in r
                                                             for r in rows) else (math.nan, math.nan)
    means = {"tokens_per_s": mean_tps, "step_time_s": mean_step}
    for ax, panel in zip(axes[1:], panels):
        _plot_panel(ax, rows, panel, marker, means.get(panel[0], math.nan))
    for ax in axes[len(panels) + 1:]:
        ax.set_visible(False)
    all_steps = steps + [e["step"] for e in evals]
    for ax in axes[:len(panels) + 1]:
        _step_axis(ax, all_steps, skipped)
    title = f"Training metrics: {len(rows)} step{'s' if len(rows) != 1 else ''}"
    if math.isfinite(mean_tps) and len(rows) > 1:
        title += f", {mean_tps:.4g} tokens/s and {mean_step:.3g} s per step after the first"
    if skipped:
        title += f", {len(skipped)} skipped"
    fig.suptitle(title, fontsize=13)
    fig.savefig(path, dpi=100)  # no bbox_inches="tight": the image keeps exactly ``size``
    return size


def _plot_loss(ax, rows: Sequence[dict], evals: Sequence[dict], marker: str | None, any_skipped: bool) -> None:
    """The loss panel: the training line, the validation squares and a legend that names both."""
    from matplotlib.patches import Patch

    loss = _values(rows, "loss")
    ax.plot([r["step"] for r in rows], loss, color=_TRAIN, marker=marker, markersize=3, lw=1.5,
            label="training loss" + _last(loss))
    if evals:
        eval_loss = _values(evals, "loss")
        ax.plot([e["step"] for e in evals], eval_loss, color=_EVAL, marker="s", markersize=6, lw=1, ls="--",
                label="validation loss" + _last(eval_loss))
    ax.set_title("Loss (mean cross-entropy per trained token)")
    ax.set_ylabel("loss (nats / token)")
    handles, _ = ax.get_legend_handles_labels()
    if any_skipped:
        handles.append(Patch(color=_SKIP, alpha=0.15, label="skipped step (non-finite loss or norm)"))
    ax.legend(handles=handles, loc="upper right", fontsize=9, title_fontsize=8,
              title=None if evals else "no validation in this run (eval_every 0)")


def _plot_panel(ax, rows: Sequence[dict], panel: tuple[str, str, str, float], marker: str | None,
                mean: float) -> None:
    """One of ``_PANELS``: the values from zero up, with a dashed line at their ``mean`` if finite."""
    key, title, ylabel, factor = panel
    vals = _values(rows, key, factor)
    ax.plot([r["step"] for r in rows], vals, color=_TRAIN, marker=marker, markersize=3, lw=1.5)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0, top=max([v for v in vals if not math.isnan(v)], default=1.0) * 1.15 or 1.0)
    if math.isfinite(mean) and len(rows) > 1:
        unit = "tokens/s" if key == "tokens_per_s" else "s"
        ax.axhline(mean, color=_MEAN, ls="--", lw=1, label=f"mean after step 1: {mean:.4g} {unit}")
        ax.legend(loc="lower right", fontsize=9)
    if key == "lr":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))


def _step_axis(ax, all_steps: list[int], skipped: list[int]) -> None:
    """The shared x axis of every panel: whole steps, padded, skipped steps shaded."""
    from matplotlib.ticker import MaxNLocator

    x_lo, x_hi = (min(all_steps), max(all_steps)) if all_steps else (0, 1)
    pad = max(0.5, 0.02 * (x_hi - x_lo))
    ax.set_xlim(x_lo - pad, x_hi + pad)
    if x_hi - x_lo < 4:  # a locator would put ticks between the steps
        ax.set_xticks(range(x_lo, x_hi + 1))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    for s in skipped:
        ax.axvspan(s - 0.5, s + 0.5, color=_SKIP, alpha=0.15, lw=0)


def _last(values: list[float]) -> str:
    finite = [v for v in values if not math.isnan(v)]
    return f" (last {finite[-1]:.4f})" if finite else ""


def results_rows(per_rank: list[list[dict]], loss_rank: int) -> list[dict]:
    """``results.json``'s iterations from every rank's history: the loss rank's step figures, each
    rank's peak memory, and each rank's byte counts and timed parts."""
    rows = []
    for i, loss_row in enumerate(per_rank[loss_rank]):
        rows.append({**{k: loss_row[k] for k in ("step", "step_time_s", "tokens_per_s", "tflops_per_gpu", "loss",
                                                  "grad_norm", "lr")},
                     "peak_mem_bytes": [h[i]["peak_mem_bytes"] for h in per_rank],
                     "per_rank": [{k: v for k, v in h[i].items() if k.endswith(("_bytes", "_seconds"))}
                                  for h in per_rank]})
    return rows


def peak_rss() -> int:
    """Peak resident bytes of this process (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_pinned() -> int:
    """Peak bytes of page-locked host blocks torch's pinned allocator held (not in the resident set:
    the driver maps them), 0 where the build reports none."""
    stats = torch.cuda.host_memory_stats()
    return int(next((v for k, v in stats.items() if k.startswith("allocated_bytes") and k.endswith("peak")), 0))


def peak_memory(device: torch.device) -> int:
    """Peak bytes of the device's allocations (CPU: the process's peak RSS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return peak_rss()


def device_stats(device: torch.device, stores: dict) -> dict:
    """Reserved GPU memory, host memory and PCIe transfer volume/rate of this rank since the last call."""
    out = {"host_rss_bytes": peak_rss()}
    if device.type == "cuda":
        out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        out["host_pinned_bytes"] = peak_pinned()
        totals = {"h2d": [0, 0.0], "d2h": [0, 0.0]}
        for store in stores.values():
            for kind, (nbytes, secs) in store.pop_transfer_stats().items():
                totals[kind][0] += nbytes
                totals[kind][1] += secs
        for kind, (nbytes, secs) in totals.items():
            out[f"{kind}_bytes"], out[f"{kind}_seconds"] = nbytes, secs
    return out


def write_results(path: Path, config: dict, env: DistEnv, data_parallel: int, history: list[dict],
                  loss_rank: int, resumed_at: int = 0) -> None:
    """Gather every rank's step rows and write ``results.json`` from rank 0 (collective). A run
    resumed after step ``resumed_at`` keeps the rows of steps up to it that ``path`` holds (those
    of the run it continues; the steps an abandoned continuation wrote after them go, as in
    ``metrics.jsonl``)."""
    per_rank = gather_objects(history)
    if env.rank == 0:
        earlier = [row for row in earlier_rows(path) if row.get("step", 0) <= resumed_at] if resumed_at else []
        write_json_atomic(path, {"config": config, "world_size": env.world_size, "data_parallel": data_parallel,
                                 "iterations": earlier + results_rows(per_rank, loss_rank)})
    barrier()


def earlier_rows(path: Path) -> list[dict]:
    """The iterations an earlier ``results.json`` at ``path`` holds; none if there is no readable one."""
    try:
        rows = json.loads(Path(path).read_text()).get("iterations", [])
    except (OSError, ValueError, AttributeError):
        return []
    return rows if isinstance(rows, list) else []
