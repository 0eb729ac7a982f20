"""A tokenizer whose ids are the characters' code points, for the data tests that write every
expected id by hand (tests/one_process/test_data.py, test_chat_data.py,
tests/multi_process/test_prelaunch.py)."""
from __future__ import annotations

BOS, EOS, PAD = 1, 2, 0  # below every printable character's code point: no text token collides


class CharTokenizer:
    """One token per character (its code point)."""

    bos_token_id = BOS
    eos_token_id = EOS
    pad_token_id = PAD

    def __call__(self, texts: list[str], add_special_tokens: bool = True) -> dict:
        assert add_special_tokens is False  # tokenize_records adds bos/eos itself
        return {"input_ids": [[ord(c) for c in t] for t in texts]}


def chars(text: str) -> list[int]:
    """The ids CharTokenizer gives ``text``."""
    return [ord(c) for c in text]
