"""L0: the one path a user's text file is read by (``inputs``): bytes that are not UTF-8 are one
line naming the file, the line, the byte and the fix, also when a dataset file is checked a block
at a time and the bad byte or a character cut by a block's end falls anywhere; JSON, JSON Lines
and YAML errors name the line; a YAML key given twice is refused with both lines; a negative
number after a flag is that flag's value."""
from __future__ import annotations

import argparse

import pytest

import inputs.files as files
from inputs import (InputError, NumberParser, check_utf8, join_negative_values, read_json, read_json_lines, read_text,
                    read_yaml)

LINES = ['{"document": "caf\u00e9 au lait", "summary": "na\u00efve"}\n'] * 4


def _latin_at(tmp_path, line: int):
    """A UTF-8 JSON Lines file with one Latin-1 byte (0xe9, é) in line ``line``; the byte's offset."""
    data = b"".join(t.encode() for t in LINES[:line - 1]) + b'{"document": "caf\xe9", "summary": "s"}\n' + \
        b"".join(t.encode() for t in LINES[line - 1:])
    path = tmp_path / "data.jsonl"
    path.write_bytes(data)
    return path, data.index(b"caf\xe9") + 3


def test_not_utf8_names_the_line_the_byte_and_the_fix(tmp_path):
    path, offset = _latin_at(tmp_path, 3)
    with pytest.raises(InputError) as err:
        read_text(path, "data file")
    msg = str(err.value)
    assert msg.startswith(f"data file '{path}' is not UTF-8 text: line 3 (byte {offset} of the file) holds 0xe9"), msg
    assert f"iconv -f cp1252 -t utf-8 {path} > {tmp_path / 'data.utf8.jsonl'}" in msg and "\n" not in msg
    with pytest.raises(InputError, match=rf"line 3 \(byte {offset} of the file\)"):
        check_utf8(path, "data file")


@pytest.mark.parametrize("block", [1, 2, 3, 5, 7, 64])
def test_the_block_check_finds_the_byte_wherever_the_blocks_end(tmp_path, monkeypatch, block):
    """Blocks that end inside a two-byte character (é, ï) neither hide the bad byte nor report a
    good character as bad."""
    monkeypatch.setattr(files, "_BLOCK", block)
    good = tmp_path / "good.jsonl"
    good.write_text("".join(LINES))
    check_utf8(good, "data file")
    path, offset = _latin_at(tmp_path, 4)
    with pytest.raises(InputError, match=rf"line 4 \(byte {offset} of the file\) holds 0xe9"):
        check_utf8(path, "data file")
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes("".join(LINES).encode()[:-len('f")\n')] + b"\xc3")  # a file that ends inside a character
    with pytest.raises(InputError, match="holds 0xc3"):
        check_utf8(cut, "data file")


def test_a_byte_order_mark_is_text(tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"r": 8}')
    assert read_json(path, "adapter config") == {"r": 8}


def test_json_and_json_lines_name_the_line(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{\n  "r": 8,\n  "lora_alpha" 16\n}\n')
    with pytest.raises(InputError, match=rf"^adapter config '{path}' is not valid JSON at line 3, column 16: "):
        read_json(path, "adapter config")
    lines = tmp_path / "p.jsonl"
    lines.write_text('{"text": "a"}\n\n{"text": "b"}\n["not", "an object"]\n')
    with pytest.raises(InputError, match=r"line 4 is a JSON list, not an object"):
        read_json_lines(lines, "prompts file")
    lines.write_text('{"text": "a"}\n\n{"text": "b"}\n')
    assert read_json_lines(lines, "prompts file") == [(1, {"text": "a"}), (3, {"text": "b"})]
    with pytest.raises(InputError, match=r"^cannot read prompts file '.*nope.jsonl': No such file"):
        read_json_lines(tmp_path / "nope.jsonl", "prompts file")


@pytest.mark.parametrize("text, where", [
    ("lr: 1e-4\nbatch_size: 8\nlr: 3e-4\n", "at lines 1 and 3"),
    ("optimizer:\n  lr: 1e-4\n  warmup_iterations: 2\n  lr: 3e-4\n", "at lines 2 and 4"),
    ("gpus: [{index: 0, root: 0, index: 1}]\n", "on line 1"),
])
def test_a_yaml_key_given_twice_is_refused_with_both_lines(tmp_path, text, where):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(InputError) as err:
        read_yaml(path, "config file")
    key = "index" if "index" in text else "lr"
    assert str(err.value) == (f"config file '{path}' gives the key {key!r} twice, {where} (YAML would keep the last "
                              "value without a word); keep one of them")


def test_yaml_merge_keys_and_numbers(tmp_path):
    """A merged mapping's keys may be overridden (what '<<' is for); 3e-4 is a number."""
    path = tmp_path / "c.yaml"
    path.write_text("base: &b {lr: 1e-4, seed: 1}\nrun:\n  <<: *b\n  lr: 3e-4\n")
    assert read_yaml(path, "config file") == {"base": {"lr": 1e-4, "seed": 1}, "run": {"lr": 3e-4, "seed": 1}}
    path.write_text("lr: [1, 2\n")
    with pytest.raises(InputError, match=rf"^config file '{path}' is not valid YAML at line 2, column 1: "):
        read_yaml(path, "config file")


def test_a_negative_number_after_a_flag_is_its_value():
    takes = {"--lr", "--seed", "--name"}.__contains__
    assert join_negative_values(["--lr", "-1e-4", "--seed", "-3", "--name", "-x", "--", "--lr", "-1"], takes) == \
        ["--lr=-1e-4", "--seed=-3", "--name", "-x", "--", "--lr", "-1"]
    assert join_negative_values(["--flag", "-2.5E3", "--lr", "-.5", "--lr", "-inf"], takes) == \
        ["--flag", "-2.5E3", "--lr=-.5", "--lr=-inf"]
    p = NumberParser()
    p.add_argument("--lr", type=float)
    p.add_argument("--on", action="store_true")
    assert p.parse_args(["--lr", "-1e-4", "--on"]) == argparse.Namespace(lr=-1e-4, on=True)
    plain = argparse.ArgumentParser()
    plain.add_argument("--lr", type=float)
    with pytest.raises(SystemExit):  # what NumberParser is for: argparse takes -1e-4 for a flag
        plain.parse_args(["--lr", "-1e-4"])
