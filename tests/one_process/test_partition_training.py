"""An uneven partition (the counts the cost partition gives the tiny model with a wide vocabulary
on two GPUs: its head's stage holds fewer layers; with one GPU it keeps the even split) trains
exactly like single-process training, in one process (the partition itself:
tests/pure/test_partition.py; two processes: tests/multi_process/test_gloo_partition.py)."""
from __future__ import annotations


def test_in_process_uneven_partition_matches_reference(wide_vocab_model_dir):
    from tests.helpers.reference import assert_same_training, in_process_trainer, trained
    from tests.helpers.runs import reference_result, tiny_cfg

    cfg = tiny_cfg(wide_vocab_model_dir, num_stages=2, schedule="1f1b", use_offload=True, partition="5,1")
    trainer = in_process_trainer(cfg)
    assert [len(p) for p in trainer.rank.parts] == [5, 1]  # the head's stage holds one layer, not three
    run = trained(trainer)
    assert_same_training(*run.outcome, *reference_result(str(wide_vocab_model_dir)))
