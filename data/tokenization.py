"""Records -> token ids with labels, truncated to ``seq_length``.

XSum records become ``bos + prompt(document) + summary + eos`` and only ``summary + eos``
is trained; Alpaca records become ``bos + prompt(instruction, input) + output + eos`` and only
``output + eos`` is trained; chat records are rendered with the tokenizer's chat template and
only the assistant turns are trained; text records become ``bos + text + eos`` and every token
after ``bos`` is trained (docs/data.md has the exact rules). Labels follow the Hugging Face
convention: aligned with ``input_ids``, ``-100`` where nothing is trained (the model shifts them
itself).

(The module is not called ``tokenize.py`` so that running a script from ``data/`` cannot
shadow the standard library's ``tokenize``, which ``inspect`` and ``linecache`` import.)
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Protocol, Sequence

from data.dataset import (
    ALPACA,
    CHAT,
    FORMATS,
    TEXT,
    XSUM,
    DataError,
    chat_messages,
    detect_format,
    error_line,
    record_fields,
)

IGNORE_INDEX = -100
PROMPT_TEMPLATE = "Summarize the following article.\n\n{document}\n\nSummary: "
_PROMPT_PREFIX, _PROMPT_SUFFIX = PROMPT_TEMPLATE.split("{document}")
# The Stanford Alpaca prompts (with and without an input), as its training code writes them.
ALPACA_TEMPLATE = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_TEMPLATE_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)
_CHUNK_SIZE = 1024  # records per batched tokenizer call


class Tokenizer(Protocol):
    """What tokenization needs from a Hugging Face tokenizer."""

    bos_token_id: int | None
    eos_token_id: int | None

    def __call__(self, text: list[str], add_special_tokens: bool = ...) -> Mapping[str, Any]: ...

    # Chat records also need ``chat_template`` (a Jinja string), ``apply_chat_template(messages,
    # tokenize=False, add_generation_prompt=...)`` and ``return_offsets_mapping=True`` in __call__.


class _Encoder(Protocol):
    """One format's encoder (``_ENCODERS``): ``prepare`` picks what a row needs (None: skip it),
    ``encode`` turns a chunk of prepared rows into examples (None: no trainable token)."""

    truncated: int

    def prepare(self, row: Any) -> Any | None: ...

    def encode(self, chunk: list[Any]) -> list[Example | None]: ...


@dataclass(frozen=True)
class Example:
    """One tokenized record: ``labels[i]`` is ``input_ids[i]`` or ``IGNORE_INDEX``."""

    input_ids: list[int]
    labels: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)


def format_alpaca_prompt(instruction: str, input: str = "") -> str:
    """The prompt text put before an Alpaca output (the no-input prompt when ``input`` is blank)."""
    if input.strip():
        return ALPACA_TEMPLATE.format(instruction=instruction, input=input)
    return ALPACA_TEMPLATE_NO_INPUT.format(instruction=instruction)


def encode_prompt(tokenizer: Tokenizer, document: str) -> list[int]:
    """Token ids of ``bos + prompt(document)`` exactly as training sees them (for generation)."""
    prefix, doc, suffix = _encode(tokenizer, [_PROMPT_PREFIX, document, _PROMPT_SUFFIX])
    return _bos(tokenizer) + prefix + doc + suffix


def encode_generation_prompt(tokenizer: Tokenizer, fmt: str, record: Mapping[str, Any]) -> list[int]:
    """Token ids of the prompt training puts before the trained part of a ``fmt`` record, for
    generation: XSum ``bos + prompt(document)``, Alpaca ``bos + prompt(instruction, input)``, chat
    the chat template's rendering of ``messages`` with its generation prompt (tokenized as
    training tokenizes the whole conversation), text ``bos + text``. ``record`` has the training
    record's fields without the answer (``summary``, ``output``, the last assistant turn)."""
    if fmt == XSUM:
        return encode_prompt(tokenizer, record["document"])
    if fmt == ALPACA:
        prompt = format_alpaca_prompt(record["instruction"], record.get("input") or "")
        return _bos(tokenizer) + _encode(tokenizer, [prompt])[0]
    if fmt == CHAT:
        text = _ChatEncoder(tokenizer, 2).render(list(record["messages"]), add_generation_prompt=True)
        return _encode(tokenizer, [text])[0]
    if fmt == TEXT:
        return _bos(tokenizer) + _encode(tokenizer, [record[TEXT]])[0]
    raise ValueError(f"fmt ({fmt!r}) must be one of {list(FORMATS)}")


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
    nothing about summarising) and then cuts the summary's end (and ``eos``). Chat, Alpaca and
    text truncation cuts the end.

    Args:
        records: a ``datasets.Dataset`` or any iterable of dict-like rows.
        tokenizer: a Hugging Face tokenizer with ``eos_token_id`` set (``bos`` is optional); for
            chat records a fast tokenizer with a chat template.
        seq_length: the longest example, in tokens.
        fmt: ``'xsum'``, ``'chat'``, ``'alpaca'`` or ``'text'``; detected from the columns (or
            first row) if None.
        stats: if given, receives ``truncated`` (examples cut to ``seq_length``), ``summary_cut``
            (XSum examples whose summary was cut to keep the document's minimum) and ``unusable``
            (the skipped rows whose fields are missing, None, non-string or empty; the other skipped
            rows had no trainable token within ``seq_length`` or were refused by the chat template).

    Returns:
        ``(examples, num_skipped)``: rows with a missing, None, non-string or empty field (see
        ``record_fields`` and ``chat_messages``), rows the chat template refuses, and rows with no
        trainable token left after truncation are skipped and counted.

    Raises:
        DataError: no example survives, the columns match no format, a chat record's tokenizer
            has no chat template, or the template rewrites earlier turns (see ``_ChatEncoder``).
        ValueError: ``seq_length`` < 2 or the tokenizer has no eos token.
    """
    if seq_length < 2:
        raise ValueError(f"seq_length ({seq_length}) must be >= 2 (one input and one target)")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token; set tokenizer.eos_token")
    rows, fmt = _rows_and_format(records, fmt)
    encoder = _ENCODERS[fmt](tokenizer, seq_length)
    examples, num_skipped, num_unusable = _encode_rows(encoder, rows)
    if stats is not None:
        stats.update(truncated=encoder.truncated, summary_cut=getattr(encoder, "summary_cut", 0),
                     unusable=num_unusable)
    if not examples:
        failure = getattr(encoder, "first_failure", None)
        raise DataError(
            f"no usable {fmt} records: all {num_skipped} were corrupt or had no trainable token "
            f"within seq_length={seq_length}" + (f"; {failure}" if failure else "")
        )
    return examples, num_skipped


def _rows_and_format(records: Iterable[Mapping[str, Any]], fmt: str | None) -> tuple[Iterable[Any], str]:
    """The records as an iterator, and their format: ``fmt``, or detected from the columns (a
    ``datasets.Dataset``'s, else the first row's keys, the row put back in front)."""
    rows = iter(records)
    if fmt is None:
        columns = getattr(records, "column_names", None)
        if columns is None:
            first = next(rows, None)
            columns = [] if first is None else list(first)
            rows = itertools.chain([] if first is None else [first], rows)
        fmt = detect_format(columns)
    if fmt not in FORMATS:
        raise ValueError(f"fmt ({fmt!r}) must be one of {list(FORMATS)}")
    return rows, fmt


def _encode_rows(encoder: _Encoder, rows: Iterable[Any]) -> tuple[list[Example], int, int]:
    """Encode ``rows`` in chunks of ``_CHUNK_SIZE``: ``(examples, num_skipped, num_unusable)``,
    the unusable rows (missing or empty fields) among the skipped ones."""
    examples: list[Example] = []
    num_skipped = num_unusable = 0
    chunk: list[Any] = []

    def flush() -> None:
        nonlocal num_skipped
        for example in encoder.encode(chunk):
            if example is None:
                num_skipped += 1
            else:
                examples.append(example)
        chunk.clear()

    for row in rows:
        item = encoder.prepare(row)
        if item is None:
            num_skipped += 1
            num_unusable += 1
            continue
        chunk.append(item)
        if len(chunk) == _CHUNK_SIZE:
            flush()
    if chunk:
        flush()
    return examples, num_skipped, num_unusable


def min_document_tokens(seq_length: int) -> int:
    """Document tokens an XSum example keeps however long its summary: a quarter of seq_length."""
    return seq_length // 4


class _FieldEncoder:
    """Shared by the formats made of text fields: ``prepare`` picks a row's fields (None: skip
    it), ``encode`` tokenizes a chunk with one batched call per field (the fast tokenizer
    parallelises over the chunk) and builds each example with ``self(*ids)``."""

    fmt: str

    def __init__(self, tokenizer: Tokenizer, seq_length: int) -> None:
        self.tokenizer = tokenizer
        self.bos = _bos(tokenizer)
        self.eos = tokenizer.eos_token_id
        self.seq_length = seq_length
        self.truncated = 0

    def prepare(self, row: Any) -> list[str] | None:
        return record_fields(self.fmt, row)

    def encode(self, chunk: list[list[str]]) -> list[Example | None]:
        encoded = [_encode(self.tokenizer, [item[i] for item in chunk]) for i in range(len(chunk[0]))]
        return [self(*ids) for ids in zip(*encoded)]


class _XsumEncoder(_FieldEncoder):
    fmt = XSUM

    def __init__(self, tokenizer: Tokenizer, seq_length: int) -> None:
        super().__init__(tokenizer, seq_length)
        prefix, self.suffix = _encode(tokenizer, [_PROMPT_PREFIX, _PROMPT_SUFFIX])
        self.head = self.bos + prefix
        self.min_document = min_document_tokens(seq_length)
        self.summary_cut = 0

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


class _AlpacaEncoder(_FieldEncoder):
    """``bos + prompt + output + eos``, only ``output + eos`` trained, cut from the end."""

    fmt = ALPACA

    def prepare(self, row: Any) -> list[str] | None:
        fields = record_fields(ALPACA, row)
        # The prompt is tokenized whole and the output on its own, as generation sees them.
        return None if fields is None else [format_alpaca_prompt(fields[0], fields[1]), fields[2]]

    def __call__(self, prompt: list[int], output: list[int]) -> Example | None:
        prompt = self.bos + prompt
        answer = output + [self.eos]
        input_ids = (prompt + answer)[: self.seq_length]
        labels = ([IGNORE_INDEX] * len(prompt) + answer)[: self.seq_length]
        example = _checked(input_ids, labels)
        self.truncated += example is not None and len(prompt) + len(answer) > self.seq_length
        return example


class _TextEncoder(_FieldEncoder):
    fmt = TEXT

    def __call__(self, text: list[int]) -> Example | None:
        full = self.bos + text + [self.eos]
        input_ids = full[: self.seq_length]
        # bos is never a target (nothing precedes it); mask it so labels count targets.
        labels = [IGNORE_INDEX] * len(self.bos) + input_ids[len(self.bos):]
        example = _checked(input_ids, labels)
        self.truncated += example is not None and len(full) > self.seq_length
        return example


class _ChatEncoder:
    """Chat records: the chat template's text, tokenized once; loss on the assistant spans.

    The span of assistant message ``i`` is found by rendering prefixes: it starts where
    ``render(messages[:i], add_generation_prompt=True)`` ends and ends where
    ``render(messages[:i + 1])`` ends, so it holds the message's content and whatever the
    template closes the turn with (end-of-turn token, separator). A token carries loss when its
    characters overlap a span (the offsets of a fast tokenizer). Each prefix should be a prefix of
    the whole rendering; for a template that renders the last turn differently (Qwen3 adds an
    empty think block), the turn is found in the whole by its content (``_rewritten_span``); a
    template whose turns are found neither way is refused with a DataError rather than trained
    on wrong spans.
    """

    def __init__(self, tokenizer: Tokenizer, seq_length: int) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                "'messages' (chat) records need a tokenizer with a chat template and this one has none; "
                "use the chat/instruct model's tokenizer (tokenizer: <directory>) or put a Jinja template "
                "in chat_template.jinja next to its tokenizer.json"
            )
        self.tokenizer = tokenizer
        self.seq_length = seq_length
        self.truncated = 0
        self.first_failure: str | None = None
        self.seen = 0

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def prepare(self, row: Any) -> tuple[str, list[tuple[int, int]]] | None:
        index, self.seen = self.seen, self.seen + 1
        messages = chat_messages(row)
        if messages is None:
            return None
        try:
            text = self.render(messages)
            spans = []
            for i, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                before = self.render(messages[:i], add_generation_prompt=True)
                through = self.render(messages[: i + 1])
                if through.startswith(before) and text.startswith(through):
                    spans.append((len(before), len(through)))
                    continue
                span = _rewritten_span(text, before, through, message["content"])
                if span is None:
                    raise DataError(
                        f"chat record {index}: the chat template renders the conversation up to message {i} "
                        "differently from the whole conversation (it rewrites earlier turns), and the turn's "
                        "content and end are not found in the whole either, so the assistant tokens cannot be "
                        "found; use a template whose renderings of a conversation's prefixes are prefixes of its "
                        "rendering"
                    )
                spans.append(span)
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - a template's raise_exception and Jinja errors alike
            if self.first_failure is None:
                self.first_failure = f"the chat template failed on record {index}: {error_line(e)}"
            return None
        return text, spans

    def encode(self, chunk: list[tuple[str, list[tuple[int, int]]]]) -> list[Example | None]:
        try:
            encoded = self.tokenizer(
                [text for text, _ in chunk], add_special_tokens=False, return_offsets_mapping=True
            )
        except NotImplementedError:
            raise DataError("'messages' (chat) records need a fast tokenizer (with offsets); "
                            "load the model's tokenizer.json (use_fast)") from None
        out = []
        for (_, spans), ids, offsets in zip(chunk, encoded["input_ids"], encoded["offset_mapping"]):
            labels = [
                token if any(_overlaps(start, end, a, b) for a, b in spans) else IGNORE_INDEX
                for token, (start, end) in zip(ids, offsets)
            ]
            # Cut from the end; a record with no assistant token left is skipped (_checked).
            example = _checked(list(ids[: self.seq_length]), labels[: self.seq_length])
            self.truncated += example is not None and len(ids) > self.seq_length
            out.append(example)
        return out


def _rewritten_span(text: str, before: str, through: str, content: str) -> tuple[int, int] | None:
    """The span of an assistant turn that the template renders one way as the last turn
    (``through``) and another way inside the whole conversation (``text``), as Qwen3's template
    adds an empty ``<think></think>`` block to the last turn only; None if it cannot be found.

    The whole must start with the generation prompt (``before``); after it, the turn's content
    must follow, preceded by at most a tail of what the last-turn rendering puts before it, and
    followed by what the last-turn rendering closes the turn with."""
    body = content.strip()
    if not body or not text.startswith(before) or not through.startswith(before):
        return None
    delta = through[len(before):]
    j = delta.rfind(body)
    k = text.find(body, len(before))
    if j < 0 or k < 0 or not delta[:j].endswith(text[len(before):k]):
        return None
    close = delta[j + len(body):]
    end = k + len(body)
    return (len(before), end + len(close)) if text.startswith(close, end) else None


def _overlaps(start: int, end: int, a: int, b: int) -> bool:
    """Whether the characters [start, end) of a token meet the span [a, b) (an empty token
    range counts where it sits)."""
    if start == end:
        return a <= start < b
    return start < b and end > a


_ENCODERS = {XSUM: _XsumEncoder, CHAT: _ChatEncoder, ALPACA: _AlpacaEncoder, TEXT: _TextEncoder}


def _checked(input_ids: list[int], labels: list[int]) -> Example | None:
    # Position 0 is never predicted, so a trainable label must sit at position >= 1.
    if all(label == IGNORE_INDEX for label in labels[1:]):
        return None
    return Example(input_ids, labels)


def _bos(tokenizer: Tokenizer) -> list[int]:
    return [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]


def _encode(tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]
