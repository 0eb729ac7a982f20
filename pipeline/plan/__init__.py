"""Before any process group, and all that ``--plan`` runs: the checks (``preflight``), the model
source (``source``, ``weight_files``), what the model's stages hold and compute (``shapes``), the
layout of replicas (``layout``), the settings ``auto`` resolves to (``settings``), the automatic
choices made once (``resolve``, ``long_rows``, ``fit``), the memory plan (``memory``), the
partition, the placement (``placement``, ``topology``) and the programs (``programs``).

Pure: no weight is loaded and no tensor is made, so a GPU run can be planned on a laptop. The
runtime (``pipeline.run``) reads what is decided here and decides none of it again.
"""
