"""MMoC-Pipe entry point: ``torchrun --nproc_per_node N main.py [--flags]`` (or ``bash train.sh``)."""
from __future__ import annotations

import os
import sys
import traceback

from pipeline.config import ConfigError, parse_args
from pipeline.dist import DistEnv, cleanup, init_distributed, pick_device


def _fail(env: DistEnv, message: str) -> int:
    if env.rank == 0:  # one line from one rank; every rank exits non-zero
        print(f"error: {message}", file=sys.stderr, flush=True)
    return 2


def main(argv: list[str] | None = None) -> int:
    from data import DataError
    from pipeline.train import check_config, train

    env = DistEnv.from_environ()
    try:
        cfg, path, check_only = parse_args(argv)
        check_config(cfg, env.world_size)
    except (ConfigError, DataError) as e:
        return _fail(env, str(e))
    if check_only:
        return 0
    if env.rank == 0:
        print(f"config ({path or 'defaults'} + flags): " + " ".join(f"{k}={v}" for k, v in cfg.to_dict().items()),
              flush=True)
    init_distributed(env, pick_device(cfg.device, env), timeout_s=600)
    try:
        train(cfg, env)
    except (ConfigError, DataError) as e:
        cleanup()
        return _fail(env, str(e))
    except BaseException:  # noqa: BLE001 - e.g. CUDA OOM on one rank
        # Peers may be blocked in a send/recv with this rank; a clean NCCL teardown would wait
        # for them forever. Report, then leave at once: torchrun then stops the other ranks.
        print(f"[rank {env.rank}] training failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        os._exit(1)
    cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
