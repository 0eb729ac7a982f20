"""The offload section of the settings (``pipeline.config.TrainConfig`` composes it): where a
stage's parameters and AdamW state live between its computes, what steps where, and the memory
the plan may count on. Each field is a YAML key and a flag of the same name, documented beside
its default. Plain data: nothing in ``offload/`` reads the settings; the run's builders hand it
what they decide."""
from __future__ import annotations

from dataclasses import dataclass

from inputs.settings import at_least, setting


@dataclass
class OffloadSection:
    """Where the stages' parameters and AdamW state wait between computes, and the memory to plan for."""

    use_offload: bool = setting(False, "Keep stage parameters in host memory; load them only while the stage computes.")
    use_prefetch: bool = setting(True, "Load the next stage's parameters while the current one computes.")
    resident_stages: int = setting(-1, "With use_offload: stages per GPU that stay on it, AdamW state included (their "
                                   "optimizer step runs on the GPU, not the CPU): the GPU's first stages, whose steps "
                                   "the next iteration needs first. -1 = auto: as many as the memory plan fits in 90% "
                                   "of the GPU (0 without a GPU).")
    device_steps: int = setting(0, "With use_offload: offloaded stages per GPU whose AdamW step runs on the GPU "
                                "beside the CPU's, the last ones its forward needs; their AdamW moments stay on the "
                                "GPU (8 bytes a parameter, which --plan counts) and their fp32 masters and gradients "
                                "cross PCIe at the step. With clipping, the CPU then has fewer steps to finish "
                                "between the norm and the next forward's need of them. Not with data_parallel, "
                                "delayed_update, lora_rank or embeddings tied across stages.",
                                check=at_least(0, " (0: every offloaded stage steps on the CPU)"))
    gpu_memory_gb: float = setting(0.0, "Cap on each GPU's usable memory in GiB (emulates a smaller card; 0 = no "
                                   "cap). With --plan on a machine without a GPU (device auto): plan for GPUs of this "
                                   "size.", check=at_least(0))
    host_memory_gb: float = setting(0.0, "Host memory the run may use in GiB, for the memory plan's host check "
                                    "(--plan and before training): set it, with nproc and gpu_memory_gb, to plan for "
                                    "another machine (0 = what this machine has available now).", check=at_least(0))
    optimizer_threads: int = setting(0, "CPU threads for the offloaded AdamW of each process (0 = this rank's share "
                                     "of its GPU's NUMA node cores, or of all cores, less two for its other threads).",
                                     check=at_least(0))
    delayed_update: bool = setting(False, "NOT exact: iteration k+1 computes with the weights before step k, so each "
                                   "CPU AdamW step overlaps the next iteration instead of delaying it (ZeRO-Offload's "
                                   "delayed parameter update): the gradients are one update stale. Needs use_offload; "
                                   "every stage is offloaded (resident_stages 0); no eval_every, checkpoints or "
                                   "resume.")
