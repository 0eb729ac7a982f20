"""The run's terms, read by the stages, the runners and the plan alike, made from the settings and
the model's config alone (no tensor, no process group): what each stage holds and computes
(``shapes``), what ``auto`` resolves to (``settings``), the decoder layers
per stage (``partition``), the programs (``programs``), LoRA's targets
and a 4-bit base's parts (``lora``), the weight files' index (``weight_files``), the memory
ledger with the parameters' and the host's formulas (``footprint``), whose accounts the runners
keep with what a stage's computes save and allocate per token (``compute_bytes``), and the
``RunSpec`` that gathers one run's facts from them once (``run_spec``)."""
