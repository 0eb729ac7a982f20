"""A torchrun worker that trains several configurations in one process group, one after
another, as ``main.py`` trains one (``pipeline.train.train``: resolve, build, train, save): the
LoRA family test starts one torchrun for all families instead of one each (each start costs
seconds of CI's two cores). ``python -m torch.distributed.run ... tests/helpers/lora_runs.py
RUNS.json``, RUNS.json a list of configuration mappings."""
from __future__ import annotations

import json
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import torch

    from pipeline.config import make_config
    from pipeline.dist import DistEnv, cleanup, init_distributed
    from pipeline.train import train

    env = DistEnv.from_environ()
    init_distributed(env, torch.device("cpu"), timeout_s=120)
    for values in json.loads(Path(sys.argv[1]).read_text()):
        train(make_config(values), env)
    cleanup()
