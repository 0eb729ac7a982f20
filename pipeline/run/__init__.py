"""One torchrun process: the builders of a rank's parts (``build``), the training loop
(``trainer``), the executor that interprets the rank's action list (``executor``), p2p channels
(``comm``), data-parallel groups (``replicas``), the optimizer settings (``optim``), evaluation,
signals and orphaned workers (``faults``, ``orphans``) and the outputs (``checkpoint``,
``metrics``, ``timeline``).

Nothing is imported here: ``main.py`` imports ``pipeline.run.orphans`` with the standard library
alone, before torch."""
