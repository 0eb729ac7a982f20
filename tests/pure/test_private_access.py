"""L0: an object's ``_`` fields and methods are its own. No package code writes another object's
``_`` attribute (``x._f = ...``, ``x._f += ...``, ``x._f[k] = ...``, ``del x._f``,
``setattr(x, "_f", ...)``), calls another object's ``_`` method (``x._m(...)``, a module's
``module._f(...)`` too), reads one (``x._f``, ``getattr(x, "_f")``, a bound ``x._m`` handed on) or
imports another module's ``_`` name; ``self``, ``cls`` and ``super()`` are the object's own. What
the outside libraries offer only under a ``_`` name is listed in ``OUTSIDE``, each with its reason
and the one file allowed to use it. The checker is fed planted violations too, so a test that
reports nothing is known to be able to report something."""
from __future__ import annotations

import ast

from tests.helpers.paths import ROOT
from tests.helpers.sources import package_files

# (file, or "*" for any; the expression) -> why the package uses an outside library's ``_`` name
OUTSIDE: dict[tuple[str, str], str] = {
    ("*", "os._exit"): "the standard library's documented way to leave without the interpreter's teardown",
    ("offload/adamw.py", "torch._fused_adamw_"):
        "the kernel behind torch.optim.AdamW(fused=True), run on slices of the flat state so that a load can "
        "stream behind the step (the optimizer's step() takes whole tensors); the bits equal the optimizer's "
        "(tests/one_process/test_store.py)",
    ("models/spec.py", "config._attn_implementation"):
        "transformers' config has no public accessor for the attention kernel: its own code uses this "
        "attribute; models.spec.attn_implementation and set_attn_implementation are the one place that does",
    ("models/spec.py", "causal_lm_class(config)._supports_sdpa"):
        "transformers says whether a model class has an sdpa attention only by this class attribute",
    ("models/spec.py", "meta._is_hf_initialized"):
        "transformers' init functions skip a tensor with this flag (it marks a loaded one): the one way to keep "
        "a model's init_weights, which runs inside its constructor, off a skeleton's meta parameters",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own(node: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: the object's own attributes."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _written(target: ast.expr) -> list[ast.Attribute]:
    """The attributes an assignment to ``target`` writes, or writes into (``x._f[k] = ...``)."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return [a for t in target.elts for a in _written(t)]
    if isinstance(target, ast.Starred):
        return _written(target.value)
    while isinstance(target, ast.Subscript):
        target = target.value
    return [target] if isinstance(target, ast.Attribute) else []


# builtins that name the attribute they use: -> what they do with it
BY_NAME = {"setattr": "writes", "delattr": "writes", "object.__setattr__": "writes", "object.__delattr__": "writes",
           "getattr": "reads", "hasattr": "reads"}


def _named(call: ast.Call) -> tuple[str, ast.expr, str] | None:
    """(what, object, attribute) of ``setattr(x, "_f", ...)`` and its kin, else None."""
    what = BY_NAME.get(ast.unparse(call.func)) if isinstance(call.func, (ast.Name, ast.Attribute)) else None
    if what is None or len(call.args) < 2:
        return None
    name = call.args[1]
    if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
        return None
    return what, call.args[0], name.value


def _uses(tree: ast.AST, module: str) -> list[tuple[int, str, str]]:
    """(line, what, expression) of every use of another object's ``_`` attribute in ``tree``:
    ``writes`` (assigned, augmented, assigned into, deleted), ``calls``, ``reads``, ``imports``."""
    writes, calls, found = set(), set(), []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        writes |= {id(a) for t in targets for a in _written(t)}
        if isinstance(node, ast.Call):
            calls.add(id(node.func))
            named = _named(node)
            if named is not None and _private(named[2]) and not _own(named[1]):
                found.append((node.lineno, named[0], f"{ast.unparse(named[1])}.{named[2]}"))
        if isinstance(node, ast.ImportFrom) and node.module and node.module != module:
            found += [(node.lineno, "imports", f"{node.module}.{a.name}") for a in node.names if _private(a.name)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _own(node.value):
            what = "writes" if id(node) in writes else "calls" if id(node) in calls else "reads"
            found.append((node.lineno, what, ast.unparse(node)))
    return sorted(found)


def private_uses(path: str, source: str, module: str = "") -> list[str]:
    """Each use of another object's ``_`` attribute in ``source`` that ``OUTSIDE`` does not allow,
    one line each: ``path:line: writes|calls|reads|imports expression``."""
    return [f"{path}:{line}: {what} {expr}" for line, what, expr in _uses(ast.parse(source), module)
            if (path, expr) not in OUTSIDE and ("*", expr) not in OUTSIDE]


def test_no_object_touches_another_objects_private_fields():
    found = []
    for path in package_files():
        rel = str(path.relative_to(ROOT))
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        found += private_uses(rel, path.read_text(), module)
    assert not found, ("another object's _ attribute written, called, read or imported (make it public on its owner, "
                       "or let the owner do it; an outside library's, with its reason, in OUTSIDE):\n"
                       + "\n".join(found))


def test_every_outside_exception_is_still_needed():
    """An entry of ``OUTSIDE`` that no file uses any more goes."""
    used = set()
    for path in package_files():
        rel = str(path.relative_to(ROOT))
        for _, _, expr in _uses(ast.parse(path.read_text()), ""):
            used |= {(rel, expr), ("*", expr)}
    assert set(OUTSIDE) <= used, set(OUTSIDE) - used


PLANTED = '''
import os
from offload.store import _WEIGHT_VIEW, StageStore
from offload import owners


class Residency:
    def __init__(self, store):
        self._mine = 0
        self.store = store

    def load(self, store):
        store._load_future = None
        store._progress, self._mine = None, 1
        store._work_reads += [1]
        store._gathered["k"] = 2
        self.store._owner = None
        del store._gathered
        setattr(store, "_grads_event", None)
        object.__setattr__(store, "_norm_future", None)
        store._bind(None, None)
        owners._private_helper()
        super()._also_mine()
        self._mine += 1
        store.public = store._read_too
        executor.submit(store._squared_norm, getattr(store, "_grads_event"))
        setattr(self, "_mine", 2)
        os._exit(0)
'''


def test_planted_private_uses_are_reported():
    """The checker on a source made up for it: every kind of use is reported, the object's own
    and an allowed outside name are not."""
    found = private_uses("offload/planted.py", PLANTED, "offload.planted")
    assert [line.split(": ", 1)[1] for line in found] == [
        "imports offload.store._WEIGHT_VIEW",
        "writes store._load_future",
        "writes store._progress",
        "writes store._work_reads",
        "writes store._gathered",
        "writes self.store._owner",
        "writes store._gathered",
        "writes store._grads_event",
        "writes store._norm_future",
        "calls store._bind",
        "calls owners._private_helper",
        "reads store._read_too",
        "reads store._grads_event",
        "reads store._squared_norm",
    ], found
    assert found[1].startswith("offload/planted.py:13: "), found
