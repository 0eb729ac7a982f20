"""``delayed_update``: iteration k+1 computes with the weights before step k. Not exact by
design; what it must equal is AdamW applied one step late, and that is what these check."""
from __future__ import annotations

import pytest
import torch

from pipeline.config import ConfigError, make_config
from pipeline.plan.preflight import check_config
from pipeline.run.optim import lr_at
from tests.helpers.reference import assert_same_training, in_process_trainer, reference_train, trainer_masters
from tests.helpers.runs import tiny_cfg


def reference_train_delayed(cfg, model_dir) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain Hugging Face training in which each iteration's gradient (clipped by its own norm)
    is applied by AdamW during the next iteration, whose gradient is taken at the weights before
    that step; the last gradient is applied after the loop."""
    from transformers import AutoModelForCausalLM

    from pipeline.run.build import build_stream
    from pipeline.plan.source import resolve_model

    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=cfg.attn_implementation,
                                                 dtype=torch.float32)
    stream, _ = build_stream(cfg, resolve_model(cfg))
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)

    def apply(grads: list[torch.Tensor], lr: float) -> None:
        for p, g in zip(params, grads):
            p.grad = g
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=True)

    losses, pending = [], None
    for it in range(cfg.num_iterations):
        batch = stream.next_batch()
        loss = model(input_ids=batch.input_ids, labels=batch.labels).loss
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        grads = [p.grad.clone() for p in params]
        opt.zero_grad(set_to_none=True)
        if pending is not None:
            apply(*pending)  # the last iteration's step, after this iteration's gradient was taken
        pending = (grads, lr_at(it, cfg))
        losses.append(loss.item())
    apply(*pending)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("schedule,grad_clip", [("gpipe", 1.0), ("1f1b", 0.0), ("interleaved", 1.0)])
def test_delayed_update_is_adamw_one_step_late(tiny_model_dir, schedule, grad_clip):
    cfg = tiny_cfg(tiny_model_dir, schedule=schedule, use_offload=True, use_prefetch=True, delayed_update=True,
               grad_clip=grad_clip, num_iterations=4)
    trainer = in_process_trainer(cfg)
    history = trainer.train()
    trainer.executor.finish()
    ref = reference_train_delayed(cfg, str(tiny_model_dir))
    assert_same_training([h["loss"] for h in history], trainer_masters(trainer), *ref)
    # and it is not the exact training: the delay changes the weights
    exact_losses, exact_params = reference_train(tiny_cfg(tiny_model_dir, grad_clip=grad_clip, num_iterations=4),
                                                 str(tiny_model_dir))
    with pytest.raises(AssertionError):
        assert_same_training([h["loss"] for h in history], trainer_masters(trainer), exact_losses, exact_params)


@pytest.mark.parametrize("extra,named", [({"use_offload": False}, "use_offload off"),
                                         ({"resident_stages": 1}, "resident_stages 1"),
                                         ({"eval_every": 2}, "eval_every 2"),
                                         ({"checkpoint_every": 5}, "checkpoint_every 5"),
                                         ({"resume": "latest"}, "resume 'latest'")])
def test_delayed_update_refuses_what_would_see_the_other_weights(extra, named):
    cfg = make_config({"delayed_update": True, "use_offload": True, **extra})
    with pytest.raises(ConfigError, match=f"delayed_update needs .*got {named}"):
        check_config(cfg, 2)
