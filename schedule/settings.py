"""The parallelism section of the settings (``pipeline.config.TrainConfig`` composes it): the
pipeline's shape (stages, replicas, the schedule, the layers per stage, sequence segments), the
placement of stages on GPUs and the messages between them, and how a stage keeps or recomputes
its activations. Each field is a YAML key and a flag of the same name, documented beside its
default. The schedule's names and the mapping modes are this folder's; the stage modes'
(``activation_checkpointing`` to ``tiled_mlp``) are read by ``pipeline.runners``, which the
settings cannot import (it sits above them), and stay in the section users know them by."""
from __future__ import annotations

from dataclasses import dataclass

from inputs.settings import Check, above, at_least, setting
from schedule.generate import SCHEDULE_NAMES
from schedule.mapping import MAPPING_MODES, RENAMED_MAPPING_MODES

DEVICES = ("auto", "cpu", "cuda")
COMPILE_CHOICES = ("auto", "true", "false")
# partition's names; any other value is the layers per stage, comma-separated
PARTITIONS = ("cost", "layers")


@dataclass
class ParallelismSection:
    """How the model is cut into stages, scheduled, placed on GPUs, and recomputed or kept."""

    num_stages: int = setting(4, "Pipeline stages; a multiple of the number of processes (virtual stages). -1 = auto "
                              "(with a GPU or gpu_memory_gb): the fewest whose memory plan fits, with seq_chunks and "
                              "tiled_mlp if those are auto too (--plan says the longest row that fits).")
    data_parallel: int = setting(1, "Replicas of the pipeline: the processes form data_parallel pipelines of "
                                 "processes / data_parallel ranks each; each replica runs num_chunks / data_parallel "
                                 "of the global batch's micro-batches and the replicas sum their gradients before the "
                                 "step. With use_offload each replica runs 1/data_parallel of an offloaded stage's "
                                 "CPU AdamW step and holds that part of its AdamW state (ZeRO-1 on host state).")
    schedule: str = setting("1f1b", "Pipeline schedule: 1f1b keeps fewer micro-batches in flight than gpipe and was "
                            "the fastest on GPUs; gpipe runs every forward first; interleaved is 1F1B over virtual "
                            "stages.", choices=SCHEDULE_NAMES)
    partition: str = setting("cost", "Decoder layers per stage: cost (the counts the cost model predicts fastest, "
                             "from each stage's FLOPs, the head's 2*vocab*hidden a token included, and its parameter "
                             "loads; the even split unless another is predicted at least 0.1% faster, and always with "
                             "one GPU to a pipeline), layers (as even as possible, extra layers to the middle stages) "
                             'or the counts themselves, comma-separated ("3,5,4,4": what a checkpoint\'s stages '
                             "hold). --plan shows the layers per stage.")
    seq_chunks: int = setting(1, "Sequence-level pipelining (Seq1F1B): cut every row into seq_chunks contiguous "
                              "segments and pipeline (micro-batch, segment) pairs; a stage holds a few segments' "
                              "activations instead of whole sequences (exact: each segment attends to the earlier "
                              "segments' keys and values, which stay on the device until the micro-batch's backward). "
                              "For long seq_length; segment lengths balance the attention cost (later segments are "
                              "shorter). 1 = whole rows; -1 = auto (with a GPU or gpu_memory_gb): whole rows if the "
                              "memory plan fits them, else the fewest segments that fit. With activation_offload the "
                              "carried keys and values wait in host memory between a stage's forwards and its "
                              "backwards.")
    activation_checkpointing: bool = setting(False, "Recompute each decoder layer's activations in backward (and the "
                                             "last stage's head and loss).")
    keep_layers: int = setting(0, "With activation_checkpointing: decoder layers per stage that keep their "
                               "activations for backward instead of recomputing them (the stage's last ones; exact, "
                               "faster, more memory). N = N layers of every stage; -1 = auto: with a GPU, layer by "
                               "layer where the memory plan's peak grows least (stages with few micro-batches in "
                               "flight first) while it stays in 90% of the GPU beside the resident stages (not yet "
                               "measured on GPUs).",
                               check=Check(lambda v: v >= -1, "-1 (auto) or >= 0 (layers per stage)"))
    activation_offload: bool = setting(False, "Exact low-memory mode: a stage's forward builds no graph and its input "
                                       "(the activation from the previous stage) waits for the backward in host "
                                       "memory; the backward copies it back (the next one's copy prefetched) and "
                                       "recomputes the stage whole, once. GPU memory then holds one stage's "
                                       "activations of one micro-batch (with seq_chunks: of one segment, beside the "
                                       "carried keys and values of the micro-batches in flight), whatever the number "
                                       "of micro-batches in flight; host memory holds one hidden state per "
                                       "micro-batch and stage in flight. Layers are not checkpointed again "
                                       "(keep_layers must be 0; activation_checkpointing still chunks the last "
                                       "stage's loss). Not with attention dropout.")
    compile_layers: str = setting("auto", "Regional torch.compile of every decoder layer (one compiled graph serves "
                                  "all layers of a shape): fused norms, activations and rotary embeddings, the same "
                                  "arithmetic up to rounding, as any kernel fusion. auto = true on a GPU (Triton) "
                                  "without seq_chunks, false on the CPU (where compiling takes longer than a short "
                                  "run saves); the first step is slower while it compiles.", choices=COMPILE_CHOICES)
    fuse_last_stage: str = setting("auto", "The last stage runs forward, loss and backward of each micro-batch back "
                                   "to back in its forward: its layers are never checkpointed or recomputed, its head "
                                   "and loss run in chunks of tokens (the logits exist for one chunk at a time) and "
                                   "only the gradient of its input waits for the schedule's backward. Exact: the same "
                                   "arithmetic as recomputing. auto = true without seq_chunks (a segment's backward "
                                   "needs the later segments'; true is refused there) and unless gpipe runs with "
                                   "activation_offload (each micro-batch's input gradient would wait on the GPU).",
                                   choices=COMPILE_CHOICES)
    tiled_mlp: str = setting("auto", "Run each decoder layer's MLP in tiles of tokens (one tile's intermediate tensor "
                             "at most mlp_tile_mib), each recomputed in its backward: a long row's MLP intermediates "
                             "then exist for one tile at a time. Exact; costs one more MLP forward. auto = true only "
                             "where the memory plan does not fit without it (with a GPU or gpu_memory_gb; false "
                             "without). Not for mixture-of-experts layers.", choices=COMPILE_CHOICES)
    mlp_tile_mib: float = setting(256.0, "tiled_mlp: the most one tile's intermediate tensor (tokens x "
                                  "intermediate_size in the compute dtype) may take, MiB; its tokens follow (Llama-3B "
                                  "in bf16: 15534). Larger tiles are fewer kernels and hold more memory.",
                                  check=above(0))
    mapping: str = setting("planned", "Stage -> rank placement: planned (the cross-mapping planner spreads the loads "
                           "over the GPUs' PCIe roots; round_robin when there are no GPUs, no offload or no known "
                           "topology) or round_robin (stage s on rank s % N, rank r on the r-th GPU of "
                           "CUDA_VISIBLE_DEVICES). The older auto and cross mean planned, sequential and manual "
                           "round_robin.", choices=MAPPING_MODES, renamed=RENAMED_MAPPING_MODES)
    topology: str = setting("", "YAML/JSON file of GPU root groups overriding discovery ({gpus: [{index, root, numa, "
                            "bandwidth_gbps}]}); ranks use its GPUs in CUDA_VISIBLE_DEVICES order.")
    plan_tflops: float = setting(60.0, "Achieved TFLOP/s per GPU the mapping planner assumes for compute time.",
                                 check=above(0))
    stagger_loads: bool = setting(True, "With the planner: hold back a rank's first load when the cost model predicts "
                                  "it would slow an earlier stage's load under the same root complex.")
    device: str = setting("auto", "auto, cpu (gloo) or cuda (nccl).", choices=DEVICES)
    receive_ahead: int = setting(0, "Post each receive from another rank this many computes before the compute that "
                                 "takes it, so that its transfer can run during them (0 = right before it). Each "
                                 "costs one more receive buffer per incoming neighbour, which --plan counts. On two "
                                 "H200s over PCIe (7B, 16 stages) 1 measured the same step as 0.",
                                 check=at_least(0, " computes (0: each receive right before the compute that "
                                                   "takes it)"))
    comm_timeout_s: float = setting(600.0, "Seconds a send/recv or collective may wait for a peer before the run "
                                    "stops with an error naming the stalled action.", check=above(0))
