"""Mistral: Llama's layout, ``sliding_window`` on every layer (Mistral-7B-v0.1)."""
from models.spec import ArchSpec

SPEC = ArchSpec(
    family="Mistral", model_types=("mistral",), config_class="MistralConfig", sliding="all",
    examples="Mistral-7B v0.1 (4096-token window) to v0.3 (no window)",
    tiny=dict(sliding_window=32, rope_theta=10000.0),
)
