"""Ordinary single-process training of the plain Hugging Face model: the ground truth the
pipeline must reproduce (same batches, same AdamW groups, clipping and LR schedule), and the
pipeline's trainer run in this one process to compare with it."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.config import TrainConfig
from pipeline.run.optim import lr_at
from tests.helpers.tolerance import assert_close


def reference_train(cfg: TrainConfig, model_dir: Path, device: str = "cpu",
                    compute_dtype: torch.dtype = torch.float32) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``compute_dtype`` bfloat16: Hugging Face mixed-precision training, as the pipeline does it
    and as fine-tuning recipes do: a bf16 copy of the model computes, its gradients go to float32
    master weights, which AdamW steps and copies back (``device`` cuda for the GPU tests)."""
    from transformers import AutoModelForCausalLM

    from pipeline.run.build import build_stream
    from pipeline.plan.source import resolve_model

    torch.manual_seed(cfg.seed)
    impl = {} if cfg.attn_implementation == "auto" else {"attn_implementation": cfg.attn_implementation}
    impl.update(quantization(cfg, compute_dtype, device))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **impl)
    if not cfg.load_in_4bit:  # a 4-bit model is placed by its device_map
        model = model.to(device)
    else:
        # training mode, as a trainer sets it: in eval mode bitsandbytes on a CPU with AVX512-BF16
        # repacks a 4-bit weight whose input needs no gradient (the first layer's) for its
        # inference kernel, which computes in bfloat16
        model.train()
    if cfg.num_layers:
        model.model.layers = model.model.layers[: cfg.num_layers]
        model.config.num_hidden_layers = cfg.num_layers
    compute = model
    if compute_dtype != torch.float32:
        import copy

        compute = copy.deepcopy(model).to(compute_dtype)
    source = resolve_model(cfg)
    stream, _ = build_stream(cfg, source)
    adapters = _with_adapters(cfg, source, model, compute is not model)
    if adapters is not None:
        model = compute = adapters
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trained if p.ndim >= 2]
    no_decay = [p for p in trained if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    losses = []
    for it in range(cfg.num_iterations):
        batch = stream.next_batch().to(device) if device != "cpu" else stream.next_batch()
        # Hugging Face's own loss: mean over every trained token of the batch, shifted inside.
        loss = _loss_and_backward(compute, batch, cfg, accumulate=compute is not model)
        if compute is not model:
            for master, p in zip(model.parameters(), compute.parameters()):
                master.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(trained, cfg.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(it, cfg)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if compute is not model:
            with torch.no_grad():
                for master, p in zip(model.parameters(), compute.parameters()):
                    p.copy_(master)
        losses.append(loss.item())
    if adapters is not None:  # the adapters, as peft saves them
        from peft import get_peft_model_state_dict

        return losses, {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(model).items()}
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()  # saved once, as the embedding
    return losses, {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k not in tied}


def quantization(cfg: TrainConfig, compute_dtype: torch.dtype, device: str) -> dict:
    """``from_pretrained``'s arguments for ``load_in_4bit``: transformers' own 4-bit loading
    (``BitsAndBytesConfig``, bitsandbytes' kernels; on the CPU its CPU path), the run's quantization
    settings, placed on ``device``; none without it."""
    from pipeline.spec.lora import base_4bit

    base = base_4bit(cfg)
    if base is None:
        return {}
    from transformers import BitsAndBytesConfig

    record = base.record(str(compute_dtype).removeprefix("torch."))
    return {"quantization_config": BitsAndBytesConfig(**record), "device_map": device}


def _with_adapters(cfg: TrainConfig, source, model, mixed: bool):
    """LoRA (``cfg.lora_rank``): ``model`` as a peft ``PeftModel`` with the run's adapters, their
    initial values the pipeline's (``pipeline.stage.lora.init_adapters``) or ``cfg.lora_adapter``'s;
    None for full fine-tuning."""
    from pipeline.spec.lora import lora_settings

    settings = lora_settings(cfg, source.config)
    if settings is None:
        return None
    assert not mixed, "the LoRA reference trains in float32"
    from peft import PeftModel, get_peft_model

    from pipeline.stage.lora import init_adapters, peft_config

    if cfg.lora_adapter:
        return PeftModel.from_pretrained(model, cfg.lora_adapter, is_trainable=True)
    peft_model = get_peft_model(model, peft_config(settings))
    init_adapters(peft_model, cfg.seed)
    return peft_model


def _loss_and_backward(model, batch, cfg: TrainConfig, accumulate: bool = False) -> torch.Tensor:
    """The batch's loss, its gradients accumulated. A mixture-of-experts model whose config adds
    the router loss, and ``accumulate`` (gradient accumulation, as mixed-precision recipes run
    it), run one forward per micro-batch, each token loss over the whole batch's count
    (``num_items_in_batch``) and each router loss over the micro-batches, the pipeline's
    definition (``pipeline.stage.router_loss``); with one micro-batch, the plain Hugging Face loss."""
    attn = cfg.attn_implementation if cfg.attn_implementation != "auto" else model.config._attn_implementation
    if not accumulate and not getattr(model.config, "output_router_logits", False):
        extra = {} if batch.segment_ids is None else packed_inputs(batch, attn)
        loss = model(input_ids=batch.input_ids, labels=batch.labels, **extra).loss
        loss.backward()
        return loss.detach()
    total = torch.zeros((), device=batch.input_ids.device)
    coef, M = getattr(model.config, "router_aux_loss_coef", 0.0), cfg.num_chunks
    for mb in batch.microbatches(M):
        extra = {} if mb.segment_ids is None else packed_inputs(mb, attn)
        out = model(input_ids=mb.input_ids, labels=mb.labels, num_items_in_batch=batch.num_targets, **extra)
        loss = out.loss
        if getattr(out, "aux_loss", None) is not None:  # Hugging Face adds coef * aux_loss whole
            loss = loss - coef * (1 - 1 / M) * out.aux_loss
        loss.backward()
        total += loss.detach()
    return total


def packed_inputs(batch, attn_implementation: str) -> dict:
    """What the Hugging Face model takes for packed rows, built here from the segment ids alone:
    the positions, a 4-D block-diagonal causal mask (sdpa: True = attend; eager: additive) and
    the shifted labels (a record's last token predicts nothing). No sliding window: for Llama."""
    seg = batch.segment_ids
    t = seg.shape[1]
    allowed = (seg[:, None, :, None] == seg[:, None, None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    mask = allowed if attn_implementation == "sdpa" else \
        torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return {"position_ids": batch.position_ids, "attention_mask": mask, "shift_labels": batch.targets}


def hf_model(path, impl: str):
    """The Hugging Face model in ``path``, float32, with ``impl`` attention, in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl, dtype=torch.float32).eval()


def in_process_trainer(cfg: TrainConfig):
    """A Trainer that holds every stage in this one process (world size 1)."""
    from pipeline.dist import DistEnv
    from pipeline.run.trainer import Trainer

    return Trainer(cfg, DistEnv(0, 1, 0, 1))


@dataclass(frozen=True)
class InProcessRun:
    """A finished in-process training: the trainer, its history rows, the loss of each step and
    the fp32 master weights right after the last step (``trainer_masters``)."""

    trainer: Any
    history: list[dict]
    losses: list[float]
    masters: dict[str, torch.Tensor]

    @property
    def outcome(self) -> tuple[list[float], dict[str, torch.Tensor]]:
        """``(losses, masters)``, the shape of ``reference_train``'s result and of
        ``assert_same_training``'s first two arguments."""
        return self.losses, self.masters


def trained(trainer) -> InProcessRun:
    """Run ``trainer``'s training (one built with ``in_process_trainer``, inspected before it trains)."""
    history = trainer.train()
    return InProcessRun(trainer, history, [h["loss"] for h in history], trainer_masters(trainer))


def train_adapters(cfg: TrainConfig):
    """Losses and adapters (peft's keys) of LoRA ``cfg`` trained in this process, and the trainer."""
    from pipeline.stage.lora import adapter_tensors

    trainer = in_process_trainer(cfg)
    history = trainer.train()
    adapters = {}
    for store in trainer.stores.values():
        adapters.update(adapter_tensors(store))
    return [h["loss"] for h in history], adapters, trainer


def train_in_process(cfg: TrainConfig) -> InProcessRun:
    """Train ``cfg`` with every stage in this one process."""
    return trained(in_process_trainer(cfg))


def trainer_masters(trainer) -> dict[str, torch.Tensor]:
    """Copies of the fp32 master weights of every stage the trainer holds, by Hugging Face name."""
    out = {}
    for store in trainer.stores.values():
        out.update({k: v.clone() for k, v in store.master_state_dict().items()})
    return out


def assert_same_training(losses, params, ref_losses, ref_params, rtol: float = 1e-5) -> None:
    """Per-step losses and every final tensor agree to ``rtol`` (relative, per tensor norm)."""
    assert len(losses) == len(ref_losses), (len(losses), len(ref_losses))
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= rtol * abs(b), f"step {i}: loss {a!r} vs reference {b!r}"
    assert_close(params, ref_params, rtol)


def stages_forward(config, path: Path, x: torch.Tensor, num_stages: int, mutate=None) -> torch.Tensor:
    """The pipeline's forward without an executor: ``num_stages`` stages built from ``path``
    (seed 0) run one after another on ``x`` without gradients; ``mutate(stage)`` changes each stage
    first (the mutation tests)."""
    from pipeline.spec.shapes import partition_layers
    from pipeline.stage.model import build_stage

    parts = partition_layers(config.num_hidden_layers, num_stages)
    h = x
    with torch.no_grad():
        for s in range(num_stages):
            stage = build_stage(config, s, num_stages, parts[s], model_dir=path, seed=0).eval()
            if mutate is not None:
                mutate(stage)
            h = stage(h)
    return h
