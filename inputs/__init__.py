"""What a user hands the program: the files it reads as text (a dataset's JSON Lines, JSON or CSV
file, a YAML config, a topology file, a prompts file, an adapter's adapter_config.json), the
values of the command line, and how a setting is declared (``inputs.settings``). One path for
every such file: one that is not UTF-8, or not valid JSON or YAML, is one ``InputError`` line
naming the file, the line (and the byte, for bytes that are not UTF-8) and the fix. The standard
library and PyYAML only: train.sh's launch settings import it before torch."""
from inputs.args import NumberParser, join_negative_values
from inputs.files import (InputError, YamlLoader, check_utf8, first_bad_json, read_json, read_json_lines, read_text,
                          read_yaml, utf8_text)

__all__ = ["InputError", "NumberParser", "YamlLoader", "check_utf8", "first_bad_json", "join_negative_values",
           "read_json", "read_json_lines", "read_text", "read_yaml", "utf8_text"]
