"""MMoC-Pipe's run, folder by folder in the order of its flow (docs/design.md has the table):

* ``config.py``: defaults < YAML < flags into one ``TrainConfig``.
* ``plan/``: what runs before any process group and under ``--plan``, on rank 0 alone or on a
  laptop: the checks, the model source, the automatic choices (``resolve``), the memory plan,
  the partition, the placement and the programs. No weight is loaded and no tensor is made.
* ``stage/``: a stage, the model's own modules cut out (``Stage``), and how it computes (the
  attention kernels, tiled MLPs, sequence segments, the router loss).
* ``runners/``: one object per way of running a stage's work, which the executor calls and the
  memory plan asks what it holds.
* ``run/``: one torchrun process: the builders, the trainer loop, the executor, communication,
  replicas, faults, checkpoints, metrics and the timeline.
* ``train.py``: the two ways through those steps, ``train`` and ``plan_report``.

``dist.py`` (process groups, the rank-aware logger) and ``launch.py`` (``python3 -m
pipeline.launch``) serve every step.
"""
