"""L0: the package's layers run one way. Every module of the package (``schedule``, ``models``,
``data``, ``offload``, ``pipeline``, ``inputs``, ``main.py``, ``generate.py``) imports only from its own layer
and the layers before it in ``LAYERS``, the imports inside functions and under ``TYPE_CHECKING``
included; docs/design.md's layer table states the same order. The checker is fed planted
violations too, so a test that reports nothing is known to be able to report something."""
from __future__ import annotations

import ast
import re

from tests.helpers.paths import ROOT
from tests.helpers.sources import package_sources

# The layers, first to last. A name covers its module and every module under it; a module's layer
# is the one of the longest name that covers it. docs/design.md ("Layers") gives the reasons.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("inputs",),
    ("schedule",),
    ("models",),
    ("data",),
    ("offload",),
    ("pipeline.config", "pipeline.dist"),
    ("pipeline.spec",),
    ("pipeline.stage",),
    ("pipeline.runners",),
    # the plan: the memory plan (after the runners), the model source and the model's rules
    # (model_rules, after the stage: an unregistered family must pass its self-check)
    ("pipeline.plan",),
    ("pipeline.run",),
    ("pipeline.train", "pipeline.launch", "main", "generate"),
)


def is_package(name: str, sources: dict[str, str]) -> bool:
    return any(m.startswith(name + ".") for m in sources)


def imports(module: str, source: str, sources: dict[str, str]) -> list[tuple[str, int]]:
    """(imported module, line) of every import in ``source``, at any depth: ``from a import b``
    imports ``a.b`` where that is a module of the package, else ``a``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package up
                package = module.split(".") if is_package(module, sources) else module.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in sources else base, node.lineno))
    return found


def layer_of(module: str) -> int | None:
    """Index in ``LAYERS`` of the longest name that covers ``module``; None outside the package's layers."""
    best, best_len = None, -1
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best_len:
                best, best_len = i, len(name)
    return best


def violations(sources: dict[str, str]) -> list[str]:
    """Every import of a later layer's module, one line each (module, line, target, both layers)."""
    out = []
    for module, source in sorted(sources.items()):
        own = layer_of(module)
        for target, line in imports(module, source, sources):
            theirs = layer_of(target)
            if own is not None and theirs is not None and theirs > own:
                out.append(f"{module}:{line} imports {target} (layer {theirs + 1}, {', '.join(LAYERS[theirs])}) "
                           f"from layer {own + 1} ({', '.join(LAYERS[own])})")
    return out


def test_every_module_has_a_layer():
    sources = package_sources()
    assert {"schedule.ir", "pipeline.run.executor", "main"} <= set(sources)
    # a package's __init__ holding no import needs no place
    unplaced = [m for m, src in sources.items() if layer_of(m) is None and imports(m, src, sources)]
    assert not unplaced, f"modules in no layer of LAYERS: {unplaced}"


def test_imports_follow_the_layers():
    found = violations(package_sources())
    assert not found, "imports against the layers (tests/pure/test_layers.py, docs/design.md):\n" + "\n".join(found)


def test_a_planted_upward_import_is_reported():
    """The checker on sources made up for it: an import of a later layer is reported wherever it
    is written (top level, inside a function, ``from`` a package of a module, relative); the
    same imports from a later layer, or within one, are not."""
    planted = {
        "pipeline.spec.shapes": "import torch\nfrom schedule.ir import Op\n",
        "pipeline.spec.footprint": "def walk():\n    from pipeline.runners import runner_for\n",
        "models.spec": "from pipeline.stage import model\n",
        "offload.store": "if True:\n    import pipeline.run.executor\n",
        "pipeline.stage.weights": "from ..plan import memory\n",
        "pipeline.stage.model": "",
        "pipeline.plan.memory": "from pipeline.runners import runner_for\nfrom pipeline.spec.footprint import Ledger\n",
        "pipeline.runners": "from pipeline.spec.footprint import Ledger\nfrom . import base\n",
        "pipeline.runners.base": "",
        "pipeline.run.executor": "",
    }
    found = violations(planted)
    assert [line.split(" imports ")[0] for line in found] == [
        "models.spec:1", "offload.store:2", "pipeline.spec.footprint:2", "pipeline.stage.weights:1"], found
    assert "imports pipeline.stage.model (layer 8" in found[0] and "from layer 3 (models)" in found[0], found
    assert "imports pipeline.plan.memory (layer 10" in found[3], found


def test_design_md_states_the_layers():
    """docs/design.md's table under "### Layers" lists ``LAYERS``, row by row, in order."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("\n### Layers\n", 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\|\s*\d+\s*\|", line)]
    stated = tuple(tuple(re.findall(r"`([\w.]+)`", row.split("|")[2])) for row in rows)
    assert stated == LAYERS, f"docs/design.md's layers {stated} differ from tests/pure/test_layers.py's {LAYERS}"


def unit(module: str, sources: dict[str, str]) -> str | None:
    """The folder of ``pipeline`` a module belongs to (``pipeline.plan`` for ``pipeline.plan.fit``),
    or the module itself where it sits in ``pipeline`` directly (``pipeline.config``); None outside."""
    parts = module.split(".")
    if parts[0] != "pipeline" or len(parts) < 2:
        return None
    folder = ".".join(parts[:2])
    return folder if is_package(folder, sources) else module


def folder_cycle(sources: dict[str, str]) -> list[str]:
    """One cycle of any length in the graph of ``pipeline``'s folders (an edge where a module of
    one imports a module of another), as the folders in order, the first again at the end; [] when
    the graph has none."""
    edges: dict[str, set[str]] = {}
    for module, source in sources.items():
        here = unit(module, sources)
        for target, _ in imports(module, source, sources):
            there = unit(target, sources)
            if here and there and there != here:
                edges.setdefault(here, set()).add(there)
    state: dict[str, str] = {}  # "open" while on the path, "done" after

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":  # on the path (no folder imports itself here)
                return path[path.index(nxt):] + [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [node])):
                return found
        state[node] = "done"
        return []

    for node in sorted(edges):
        if node not in state and (found := visit(node, [])):
            return found
    return []


def test_pipelines_folders_import_one_way():
    """Each folder of ``pipeline`` is declared once in ``LAYERS`` (none split across two layers),
    and no chain of imports between the folders comes back to where it started."""
    sources = package_sources()
    names = [name for layer in LAYERS for name in layer if name.startswith("pipeline.")]
    assert [name for name in names if unit(name, sources) != name] == [], "a layer names part of a folder"
    assert len(set(names)) == len(names), names
    assert folder_cycle(sources) == [], folder_cycle(sources)


def test_a_planted_cycle_of_three_folders_is_reported():
    planted = {
        "pipeline.stage.model": "from pipeline.runners.base import Mode\n",
        "pipeline.runners.base": "def account():\n    from pipeline.plan.fit import assess\n",
        "pipeline.plan.fit": "from pipeline.stage import model\nfrom pipeline.config import TrainConfig\n",
        "pipeline.config": "",
        "pipeline.spec.shapes": "from pipeline.config import TrainConfig\n",
    }
    cycle = folder_cycle(planted)
    assert len(cycle) == 4 and cycle[0] == cycle[-1], cycle
    assert set(cycle) == {"pipeline.stage", "pipeline.runners", "pipeline.plan"}, cycle
    del planted["pipeline.runners.base"]
    assert folder_cycle(planted) == []
