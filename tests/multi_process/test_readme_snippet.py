"""The README's "Using the result" snippet as a user runs it: a script of its own in another
directory, in a subprocess (the rest of the documentation's checks: tests/pure/test_docs.py)."""
from __future__ import annotations

import re
import sys

import pytest

from tests.helpers.paths import ROOT


@pytest.mark.slow
def test_readme_generation_snippet_runs_outside_the_repository(tiny_model_dir, tmp_path):
    """The README's "Using the result" snippet, saved as a script elsewhere, with its two paths
    pointed at this repository and a model, runs and prints the continuation."""
    import subprocess

    from tests.helpers.paths import env_without_dist

    text = (ROOT / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", text[text.index("**Using the result.**"):], re.S).group(1)
    assert '"/path/to/mmoc-pipe"' in snippet and '"/path/to/mmoc-pipe/outputs/run/model"' in snippet
    script = tmp_path / "generate.py"
    script.write_text(snippet.replace('"/path/to/mmoc-pipe/outputs/run/model"', repr(str(tiny_model_dir)))
                      .replace('"/path/to/mmoc-pipe"', repr(str(ROOT)))
                      .replace("max_new_tokens=60", "max_new_tokens=5"))
    env = {k: v for k, v in env_without_dist().items() if k != "PYTHONPATH"}  # nothing but the snippet's own path
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), proc.stderr[-2000:]
