"""One bench row as a process that ends on its own terms: within its time limit, and before the
host runs out of memory. A GPU call whose host is exhausted loses the machine and everything it
has not sent back, so every row of the bench drivers runs through ``run_guarded``: its process
group is killed when its time is up, or when the host's available memory falls under ``floor`` of
its total (``MemAvailable`` in ``/proc/meminfo``, read every half second), and its log then ends
with the line that says which."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

HOST_FLOOR = 0.10  # share of the host's memory a row leaves available
# a killed row's log ends with one of these (then the limit, and "]")
HOST_STOPPED = "[stopped: host memory under"
TIMED_OUT = "[killed: past its time limit"
STOPPED_STATUS = f"stopped (host memory under {HOST_FLOOR:.0%})"  # a row's status in the drivers' tables


@dataclass
class Outcome:
    rc: int            # -9 for a row this module killed
    log: str
    wall_s: float
    timed_out: bool = False
    host_stopped: bool = False


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (empty where there is none)."""
    out = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def host_short(floor: float) -> bool:
    """Whether less than ``floor`` of the host's memory is available now."""
    m = meminfo()
    return bool(m) and m.get("MemAvailable", m.get("MemFree", 0)) < floor * m["MemTotal"]


def run_guarded(cmd: list[str], env: dict, timeout_s: float, log_path: Path, cwd: Path | None = None,
                header: str = "", floor: float = HOST_FLOOR, poll_s: float = 0.5) -> Outcome:
    """Run ``cmd`` in its own process group, its output after ``header`` into ``log_path``, until it
    ends, its ``timeout_s`` passes or the host's memory runs short."""
    t0 = time.time()
    timed_out = stopped = False
    with open(log_path, "w") as fh:
        fh.write(header)
        fh.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        while proc.poll() is None:
            time.sleep(poll_s)
            timed_out = time.time() - t0 > timeout_s
            stopped = not timed_out and host_short(floor)
            if timed_out or stopped:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                why = f"{TIMED_OUT} of {timeout_s:.0f}s" if timed_out else f"{HOST_STOPPED} {floor:.0%} available"
                fh.write(f"\n{why}]\n")
                break
    killed = timed_out or stopped
    return Outcome(-9 if killed else proc.returncode, Path(log_path).read_text(errors="replace"), time.time() - t0,
                   timed_out, stopped)


__all__ = ["HOST_FLOOR", "HOST_STOPPED", "Outcome", "STOPPED_STATUS", "TIMED_OUT", "host_short", "meminfo", "run_guarded"]
