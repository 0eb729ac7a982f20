"""call4's matrix.json, rebuilt from the driver's table (matrix_stdout.txt): the device call brings
back at most 8 files and this one's matrix.json was not among them. Each row's flags are
plan_matrix.row_flags of its name as the call ran it (two steps; the host figure it was given,
MemAvailable at the call's start, only bounds the plan, it does not change its figures); the
measured peaks are the table's, to 0.01 GiB.

    python3 bench/results/2026-12-02_plan_matrix/call4/rebuild_matrix.py
"""
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[3] / "bench"))
import plan_matrix  # noqa: E402

HOST_GB = 125.34  # call1's MemAvailable (the first try's matrix.json, the same machine minutes before)
ROW = re.compile(r"^\| (\S+) \((\d+)\) \| ok \| (\d+) stages, seq_chunks (\d+), tiled (\w+), resident (\d+) \| "
                 r"([\d.]+) \(([\d.]+)\) \| [^|]+ \| ([\d.]+) \(([\d.]+)\) \| [^|]+ \| ([\d.]+) \| (\w+) \|$")

rows = []
for line in (HERE / "matrix_stdout.txt").read_text().splitlines():
    m = ROW.match(line)
    if not m:
        continue
    name, tokens, stages, chunks, tiled, resident, gpu, gpu_plan, host, host_plan, step, alone = m.groups()
    job, _ = plan_matrix.parse_row(name)
    rows.append(dict(name=name, slug=name.replace("@", "_"), job=job, tokens=int(tokens),
                     flags=plan_matrix.row_flags(job, int(tokens), False, 24.0, HOST_GB, 2),
                     num_stages=int(stages), seq_chunks=int(chunks), tiled_mlp=tiled, resident_stages=int(resident),
                     plan_gib=float(gpu_plan), plan_host_gib=float(host_plan), status="ok", gpu_gib=float(gpu),
                     rss_gib=float(host), host_gib=float(host), step_s=float(step), alone=alone == "yes"))
extra = {"cap_gb": 24.0, "host_available_gib": HOST_GB, "rebuilt_from": "matrix_stdout.txt",
         "versions": {"torch": "2.11.0+cu130", "transformers": "5.17.0", "gpu": "NVIDIA H200", "cores": 16}}
(HERE / "matrix.json").write_text(json.dumps({**extra, "rows": rows}, indent=1) + "\n")
print(f"{len(rows)} rows")
