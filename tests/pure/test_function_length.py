"""No function of the package code is longer than a screen (``MAX_LINES``): a longer one is
several steps that a reader has to tell apart, each with the state it reads hidden in the
shared locals. Methods and nested functions count on their own; tests/ and bench/ are not
package code."""
from __future__ import annotations

import ast

from tests.helpers.paths import ROOT
from tests.helpers.sources import package_files

MAX_LINES = 80


def long_functions(source: str, filename: str, max_lines: int = MAX_LINES) -> list[str]:
    """``file:line Qualified.name (N lines)`` for each function of ``source`` longer than
    ``max_lines``, from its ``def`` line to its last line (decorators left out)."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    num_lines = child.end_lineno - child.lineno + 1
                    if num_lines > max_lines:
                        found.append(f"{filename}:{child.lineno} {name} ({num_lines} lines)")
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source, filename), "")
    return found


def test_no_package_function_is_longer_than_a_screen():
    files = package_files()
    assert ROOT / "schedule" / "costmodel.py" in files and ROOT / "main.py" in files, "the scan missed the package"
    found = [line for path in files for line in long_functions(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, (f"functions longer than {MAX_LINES} lines ({len(found)}); split each into named steps "
                       f"(or a small class whose methods share the state):\n  " + "\n  ".join(found))


def _function(name: str, num_lines: int, indent: str = "") -> str:
    """Source of a function ``num_lines`` long: its ``def`` line, then one statement a line."""
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(num_lines - 1))
    return f"{indent}def {name}():\n{body}"


def test_the_check_finds_a_planted_long_function():
    source = (_function("short", 3) + "\n\n" + _function("at_the_limit", MAX_LINES) + "\n\nclass Runner:\n"
              + _function("planted", MAX_LINES + 1, indent="    ")
              + "\n\ndef outer():\n" + _function("nested", MAX_LINES + 5, indent="    ") + "    return nested\n")
    found = long_functions(source, "planted.py")
    runner_line = source.splitlines().index("class Runner:") + 2
    outer_line = source.splitlines().index("def outer():") + 1
    assert found == [f"planted.py:{runner_line} Runner.planted ({MAX_LINES + 1} lines)",
                     f"planted.py:{outer_line} outer ({MAX_LINES + 7} lines)",
                     f"planted.py:{outer_line + 1} outer.nested ({MAX_LINES + 5} lines)"]
