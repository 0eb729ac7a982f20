"""MMoC-Pipe entry point: ``torchrun --nproc_per_node N main.py [--flags]`` (or ``bash train.sh``)."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback

# Only the standard library here: a Ctrl-C while torch imports must reach the handler at the bottom.


# --plan's exit status when the run would not fit (0: it fits; 2: bad settings).
PLAN_DOES_NOT_FIT = 1
# How long a rank other than 0 waits before exiting on an error that rank 0 reports too.
REPORT_GRACE_S = 60.0


def _fail(env, message: str) -> int:
    """One line from one rank, a non-zero exit on every rank.

    Rank 0 reports and exits. The others wait first: had one of them exited before rank 0
    printed (rank 0 may still be importing torch), torchrun would kill rank 0 and the line
    would be lost. torchrun stops the waiting ranks as soon as rank 0 has exited; a rank
    whose error rank 0 did not share reports it itself when the wait runs out.
    """
    if env.rank != 0:
        time.sleep(REPORT_GRACE_S)
    prefix = "" if env.rank == 0 else f"[rank {env.rank}] "
    sys.stderr.write(f"error: {prefix}{message}\n")  # one write: see Log.info
    sys.stderr.flush()
    return 2


def _release_save_dir() -> None:
    """Rank 0's lock file in save_dir goes with the run, however it ends (before
    pipeline.plan.save_dir is imported this process holds none, and importing it would import torch)."""
    save_dir = sys.modules.get("pipeline.plan.save_dir")
    if save_dir is not None:
        save_dir.release_save_dir()


_INTERRUPTED = threading.Lock()  # the line once, whichever thread sees the signal first


def _interrupted() -> int:
    """Ctrl-C outside the training loop (which stops at a step boundary and saves instead): one
    line from rank 0, no traceback from any rank. Nothing of this run's start-up is kept."""
    if os.environ.get("RANK", "0") == "0" and _INTERRUPTED.acquire(blocking=False):
        sys.stderr.write("error: interrupted by Ctrl-C (SIGINT) outside the training steps; no checkpoint was "
                         "written by this stop\n")
        sys.stderr.flush()
    _release_save_dir()
    return 130


def _plan(cfg, env, notes: list[str]) -> int:
    """--plan: the report of rank 0 (of torchrun's processes, or of the ones the plan is for),
    exit 0 if the run fits."""
    from pipeline.plan.fit import planned_for
    from pipeline.plan.preflight import check_config, planned_processes
    from pipeline.train import plan_report

    cfg = planned_for(cfg)
    world_size = planned_processes(cfg, env.world_size)
    check_config(cfg, world_size, need_devices=False)
    if env.rank != 0:
        return 0
    _say(notes)
    text, fits = plan_report(cfg, world_size)
    print(text, flush=True)
    return 0 if fits else PLAN_DOES_NOT_FIT  # for scripts: 2 is a bad setting, as elsewhere


def _say(notes: list[str]) -> None:
    """The start-up's warnings: what the run does that its settings do not say, once (rank 0)."""
    if notes:
        sys.stderr.write("".join(f"warning: {note}\n" for note in notes))  # one write: see Log.info
        sys.stderr.flush()


def start_line(cfg, path: str | None, env) -> str:
    """What this run is: the settings that differ from the defaults, one per line, and where the
    processes meet (torchrun --standalone picks the port itself)."""
    from pipeline.config import TrainConfig

    defaults = TrainConfig().to_dict()
    changed = [f"  {k}: {v!r}" if isinstance(v, str) else f"  {k}: {v}"
               for k, v in cfg.to_dict().items() if v != defaults[k]]
    where = f"{os.environ.get('MASTER_ADDR', 'localhost')}:{os.environ['MASTER_PORT']}" \
        if "MASTER_PORT" in os.environ else "no rendezvous (one process)"
    head = (f"run: {env.world_size} process{'es' if env.world_size > 1 else ''}, rendezvous {where}; "
            f"config {path or '(no file)'} + flags, {len(changed)} setting{'s' if len(changed) != 1 else ''} "
            f"differ from the defaults{':' if changed else ''}")
    return "\n".join([head] + changed)


def main(argv: list[str] | None = None) -> int:
    # Long rows allocate and free blocks of a GiB and more, of many sizes: with expandable segments
    # a freed block serves an allocation of another size, so the caching allocator's fragmentation
    # stays small beside the 10% of the GPU the memory plan leaves free. Before torch starts CUDA;
    # a setting of the user's wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    try:
        from data import DataError
        from inputs import InputError
        from pipeline.run import faults, orphans
        from pipeline.config import ConfigError, parse_args
        from pipeline.dist import DistEnv, cleanup, init_distributed, pick_device
        from pipeline.run.metrics import TrainingError
        from pipeline.plan.preflight import check_config, check_files, start_notes
        from pipeline.plan.save_dir import check_save_dir, hold_save_dir
        from pipeline.train import train
    except ModuleNotFoundError as e:  # a package every run needs (torch, transformers, datasets, ...)
        if (e.name or "").split(".")[0] in ("data", "inputs", "models", "offload", "pipeline", "schedule"):
            raise  # this checkout's own code: not a package to install
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"error: MMoC-Pipe needs the {e.name} package, which is not installed: python3 -m pip "
                             "install -r requirements-gpu.txt (every package but torch; or requirements.txt, torch "
                             "too)\n")
        return 2

    env = DistEnv.from_environ()
    notes: list[str] = []  # said once, at start-up (rank 0)
    try:
        cfg, path, mode = parse_args(argv, notes)
        if mode == "plan":
            return _plan(cfg, env, notes)
        check_config(cfg, env.world_size)
        # Files too (model, tokenizer, data, save_dir), on every rank alike, before any process
        # group exists: a direct torchrun launch then fails as train.sh's --check_only does.
        source = check_files(cfg, rank0=env.rank == 0, world_size=env.world_size)
        if mode == "check":
            return 0
        if env.rank == 0:
            # The run's one writer from here until this process ends; under the lock, what
            # save_dir holds is checked again (another run may have finished there meanwhile).
            hold_save_dir(cfg.save_dir, launcher_pid=orphans.launcher_pid())
            check_save_dir(cfg, test_lock=False)
    except (ConfigError, DataError, InputError) as e:
        return _fail(env, str(e))
    if env.rank == 0:
        print(start_line(cfg, path, env), flush=True)
        _say(notes + start_notes(cfg, env.world_size))
    # The rendezvous waits inside C++, where Python's signal handlers cannot run: a rank whose
    # peer left on Ctrl-C would wait there for the whole comm_timeout_s. Ctrl-C (and SIGTERM,
    # the launcher's death included) ends it at once.
    handlers = {sig: signal.signal(sig, signal.SIG_DFL) for sig in (signal.SIGINT, signal.SIGTERM)}
    init_distributed(env, pick_device(cfg.device, env), timeout_s=cfg.comm_timeout_s)
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    faults.leave_at_once_outside_steps(_interrupted)  # the start-up's collectives wait in C++ too
    try:
        train(cfg, env, source)
    except (ConfigError, DataError, TrainingError) as e:
        # The line goes out before any teardown: a process-group shutdown that aborts (gloo, with
        # this rank's channels still referenced by the traceback) must not swallow it.
        return _fail(env, str(e))
    except KeyboardInterrupt:
        # Peers may wait on this rank in a collective: leave at once, as below.
        sys.stdout.flush()
        os._exit(_interrupted())
    except BaseException:  # noqa: BLE001 - e.g. CUDA OOM on one rank
        if faults.stop_seen():  # a peer left on the same Ctrl-C and broke a connection: the stop's error
            os._exit(_interrupted())
        # Peers may be blocked in a send/recv with this rank; a clean NCCL teardown would wait
        # for them forever. Report, then leave at once: torchrun then stops the other ranks.
        print(f"[rank {env.rank}] training failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        _release_save_dir()
        os._exit(1)
    cleanup()
    return 0


if __name__ == "__main__":
    from pipeline.run import orphans  # the standard library only

    worker = "TORCHELASTIC_RUN_ID" in os.environ
    if worker:  # a torchrun worker must not outlive its launcher
        orphans.watch()
    try:
        code = main()
    except KeyboardInterrupt:
        code = _interrupted()
    if worker:
        orphans.report()  # a worker stopped because its launcher died says so
    _release_save_dir()
    # Everything is written, flushed and closed and the process group is destroyed; leave without
    # the interpreter's teardown, where gloo's C++ threads can abort the process at exit
    # ("terminate called without an active exception") and turn a finished run into a failed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
