"""Try a model MMoC-Pipe trained: ``python3 generate.py --model outputs/run/model --prompt "..."``
(or ``--prompts FILE``; a LoRA run: ``--adapter save_dir/adapter``, ``--model`` its base), the
prompt built as training built it (``data/generation.py``)."""
from __future__ import annotations

import sys

if __name__ == "__main__":
    from data.generation import main
    from pipeline.spec.lora import adapter_fits  # the adapter's shapes against the base's family
    from pipeline.plan.source import saved_model_dir  # 'generated' and the presets: main.py's model names
    from pipeline.stage.quantized import quiet_bitsandbytes

    quiet_bitsandbytes()  # before peft and transformers import bitsandbytes

    sys.exit(main(model_dir=saved_model_dir, adapter_check=adapter_fits))
