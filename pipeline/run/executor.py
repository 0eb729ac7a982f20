"""A per-rank interpreter of an action list (see ``schedule/ir.py``).

It reads the next action and dispatches on its op; it never reorders or skips work. All
decisions about order (which micro-batch, when to load, when to step) were made by the
schedule, which was validated and simulated before any process ran it.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from offload.activations import ActivationStash
from offload.kv import CarriedKV
from offload.store import StageStore, time_point
from pipeline.plan.shapes import segment_bounds, segment_lengths
from pipeline.stage.router_loss import RouterLoss
from pipeline.stage.segments import SegmentStage
from schedule.ir import Action, Op, crosses, peer_stage, tie_covers, tied_stages


Key = tuple[int, int, "int | None"]  # (stage, micro-batch, segment): what the executor's buffers are keyed by


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
    after the iteration's synchronize (no host sync inside the step); elsewhere wall clock."""

    KEYS = ("compute", "load_wait", "offload_wait", "optimizer_wait")

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._seconds = dict.fromkeys(self.KEYS, 0.0)
        self._spans: list[tuple[str, object, object]] = []

    def mark(self):
        return time_point(torch.cuda.current_stream() if self.cuda else None)

    def span(self, key: str, start, end) -> None:
        if self.cuda:
            self._spans.append((key, start, end))
        else:
            self._seconds[key] += end - start

    def add(self, key: str, seconds: float) -> None:
        self._seconds[key] += seconds

    def seconds(self) -> dict[str, float]:
        """``{key}_seconds`` totals; on CUDA call after the device finished the iteration."""
        for key, start, end in self._spans:
            self._seconds[key] += start.elapsed_time(end) / 1e3
        self._spans.clear()
        return {f"{k}_seconds": v for k, v in self._seconds.items()}


@dataclass
class IterationResult:
    loss: float | None          # sum over micro-batches of the normalised loss (last-stage rank only)
    grad_norm: float | None     # global, before clipping (None without a NORM action)
    skipped: bool = False       # NORM found a non-finite norm: every STEP discarded its gradients
    clock: StepClock | None = field(default=None, repr=False)


class Executor:
    def __init__(self, rank: int, stages: dict[int, torch.nn.Module], stores: dict[int, StageStore],
                 mapping: list[int], p2p, *, device: torch.device, dtype: torch.dtype, hidden_size: int,
                 grad_clip: float, timeline=None, replicas=None, start_offset_s: float = 0.0,
                 num_segments: int = 1, key_cost: float = 0.0, activation_offload: bool = False,
                 fuse_last_stage: bool = False, router_loss: RouterLoss | None = None):
        """``rank`` is the pipeline rank (the position in a replica, ``pipeline.run.replicas``);
        ``replicas``: with data parallelism, the ``GradSync`` that sums each stage's gradient over
        its peers in the other replicas before NORM (or, without NORM, before the stage's STEP).
        ``start_offset_s``: this rank's load stagger (``schedule.mapping.plan_stagger``): a training
        iteration's first action waits this long, so that its first LOAD does not share its root
        complex's bandwidth with a load another rank needs earlier.
        ``num_segments`` (``seq_chunks``): the programs' actions carry a segment of their
        micro-batch's columns, cut by ``segment_lengths`` with ``key_cost``
        (``schedule.costmodel.attention_key_cost``); each stage then runs through a
        ``SegmentStage``, which carries the keys/values between the segments of a micro-batch.
        ``activation_offload``: in training, every stage's forward builds no graph and its input
        waits in host memory (``offload.activations``); its backward recomputes it (``_recompute``).
        ``fuse_last_stage``: in training without segments, the last stage's forward runs its
        backward too (``Stage.forward_backward``: nothing checkpointed or recomputed, the logits
        made a chunk at a time) and its BACKWARD only hands the input's gradient on; the actions
        stay where they are, so the schedule's communication and parameter movement do not change.
        ``router_loss``: a mixture-of-experts model's router loss (``pipeline.stage.router_loss``), whose
        partial sums travel with the activations and gradients in training."""
        self.rank, self.stages, self.stores, self.mapping, self.p2p = rank, stages, stores, mapping, p2p
        self.replicas = replicas
        self.start_offset_s = start_offset_s
        self.device, self.dtype, self.hidden_size, self.grad_clip = device, dtype, hidden_size, grad_clip
        self.num_stages = len(mapping)
        self.num_segments, self.key_cost = num_segments, key_cost
        self.runners: dict[int, SegmentStage] = {}
        self.bounds: list[tuple[int, int]] = []
        self.timeline = timeline  # optional recorder with .begin(action) / .end(action)
        self.stash = ActivationStash(device) if activation_offload else None
        # seq_chunks with activation_offload: the carried keys/values wait in host memory too
        self.kv_host = CarriedKV(device) if activation_offload and num_segments > 1 else None
        self.fuse_last_stage = fuse_last_stage
        self.router_loss = router_loss
        self._handlers = {
            Op.FORWARD: self._forward, Op.BACKWARD: self._backward,
            Op.SEND_F: self._send_f, Op.RECV_F: self._recv_f, Op.SEND_B: self._send_b, Op.RECV_B: self._recv_b,
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
        self.mbs, self.num_targets, self.lr, self.loss_scale = microbatches, num_targets, lr, loss_scale
        self.training = train
        # the router loss's sums travel (and count) in training only
        self.routed = self.router_loss if train else None
        if self.routed is not None:
            self.routed.reset()
        # Keyed by (stage, micro-batch, segment); the segment is None without seq_chunks.
        self.inputs: dict[Key, torch.Tensor] = {}    # stage input (needs its grad)
        self.outputs: dict[Key, torch.Tensor] = {}   # stage output, or loss on the last stage
        self.local_in: dict[Key, torch.Tensor] = {}  # activation from a same-rank stage
        self.local_grad: dict[Key, torch.Tensor] = {}
        self.recvs: dict[tuple[Op, int, int, int | None], tuple[torch.Tensor, object]] = {}
        self.grads_out: dict[Key, torch.Tensor] = {}
        # activation_offload (training only): each backward prefetches the input of this rank's next one
        self.offloading = self.stash is not None and train
        # a segment's backward needs the later segments' (gradients of keys and values): not fusable
        self.fusing = self.fuse_last_stage and train and self.num_segments == 1
        self.fused_grads: dict[Key, torch.Tensor | None] = {}  # last stage: input gradients its F made
        if self.num_segments > 1:
            # Fresh runners each iteration: what they carry lives from a micro-batch's first
            # forward to its last backward, all inside this call.
            width = microbatches[0].input_ids.shape[1]
            lengths = segment_lengths(width, self.num_segments, self.key_cost)
            self.bounds = segment_bounds(lengths)
            # activation_offload: a segment's forward keeps only its carried keys/values, and its
            # backward recomputes it (``_recompute``)
            self.runners = {s: SegmentStage(stage, lengths, recompute=self.offloading,
                                            kv_host=self.kv_host if self.offloading else None)
                            for s, stage in self.stages.items()}
        self.sends: list[tuple[object, torch.Tensor]] = []
        self.losses: list[torch.Tensor] = []
        self.clip_coef, self.grad_norm, self.skip_step = None, None, False
        self.summed: set[int] = set()  # stages whose gradient is summed over the replicas (data parallel)
        self.has_norm = any(a.op is Op.NORM for a in actions)
        order = [(a.stage, a.mb, a.seg) for a in actions if a.op is Op.BACKWARD and not self._fused(a.stage)]
        self.next_backward = dict(zip(order, order[1:]))
        if self.stash is not None:
            self.stash.clear()
        if self.kv_host is not None:
            self.kv_host.clear()
        self.clock = StepClock(self.device.type == "cuda")
        if train and self.start_offset_s > 0:
            # The host is in step with the device here (the last iteration ended with a
            # synchronize), so waiting delays the first copy.
            time.sleep(self.start_offset_s)
        with torch.set_grad_enabled(train):
            for action in actions:
                # A LOAD's copy and a STEP may run later on another thread: their handlers
                # record the spans of the work itself.
                timed = self.timeline is not None and action.op not in (Op.LOAD, Op.STEP)
                if timed:
                    self.timeline.begin(action)
                try:
                    self._handlers[action.op](action)
                except torch.OutOfMemoryError as e:  # before RuntimeError: it is one
                    raise OutOfMemory(self.rank, action, describe(action, self.mapping), e, self.device) from e
                except RuntimeError as e:  # a gloo/NCCL timeout or a dead peer surfaces in some wait
                    raise ActionError(f"rank {self.rank}: action {action} ({describe(action, self.mapping)}) "
                                      f"failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
                if timed:
                    self.timeline.end(action)
        for work, _ in self.sends:  # keep each sent tensor alive until its send completed
            work.wait()
        self.runners = {}  # every micro-batch's backward (or last forward) freed what they carried
        if self.routed is not None:
            self.losses += self.routed.losses
        loss = float(torch.stack(self.losses).sum()) if self.losses else None  # host sync: end of iteration
        return IterationResult(loss, self.grad_norm, self.skip_step, self.clock)

    # --- compute ------------------------------------------------------------------------
    def _act_shape(self, m: int, seg: int | None) -> tuple[int, int, int]:
        b, t = self.mbs[m].input_ids.shape
        if seg is not None:
            start, end = self.bounds[seg]
            t = end - start
        return b, t, self.hidden_size

    def _columns(self, t: torch.Tensor, seg: int | None) -> torch.Tensor:
        """The columns of micro-batch tensor ``t`` [b, T] that segment ``seg`` covers (all without one)."""
        if seg is None:
            return t
        start, end = self.bounds[seg]
        return t[:, start:end]

    def _stage_forward(self, a: Action, x: torch.Tensor, last: bool, recompute: bool = False) -> torch.Tensor:
        mb = self.mbs[a.mb]
        targets = self._columns(mb.targets, a.seg) if last else None
        if a.seg is None:
            return self.stages[a.stage](x, targets, **mb.packing()) if last else self.stages[a.stage](x, **mb.packing())
        packed = {}
        if mb.segment_ids is not None:  # the records' ids so far keep attention within a record
            packed = {"position_ids": self._columns(mb.position_ids, a.seg),
                      "doc_ids": mb.segment_ids[:, :self.bounds[a.seg][1]]}
        runner = self.runners[a.stage]
        return (runner.recompute_forward if recompute else runner.forward)(a.mb, a.seg, x, targets, **packed)

    @contextlib.contextmanager
    def _routing(self, key: Key):
        """Stage ``key[0]``'s routers record (first pass) or replay (recomputes) the routing of
        ``key`` in training (``models.moe``); evaluation records nothing."""
        with self.stages[key[0]].routing.pass_(key if self.training else None):
            yield

    def _fused(self, s: int) -> bool:
        """Whether stage ``s``'s forward runs its backward too (``fuse_last_stage``)."""
        return self.fusing and s == self.num_stages - 1

    def _forward(self, a: Action) -> None:
        s, m, key = a.stage, a.mb, (a.stage, a.mb, a.seg)
        fused = self._fused(s)
        self.stores[s].before_compute(backward=fused, clock=self.clock)
        if s == 0:
            x = self._columns(self.mbs[m].input_ids, a.seg)
        else:
            x = self.local_in.pop(key, None)
            if x is None:
                buf, work = self.recvs.pop((Op.RECV_F, *key))
                work.wait()  # device-side wait with NCCL; the host blocks only with gloo
                x = buf
            if fused:
                pass  # its backward runs now: nothing waits for it
            elif self.offloading:
                self.stash.save(key, x)  # stage 0 needs none: its tokens stay in self.mbs
            elif a.seg is None:  # a segment's runner makes its own input leaf
                x.requires_grad_(True)
                self.inputs[key] = x
        if self.offloading:
            self._release_sent()
        start = self.clock.mark()
        if fused:
            with self._routing(key):
                self._forward_backward(a, x)
            self.clock.span("compute", start, self.clock.mark())
            return
        last = s == self.num_stages - 1
        # activation_offload: no graph; the backward recomputes this forward from the stashed input
        with torch.no_grad() if self.offloading else contextlib.nullcontext(), self._routing(key):
            out, loss = self._run_stage(a, x, last)
        if self.routed is not None:
            self.routed.forward_done(key, last, self.mbs[m].input_ids.numel())
        if last:
            self.losses.append(loss.detach())
        elif not crosses(self.mapping, s, s + 1):
            self.local_in[(s + 1, m, a.seg)] = out.detach()
        if not self.offloading or (not last and crosses(self.mapping, s, s + 1)):
            self.outputs[key] = out  # offloading: only until SEND_F has sent it
        self.clock.span("compute", start, self.clock.mark())

    def _forward_backward(self, a: Action, x: torch.Tensor) -> None:
        """The fused last stage's forward, loss and backward of ``a``'s micro-batch; the
        gradient w.r.t. its input waits for the BACKWARD action. The loss scale and the
        normalisation ride in as the backward's scale, as through ``_run_stage``'s loss."""
        mb, key = self.mbs[a.mb], (a.stage, a.mb, a.seg)
        def router_roots():  # after the forward: the router loss's totals and this stage's roots
            self.routed.forward_done(key, True, mb.input_ids.numel())
            return self.routed.roots(key, True, mb.input_ids.numel(), self.loss_scale)

        extra = router_roots if self.routed is not None else None
        with self.stores[a.stage].saved_tensor_hooks():
            loss, g = self.stages[a.stage].forward_backward(x, mb.targets, self.loss_scale / self.num_targets,
                                                            **mb.packing(), extra=extra)
        self.stages[a.stage].routing.release(key)
        self.losses.append(loss / self.num_targets)
        self.fused_grads[(a.stage, a.mb, a.seg)] = g

    def _run_stage(self, a: Action, x: torch.Tensor, last: bool,
                   recompute: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stage of ``a`` on its micro-batch (segment): (what backward starts from, the
        normalised loss on the last stage, else None). On the last stage the first is the loss
        times the loss scale (float16: every gradient is then scaled, see LossScaler).
        ``recompute``: activation_offload's forward again, right before the backward."""
        with self.stores[a.stage].saved_tensor_hooks():
            out = self._stage_forward(a, x, last, recompute)
        if not last:
            return out, None
        loss = out / self.num_targets
        return (loss * self.loss_scale if self.loss_scale != 1.0 else loss), loss

    def _recompute(self, a: Action, last: bool) -> tuple[torch.Tensor, object]:
        """activation_offload: micro-batch ``a.mb``'s forward of stage ``a.stage`` (segment
        ``a.seg``) again, with a graph, from its input brought back from host memory; first the
        copy back of this rank's next backward's input is started, so it overlaps this backward.
        A segment's recompute attends to the keys/values its earlier segments carried (its
        ``SegmentStage`` holds them). Returns what the backward starts from and the compute
        span's start."""
        key = (a.stage, a.mb, a.seg)
        x = self.stash.restore(key) if a.stage > 0 else self._columns(self.mbs[a.mb].input_ids, a.seg)
        nxt = self.next_backward.get(key)
        if nxt is not None:
            if nxt[0] > 0:
                self.stash.prefetch(nxt)  # nothing if its forward has not run yet
            if nxt[2] is not None:
                # its stage's carried keys/values (nothing if they are on the device already)
                self.runners[nxt[0]].prefetch(nxt[1])
        if a.stage > 0 and a.seg is None:  # a segment's runner makes its own input leaf
            x.requires_grad_(True)
            self.inputs[key] = x
        start = self.clock.mark()
        return self._run_stage(a, x, last, recompute=a.seg is not None)[0], start

    def _release_sent(self) -> None:
        """activation_offload: drop the sent tensors whose sends are done (without it they live to
        the end of the iteration, one per micro-batch). ``is_completed`` does not block."""
        self.sends = [(work, t) for work, t in self.sends if not work.is_completed()]

    def _backward(self, a: Action) -> None:
        with self._routing((a.stage, a.mb, a.seg)):  # a checkpointed layer recomputes in here
            self._backward_compute(a)
        self.stages[a.stage].routing.release((a.stage, a.mb, a.seg))

    def _backward_compute(self, a: Action) -> None:
        s, m, key = a.stage, a.mb, (a.stage, a.mb, a.seg)
        self.stores[s].before_compute(backward=True, clock=self.clock)
        last = s == self.num_stages - 1
        if self._fused(s):
            self._hand_on_grad(a, self.fused_grads.pop(key))
            return
        if self.offloading:
            self._release_sent()
            # the recompute needs no gradient yet: it runs before the wait for the one sent back
            out, start = self._recompute(a, last)
        else:
            out, start = self.outputs.pop(key), None
        grad = None
        if not last:
            grad = self.local_grad.pop(key, None)
            if grad is None:
                grad, work = self.recvs.pop((Op.RECV_B, *key))
                work.wait()
        start = self.clock.mark() if start is None else start
        if a.seg is not None:
            if last:
                # The runner's root is the segment's summed loss: d(loss * scale / num_targets) is
                # what autograd would give it through the normalisation of _run_stage.
                grad = torch.full_like(out, self.loss_scale) / self.num_targets
            g = self.runners[s].backward(m, a.seg, grad)
        else:
            roots, grads = [], []
            if self.routed is not None:
                roots, grads = self.routed.roots(key, last, self.mbs[m].input_ids.numel(), self.loss_scale)
            torch.autograd.backward([out] + roots, [torch.ones_like(out) if last else grad] + grads)
            g = self.inputs.pop(key).grad if s > 0 else None
        self._hand_on_grad(a, g)
        self.clock.span("compute", start, self.clock.mark())

    def _hand_on_grad(self, a: Action, g: torch.Tensor | None) -> None:
        """The gradient w.r.t. stage ``a.stage``'s input, to the previous stage: kept here for
        it on this rank, else for SEND_B."""
        if a.stage == 0:
            return
        if not crosses(self.mapping, a.stage, a.stage - 1):
            self.local_grad[(a.stage - 1, a.mb, a.seg)] = g
        else:
            self.grads_out[(a.stage, a.mb, a.seg)] = g

    # --- communication ------------------------------------------------------------------
    def _send_f(self, a: Action) -> None:
        # activation_offload: the output is not kept for a backward, only for this send
        key = (a.stage, a.mb, a.seg)
        t = (self.outputs.pop(key) if self.offloading else self.outputs[key]).detach()
        self.sends.append((self.p2p.send(t, self.mapping[peer_stage(a)]), t))
        if self.routed is not None:
            self.sends.append(self.routed.send_forward(self.p2p, key, self.mapping[peer_stage(a)]))

    def _send_b(self, a: Action) -> None:
        t = self.grads_out.pop((a.stage, a.mb, a.seg))
        self.sends.append((self.p2p.send(t, self.mapping[peer_stage(a)]), t))
        if self.routed is not None:
            self.sends.append(self.routed.send_backward(self.p2p, (a.stage, a.mb, a.seg), self.mapping[peer_stage(a)]))

    def _recv_f(self, a: Action) -> None:
        buf = torch.empty(self._act_shape(a.mb, a.seg), dtype=self.dtype, device=self.device)
        self.recvs[(Op.RECV_F, a.stage, a.mb, a.seg)] = (buf, self.p2p.recv(buf, self.mapping[peer_stage(a)]))
        if self.routed is not None:
            self.routed.recv_forward(self.p2p, (a.stage, a.mb, a.seg), self.mapping[peer_stage(a)])

    def _recv_b(self, a: Action) -> None:
        buf = torch.empty(self._act_shape(a.mb, a.seg), dtype=self.dtype, device=self.device)
        self.recvs[(Op.RECV_B, a.stage, a.mb, a.seg)] = (buf, self.p2p.recv(buf, self.mapping[peer_stage(a)]))
        if self.routed is not None:
            self.routed.recv_backward(self.p2p, (a.stage, a.mb, a.seg), self.mapping[peer_stage(a)])

    # --- parameters and optimizer -------------------------------------------------------
    def _load(self, a: Action) -> None:
        span = self.stores[a.stage].load()
        if self.timeline is not None:
            self.timeline.add(a, span)

    def _drop(self, a: Action) -> None:
        self.stores[a.stage].drop()

    def _offload(self, a: Action) -> None:
        self.stores[a.stage].offload_grads(norm=self.has_norm)

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
        if self.replicas is not None and s not in self.summed:
            self.stores[s].reduce_grads(self.replicas.sum_)
            self.summed.add(s)

    def _norm(self, a: Action) -> None:
        before = self.clock.mark()
        for s in sorted(self.stores):
            self._sum_over_replicas(s)
        sq = sum(self.stores[s].grad_sq_norm().to(self.device) for s in sorted(self.stores))
        self.clock.span("offload_wait", before, self.clock.mark())  # the gradient offloads and their norms
        if dist.is_initialized():
            # with replicas, over this replica's ranks: every replica now holds the same gradients
            dist.all_reduce(sq, group=self.replicas.pipeline_group if self.replicas is not None else None)
        norm = sq.sqrt() / self.loss_scale  # the gradients carry the loss scale
        self.grad_norm = float(norm)  # host sync: the norm is logged and gates the steps anyway
        if not math.isfinite(self.grad_norm):
            # A NaN/inf anywhere makes the all-reduced norm non-finite on every rank alike, so
            # every rank skips its steps of this iteration and the replicas stay consistent.
            self.clip_coef, self.skip_step = None, True
            return
        # One host float that clips (torch's clip_grad_norm_ coefficient) and unscales: the steps
        # then need no device tensor, so an optimizer thread never waits for the GPU to read one.
        coef = float(torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0)) if self.grad_clip > 0 else 1.0
        coef /= self.loss_scale
        self.clip_coef = coef if coef != 1.0 else None

    def _step(self, a: Action) -> None:
        # Not a scheduling decision: the STEP runs where the schedule put it; NORM's value
        # decides whether it updates the weights or throws the gradients away.
        if self.skip_step:
            self.stores[a.stage].discard_grads()
        else:
            self._sum_over_replicas(a.stage)
            span = self.stores[a.stage].step(self.lr, self.clip_coef)
            if self.timeline is not None:
                self.timeline.add(a, span)

    def finish(self) -> None:
        """Wait for optimizer work still running on worker threads."""
        for store in self.stores.values():
            store.wait_step()
