"""Who owns what where a rank's threads and streams meet (docs/design.md, "Who owns what"), and the
debug check of it: every field of a ``StageStore`` and of its residency is written by the thread
that built them (the main thread), other threads write only buffer contents; each stream has one
producing thread (compute and offload the main thread, load the loader thread when the rank has
workers).

``MMOC_DEBUG_THREADS=1`` asserts both at every stream use and every such field write, with an
``AssertionError`` naming both threads.
"""
from __future__ import annotations

import os
import threading

# Debug: check the ownership rules (module docstring) at every stream use and every field write of
# a store or its residency, and raise an AssertionError naming both threads. Read at each check, so
# a test can set it; off, a check costs one flag test (a field write, a Python-level __setattr__:
# a fraction of a microsecond, a few per action).
CHECK_THREADS = os.environ.get("MMOC_DEBUG_THREADS", "0") not in ("", "0")


def assert_owner(owner: threading.Thread, what: str) -> None:
    """``CHECK_THREADS``: the calling thread must be ``owner``."""
    if threading.current_thread() is not owner:
        raise AssertionError(f"{what} belongs to {owner.name!r}, but {threading.current_thread().name!r} used it "
                             "(offload/owners.py)")


def check_field_write(owner: threading.Thread | None, cls: str, name: str) -> None:
    """``CHECK_THREADS``: a write of field ``name`` of an object of class ``cls`` comes from its
    ``owner``, the thread that made it (None while it is being made: the fields it starts with)."""
    if CHECK_THREADS and owner is not None:
        assert_owner(owner, f"{cls}.{name}")


__all__ = ["CHECK_THREADS", "assert_owner", "check_field_write"]
