"""Who owns what where a rank's threads and streams meet (docs/design.md, "Who owns what"), and the
debug check of it: every ``StageStore`` field is written by the thread that built the store (the
main thread), other threads write only buffer contents; each stream has one producing thread
(compute and offload the main thread, load the loader thread when the rank has workers).

``MMOC_DEBUG_THREADS=1`` asserts both at every stream use and every store field write, with an
``AssertionError`` naming both threads.
"""
from __future__ import annotations

import os
import threading

# Debug: check the ownership rules (module docstring) at every stream use and every StageStore
# field write, and raise an AssertionError naming both threads. Read at each check, so a test can
# set it; off, a check costs one flag test (a StageStore field write, a Python-level __setattr__:
# a fraction of a microsecond, a few per action).
CHECK_THREADS = os.environ.get("MMOC_DEBUG_THREADS", "0") not in ("", "0")


def assert_owner(owner: threading.Thread, what: str) -> None:
    """``CHECK_THREADS``: the calling thread must be ``owner``."""
    if threading.current_thread() is not owner:
        raise AssertionError(f"{what} belongs to {owner.name!r}, but {threading.current_thread().name!r} used it "
                             "(offload/owners.py)")


__all__ = ["CHECK_THREADS", "assert_owner"]
