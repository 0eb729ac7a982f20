"""Before any process group, and all that ``--plan`` runs: the checks (``preflight``, with
``save_dir`` for the runs a save_dir holds; the rules between settings in ``settings_rules``, the
model's in ``model_rules``), the model source (``source``), the layout of replicas (``layout``),
the automatic choices made once (``resolve``, ``long_rows``, ``fit``), the memory plan
(``memory``) and the placement (``placement``, ``topology``). The terms all of it
reads, as the stages and the runners do, are ``pipeline.spec``'s.

No stage of the run is built and no weight read outside ``check_files`` (which opens the weight
files and compares a tied head with the embedding), so a GPU run can be planned on a laptop; the
only tensors made are an unregistered family's self-check (``pipeline.stage.selfcheck``) and, on a
GPU, the cuDNN probe (``fit``). The runtime (``pipeline.run``) reads what is decided here and decides
none of it again. It comes after the runners (docs/design.md, "Layers"): the memory plan sums their
accounts, and the model's rules ask the stage's self-check for an unregistered family.
"""
