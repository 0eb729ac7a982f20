"""L0: every ConfigError of the package is made in a validation home (docs/design.md, "Where
settings are checked"): the settings' rules (each field's own beside it, the rules between fields
in one module), the model's rules in one module, the files' and the machine's in the pre-launch
checks; the few refusals that need what only a started run has are named here one by one. Read
from the source (an AST scan), no import."""
from __future__ import annotations

import ast

from tests.helpers.paths import ROOT
from tests.helpers.sources import package_files

HOMES = {
    "pipeline/config.py": "the settings as read: keys, types, choices, and each field's own rule",
    "pipeline/plan/settings_rules.py": "the settings alone (and the number of processes): the rules between fields",
    "pipeline/plan/model_rules.py": "the settings against the model's config, after resolve_model reads it",
    "pipeline/plan/preflight.py": "the files and the machine, before any process group exists",
    "pipeline/plan/save_dir.py": "save_dir, its lock and the checkpoint a resume names, before any process group",
}
# Refusals that need what only a started run has, each in the one function that can know it.
RUN_TIME = {
    ("pipeline/plan/fit.py", "auto_capacity"): "an automatic choice sized against a GPU --plan does not see",
    ("pipeline/plan/fit.py", "check_fits"): "the memory plan of the choices resolve made on rank 0",
    ("pipeline/plan/placement.py", "decide_placement"): "the mapping planner on rank 0's topology",
    ("pipeline/run/checkpoint.py", "find_resume"): "the checkpoint rank 0 finds to resume from",
    ("pipeline/run/checkpoint.py", "check_resume_partition"): "that checkpoint's layers against the partition",
    ("pipeline/run/checkpoint.py", "CheckpointManager.restore"): "that checkpoint's data position",
}


def config_errors(source: str) -> list[tuple[int, str]]:
    """(line, enclosing class/function path) of each ``ConfigError(...)`` made in ``source``."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = (*scope, child.name)
            elif isinstance(child, ast.Call):
                f = child.func
                if (isinstance(f, ast.Name) and f.id == "ConfigError") or \
                        (isinstance(f, ast.Attribute) and f.attr == "ConfigError"):
                    found.append((child.lineno, ".".join(scope) or "<module>"))
            visit(child, inner)

    visit(ast.parse(source), ())
    return found


def misplaced(path: str, source: str) -> list[str]:
    """``path:line (scope)`` of each ConfigError ``source`` (the file at ``path``, relative to the
    repository) makes outside ``HOMES`` and ``RUN_TIME``."""
    if path in HOMES:
        return []
    return [f"{path}:{line} ({scope})" for line, scope in config_errors(source) if (path, scope) not in RUN_TIME]


def test_every_config_error_is_made_in_a_validation_home():
    found = [m for p in package_files() for m in misplaced(p.relative_to(ROOT).as_posix(), p.read_text())]
    assert not found, f"ConfigError made outside the validation homes ({', '.join(HOMES)}): {found}"


def test_each_run_time_refusal_is_still_there():
    """The list above names sites that exist: a refusal moved to a home leaves the list too."""
    made = {(path, scope) for path, _ in RUN_TIME
            for _, scope in config_errors((ROOT / path).read_text())}
    assert set(RUN_TIME) <= made, sorted(set(RUN_TIME) - made)
    homes = {path: len(config_errors((ROOT / path).read_text())) for path in HOMES}
    assert all(homes.values()), homes


def test_a_planted_raise_elsewhere_fails():
    planted = ('from pipeline.config import ConfigError\n\n'
               'def build_stream(cfg):\n'
               '    if cfg.batch_size > 8:\n'
               '        raise ConfigError(f"batch_size ({cfg.batch_size}) too large")\n')
    assert misplaced("pipeline/run/build.py", planted) == ["pipeline/run/build.py:5 (build_stream)"]
    # through the module, in a method, at module level: each is found
    attr = "import pipeline.config as c\n\nclass A:\n    def f(self):\n        raise c.ConfigError('x')\n"
    assert misplaced("pipeline/stage/model.py", attr) == ["pipeline/stage/model.py:5 (A.f)"]
    assert misplaced("schedule/ir.py", "ConfigError('x')\n") == ["schedule/ir.py:1 (<module>)"]
    # a run-time module outside its named function is not a home
    assert misplaced("pipeline/plan/fit.py", planted) == ["pipeline/plan/fit.py:5 (build_stream)"]
    # the same source in a home, or in a named run-time function, passes
    assert misplaced("pipeline/config.py", planted) == []
    assert misplaced("pipeline/plan/fit.py", planted.replace("build_stream", "check_fits")) == []
    # re-raising a refusal made in a home (rank 0's, after a broadcast) makes none
    assert misplaced("pipeline/run/build.py", "def f(e):\n    raise e\n") == []
