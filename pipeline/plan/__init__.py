"""Before any process group, and all that ``--plan`` runs: the checks (``preflight``, and the
model's rules in ``model_rules``), the model source (``source``, ``weight_files``), what the
model's stages hold and compute (``shapes``), the layout of replicas (``layout``), the settings
``auto`` resolves to (``settings``), the automatic choices made once (``resolve``, ``long_rows``,
``fit``), the memory plan (``memory``), the partition, the placement (``placement``,
``topology``) and the programs (``programs``).

No stage of the run is built and no weight read outside ``check_files`` (which opens the weight
files and compares a tied head with the embedding), so a GPU run can be planned on a laptop; the
only tensors made are an unregistered family's self-check (``pipeline.stage.selfcheck``) and, on a
GPU, the cuDNN probe (``fit``). The runtime (``pipeline.run``) reads what is decided here and decides
none of it again.

Two layers (docs/design.md, "Layers"): what the stages and the runners read (``shapes``,
``settings``, ``programs``, ``lora``, ``weight_files``, ``footprint``) comes before them; the rest
comes after the runners, because the memory plan sums their accounts (and the model's rules ask
the stage's self-check for an unregistered family).
"""
