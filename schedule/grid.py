"""The rank x step grid every schedule error prints, the faulty cells marked ``>>like this<<``,
and the error that carries it (``schedule.validate``, ``schedule.simulate``)."""
from __future__ import annotations

from typing import Iterable, NoReturn

from schedule.ir import Schedule

Cell = tuple[int, int]  # (rank, step index); step == len(list) means "the end of the list"
_GRID_COLUMNS = 16  # steps per block of the grid, so long schedules stay readable


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message carries the values and the marked grid."""


def format_grid(schedule: Schedule, mark: Iterable[Cell] | Cell | None = None) -> str:
    """Rank x step grid of a schedule, one row per rank, marked cells shown ``>>2F0<<``."""
    if isinstance(mark, tuple) and len(mark) == 2 and all(isinstance(x, int) for x in mark):
        mark = [mark]
    marks = set(mark or ())
    ranks = sorted(schedule)
    cells = {r: [str(a) for a in schedule[r]] for r in ranks}
    for r, i in sorted(marks):
        if r not in cells:
            continue
        if i >= len(cells[r]):
            cells[r] += [""] * (i - len(cells[r])) + ["<end>"]
        cells[r][i] = f">>{cells[r][i]}<<"
    num_cols = max([len(c) for c in cells.values()] + [0])
    label = max([len(f"rank {r}") for r in ranks] + [4])
    blocks = []
    for lo in range(0, max(num_cols, 1), _GRID_COLUMNS):
        cols = range(lo, min(lo + _GRID_COLUMNS, num_cols))
        width = {j: max([len(str(j))] + [len(cells[r][j]) for r in ranks if j < len(cells[r])]) for j in cols}
        lines = ["step".ljust(label) + " | " + " ".join(str(j).ljust(width[j]) for j in cols)]
        for r in ranks:
            row = " ".join((cells[r][j] if j < len(cells[r]) else "").ljust(width[j]) for j in cols)
            lines.append(f"rank {r}".ljust(label) + " | " + row)
        blocks.append("\n".join(line.rstrip() for line in lines))
    return "\n\n".join(blocks)


def fail(schedule: Schedule, message: str, marks: Iterable[Cell] = ()) -> NoReturn:
    raise ScheduleError(f"{message}\n{format_grid(schedule, list(marks))}")


__all__ = ["Cell", "ScheduleError", "fail", "format_grid"]
