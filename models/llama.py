"""Llama (Llama-2, Llama-3.x with GQA and llama3 rope scaling; TinyLlama, OpenLLaMA): the
layout every other family is described against."""
from models.spec import ArchSpec

SPEC = ArchSpec(
    family="Llama", model_types=("llama",), config_class="LlamaConfig", sliding="none",
    examples="Llama-2 7B/13B/70B, Llama-3.1-8B, Llama-3.2-1B/3B (tied), TinyLlama, OpenLLaMA",
    tiny=dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 32}, rope_theta=500000.0),
)
