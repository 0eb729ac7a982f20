"""Qwen2 / Qwen2.5: q/k/v biases, sliding windows on the layers ``layer_types`` marks."""
from models.spec import ArchSpec

SPEC = ArchSpec(
    family="Qwen2 / Qwen2.5", model_types=("qwen2",), config_class="Qwen2Config",
    examples="Qwen2.5-0.5B to 72B (the small sizes tie their head)",
    tiny=dict(use_sliding_window=True, sliding_window=32, max_window_layers=2),
)
