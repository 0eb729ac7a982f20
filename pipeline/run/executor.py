"""A per-rank interpreter of an action list (see ``schedule/ir.py``).

It reads the next action and dispatches on its op; it never reorders or skips work. All
decisions about order (which micro-batch, when to load, when to step) were made by the
schedule, which was validated and simulated before any process ran it. A stage's compute is its
runner's (``pipeline.runners``, chosen once per stage): the executor routes tensors between
runners, ranks and the stores, and keeps one iteration's state in one ``Iteration``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from offload.store import StageStore
from offload.streams import time_point
from pipeline.runners import RankRunners
from pipeline.runners.base import Arrival, Iteration
from pipeline.stage.router_loss import RouterLoss
from schedule.ir import Action, Op, crosses, peer_stage, tie_covers, tied_stages


class ActionError(RuntimeError):
    """An action failed (a peer that died or hangs shows up as a timeout in the action that
    waits for it); the message names the rank, the action and the peer."""


class OutOfMemory(ActionError):
    """An action ran out of GPU memory. ``train`` turns it into one line with the plan's figure;
    the attributes are what it says: the action, the bytes asked for and what was held."""

    def __init__(self, rank: int, action: Action, text: str, error: BaseException, device: torch.device):
        self.rank, self.action, self.text = rank, str(action), text
        self.tried = _tried_bytes(str(error))
        cuda = device.type == "cuda"
        self.allocated = torch.cuda.memory_allocated(device) if cuda else 0
        self.reserved = torch.cuda.memory_reserved(device) if cuda else 0
        self.peak = torch.cuda.max_memory_allocated(device) if cuda else 0
        super().__init__(f"rank {rank}: action {action} ({text}) ran out of GPU memory: "
                         f"{str(error).splitlines()[0] if str(error) else type(error).__name__}")


def _tried_bytes(message: str) -> int | None:
    """The allocation torch's out-of-memory message names ("Tried to allocate 3.15 GiB"), in bytes."""
    import re

    m = re.search(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)", message)
    if m is None:
        return None
    return int(float(m[1]) * 1024 ** ("B", "KiB", "MiB", "GiB", "TiB").index(m[2]))


_OP_WORDS = {Op.FORWARD: "forward", Op.BACKWARD: "backward", Op.SEND_F: "send activation",
             Op.RECV_F: "receive activation", Op.SEND_B: "send gradient", Op.RECV_B: "receive gradient",
             Op.LOAD: "load", Op.DROP: "drop", Op.OFFLOAD_GRADS: "offload gradients", Op.NORM: "gradient-norm all-reduce",
             Op.STEP: "optimizer step", Op.TIE: "tied-gradient exchange"}


def describe(a: Action, mapping: list[int]) -> str:
    """``2F3`` -> "forward of stage 2, micro-batch 3, input from rank 1"."""
    if a.op is Op.NORM:
        return "gradient-norm all-reduce over every rank (data_parallel: first each stage's sum over the replicas)"
    text = f"{_OP_WORDS[a.op]} of stage {a.stage}" + (f", micro-batch {a.mb}" if a.mb is not None else "") + \
        (f", segment {a.seg}" if a.seg is not None else "")
    if a.op is Op.TIE:
        first, last = tied_stages(len(mapping))
        peer = mapping[last] if a.stage == first else mapping[first]
        return text + (f", with stage {last} on this rank" if peer == mapping[a.stage] else f", with rank {peer}")
    if a.op in (Op.FORWARD, Op.RECV_F) and crosses(mapping, a.stage, a.stage - 1):
        text += f", input from rank {mapping[a.stage - 1]}"
    elif a.op in (Op.BACKWARD, Op.RECV_B) and crosses(mapping, a.stage, a.stage + 1):
        text += f", gradient from rank {mapping[a.stage + 1]}"
    elif a.op in (Op.SEND_F, Op.SEND_B):
        text += f", to rank {mapping[peer_stage(a)]}"
    return text


@dataclass
class MicroBatch:
    """What the stages need of one micro-batch (on the rank's device): the first its tokens, the
    last its targets, every stage the positions and segments of packed rows (None unpacked:
    positions are the columns and the mask is plain causal)."""

    input_ids: torch.Tensor  # [b, t]
    targets: torch.Tensor    # [b, t], -100 where nothing is predicted
    position_ids: torch.Tensor | None = None  # [b, t], restarting at 0 for every packed example
    segment_ids: torch.Tensor | None = None   # [b, t], attention stays within a segment

    def widened(self, width: int) -> "MicroBatch":
        """This micro-batch with padding columns up to ``width``: token 0, no target, and (packed)
        record 0, positions 0; after every real token, so causal attention never reads them."""
        def pad(t: torch.Tensor | None, value: int) -> torch.Tensor | None:
            n = width - self.input_ids.shape[1]
            return None if t is None or n <= 0 else torch.cat([t, t.new_full((t.shape[0], n), value)], dim=1)

        if width <= self.input_ids.shape[1]:
            return self
        return MicroBatch(pad(self.input_ids, 0), pad(self.targets, -100), pad(self.position_ids, 0),
                          pad(self.segment_ids, 0))

    def packing(self) -> dict[str, torch.Tensor]:
        """The keyword arguments of ``Stage.forward`` for packed rows ({} unpacked)."""
        if self.segment_ids is None:
            return {}
        return {"position_ids": self.position_ids, "segment_ids": self.segment_ids}


class StepClock:
    """Where one iteration's time went on this rank, as ``{key}_seconds``:

    * ``compute``: forward and backward, from after their inputs arrived;
    * ``load_wait``: the compute stream waiting for a parameter load (on the CPU, the host);
    * ``offload_wait``: NORM waiting for this rank's gradients to land in host memory and
      for their squared norms (taken there by the optimizer thread);
    * ``optimizer_wait``: a compute waiting for its stage's optimizer step (the host, before
      the load could be issued).

    On CUDA, spans are timing-event pairs on the compute stream, resolved by ``seconds()``
    after the iteration's synchronize (no host sync inside the step); elsewhere wall clock.
    The timeline draws a compute from these spans too (``spans_since``), so its bars leave
    out the waits for inputs and weights, as these totals do."""

    KEYS = ("compute", "load_wait", "offload_wait", "optimizer_wait")

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._seconds = dict.fromkeys(self.KEYS, 0.0)
        self._spans: list[tuple[str, object, object]] = []

    def mark(self):
        return time_point(torch.cuda.current_stream() if self.cuda else None)

    def span(self, key: str, start, end) -> None:
        self._spans.append((key, start, end))

    def add(self, key: str, seconds: float) -> None:
        self._seconds[key] += seconds

    def count(self) -> int:
        """How many spans were recorded so far: a position for ``spans_since``."""
        return len(self._spans)

    def spans_since(self, position: int, key: str) -> list[tuple[object, object]]:
        """The (start, end) of the ``key`` spans recorded after ``position``, in order."""
        return [(start, end) for k, start, end in self._spans[position:] if k == key]

    def seconds(self) -> dict[str, float]:
        """``{key}_seconds`` totals; on CUDA call after the device finished the iteration."""
        for key, start, end in self._spans:
            self._seconds[key] += start.elapsed_time(end) / 1e3 if self.cuda else end - start
        self._spans.clear()
        return {f"{k}_seconds": v for k, v in self._seconds.items()}


@dataclass
class IterationResult:
    loss: float | None          # sum over micro-batches of the normalised loss (last-stage rank only)
    grad_norm: float | None     # global, before clipping (None without a NORM action)
    skipped: bool = False       # NORM found a non-finite norm: every STEP discarded its gradients
    clock: StepClock | None = field(default=None, repr=False)


class Executor:
    def __init__(self, rank: int, stores: dict[int, StageStore], mapping: list[int], p2p, runners: RankRunners, *,
                 device: torch.device, dtype: torch.dtype, hidden_size: int, grad_clip: float, timeline=None,
                 replicas=None, start_offset_s: float = 0.0, router_loss: RouterLoss | None = None):
        """``rank`` is the pipeline rank (the position in a replica, ``pipeline.run.replicas``);
        ``runners``: this rank's stages' runners (``pipeline.runners.RankRunners``), which compute
        every FORWARD and BACKWARD; the executor hands them their inputs and routes what they
        return. ``replicas``: with data parallelism, the ``GradSync`` that sums each stage's
        gradient over its peers in the other replicas before NORM (or, without NORM, before the
        stage's STEP). ``start_offset_s``: this rank's load stagger
        (``schedule.mapping.plan_stagger``): a training iteration's first action waits this long, so
        that its first LOAD does not share its root complex's bandwidth with a load another rank
        needs earlier. ``router_loss``: a mixture-of-experts model's router loss
        (``pipeline.stage.router_loss``), whose partial sums travel with the activations and
        gradients in training."""
        self.rank, self.stores, self.mapping, self.p2p, self.runners = rank, stores, mapping, p2p, runners
        self.replicas = replicas
        self.start_offset_s = start_offset_s
        self.device, self.dtype, self.hidden_size, self.grad_clip = device, dtype, hidden_size, grad_clip
        self.num_stages = len(mapping)
        self.timeline = timeline  # optional recorder (pipeline.run.timeline.Timeline): begin / end, span, add
        self.router_loss = router_loss
        self.it: Iteration | None = None
        self._handlers = {
            Op.FORWARD: self._forward, Op.BACKWARD: self._backward,
            Op.SEND_F: self._send_f, Op.RECV_F: self._recv, Op.SEND_B: self._send_b, Op.RECV_B: self._recv,
            Op.LOAD: self._load, Op.DROP: self._drop, Op.OFFLOAD_GRADS: self._offload,
            Op.NORM: self._norm, Op.STEP: self._step, Op.TIE: self._tie,
        }

    # --- one iteration ------------------------------------------------------------------
    def run(self, actions: list[Action], microbatches: list[MicroBatch], num_targets: int, lr: float,
            train: bool = True, loss_scale: float = 1.0) -> IterationResult:
        """Interpret ``actions`` once. ``num_targets`` is the count of predicted tokens in the whole
        global batch, so the summed micro-batch losses equal the batch's mean token loss.

        ``train=False`` runs a forward-only program (``schedule.build_forward``) with autograd
        off: no graph is built and no activation is kept for a backward that never comes."""
        # the router loss's sums travel (and count) in training only
        router = self.router_loss if train else None
        if router is not None:
            router.reset()
        # A batch is as wide as its longest row; segments (seq_chunks) are cut per width.
        lengths, bounds = self.runners.cut(microbatches[0].input_ids.shape[1])
        self.it = it = Iteration(microbatches, lengths, bounds, num_targets, lr, loss_scale, train,
                                 StepClock(self.device.type == "cuda"), router,
                                 has_norm=any(a.op is Op.NORM for a in actions))
        # Fresh runner state each iteration: what a runner holds lives from a micro-batch's
        # first forward to its last backward, all inside this call.
        self.stage_runners = self.runners.begin(it, actions)
        if train and self.start_offset_s > 0:
            # The host is in step with the device here (the last iteration ended with a
            # synchronize), so waiting delays the first copy.
            time.sleep(self.start_offset_s)
        with torch.set_grad_enabled(train):
            for action in actions:
                # A LOAD's copy and a STEP may run later on another thread: their handlers
                # record the spans of the work itself; a compute is drawn from its clock spans.
                timed = self.timeline is not None and action.op not in (Op.LOAD, Op.STEP)
                computes = timed and action.op in (Op.FORWARD, Op.BACKWARD)
                if timed and not computes:
                    self.timeline.begin(action)
                position = it.clock.count()
                try:
                    self._handlers[action.op](action)
                except torch.OutOfMemoryError as e:  # before RuntimeError: it is one
                    raise OutOfMemory(self.rank, action, describe(action, self.mapping), e, self.device) from e
                except RuntimeError as e:  # a gloo/NCCL timeout or a dead peer surfaces in some wait
                    raise ActionError(f"rank {self.rank}: action {action} ({describe(action, self.mapping)}) "
                                      f"failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
                if computes:
                    self._draw_compute(action, it.clock.spans_since(position, "compute"))
                elif timed:
                    self.timeline.end(action)
        for work, _ in it.sends:  # keep each sent tensor alive until its send completed
            work.wait()
        self.runners.end(self.stage_runners)  # every micro-batch's backward (or last forward) freed what they held
        if router is not None:
            it.losses += router.losses
        loss = float(torch.stack(it.losses).sum()) if it.losses else None  # host sync: end of iteration
        return IterationResult(loss, it.grad_norm, it.skip_step, it.clock)

    def _draw_compute(self, action: Action, spans: list[tuple[object, object]]) -> None:
        """A FORWARD or BACKWARD on the timeline from its first compute span's start to its last's
        end: not from the action's start, which would draw the wait for a received input (the
        peer still computing it) or for the stage's load as compute. An action that computed
        nothing (the fused last stage's BACKWARD: its forward ran it) is drawn as an instant."""
        if not spans:
            now = self.it.clock.mark()
            spans = [(now, now)]
        self.timeline.span(action, spans[0][0], spans[-1][1])

    # --- compute: the stage's runner computes, the executor routes -----------------------
    def _act_shape(self, m: int, seg: int | None) -> tuple[int, int, int]:
        b, t = self.it.microbatches[m].input_ids.shape
        if seg is not None:
            start, end = self.it.bounds[seg]
            t = end - start
        return b, t, self.hidden_size

    def _input(self, a: Action) -> torch.Tensor:
        """Stage ``a.stage``'s input: its tokens (stage 0), the activation a stage of this rank
        handed on, or the one received (a device-side wait with NCCL; the host blocks only with gloo)."""
        it, key = self.it, (a.stage, a.mb, a.seg)
        if a.stage == 0:
            return it.columns(it.microbatches[a.mb].input_ids, a.seg)
        x = it.local_in.pop(key, None)
        if x is None:
            buf, work = it.recvs.pop((Op.RECV_F, *key))
            work.wait()
            x = buf
        return x

    def _grad(self, a: Action) -> torch.Tensor | None:
        """The gradient w.r.t. stage ``a.stage``'s output: none on the last stage (its loss starts
        the backward), else handed back by a stage of this rank or received."""
        if a.stage == self.num_stages - 1:
            return None
        it, key = self.it, (a.stage, a.mb, a.seg)
        grad = it.local_grad.pop(key, None)
        if grad is None:
            grad, work = it.recvs.pop((Op.RECV_B, *key))
            work.wait()
        return grad

    def _forward(self, a: Action) -> None:
        s, key = a.stage, (a.stage, a.mb, a.seg)
        out = self.stage_runners[s].forward(key, Arrival(lambda: self._input(a)))
        if out is None:  # the last stage: its loss is the iteration's
            return
        if not crosses(self.mapping, s, s + 1):
            self.it.local_in[(s + 1, a.mb, a.seg)] = out.detach()
        else:
            self.it.to_send[key] = out  # until SEND_F has sent it

    def _backward(self, a: Action) -> None:
        g = self.stage_runners[a.stage].backward((a.stage, a.mb, a.seg), Arrival(lambda: self._grad(a)))
        self._hand_on_grad(a, g)

    def _hand_on_grad(self, a: Action, g: torch.Tensor | None) -> None:
        """The gradient w.r.t. stage ``a.stage``'s input, to the previous stage: kept here for
        it on this rank, else for SEND_B."""
        if a.stage == 0:
            return
        if not crosses(self.mapping, a.stage, a.stage - 1):
            self.it.local_grad[(a.stage - 1, a.mb, a.seg)] = g
        else:
            self.it.grads_out[(a.stage, a.mb, a.seg)] = g

    # --- communication ------------------------------------------------------------------
    def _send_f(self, a: Action) -> None:
        it, key = self.it, (a.stage, a.mb, a.seg)
        t = it.to_send.pop(key).detach()
        it.sends.append((self.p2p.send(t, self.mapping[peer_stage(a)]), t))
        if it.router is not None:
            it.sends.append(it.router.send_forward(self.p2p, key, self.mapping[peer_stage(a)]))

    def _send_b(self, a: Action) -> None:
        it, key = self.it, (a.stage, a.mb, a.seg)
        t = it.grads_out.pop(key)
        it.sends.append((self.p2p.send(t, self.mapping[peer_stage(a)]), t))
        if it.router is not None:
            it.sends.append(it.router.send_backward(self.p2p, key, self.mapping[peer_stage(a)]))

    def _recv(self, a: Action) -> None:
        """RECV_F (an activation) or RECV_B (a gradient): posted now, waited for by the compute
        that takes it (``_input``, ``_grad``)."""
        it, key, peer = self.it, (a.stage, a.mb, a.seg), self.mapping[peer_stage(a)]
        buf = torch.empty(self._act_shape(a.mb, a.seg), dtype=self.dtype, device=self.device)
        it.recvs[(a.op, *key)] = (buf, self.p2p.recv(buf, peer))
        if it.router is not None:
            (it.router.recv_forward if a.op is Op.RECV_F else it.router.recv_backward)(self.p2p, key, peer)

    # --- parameters and optimizer -------------------------------------------------------
    def _load(self, a: Action) -> None:
        span = self.stores[a.stage].load()
        if self.timeline is not None:
            self.timeline.add(a, span)

    def _drop(self, a: Action) -> None:
        self.stores[a.stage].drop()

    def _offload(self, a: Action) -> None:
        self.stores[a.stage].offload_grads(norm=self.it.has_norm)

    def _tie(self, a: Action) -> None:
        # The tied matrix's gradient of both uses, in both copies, before their OFFLOAD_GRADS and the NORM.
        grads = [self.stores[s].tied_grad() for s in tie_covers(a, self.mapping)]
        if len(grads) == 2:  # this rank holds both copies
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
        else:
            self.p2p.all_reduce_tied(grads[0])

    def _sum_over_replicas(self, s: int) -> None:
        """Data parallelism: stage ``s``'s gradient becomes the sum of its D replicas' (the whole
        global batch's: each replica's loss is normalised by the global target count). Once per
        iteration, before the norm or the step reads it; every peer runs the same list, so the
        peers of a position meet here in the same order."""
        if self.replicas is not None and s not in self.it.summed:
            self.stores[s].reduce_grads(self.replicas.sum_)
            self.it.summed.add(s)

    def _norm(self, a: Action) -> None:
        it = self.it
        before = it.clock.mark()
        for s in sorted(self.stores):
            self._sum_over_replicas(s)
        whole = ranges = torch.zeros((), device=self.device)
        for s in sorted(self.stores):
            sq_s = self.stores[s].grad_sq_norm().to(self.device)
            if self.stores[s].partial_norm:
                ranges = ranges + sq_s
            else:
                whole = whole + sq_s
        it.clock.span("offload_wait", before, it.clock.mark())  # the gradient offloads and their norms
        if self.replicas is not None and self.replicas.shared:
            sq = self.replicas.sum_norms(whole, ranges)  # a stage's ranges on its peers, whole ones once
        else:
            sq = whole + ranges
            if dist.is_initialized():
                # with replicas, over this replica's ranks: every replica now holds the same gradients
                dist.all_reduce(sq, group=self.replicas.pipeline_group if self.replicas is not None else None)
        norm = sq.sqrt() / it.loss_scale  # the gradients carry the loss scale
        it.grad_norm = float(norm)  # host sync: the norm is logged and gates the steps anyway
        if not math.isfinite(it.grad_norm):
            # A NaN/inf anywhere makes the all-reduced norm non-finite on every rank alike, so
            # every rank skips its steps of this iteration and the replicas stay consistent.
            it.clip_coef, it.skip_step = None, True
            return
        # One host float that clips (torch's clip_grad_norm_ coefficient) and unscales: the steps
        # then need no device tensor, so an optimizer thread never waits for the GPU to read one.
        coef = float(torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0)) if self.grad_clip > 0 else 1.0
        coef /= it.loss_scale
        it.clip_coef = coef if coef != 1.0 else None

    def _step(self, a: Action) -> None:
        # Not a scheduling decision: the STEP runs where the schedule put it; NORM's value
        # decides whether it updates the weights or throws the gradients away.
        it = self.it
        if it.skip_step:
            self.stores[a.stage].discard_grads()
        else:
            self._sum_over_replicas(a.stage)
            span = self.stores[a.stage].step(it.lr, it.clip_coef)
            if self.timeline is not None:
                self.timeline.add(a, span)

    def finish(self) -> None:
        """Wait for optimizer work still running on worker threads."""
        for store in self.stores.values():
            store.wait_step()
