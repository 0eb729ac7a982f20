"""The GPU tests (``pytest -m gpu``) in parts that each fit one device call.

    python3 bench/gpu_tests.py --list                      # the parts and their expected seconds
    python3 bench/gpu_tests.py --part 1 --out $OUT/tests1  # run part 1 of PARTS (default 3)
    python3 bench/gpu_tests.py --part 2 --parts 3 --out $OUT/tests2 -- -x   # extra pytest arguments
    python3 bench/gpu_tests.py --parts 1 --part 1 --skip ran.txt --out $OUT/rest  # what earlier calls left

The tests are split by their expected time (``gpu_test_seconds.json`` beside this file, measured
on nvidia-h200-x2 and, for the one-GPU tests of 2026-12-02, nvidia-h200; a test it does
not list counts as ``--unknown_s``), longest first, each to the
part expected to finish first. A part's log (``pytest.txt``, verbose) gets each test's outcome as
it ends, so one cut by ``--timeout_s`` still says what ran (``summary.txt``) and why a test failed
(``failures.txt``, written as each fails); the durations table
(``--durations=0``) comes only with a finished part, and ``seconds.json`` in ``--out`` holds its
times, to merge into ``gpu_test_seconds.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECONDS = Path(__file__).with_name("gpu_test_seconds.json")
DURATION_RE = re.compile(r"^([\d.]+)s (?:call|setup|teardown)\s+(\S+)$", re.M)
OUTCOME_RE = re.compile(r"^\S+::\S+ (PASSED|FAILED|ERROR|SKIPPED)\b", re.M)  # a verbose run's line per test


def collect() -> list[str]:
    """Node ids of every GPU test, in pytest's order."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "tests"], cwd=ROOT,
                          capture_output=True, text=True)
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    if not ids:
        raise SystemExit(f"error: no GPU test collected (pytest exit {proc.returncode}): {proc.stdout[-500:]}")
    return ids


def split(ids: list[str], seconds: dict[str, float], parts: int, unknown_s: float) -> list[list[str]]:
    """``parts`` lists of node ids whose expected times are as even as greedy makes them (longest
    first, each to the lightest part); each part keeps pytest's order."""
    load = [0.0] * parts
    chosen: list[list[str]] = [[] for _ in range(parts)]
    for node in sorted(ids, key=lambda n: (-seconds.get(n, unknown_s), n)):
        k = min(range(parts), key=load.__getitem__)
        chosen[k].append(node)
        load[k] += seconds.get(node, unknown_s)
    order = {n: i for i, n in enumerate(ids)}
    return [sorted(part, key=order.__getitem__) for part in chosen]


def listed(paths: list[str]) -> set[str]:
    """The node ids that start the lines of ``paths`` (a list, or a verbose log's outcome lines)."""
    return {words[0] for path in paths for line in Path(path).read_text().splitlines()
            if (words := line.split()) and "::" in words[0]}


def measured(log: str) -> dict[str, float]:
    """Seconds per node id from pytest's ``--durations=0`` table (setup, call and teardown summed)."""
    out: dict[str, float] = {}
    for secs, node in DURATION_RE.findall(log):
        out[node] = round(out.get(node, 0.0) + float(secs), 2)
    return out


def pytest_runtest_logreport(report) -> None:
    """As a pytest plugin (``-p gpu_tests``): each failure's report into ``$GPU_TESTS_FAILURES`` as
    its test ends, since pytest prints them only at the end, which a part cut by its limit never reaches."""
    if report.failed and os.environ.get("GPU_TESTS_FAILURES"):
        with open(os.environ["GPU_TESTS_FAILURES"], "a") as fh:
            fh.write(f"{report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", type=int, default=3)
    p.add_argument("--part", type=int, default=0, help="which part to run, 1..parts")
    p.add_argument("--list", action="store_true", help="print the parts and their expected seconds; run nothing")
    p.add_argument("--unknown_s", type=float, default=10.0, help="expected seconds of a test not yet measured")
    p.add_argument("--timeout_s", type=float, default=560.0, help="stop the part after this long")
    p.add_argument("--out", default="gpu_tests")
    p.add_argument("--skip", action="append", default=[],
                   help="a file whose lines start with node ids to leave out (an earlier call's verbose log "
                        "or a list), before the split; repeatable")
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if not args.list and not 1 <= args.part <= args.parts:
        raise SystemExit(f"error: --part ({args.part}) must be 1..--parts ({args.parts}), or use --list")
    seconds = json.loads(SECONDS.read_text()) if SECONDS.exists() else {}
    skipped = listed(args.skip)
    parts = split([n for n in collect() if n not in skipped], seconds, args.parts, args.unknown_s)
    if args.list:
        for k, part in enumerate(parts, 1):
            expected = sum(seconds.get(n, args.unknown_s) for n in part)
            print(f"part {k}: {len(part)} tests, about {expected:.0f} s")
            print("".join(f"  {n}\n" for n in part), end="")
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-rA", "--durations=0", "-p", "no:cacheprovider",
           "-p", "gpu_tests", *extra, *parts[args.part - 1]]
    log = out / "pytest.txt"
    failures = out / "failures.txt"
    failures.unlink(missing_ok=True)
    env = {**os.environ, "GPU_TESTS_FAILURES": str(failures.resolve()),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
    with log.open("w") as fh:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, timeout=args.timeout_s,
                                env=env).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    text = log.read_text(errors="replace")
    (out / "seconds.json").write_text(json.dumps(measured(text), indent=1, sort_keys=True) + "\n")
    outcomes = OUTCOME_RE.findall(text)
    summary = (f"part {args.part} of {args.parts}: pytest exit {rc}{' (timed out)' if rc == 124 else ''}; "
               + ", ".join(f"{outcomes.count(k)} {k.lower()}" for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")))
    failed = [line for line in text.splitlines() if (m := OUTCOME_RE.match(line)) and m[1] in ("FAILED", "ERROR")]
    (out / "summary.txt").write_text(summary + "\n" + "".join(line + "\n" for line in failed))
    print(summary)
    sys.exit(rc)


if __name__ == "__main__":
    main()
