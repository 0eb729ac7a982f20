"""The one way a user's text file is read: its bytes decoded as UTF-8 (a byte-order mark dropped),
then parsed as JSON, JSON Lines or YAML where it is one. Every failure is an ``InputError`` of
one line: which file (``what`` says what it is for), where (line and column; for a byte that is
not UTF-8 its line and offset too) and what to do about it."""
from __future__ import annotations

import codecs
import json
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

# How much of a large file is decoded at a time when it is only checked (a dataset file).
_BLOCK = 1 << 24


class InputError(ValueError):
    """A user's file that cannot be read as the text it should be: one line, naming the file."""


def _shown(path) -> str:
    return repr(str(path))


def _not_utf8(path, what: str, offset: int, line: int, bad: bytes) -> str:
    p = Path(path)
    fixed = p.with_name(f"{p.stem}.utf8{p.suffix}")
    return (f"{what} {_shown(path)} is not UTF-8 text: line {line} (byte {offset} of the file) holds "
            f"{' '.join(f'0x{b:02x}' for b in bad)}, which UTF-8 does not allow; save the file as UTF-8, e.g. "
            f"for Latin-1 or Windows-1252 text: iconv -f cp1252 -t utf-8 {shlex.quote(str(p))} > "
            f"{shlex.quote(str(fixed))}")


def utf8_text(data: bytes, path, what: str) -> str:
    """``data``, the bytes of the file ``path``, as text (a UTF-8 byte-order mark dropped)."""
    skip = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as e:
        start = skip + e.start
        raise InputError(_not_utf8(path, what, start, data.count(b"\n", 0, start) + 1,
                                   data[start:skip + e.end])) from None


def read_text(path, what: str) -> str:
    """The text of the file ``path`` (``what``: what it is for, as the message names it)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise InputError(f"cannot read {what} {_shown(path)}: {e.strerror or e}") from None
    return utf8_text(data, path, what)


def check_utf8(path, what: str) -> None:
    """The file ``path`` is UTF-8 throughout, read a block at a time (a dataset file may be larger
    than the memory one should spend on a check). Another library parses it afterwards."""
    lines, offset, carry = 1, 0, b""  # carry: a character cut by the end of the last block
    try:
        with open(path, "rb") as fh:
            while True:
                block = fh.read(_BLOCK)
                data = carry + block
                try:
                    data.decode("utf-8")
                    carry = b""
                except UnicodeDecodeError as e:
                    if block and e.end == len(data) and e.reason == "unexpected end of data":
                        carry = data[e.start:]  # the rest of its bytes come in the next block
                        data = data[:e.start]
                    else:
                        start = offset + e.start
                        raise InputError(_not_utf8(path, what, start, lines + data.count(b"\n", 0, e.start),
                                                   data[e.start:e.end])) from None
                lines += data.count(b"\n")
                offset += len(data)
                if not block:
                    return
    except OSError as e:
        raise InputError(f"cannot read {what} {_shown(path)}: {e.strerror or e}") from None


def read_json(path, what: str) -> Any:
    """The JSON document in the file ``path``."""
    text = read_text(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{what} {_shown(path)} is not valid JSON at line {e.lineno}, column {e.colno}: "
                         f"{e.msg}") from None


def first_bad_json(paths, what: str) -> str | None:
    """The error line of the first of ``paths`` (files of a directory a library could not load)
    that is not valid JSON, or None: which file, and where, where the library's error says neither."""
    for f in paths:
        try:
            read_json(f, what)
        except InputError as bad:
            return str(bad)
    return None


def read_json_lines(path, what: str) -> list[tuple[int, dict]]:
    """The records of the JSON Lines file ``path`` with their line numbers: one JSON object a
    line, blank lines skipped."""
    out = []
    for number, line in enumerate(read_text(path, what).splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{what} {_shown(path)} line {number} is not valid JSON (column {e.colno}: {e.msg}); "
                             "a JSON Lines file holds one JSON object a line") from None
        if not isinstance(value, dict):
            raise InputError(f"{what} {_shown(path)} line {number} is a JSON {type(value).__name__}, not an object "
                             "(a JSON Lines file holds one JSON object a line)")
        out.append((number, value))
    return out


class _DuplicateKey(yaml.YAMLError):
    """A mapping that gives one key twice (YAML itself would keep the last value without a word)."""


class YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader reading numbers as YAML 1.2 and Python do (YAML 1.1 wants a dot in a
    float, so ``3e-4`` or ``1E5`` would otherwise come back as strings: a config file's ``lr``, a
    topology file's ``bandwidth_gbps``, ``--help``'s shown values), and refusing a mapping that
    gives a key twice: one of the two values would be dropped in silence."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *base': later keys override it, as meant
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                    seen.setdefault(key, line)
                except TypeError:  # an unhashable key: SafeLoader's own error follows
                    continue
                if first is not None:
                    where = f"on line {line}" if first == line else f"at lines {first} and {line}"
                    raise _DuplicateKey(f"gives the key {key!r} twice, {where} (YAML would keep the last value "
                                        "without a word); keep one of them")
        return super().construct_mapping(node, deep)


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                   |[-+]?(?:[0-9][0-9_]*)[eE][-+]?[0-9]+
                   |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                   |[-+]?\.(?:inf|Inf|INF)
                   |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def read_yaml(path, what: str) -> Any:
    """The YAML document in the file ``path`` (``YamlLoader``: YAML 1.2 numbers, no key given twice)."""
    text = read_text(path, what)
    try:
        return yaml.load(text, Loader=YamlLoader)
    except _DuplicateKey as e:
        raise InputError(f"{what} {_shown(path)} {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise InputError(f"{what} {_shown(path)} is not valid YAML{where}: {problem}") from None


__all__ = ["InputError", "YamlLoader", "check_utf8", "first_bad_json", "read_json", "read_json_lines", "read_text",
           "read_yaml", "utf8_text"]
