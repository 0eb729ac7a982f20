"""One rank's training loop over the parts ``build_rank`` made: each iteration runs the executor
on the next batch, logs one line, evaluates, checkpoints and stops when the ranks agree to. It
saves and restores through the ``CheckpointManager`` and reports through ``pipeline.run.metrics``;
it decides nothing the configuration or ``resolve`` decided. The outputs a user can do without
(metrics.png, the timeline's files) are written last, after the model: a failure there is one
warning line (``metrics.optional_output``), never the model."""
from __future__ import annotations

import contextlib
import gc
import time
from pathlib import Path
from typing import Callable

import torch

from pipeline.config import TrainConfig, report_targets
from pipeline.dist import DistEnv, gather_objects
from pipeline.plan.layout import replica_share
from pipeline.plan.preflight import installed
from pipeline.plan.resolve import Resolved
from pipeline.spec.shapes import model_flops_per_token
from pipeline.plan.source import ModelSource
from pipeline.run import checkpoint, faults, orphans
from pipeline.run.build import build_rank
from pipeline.run.evaluate import evaluate
from pipeline.run.executor import ActionError, MicroBatch
from pipeline.run.metrics import (STEP_KEYS, Metrics, SkipGuard, TrainingError, device_stats, optional_output,
                                 peak_memory, write_results)
from pipeline.run.optim import lr_at
from pipeline.run.timeline import Timeline, write_run_timeline


@contextlib.contextmanager
def waiting_for_peers(rank: int, step: int, what: str):
    """A collective outside the executor's actions (the end of a step): a peer that died or hangs
    shows up as a timeout here too, and is named the way a failed action is."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, (ActionError, TrainingError)):  # already one line, or raised on every rank alike
            raise
        raise ActionError(f"rank {rank}: the end of step {step} ({what}) failed: "
                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e


class GcClock:
    """A ``gc.callbacks`` entry: seconds the cyclic garbage collector ran (every thread waits
    for it), summed until ``take``."""

    def __init__(self):
        self._seconds, self._start = 0.0, None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self._seconds += time.perf_counter() - self._start
            self._start = None

    def take(self) -> float:
        out, self._seconds = self._seconds, 0.0
        return out


def freeze_survivors() -> None:
    """Collect, then move every object that survived out of the cyclic GC's reach for the rest of
    the run (objects still die by reference count). Done before training (modules, stores, torch's
    and transformers' own objects: some 400k for 7B), then after the first step and after the first
    evaluation, which build the compiled layers' graphs and guards. A full collection walks every
    object not frozen: with only start-up frozen it took 0.13-0.16 s on a 7B two-GPU row, on each
    rank every other step, stalling that rank's kernel launches while its peer waited."""
    gc.collect()
    gc.freeze()


class Trainer:
    """One rank's training loop over the parts ``build_rank`` made; checkpoints go through a
    ``CheckpointManager``, step figures and results through ``pipeline.run.metrics``."""

    def __init__(self, cfg: TrainConfig, env: DistEnv, source: ModelSource | None = None,
                 resolved: Resolved | None = None):
        """``resolved``: the automatic choices, made by ``train()`` on rank 0; without it (tests)
        this rank makes them."""
        self.rank = r = build_rank(cfg, env, source, resolved)
        self.cfg, self.env = r.cfg, env
        self.start_iteration = r.resume_point.iteration if r.resume_point else 0
        self.stopped_by = 0  # the signal that ended the run early, if one did
        self.gc_clock = GcClock()
        self.evaluated_once = False  # the first evaluation's objects are frozen after it (freeze_survivors)
        # The outputs written after the model and results (``save``) on this rank: (what a failure
        # means, the writer).
        self.optional: list[tuple[str, Callable[[], object]]] = []
        self.flops_per_token = model_flops_per_token(r.source.config, r.source.config.num_hidden_layers,
                                                     r.cfg.seq_length, r.spec.trained_adapters)
        self.checkpoints = checkpoint.CheckpointManager(
            r.cfg, env, r.source, r.device, r.log, r.layout, stores=r.stores, stream=r.stream, scaler=r.scaler,
            parts=r.parts, mapping=r.mapping, adapters=r.adapters, dtype=r.dtype)
        if r.resume_point:
            self.checkpoints.restore(r.resume_point)

    # The parts tests and tools reach for.
    stages = property(lambda self: self.rank.stages)
    stores = property(lambda self: self.rank.stores)
    executor = property(lambda self: self.rank.executor)
    stream = property(lambda self: self.rank.stream)
    actions = property(lambda self: self.rank.actions)
    eval_actions = property(lambda self: self.rank.eval_actions)
    scaler = property(lambda self: self.rank.scaler)

    def microbatches(self, batch) -> list[MicroBatch]:
        from data.batching import to_device

        device = self.rank.device
        mbs = [MicroBatch(*(to_device(t, device) for t in (mb.input_ids, mb.targets, mb.position_ids,
                                                             mb.segment_ids)))
               for mb in replica_share(batch.microbatches(self.cfg.num_chunks), self.rank.layout)]
        # A batch is as wide as its longest row: one narrower than seq_chunks gets padding
        # columns, one a segment (after every token, predicting nothing, so nothing changes).
        return [mb.widened(self.cfg.seq_chunks) for mb in mbs]

    def sum_loss(self, loss: float | None) -> float | None:
        """The global batch's loss from this replica's share (the executor's loss is this
        replica's micro-batches' sum, each normalised by the global batch's target count)."""
        return self.rank.replicas.sum_loss(loss) if self.rank.replicas is not None else loss

    def evaluate(self) -> dict:
        """Validation loss over ``eval_batches`` (token-weighted mean; None off the loss rank)."""
        def run(batch):
            # num_targets=1: the executor's loss is then the plain sum of the batch's token losses.
            return self.sum_loss(self.executor.run(self.eval_actions, self.microbatches(batch), 1, 0.0,
                                                   train=False).loss)

        return evaluate(run, self.rank.eval_batches)

    def train(self) -> list[dict]:
        cfg, r = self.cfg, self.rank
        if self.start_iteration >= cfg.num_iterations:
            r.log.info(f"resume: {r.resume_point.path} is at iteration {self.start_iteration}, "
                       f"num_iterations is {cfg.num_iterations}: nothing left to train "
                       "(raise num_iterations to go on)")
            return []
        r.log.info(f"training {cfg.num_iterations} iterations: {cfg.num_stages} stages on "
                   f"{self.env.world_size} processes"
                   + (f" ({cfg.data_parallel} replicas of {r.layout.pipeline_size})" if cfg.data_parallel > 1
                      else "")
                   + f" ({r.device.type}, {r.dtype}), schedule {cfg.schedule}, "
                   f"offload={cfg.use_offload} prefetch={cfg.use_prefetch}")
        metrics = Metrics(r.log, speaks=self.env.rank == r.loss_rank, num_steps=cfg.num_iterations,
                          save_dir=cfg.save_dir if cfg.save_metrics else None, progress_bar=cfg.progress_bar,
                          report_to=report_targets(cfg.report_to), config=cfg.to_dict())
        if metrics.plot_path is not None:
            self.optional.append((f"{metrics.plot_path} was not written", metrics.write_plot))
        guard = SkipGuard(cfg.max_skipped_steps)
        freeze_survivors()
        gc.callbacks.append(self.gc_clock)
        try:
            # While training, SIGINT/SIGTERM only set a flag; the loop stops after a step all ranks agree on.
            with faults.StopRequest() as self.stop:
                metrics.start(self.start_iteration)
                history = self._train_loop(metrics, guard)
                metrics.finish(peak_memory(r.device))
        finally:
            metrics.close()
            gc.callbacks.remove(self.gc_clock)
            gc.unfreeze()  # a caller that goes on (tests, several runs in one process) collects as usual
        return history

    def _train_loop(self, metrics: Metrics, guard: SkipGuard) -> list[dict]:
        cfg, r, history = self.cfg, self.rank, []
        timeline_at = cfg.timeline_iteration % cfg.num_iterations if cfg.timeline else None
        recorded = None
        for it in range(self.start_iteration, cfg.num_iterations):
            batch = r.stream.next_batch()
            if it == timeline_at:
                recorded = r.executor.timeline = self.new_timeline()
            t0 = time.perf_counter()
            res = r.executor.run(r.actions, self.microbatches(batch), batch.num_targets, lr_at(it, cfg),
                                 loss_scale=r.scaler.scale if r.scaler else 1.0)
            r.executor.timeline = None
            with waiting_for_peers(self.env.rank, it + 1, "the loss summed over the replicas"):
                res.loss = self.sum_loss(res.loss)
            if r.device.type == "cuda":
                torch.cuda.synchronize(r.device)  # host sync: end of iteration, for honest timing
            dt = time.perf_counter() - t0
            tokens = batch.input_ids.numel()
            # this rank's row of results.json; metrics.jsonl gets its STEP_KEYS, under the same names
            row = {"step": it + 1, "step_time_s": dt, "tokens": tokens, "tokens_per_s": tokens / dt, "loss": res.loss,
                   "grad_norm": res.grad_norm, "lr": lr_at(it, cfg), "peak_mem_bytes": peak_memory(r.device),
                   "tflops_per_gpu": self.flops_per_token * tokens / dt / self.env.world_size / 1e12,
                   "skipped": res.skipped, **res.clock.seconds(), "gc_seconds": self.gc_clock.take(),
                   **device_stats(r.device, r.stores)}
            history.append(row)
            metrics.log_step({k: row[k] for k in STEP_KEYS})
            overflow = r.scaler.update(res.skipped) if r.scaler is not None else False
            if overflow:  # float16: an overflow of the loss scale, which has just halved; not a fault
                r.log.info(f"step {it + 1}: gradients overflowed float16, loss scale now {r.scaler.scale:g}")
            # raises on every rank alike past max_skipped_steps
            guard.update(it + 1, res.skipped and not overflow)
            evaluated = bool(cfg.eval_every) and ((it + 1) % cfg.eval_every == 0 or it + 1 == cfg.num_iterations)
            if evaluated:
                metrics.log_eval({"step": it + 1, **self.evaluate()})
            if it == self.start_iteration or (evaluated and not self.evaluated_once):
                freeze_survivors()
            self.evaluated_once |= evaluated
            with waiting_for_peers(self.env.rank, it + 1, "agreeing whether a rank was asked to stop"):
                self.stopped_by = self.stop.agreed(r.device)
            every = cfg.checkpoint_every
            if self.stopped_by or (every and ((it + 1) % every == 0 or it + 1 == cfg.num_iterations)):
                self.save_checkpoint(it + 1)
            if self.stopped_by:
                why = " (its launcher died)" if orphans.launcher_gone() else ""
                r.log.info(f"stopped by {faults.signal_name(self.stopped_by)}{why} after step {it + 1}, checkpoint "
                           f"saved; continue with --resume latest")
                break
        r.executor.finish()
        if recorded is not None:  # every rank alike: the stop step is agreed
            self.write_timeline(recorded)
        return history

    def new_timeline(self) -> Timeline:
        streams = self.rank.streams
        lanes = {"load": streams.load, "offload": streams.offload} if streams.cuda else None
        return Timeline(self.rank.layout.position, self.rank.device.type, streams=lanes)

    def write_timeline(self, recorded: Timeline) -> None:
        """Gather the recorded iteration to rank 0 (collective), which writes the trace, Gantt and
        prediction with the other optional outputs, after the model (``save``)."""
        r = self.rank
        # replica 0's ranks: the other replicas run the same lists
        events = [e for rank_events in gather_objects(recorded.events())[:r.layout.pipeline_size]
                  for e in rank_events]
        if self.env.rank == 0:
            def write() -> None:
                _, line = write_run_timeline(self.cfg.save_dir, events, r.schedule, r.mapping,
                                             r.placement.stage_bytes, r.placement.rank_groups,
                                             png=installed("matplotlib"))
                print(line, flush=True)

            self.optional.append((f"the timeline (timeline.json, timeline.png) in {self.cfg.save_dir} was not written",
                                  write))

    def save_checkpoint(self, step: int) -> Path:
        """Everything exact continuation needs after ``step`` completed steps (collective)."""
        # Every step done first: a sharded stage's gather (collective over its peers) uses the group
        # the optimizer thread's exchanges use, and one group is used by one thread at a time.
        self.executor.finish()
        return self.checkpoints.save(step)

    def save_lora(self, out: Path) -> None:
        """LoRA's outputs: the adapter in peft's format (``save_dir/adapter``) and, with
        ``merge_lora``, the base model with the adapters merged into it (``save_dir/model``)."""
        from pipeline.stage.lora import merged_tensors

        cfg, r = self.cfg, self.rank
        if not cfg.save_model or self.stopped_by:
            return
        stores = self.checkpoints.saved_stores
        base = str(r.source.weights_dir) if r.source.weights_dir is not None else None
        checkpoint.save_adapter(out / checkpoint.ADAPTER_DIR, stores, r.adapters, base, self.env, r.dtype)
        r.log.info(f"saved LoRA adapter (peft format) to {out / checkpoint.ADAPTER_DIR}")
        if cfg.merge_lora:
            checkpoint.save_hf_model(out / "model", stores, r.source, self.env, cfg.num_stages,
                                     lambda s, store: merged_tensors(r.stages[s], store, cfg.merge_lora_base or None))
            r.log.info(f"saved the merged Hugging Face model to {out / 'model'}")

    def save(self, history: list[dict]) -> None:
        """The run's outputs: the Hugging Face model and params.pt (not after a stop: its model is
        its last checkpoint), then results.json (collective), then finished.json (not after a stop)."""
        cfg, r = self.cfg, self.rank
        out = Path(cfg.save_dir)
        if r.adapters is not None:
            self.save_lora(out)
        elif cfg.save_model and not self.stopped_by:
            checkpoint.save_hf_model(out / "model", self.checkpoints.saved_stores, r.source, self.env,
                                     cfg.num_stages)
            r.log.info(f"saved Hugging Face model to {out / 'model'}")
        if cfg.save_params and not self.stopped_by:
            checkpoint.save_params(out / "params.pt", self.checkpoints.saved_stores, self.env)
            r.log.info(f"saved parameters to {out / 'params.pt'}")
        write_results(Path(cfg.results_path), cfg.to_dict(), self.env, cfg.data_parallel, history, r.loss_rank,
                      resumed_at=self.start_iteration)
        if not self.stopped_by:  # a stopped run's outputs are its checkpoint, of its last step
            checkpoint.mark_finished(out, history[-1]["step"] if history else self.start_iteration, self.env)
        self.write_optional()

    def write_optional(self) -> None:
        """The outputs a user can do without, now that the model and results are on disk: each
        failure is one warning line."""
        for what, write in self.optional:
            optional_output(self.rank.log, what, write)
        self.optional = []


__all__ = ["GcClock", "Trainer"]
