"""Try a model MMoC-Pipe trained: ``python3 generate.py --model outputs/run/model --prompt "..."``
(or ``--prompts FILE``), the prompt built as training built it (``data/generation.py``)."""
from __future__ import annotations

import sys

if __name__ == "__main__":
    from data.generation import main

    sys.exit(main())
