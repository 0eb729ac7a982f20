"""How a setting is declared: a dataclass field with its default, its help text and, where one
value alone can be wrong, its own rule (``Check``). The sections of ``pipeline.config.TrainConfig``
are declared with ``setting`` beside the code they configure (``schedule/settings.py``,
``offload/settings.py``, ``data/settings.py``); ``pipeline.config`` reads the metadata into the
flags, the YAML keys and their checks, and ``docs/gen_config.py`` into docs/config.md."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class Check:
    """A rule on one field's value alone, declared beside the field (``setting(..., check=...)``):
    a value for which ``ok`` is false is refused as "<name> (<value>) must be <must>"."""

    ok: Callable[[Any], bool]
    must: str


def at_least(low: float, meaning: str = "") -> Check:
    """The value is ``>= low``; ``meaning`` says what the lowest values do (" (0 = off)")."""
    return Check(lambda v: v >= low, f">= {low}{meaning}")


def above(low: float) -> Check:
    """The value is ``> low``."""
    return Check(lambda v: v > low, f"> {low}")


def fraction(upper_open: bool) -> Check:
    """The value is in [0, 1], or [0, 1) with ``upper_open``."""
    return Check(lambda v: 0 <= v < 1 if upper_open else 0 <= v <= 1, "in [0, 1)" if upper_open else "in [0, 1]")


# A count of which there must be one at least.
AT_LEAST_ONE = Check(lambda v: v >= 1, "at least 1")


def setting(default: Any, help: str, check: Check | None = None, **kw: Any) -> Any:
    """A field of a settings section: ``default``, the ``help`` that --help and docs/config.md
    show, its own rule, and ``kw``: ``choices`` (the values allowed), ``renamed`` (older value ->
    its name now) or ``listed`` (the names a comma-separated value, or a YAML list, may hold)."""
    return field(default=default, metadata={"help": help, "check": check, **kw})
