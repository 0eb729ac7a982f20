"""Records -> token ids with labels, truncated to ``seq_length``.

XSum records become ``bos + prompt(document) + summary + eos`` and only ``summary + eos``
is trained; text records become ``bos + text + eos`` and every token after ``bos`` is
trained. Labels follow the Hugging Face convention: aligned with ``input_ids``, ``-100``
where nothing is trained (the model shifts them itself).

(The module is not called ``tokenize.py`` so that running a script from ``data/`` cannot
shadow the standard library's ``tokenize``, which ``inspect`` and ``linecache`` import.)
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Protocol, Sequence

from data.dataset import TEXT, XSUM, DataError, detect_format

IGNORE_INDEX = -100
PROMPT_TEMPLATE = "Summarize the following article.\n\n{document}\n\nSummary: "
_PROMPT_PREFIX, _PROMPT_SUFFIX = PROMPT_TEMPLATE.split("{document}")
_CHUNK_SIZE = 1024  # records per batched tokenizer call


class Tokenizer(Protocol):
    """What tokenization needs from a Hugging Face tokenizer."""

    bos_token_id: int | None
    eos_token_id: int | None

    def __call__(self, text: list[str], add_special_tokens: bool = ...) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class Example:
    """One tokenized record: ``labels[i]`` is ``input_ids[i]`` or ``IGNORE_INDEX``."""

    input_ids: list[int]
    labels: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)


def format_prompt(document: str) -> str:
    """The prompt text put before a summary."""
    return PROMPT_TEMPLATE.format(document=document)


def encode_prompt(tokenizer: Tokenizer, document: str) -> list[int]:
    """Token ids of ``bos + prompt(document)`` exactly as training sees them (for generation)."""
    prefix, doc, suffix = _encode(tokenizer, [_PROMPT_PREFIX, document, _PROMPT_SUFFIX])
    return _bos(tokenizer) + prefix + doc + suffix


def tokenize_records(
    records: Iterable[Mapping[str, Any]],
    tokenizer: Tokenizer,
    seq_length: int,
    *,
    fmt: str | None = None,
    stats: dict[str, int] | None = None,
) -> tuple[list[Example], int]:
    """Tokenize records into examples of at most ``seq_length`` tokens.

    XSum truncation cuts the document first so that ``summary + eos`` fits, but keeps at least
    ``min_document_tokens(seq_length)`` of it (a summary trained on no document teaches
    nothing about summarising) and then cuts the summary's end (and ``eos``). Text truncation
    cuts the end.

    Args:
        records: a ``datasets.Dataset`` or any iterable of dict-like rows.
        tokenizer: a Hugging Face tokenizer with ``eos_token_id`` set (``bos`` is optional).
        seq_length: the longest example, in tokens.
        fmt: ``'xsum'`` or ``'text'``; detected from the columns (or first row) if None.
        stats: if given, receives ``truncated`` (examples cut to ``seq_length``) and
            ``summary_cut`` (XSum examples whose summary was cut to keep the document's minimum).

    Returns:
        ``(examples, num_skipped)``: rows with a missing, None, non-string or empty field, or
        with no trainable token left after truncation, are skipped and counted.

    Raises:
        DataError: no example survives, or the columns match no format.
        ValueError: ``seq_length`` < 2 or the tokenizer has no eos token.
    """
    if seq_length < 2:
        raise ValueError(f"seq_length ({seq_length}) must be >= 2 (one input and one target)")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token; set tokenizer.eos_token")
    rows = iter(records)
    if fmt is None:
        columns = getattr(records, "column_names", None)
        if columns is None:
            first = next(rows, None)
            columns = [] if first is None else list(first)
            rows = itertools.chain([] if first is None else [first], rows)
        fmt = detect_format(columns)
    if fmt not in (XSUM, TEXT):
        raise ValueError(f"fmt ({fmt!r}) must be {XSUM!r} or {TEXT!r}")

    fields = ("document", "summary") if fmt == XSUM else ("text",)
    encoder = _XsumEncoder if fmt == XSUM else _TextEncoder
    make = encoder(tokenizer, seq_length)
    examples: list[Example] = []
    num_skipped = 0
    chunk: list[list[str]] = []

    def flush() -> None:
        nonlocal num_skipped
        # One batched call per field: the fast tokenizer parallelises over the chunk.
        encoded = [_encode(tokenizer, [row[i] for row in chunk]) for i in range(len(fields))]
        for ids in zip(*encoded):
            example = make(*ids)
            if example is None:
                num_skipped += 1
            else:
                examples.append(example)
        chunk.clear()

    for row in rows:
        values = [row.get(f) if hasattr(row, "get") else None for f in fields]
        if all(isinstance(v, str) and v.strip() for v in values):
            chunk.append(values)
            if len(chunk) == _CHUNK_SIZE:
                flush()
        else:
            num_skipped += 1
    if chunk:
        flush()
    if stats is not None:
        stats.update(truncated=make.truncated, summary_cut=getattr(make, "summary_cut", 0))
    if not examples:
        raise DataError(
            f"no usable {fmt} records: all {num_skipped} were corrupt or had no trainable token "
            f"within seq_length={seq_length}"
        )
    return examples, num_skipped


def min_document_tokens(seq_length: int) -> int:
    """Document tokens an XSum example keeps however long its summary: a quarter of seq_length."""
    return seq_length // 4


class _XsumEncoder:
    def __init__(self, tokenizer: Tokenizer, seq_length: int) -> None:
        prefix, suffix = _encode(tokenizer, [_PROMPT_PREFIX, _PROMPT_SUFFIX])
        self.head = _bos(tokenizer) + prefix
        self.suffix = suffix
        self.eos = tokenizer.eos_token_id
        self.seq_length = seq_length
        self.min_document = min_document_tokens(seq_length)
        self.truncated = self.summary_cut = 0

    def __call__(self, document: list[int], summary: list[int]) -> Example | None:
        answer = summary + [self.eos]
        room = self.seq_length - len(self.head) - len(self.suffix) - len(answer)
        keep = max(room, min(len(document), self.min_document))
        prompt = self.head + document[:keep] + self.suffix
        # A prompt longer than seq_length - 1 leaves no target: the record is skipped (_checked).
        input_ids = (prompt + answer)[: self.seq_length]
        labels = ([IGNORE_INDEX] * len(prompt) + answer)[: self.seq_length]
        example = _checked(input_ids, labels)
        if example is not None and (keep < len(document) or len(prompt) + len(answer) > self.seq_length):
            self.truncated += 1
            self.summary_cut += len(prompt) + len(answer) > self.seq_length
        return example


class _TextEncoder:
    def __init__(self, tokenizer: Tokenizer, seq_length: int) -> None:
        self.bos = _bos(tokenizer)
        self.eos = tokenizer.eos_token_id
        self.seq_length = seq_length
        self.truncated = 0

    def __call__(self, text: list[int]) -> Example | None:
        full = self.bos + text + [self.eos]
        input_ids = full[: self.seq_length]
        # bos is never a target (nothing precedes it); mask it so labels count targets.
        labels = [IGNORE_INDEX] * len(self.bos) + input_ids[len(self.bos):]
        example = _checked(input_ids, labels)
        self.truncated += example is not None and len(full) > self.seq_length
        return example


def _checked(input_ids: list[int], labels: list[int]) -> Example | None:
    # Position 0 is never predicted, so a trainable label must sit at position >= 1.
    if all(label == IGNORE_INDEX for label in labels[1:]):
        return None
    return Example(input_ids, labels)


def _bos(tokenizer: Tokenizer) -> list[int]:
    return [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]


def _encode(tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]
