"""What a run reports while it trains: a progress bar, one fixed-format line and one JSONL row per
step, evaluation rows, the end-of-run summary and a PNG plot of loss and throughput.

Only the rank that computes the loss (the last stage's rank) speaks and writes files; the other
ranks take part in the summary's gather of peak memory and otherwise only warn. Files, in
``save_dir`` (with ``save_metrics``):

* ``metrics.jsonl``: one JSON object per line, ``"kind"`` is ``"train"`` (every step),
  ``"eval"`` (every evaluation, with ``"split"``) or ``"summary"`` (the last line).
  Non-finite numbers are written as ``null`` so every line is strict JSON.
* ``metrics.png``: two panels over the steps, loss (train line, eval squares) on top and
  tokens/s below; the y-axis minimum and maximum are printed at the panel's corners.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import IO, Sequence

from pipeline.dist import Log, gather_objects

GIB = 2**30
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"


class TrainingError(RuntimeError):
    """Training cannot go on (too many non-finite steps): printed as one line, exit code 2."""


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
    line = (f"summary: {row['num_steps']} steps in {row['total_time_s']:.2f}s, mean step "
            f"{row['mean_step_time_s']:.3f}s and {row['mean_tokens_per_s']:.0f} tok/s after the first step, "
            f"{row['skipped_steps']} skipped; peak memory per rank (GiB): {mems}")
    if row.get("eval_loss") is not None:
        line += f"; final eval loss {row['eval_loss']:.4f} ppl {row['eval_perplexity']:.2f}"
    return line


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
    """

    def __init__(self, log: Log, *, speaks: bool, num_steps: int, save_dir: str | Path | None,
                 progress_bar: bool):
        self.log, self.speaks, self.num_steps = log, speaks, num_steps
        self.rows: list[dict] = []
        self.evals: list[dict] = []
        self.path = Path(save_dir) / METRICS_FILE if save_dir is not None and speaks else None
        self.plot_path = Path(save_dir) / PLOT_FILE if save_dir is not None and speaks else None
        self._file: IO[str] | None = None
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
        for row in kept:
            self._write(row)
        if self.bar is not None:
            self.bar.update(first_step)

    def _write(self, row: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(_json_safe(row), allow_nan=False) + "\n")
            self._file.flush()  # a run that dies keeps every row written so far

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
        self._write(row)
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
        self._write(row)
        self.log.info(eval_line(row))

    def finish(self, peak_mem_bytes: int) -> dict | None:
        """Summary line and row, and the plot. A collective: every rank calls it (the peak
        memory of every rank is gathered). Returns the summary on the speaking rank."""
        per_rank = gather_objects(peak_mem_bytes)
        total = time.perf_counter() - self.t0
        summary = None
        if self.speaks:
            steady = self.rows[1:] or self.rows  # the first step pays for warm-up (allocations, caches)
            step_time = sum(r["step_time_s"] for r in steady)
            summary = {"kind": "summary", "num_steps": len(self.rows), "total_time_s": total,
                       "mean_step_time_s": step_time / max(1, len(steady)),
                       "mean_tokens_per_s": sum(r["tokens"] for r in steady) / step_time if step_time > 0 else 0.0,
                       "skipped_steps": sum(1 for r in self.rows if r.get("skipped")),
                       "peak_mem_bytes_per_rank": per_rank}
            if self.evals:
                summary["eval_loss"] = self.evals[-1]["loss"]
                summary["eval_perplexity"] = self.evals[-1]["perplexity"]
            self._close_bar()  # the bar goes before the summary line
            self._write(summary)
            self.log.info(summary_line(summary))
            if self.plot_path is not None and self.rows:
                write_plot_png(self.plot_path, self.rows, self.evals)
        self.close()
        return summary

    def close(self) -> None:
        """Close the bar and the file (no collective: safe on an error path)."""
        self._close_bar()
        if self._file is not None:
            self._file.close()
            self._file = None

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


# --- the plot -------------------------------------------------------------------------------
_LOSS, _EVAL, _TPS = (31, 119, 180), (214, 39, 40), (44, 160, 44)
_AXIS, _GRID, _TEXT = (90, 90, 90), (228, 228, 228), (40, 40, 40)
# 3x5 bitmap glyphs, one string of 15 bits per character (rows top to bottom).
_GLYPHS = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", "-": "000000111000000",
    "e": "000111111100111", "+": "000010111010000", " ": "000000000000000", "n": "000110101101101",
    "a": "000011101101011", "i": "010000010010010", "f": "011010111010010",
}


def plot_size(width: int = 800, height: int = 600) -> tuple[int, int]:
    """(width, height) in pixels of the PNG ``write_plot_png`` draws."""
    return width, height


def write_plot_png(path: str | Path, rows: Sequence[dict], evals: Sequence[dict] = (), *,
                   width: int = 800, height: int = 600) -> tuple[int, int]:
    """Draw loss (top) and tokens/s (bottom) over the steps; returns the image size.

    Pure numpy pixels encoded by the timeline module's PNG writer (no matplotlib here).
    """
    import numpy as np

    from pipeline.timeline import _png_bytes

    img = np.full((height, width, 3), 255, dtype=np.uint8)
    steps = [r["step"] for r in rows] + [e["step"] for e in evals]
    x_lo, x_hi = min(steps), max(steps)
    margin_l, margin_r, gap = 66, 16, 24
    panel_h = (height - 3 * gap) // 2
    panels = [(gap, [([(r["step"], r["loss"]) for r in rows], _LOSS, False),
                     ([(e["step"], e["loss"]) for e in evals], _EVAL, True)]),
              (2 * gap + panel_h, [([(r["step"], r["tokens_per_s"]) for r in rows], _TPS, False)])]
    for top, series in panels:
        box = (margin_l, top, width - margin_r, top + panel_h)  # x0, y0, x1, y1
        ys = [y for pts, _, _ in series for _, y in pts if y is not None and math.isfinite(y)]
        y_lo, y_hi = (min(ys), max(ys)) if ys else (0.0, 1.0)
        if y_hi - y_lo < 1e-12:
            y_lo, y_hi = y_lo - 0.5, y_hi + 0.5
        _frame(img, box)
        for pts, colour, markers in series:
            _series(img, box, pts, (x_lo, x_hi), (y_lo, y_hi), colour, markers)
        _text(img, _num(y_hi), 4, box[1])
        _text(img, _num(y_lo), 4, box[3] - 10)
        _text(img, _num(x_lo), box[0], box[3] + 4)
        label = _num(x_hi)
        _text(img, label, box[2] - 8 * len(label), box[3] + 4)
    Path(path).write_bytes(_png_bytes(img))
    return width, height


def _num(v: float) -> str:
    if not math.isfinite(v):
        return "nan"
    if v == int(v) and abs(v) < 1e6:
        return str(int(v))
    return f"{v:.4g}"


def _frame(img, box) -> None:
    x0, y0, x1, y1 = box
    for k in range(1, 4):  # three horizontal grid lines
        img[y0 + k * (y1 - y0) // 4, x0:x1] = _GRID
    img[y0:y1 + 1, x0] = img[y0:y1 + 1, x1] = _AXIS
    img[y0, x0:x1 + 1] = img[y1, x0:x1 + 1] = _AXIS


def _series(img, box, pts, xr, yr, colour, markers: bool) -> None:
    """A line through the finite points (a gap at a non-finite one), or square markers."""
    x0, y0, x1, y1 = box
    pad = 4

    def to_px(x: float, y: float) -> tuple[int, int]:
        px = x0 + pad + (x - xr[0]) / max(xr[1] - xr[0], 1e-12) * (x1 - x0 - 2 * pad)
        py = y1 - pad - (y - yr[0]) / (yr[1] - yr[0]) * (y1 - y0 - 2 * pad)
        return int(round(px)), int(round(py))

    prev = None
    for x, y in pts:
        if y is None or not math.isfinite(y):
            prev = None
            continue
        p = to_px(x, y)
        if markers:
            img[p[1] - 3:p[1] + 4, p[0] - 3:p[0] + 4] = colour
        elif prev is not None:
            n = max(abs(p[0] - prev[0]), abs(p[1] - prev[1])) + 1
            for t in range(n + 1):  # dense enough that consecutive pixels touch
                px = prev[0] + (p[0] - prev[0]) * t // max(n, 1)
                py = prev[1] + (p[1] - prev[1]) * t // max(n, 1)
                img[py:py + 2, px:px + 2] = colour  # 2 px thick
        else:
            img[p[1]:p[1] + 2, p[0]:p[0] + 2] = colour  # a lone point stays visible
        prev = p


def _text(img, text: str, x: int, y: int, scale: int = 2) -> None:
    """Draw ``text`` (digits, '.', '-', 'e', 'nan', 'inf') with its top-left corner at (x, y)."""
    h, w, _ = img.shape
    for i, ch in enumerate(text):
        bits = _GLYPHS.get(ch, _GLYPHS[" "])
        for k, bit in enumerate(bits):
            if bit == "1":
                r, c = divmod(k, 3)
                py, px = y + r * scale, x + i * 4 * scale + c * scale
                if 0 <= py < h - scale and 0 <= px < w - scale:
                    img[py:py + scale, px:px + scale] = _TEXT
