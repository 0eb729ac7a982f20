"""Loading raw records: a ``save_to_disk`` directory, local data files, or a cached dataset.

Whatever the source, the result is a ``datasets.Dataset`` whose columns match one of the
formats the tokenizer understands (see ``detect_format`` and docs/data.md). Every failure is a
``DataError`` naming the source, what was found and what is expected.
"""
from __future__ import annotations

import glob
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

import datasets

from inputs import InputError, check_utf8, first_bad_json, read_json, read_json_lines

XSUM = "xsum"
CHAT = "chat"
ALPACA = "alpaca"
TEXT = "text"
FORMATS = (XSUM, CHAT, ALPACA, TEXT)

# Extension -> the packaged ``datasets`` builder that reads it.
_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
# The builders that parse text (the others read binary files).
_TEXT_BUILDERS = ("json", "csv")
# Suffixes that mark a source as a file path (not a dataset name) even when it is missing.
_FILE_SUFFIXES = frozenset(_BUILDERS) | {".txt", ".tsv", ".arrow", ".gz", ".zst", ".bz2", ".xz"}
_GLOB_CHARS = "*?["
_EXPECTED = (
    "expected a datasets.save_to_disk directory, a .json/.jsonl/.parquet/.csv file or glob, "
    "or a dataset name in the local datasets cache"
)


class DataError(ValueError):
    """Bad or unusable training data; the message names the source and what to change."""


def detect_format(column_names: Iterable[str]) -> str:
    """The record format of these columns (the first record's keys), checked in this order:
    ``'xsum'`` (``document`` + ``summary``), ``'chat'`` (``messages``), ``'alpaca'``
    (``instruction`` + ``output``, ``input`` optional), ``'text'`` (``text``).

    Raises:
        DataError: no format's columns are present; the message lists the formats.
    """
    names = set(column_names)
    if {"document", "summary"} <= names:
        return XSUM
    if "messages" in names:
        return CHAT
    if {"instruction", "output"} <= names:
        return ALPACA
    if "text" in names:
        return TEXT
    raise DataError(
        f"columns {sorted(names)} match no known format: "
        "need 'document' and 'summary' (XSum style), 'messages' (chat: a list of {role, content}), "
        "'instruction' and 'output' (Alpaca style, 'input' optional) or 'text'"
    )


def _text(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def chat_messages(row: Any) -> list[dict[str, Any]] | None:
    """The ``messages`` of a chat record ready for a chat template, or None if the record is
    unusable: not a non-empty list of mappings with a string ``role`` and string ``content``, or
    without an assistant message with non-empty content. Keys whose value is None are dropped
    (``datasets`` fills a key missing from some messages with None, and templates test
    ``is defined``)."""
    messages = row.get("messages") if hasattr(row, "get") else None
    if not isinstance(messages, (list, tuple)) or not messages:
        return None
    out = []
    for message in messages:
        if not hasattr(message, "items"):
            return None
        message = {k: v for k, v in message.items() if v is not None}
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            return None
        out.append(message)
    if not any(m["role"] == "assistant" and m["content"].strip() for m in out):
        return None
    return out


def record_fields(fmt: str, row: Any) -> list[str] | None:
    """The text fields of an XSum, Alpaca or text record, in the order
    ``(document, summary)``, ``(instruction, input, output)`` (``input`` is ``''`` when missing or
    None) or ``(text,)``; None if the record is unusable (a field missing, None, not a string or
    blank; a present ``input`` that is not a string)."""
    if not hasattr(row, "get"):
        return None
    if fmt == ALPACA:
        given = row.get("input")
        values = [row.get("instruction"), "" if given is None else given, row.get("output")]
        ok = _text(values[0]) and isinstance(values[1], str) and _text(values[2])
        return values if ok else None
    values = [row.get(f) for f in (("document", "summary") if fmt == XSUM else (TEXT,))]
    return values if all(_text(v) for v in values) else None


def usable(fmt: str, row: Any) -> bool:
    """Whether ``row`` holds the fields ``fmt`` trains on (see ``record_fields``, ``chat_messages``)."""
    return (chat_messages(row) if fmt == CHAT else record_fields(fmt, row)) is not None


def load_records(source: str, split: str = "train") -> datasets.Dataset:
    """Load the records of ``source`` as a ``datasets.Dataset``.

    Args:
        source: a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``;
            a local ``.json``/``.jsonl``/``.parquet``/``.csv`` file or a glob of them; or the
            name of a dataset that ``datasets`` can load offline from its cache.
        split: the split to take from a ``DatasetDict`` directory or a cached dataset. Single
            files and single-``Dataset`` directories hold one split and ignore it.

    Raises:
        DataError: missing path, unknown extension, missing split, unreadable data, or columns
            that match no format.
    """
    source = str(source)
    path = Path(source).expanduser()
    if path.is_dir():
        dataset = _load_saved(path, split, source)
    elif path.is_file() or any(c in source for c in _GLOB_CHARS):
        dataset = _load_files(source)
    elif _looks_like_path(source):
        raise DataError(f"data source {source!r}: no such file or directory; {_EXPECTED}")
    else:
        dataset = _load_cached(source, split)
    try:
        detect_format(dataset.column_names)
    except DataError as e:
        raise DataError(f"data source {source!r}: {e}") from None
    return dataset


def _looks_like_path(source: str) -> bool:
    # Dataset names look like "owner/name" too, so only these mark a path for sure.
    return (
        os.path.isabs(source)
        or source.startswith((".", "~"))
        or Path(source).suffix.lower() in _FILE_SUFFIXES
    )


def _load_saved(path: Path, split: str, source: str) -> datasets.Dataset:
    if (path / "dataset_dict.json").is_file():
        dataset_dict = _from_disk(path, source)
        if split not in dataset_dict:
            raise DataError(
                f"data source {source!r}: no split {split!r}; "
                f"the saved DatasetDict has splits {sorted(dataset_dict)}"
            )
        return dataset_dict[split]
    if (path / "state.json").is_file():
        return _from_disk(path, source)
    found = sorted(p.name for p in path.iterdir())[:8]
    raise DataError(
        f"data source {source!r}: directory is not a save_to_disk output "
        f"(no dataset_dict.json or state.json; found {found}); {_EXPECTED}"
    )


def _from_disk(path: Path, source: str):
    """``datasets.load_from_disk``; a directory it cannot read names the file that breaks it."""
    try:
        with _quiet():
            return datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - datasets raises many types for a damaged directory
        # dataset_dict.json, state.json, dataset_info.json
        problem = first_bad_json(sorted(path.rglob("*.json")), "save_to_disk file") or \
            f"cannot load the save_to_disk directory: {error_line(root_cause(e))}"
        raise DataError(f"data source {source!r}: {problem}") from None


def _load_files(source: str) -> datasets.Dataset:
    expanded = os.path.expanduser(source)
    files = [expanded] if os.path.isfile(expanded) else sorted(glob.glob(expanded))
    files = [f for f in files if os.path.isfile(f)]
    if not files:
        raise DataError(f"data source {source!r}: the glob matches no files; {_EXPECTED}")
    suffixes = sorted({Path(f).suffix.lower() for f in files})
    unknown = [s for s in suffixes if s not in _BUILDERS]
    if unknown:
        raise DataError(
            f"data source {source!r}: unknown file extension(s) {unknown}; "
            f"expected one of {sorted(_BUILDERS)}"
        )
    builders = {_BUILDERS[s] for s in suffixes}
    if len(builders) > 1:
        raise DataError(
            f"data source {source!r}: mixes file types {suffixes}; use files of one type"
        )
    builder = builders.pop()
    for f in files:
        if os.path.getsize(f) == 0:
            raise DataError(f"data source {source!r}: {f} is empty")
    try:
        if builder in _TEXT_BUILDERS:
            # The JSON reader takes bytes that are not UTF-8 into the table, whose rows then fail
            # to decode wherever they are read (after launch, mid-epoch): one pass now, with the line.
            for f in files:
                check_utf8(f, "data file")
        with _quiet():
            return datasets.load_dataset(builder, data_files=files, split="train")
    except InputError as e:  # it names the file: the source too, unless the source is a glob
        raise DataError(str(e) if files == [expanded] else f"data source {source!r}: {e}") from None
    except Exception as e:  # datasets raises many types for unreadable files
        # datasets does not say which file breaks, nor where a JSON file does: find it (only on a
        # failure: parsing a large file again costs time a readable one should not pay).
        where = next((w for w in (_file_problem(f, builder) for f in files) if w), None)
        raise DataError(
            (where if files == [expanded] else f"data source {source!r}: {where}") if where else
            f"data source {source!r}: could not read {len(files)} file(s): {error_line(root_cause(e))}"
        ) from None


@contextmanager
def _quiet() -> Iterator[None]:
    """No progress bars or logged errors from ``datasets``: a failure becomes one DataError line."""
    from datasets.utils import logging as ds_logging

    level, bars = ds_logging.get_verbosity(), ds_logging.is_progress_bar_enabled()
    ds_logging.set_verbosity(ds_logging.CRITICAL)
    ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        ds_logging.set_verbosity(level)
        if bars:
            ds_logging.enable_progress_bar()


def _file_problem(path: str, builder: str) -> str | None:
    """What is wrong with the data file ``path`` that ``builder`` could not read, in one line
    naming it (and, for JSON, the line), or None where nothing is found."""
    if builder == "parquet":
        import pyarrow.parquet as pq

        try:
            pq.ParquetFile(path)
        except Exception as e:  # noqa: BLE001 - pyarrow's ArrowInvalid, OSError
            return f"data file {str(path)!r} is not a readable parquet file ({error_line(e)})"
        return None
    if builder != "json":
        return None
    try:
        if Path(path).suffix.lower() == ".jsonl":
            read_json_lines(path, "data file")
            return None
        try:
            value = read_json(path, "data file")
        except InputError as e:
            if "Extra data" not in str(e):
                raise
            read_json_lines(path, "data file")  # JSON Lines in a .json file
            return None
        if not isinstance(value, (list, dict)):
            return (f"data file {str(path)!r} holds a JSON {type(value).__name__}; expected a list of records or "
                    "JSON Lines")
    except InputError as e:
        return str(e)
    return None


_NEEDS = {
    XSUM: "document and summary as non-empty text",
    CHAT: "messages as a list of {role, content} with text content and an assistant turn",
    ALPACA: "instruction and output as non-empty text (and input, if present, as text)",
    TEXT: "text as non-empty text",
}
_SHOWN = {XSUM: ("document", "summary"), CHAT: ("messages",), ALPACA: ("instruction", "output"), TEXT: (TEXT,)}


def check_first_records(dataset: datasets.Dataset, source: str, count: int = 8) -> None:
    """There is a record, and one of the first ``count`` has its format's fields (a few bad rows
    are skipped at tokenization; all bad means a wrong file or column).

    Raises:
        DataError: no records, or none of the first ``count`` usable.
    """
    if len(dataset) == 0:
        raise DataError(f"data source {source!r} has no records")
    fmt = detect_format(dataset.column_names)
    try:
        rows = list(dataset.select(range(min(count, len(dataset)))))
    except UnicodeDecodeError as e:  # a binary file's text column (parquet) that is not UTF-8
        raise DataError(f"data source {source!r}: a text column of the first {min(count, len(dataset))} records is "
                        f"not UTF-8 ({e.reason} at byte {e.start} of a value); write the data as UTF-8") from None
    if not any(usable(fmt, row) for row in rows):
        first = ", ".join(f"{f}={str(rows[0].get(f))[:40]!r}" for f in _SHOWN[fmt])
        raise DataError(f"data source {source!r}: none of the first {len(rows)} records has {_NEEDS[fmt]} "
                        f"(record 0: {first})")


def _load_cached(name: str, split: str) -> datasets.Dataset:
    with _offline():
        try:
            return datasets.load_dataset(name, split=split)
        except Exception as e:  # not cached, unknown split, ... : all mean "cannot use it"
            raise DataError(
                f"data source {name!r}: not a path, and loading it as a dataset name from the "
                f"local cache (offline) failed: {error_line(e)}; {_EXPECTED}"
            ) from e


@contextmanager
def _offline() -> Iterator[None]:
    """Force ``datasets`` and ``huggingface_hub`` offline for the duration of the block."""
    import huggingface_hub.constants as hub_constants

    env_keys = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    saved_env = {k: os.environ.get(k) for k in env_keys}
    # Both libraries read the variables at import time, so patch their module flags too.
    flags = [
        (datasets.config, "HF_HUB_OFFLINE"),
        (datasets.config, "HF_DATASETS_OFFLINE"),
        (hub_constants, "HF_HUB_OFFLINE"),
    ]
    saved_flags = [(m, a, getattr(m, a)) for m, a in flags if hasattr(m, a)]
    os.environ.update({k: "1" for k in env_keys})
    for module, attr, _ in saved_flags:
        setattr(module, attr, True)
    try:
        yield
    finally:
        for module, attr, value in saved_flags:
            setattr(module, attr, value)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def root_cause(e: BaseException) -> BaseException:
    """The exception at the bottom of ``e``'s chain: datasets wraps the parser's own error (pandas'
    "Expected 2 fields in line 3") in one that says only that generating the dataset failed."""
    seen = {id(e)}
    while (e.__cause__ or e.__context__) is not None and id(e.__cause__ or e.__context__) not in seen:
        e = e.__cause__ or e.__context__
        seen.add(id(e))
    return e


def error_line(e: BaseException) -> str:
    """An exception in one line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
