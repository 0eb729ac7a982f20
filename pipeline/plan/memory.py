"""How much GPU and host memory a run needs, from the model config and the action lists alone.

No weights are loaded and no tensor is made: the estimate walks each rank's action list and
keeps a ledger of what the executor and the stores hold at every action (``footprint.Ledger``).
The walk counts the parameter actions itself; every FORWARD and BACKWARD is counted by its
stage's runner (``pipeline.runners``: ``Runner.account``), the same object that runs it, chosen
by the same ``runner_for`` from the same mode (``RunSpec.modes``). The walk has no mode of its own.

* **Parameters.** Resident stages keep the compute copy, its gradient, the fp32 masters, their
  gradient and AdamW's two moments on the device. For offloaded stages (with offload, those
  the action list loads) the device holds only the buffer pool of ``offload/streams.py``: the
  walk replays its take/give on LOAD, the first backward, DROP and OFFLOAD_GRADS, so prefetch and
  buffer reuse are counted as they happen (as from the second iteration on: the pool keeps what
  the first made), plus the load stream's fp32 staging buffer; their
  masters and AdamW state are host memory.
* **Activations.** What autograd saves per token of a decoder layer, for Hugging Face's Llama
  layer with sdpa attention (measured with saved-tensor hooks; ``tests/pure/test_memory.py``
  checks the formula against autograd for float32 and bfloat16), held from a stage's forward
  to its backward; with activation checkpointing only each recomputed layer's input (the
  ``kept`` layers keep everything) and the head's: the last stage recomputes its logits and
  loss too.
* **In flight.** Stage inputs and outputs the executor keeps (sent tensors live until the end
  of the iteration), and the transient peak inside one forward/backward: the logits of the
  last stage, a layer's gradients, and a recomputed layer under checkpointing.
* **activation_offload.** Forwards save nothing on the device: each stage input (not stage 0's
  tokens) waits in host memory, counted at the walk's most inputs held at once. A backward
  recomputes its stage whole, so one stage's full activations of one micro-batch (segment) are
  its transient; sent tensors are released at the next compute (once their sends are done).
  With sequence segments the carried keys/values (and their gradients) stay on the device from
  a segment's forward to its backward; on a GPU they wait in host memory between a stage's
  forwards of a micro-batch and its backwards (``offload.kv``), the next backward's brought back
  during the one before.
* **Long rows**. On a GPU sdpa computes every pass without a score matrix
  (``pipeline.stage.attention``): a layer's attention allocates flash's padded copies of q, k, v and
  the output (head dimension to a multiple of 8) and in its backward an fp32 query-gradient
  accumulator and the padded gradients; a segment concatenates its keys/values behind the carried
  ones. A tiled MLP (``pipeline.stage.tiled``) keeps no intermediate from forward to backward and
  allocates one tile's in either. A layer's backward peaks in its MLP phase (everything saved)
  or its attention phase (the MLP side's saved tensors freed by then), whichever is higher.
* **Workspaces.** cuBLAS's, one for the forward's thread and one for autograd's backward thread
  (``footprint.BLAS_WORKSPACE_BYTES``), and inductor's autotuning buffer while layers compile.
* **Not counted**: the CUDA context (outside the allocator), NCCL's buffers and the caching allocator's
  fragmentation, which the 10% of the GPU the fit check leaves free covers (``plan.USABLE_FRACTION``;
  main.py turns on expandable segments, where a freed block serves an allocation of any size).
"""
from __future__ import annotations

from typing import Sequence

from pipeline.spec.footprint import GiB, Ledger, MemoryInputs, ModelShape, RankMemory, StagePlan, gib
from pipeline.runners import Mode, runner_for
from schedule.ir import Action, Op


def estimate_rank(inp: MemoryInputs, rank: int, actions: list[Action], modes: Sequence[Mode]) -> RankMemory:
    """Walk one rank's action list and return its peak device memory and its host memory;
    ``modes``: each stage's in training (``RunSpec.modes``), whose runners count its computes.

    The offload pool keeps its buffers from one iteration to the next: a buffer the first
    iteration makes late (a first stage's gradients, say) is on the device through the next
    iteration's earlier actions too. So the list is walked twice, and the second walk, which
    starts with every buffer the first made, is the estimate."""
    runners = {s: runner_for(modes[s]) for s in range(len(inp.stages)) if inp.mapping[s] == rank}

    def walk(pool: dict[int, int] | None) -> Ledger:
        ledger = Ledger(inp, rank, actions, pool)
        for a in actions:
            if a.op in (Op.FORWARD, Op.BACKWARD):
                ledger.arrive(a)
                runners[a.stage].account(a, ledger)
            else:
                ledger.parameters(a)
        return ledger

    first = walk(None)
    assert first.pool_free == first.pool_made, "an iteration ends with every pool buffer given back"
    return walk(first.pool_made).finish()


def estimate(inp: MemoryInputs, schedule: dict[int, list[Action]], modes: Sequence[Mode]) -> list[RankMemory]:
    return [estimate_rank(inp, r, schedule[r], modes) for r in sorted(schedule)]


__all__ = ["GiB", "MemoryInputs", "ModelShape", "RankMemory", "StagePlan", "estimate", "estimate_rank", "gib"]
