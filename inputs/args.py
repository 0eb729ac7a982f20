"""Command-line values argparse would misread."""
from __future__ import annotations

import argparse
import re
import sys
from typing import Callable

# A negative number as a user writes it: -3, -0.5, -.5, -1e-4, -2.5E3, -inf. argparse takes only
# the first forms for a value: "--lr -1e-4" is, to it, a flag without its value.
_NEGATIVE = re.compile(r"-(?:(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|inf(?:inity)?)", re.I)


def join_negative_values(argv: list[str], takes_value: Callable[[str], bool]) -> list[str]:
    """``argv`` with each negative number that follows a flag taking a value (``takes_value``)
    joined to it (``--lr -1e-4`` -> ``--lr=-1e-4``), so that argparse reads it as the value; the
    range checks then say what is wrong with it. Nothing after ``--`` changes."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return out + argv[i:]
        if i + 1 < len(argv) and "=" not in arg and takes_value(arg) and _NEGATIVE.fullmatch(argv[i + 1]):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


class NumberParser(argparse.ArgumentParser):
    """argparse that reads a negative number after a flag taking a value as that value
    (``join_negative_values``)."""

    def takes_value(self, option: str) -> bool:
        return any(option in a.option_strings and a.nargs is None for a in self._actions)

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(join_negative_values(args, self.takes_value), namespace)


__all__ = ["NumberParser", "join_negative_values"]
