"""The documentation stays true to the repository: docs/config.md is what docs/gen_config.py makes
of pipeline/config.py, the README stays short, and relative links (and their #anchors) resolve
(the README's generation snippet run as a script: tests/multi_process/test_readme_snippet.py)."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

README_MAX_LINES = 249
LINKED_DOCS = ["README.md", "docs/design.md", "bench/README.md"]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _gen_config():
    """docs/gen_config.py, loaded from its file (docs/ is no package)."""
    spec = importlib.util.spec_from_file_location("gen_config", ROOT / "docs" / "gen_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_md_is_up_to_date():
    expected = _gen_config().render()
    actual = (ROOT / "docs" / "config.md").read_text()
    assert actual == expected, (
        "docs/config.md is out of date with pipeline/config.py; regenerate it with "
        "`python3 docs/gen_config.py > docs/config.md`")


def test_config_md_lists_every_field():
    import dataclasses

    from pipeline.config import TrainConfig

    text = (ROOT / "docs" / "config.md").read_text()
    missing = [f.name for f in dataclasses.fields(TrainConfig) if f"| `{f.name}` |" not in text]
    assert not missing


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def test_readme_test_command_is_ci_command():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "python3 -m pytest -q tests" in ci
    assert "python3 -m pytest -q tests" in readme


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    out, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(_slug(line.lstrip("#")))
    return out


def _links(path: Path) -> list[str]:
    out, fenced = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            out += LINK.findall(line)
    return out


@pytest.mark.parametrize("doc", LINKED_DOCS)
def test_relative_links_exist(doc):
    path = ROOT / doc
    broken = []
    for target in _links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{doc}: broken relative links {broken}"


# The peers' table the README quotes: one call, every system back to back at its best point. The
# README's performance paragraph: the ratios after its last "One GPU:" come from that table.
PEER_TABLES = {"One GPU:": ROOT / "bench/results/2026-12-02_one_gpu_table/peers.json"}
PEER_WORDS = {"RoundPipe's inexact step": "roundpipe-async", "RoundPipe's exact step": "roundpipe-sync",
              "DeepSpeed": "deepspeed", "FSDP2": "fsdp2"}


def test_readme_peer_ratios_come_from_one_bench_run():
    """Every "N.NNx <peer>" in the README is that peer's best step time over this project's best,
    from the results file of one side-by-side call, the one of the sentence it stands in (the
    2026-11-22 FSDP2 rows ran a mis-tuned micro-batch, and peers that clipped through one core
    flattered the ratios: no ratio may come from anything but such a run)."""
    text = " ".join((ROOT / "README.md").read_text().split())
    ratio = r"(\d+\.\d+)x\**( [A-Z][\w']*(?: (?:inexact|exact) step)?)?"
    quoted = re.findall(ratio, text)
    checked = 0
    for lead, table in PEER_TABLES.items():
        rows = {r["system"]: r["step_time_s"] for r in json.loads(table.read_text())["rows"] if r.get("step_time_s")}
        # the peers clip: so does the row they are compared with
        ours = min(t for name, t in rows.items() if name.startswith("mmoc-pipe") and "-noclip" not in name)
        sentence = text[text.rindex(lead):].split(". ")[0]
        for value, word in re.findall(ratio, sentence):
            word = word.strip()
            assert word in PEER_WORDS, f"README quotes {value}x {word!r}: a ratio names one of {list(PEER_WORDS)}"
            assert abs(float(value) - rows[PEER_WORDS[word]] / ours) < 0.006, (lead, value, word, rows[PEER_WORDS[word]] / ours)
            checked += 1
    assert quoted and checked == len(quoted), f"{len(quoted)} ratios in the README, {checked} in its table sentences"


def test_every_family_is_documented():
    """docs/models.md has a row per registered model_type and the README names every family."""
    from models import FAMILIES

    models_md = (ROOT / "docs" / "models.md").read_text()
    readme = (ROOT / "README.md").read_text()
    for spec in FAMILIES:
        for model_type in spec.model_types:
            assert f"| `{model_type}` |" in models_md, model_type
        name = spec.family.split(" (")[0].split(" /")[0]
        assert name in readme, name


@pytest.mark.parametrize("doc", ["README.md", "fine_tune.yaml", "docs/models.md", "docs/config.md"])
def test_every_preset_is_listed(doc):
    """Each place that lists the random-weight presets lists all of them."""
    from pipeline.plan.source import PRESETS

    text = (ROOT / doc).read_text()
    missing = [name for name in PRESETS if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text)]
    assert not missing, f"{doc} does not list the presets {missing}"


def _requirements(name: str) -> list[str]:
    lines = [line.split("#")[0].strip() for line in (ROOT / name).read_text().splitlines()]
    return [line for line in lines if line]


def test_install_files_say_what_they_install():
    """requirements.txt pins torch (from PyPI on Linux: the CUDA build) and takes the rest from
    requirements-gpu.txt, which has no torch (a GPU user's own stays); requirements-cpu.txt takes
    the same torch's CPU build from PyTorch's index. The CPU image and the conda environment
    install the CPU file, and the README names all three for what they are."""
    rest = _requirements("requirements-gpu.txt")
    assert rest and not [r for r in rest if r.startswith(("torch", "-"))], rest
    full = _requirements("requirements.txt")
    assert sorted(full) == ["-r requirements-gpu.txt", "torch==2.13.0"], full
    cpu = _requirements("requirements-cpu.txt")
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in cpu and "-r requirements-gpu.txt" in cpu, cpu
    assert [r.split(";")[0].strip() for r in cpu if r.startswith("torch")] == ["torch==2.13.0+cpu", "torch==2.13.0"]
    docker = (ROOT / "Dockerfile").read_text()
    assert "pip install --no-cache-dir -r requirements-cpu.txt" in docker
    assert "COPY requirements.txt requirements-cpu.txt requirements-gpu.txt ./" in docker
    assert "- -r requirements-cpu.txt" in (ROOT / "environment.yml").read_text()
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "python3 -m pip install -r requirements-cpu.txt" in readme and "pins a CPU torch" not in readme
    assert "`-r requirements-gpu.txt` installs everything but torch and leaves your own" in readme
    assert "`-r requirements.txt` pins torch 2.13.0 too, on Linux PyPI's CUDA build" in readme
    assert "python3 -m pip install -q -r requirements.txt" in (ROOT / ".ci" / "run").read_text()
