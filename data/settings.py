"""The data section of the settings (``pipeline.config.TrainConfig`` composes it): the records
trained on and validated with, and how they become batches and micro-batches. Each field is a
YAML key and a flag of the same name, documented beside its default."""
from __future__ import annotations

from dataclasses import dataclass

from inputs.settings import AT_LEAST_ONE, Check, at_least, setting


@dataclass
class DataSection:
    """What is trained on, in rows of how many tokens, batches and micro-batches; what validates it."""

    dataset: str = setting("sample", "'sample' (bundled XSum-style data), 'synthetic' (random tokens), a save_to_disk "
                           "directory, .json/.jsonl/.parquet/.csv file(s), or a cached dataset name.")
    dataset_split: str = setting("train", "Split to train on.")
    seq_length: int = setting(256, "Maximum tokens per sequence (longer records are truncated; an XSum record keeps "
                              "at least a quarter of seq_length of its document, else it is skipped).",
                              check=Check(lambda v: v >= 2, "at least 2"))
    allow_long_sequences: bool = setting(False, "Allow seq_length above the model's max_position_embeddings (RoPE "
                                         "then runs past the positions the model was trained on).")
    packing: bool = setting(False, "Pack several records into each row (greedy, in data order, up to seq_length): "
                            "positions restart at 0 for each record, attention and loss never cross records; a batch "
                            "is batch_size packed rows. Needs attn_implementation sdpa or eager. Validation is not "
                            "packed.")
    batch_size: int = setting(8, "Sequences per iteration (global batch).", check=AT_LEAST_ONE)
    num_chunks: int = setting(4, "Micro-batches per iteration; batch_size must be divisible by it.", check=AT_LEAST_ONE)
    eval_dataset: str = setting("", "Validation data, same forms as dataset; default: the training source's "
                                "validation split (the bundled validation file for dataset: sample).")
    eval_batches: int = setting(0, "Validation batches (of batch_size rows) per evaluation (0 = all).",
                                check=at_least(0))
