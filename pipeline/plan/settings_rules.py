"""The rules between the settings: each needs nothing but the settings and the number of
processes, and runs before anything is read or launched (``check_settings``, from
``preflight.check_config``). A field's own rule is declared with the field (``check=``); the
rules that need the model are ``pipeline.plan.model_rules``'s, the files' and the machine's
``pipeline.plan.preflight``'s."""
from __future__ import annotations

from typing import Callable

from pipeline.config import (ALL_LINEAR, LORA_FROZEN, SECTIONS, ConfigError, TrainConfig, check_fields, lora_targets,
                             partition_counts)


def _replicas(cfg: TrainConfig, world_size: int) -> None:
    D = cfg.data_parallel
    if D < 1 or world_size % D:
        raise ConfigError(f"data_parallel ({D}) must be >= 1 and divide the number of processes ({world_size}); "
                          f"e.g. launch {max(D, 1) * max(world_size // max(D, 1), 1)} processes, or data_parallel 1")
    if cfg.num_chunks % D:
        raise ConfigError(f"num_chunks ({cfg.num_chunks}) must be divisible by data_parallel ({D}): each replica "
                          f"runs num_chunks / data_parallel of the global batch's micro-batches; "
                          f"e.g. num_chunks={D * max(cfg.num_chunks // D, 1)}")


def _stages(cfg: TrainConfig, world_size: int) -> None:
    P = world_size // cfg.data_parallel  # the ranks of one pipeline
    if cfg.num_stages != -1 and (cfg.num_stages < 1 or cfg.num_stages % P):
        per = f" per pipeline (world {world_size} / data_parallel {cfg.data_parallel})" if P != world_size else ""
        raise ConfigError(f"num_stages ({cfg.num_stages}) must be a positive multiple of the number of "
                          f"processes{per} ({P}), or -1 (auto); e.g. num_stages={P * 2}")
    if cfg.num_stages == -1 and partition_counts(cfg.partition) is not None:
        raise ConfigError(f"partition {cfg.partition!r} gives the layers of every stage, so num_stages must be their "
                          f"number, not -1 (auto)")
    if cfg.batch_size % cfg.num_chunks:  # both >= 1 (their own checks)
        divisor = max(d for d in range(1, cfg.num_chunks + 1) if cfg.batch_size % d == 0)
        raise ConfigError(f"batch_size ({cfg.batch_size}) must be divisible by num_chunks ({cfg.num_chunks}); e.g. "
                          f"batch_size {cfg.num_chunks * -(-cfg.batch_size // cfg.num_chunks)} or num_chunks "
                          f"{divisor}")


def _segments(cfg: TrainConfig, world_size: int) -> None:
    if cfg.seq_chunks != -1 and not 1 <= cfg.seq_chunks <= cfg.seq_length:
        raise ConfigError(f"seq_chunks ({cfg.seq_chunks}) must be between 1 (whole rows) and seq_length "
                          f"({cfg.seq_length}): each of a row's segments needs at least one token; or -1 (auto)")
    if cfg.compile_layers == "true" and cfg.tiled_mlp == "true":
        # a tiled MLP checkpoints each tile inside the layer: not tried under torch.compile
        raise ConfigError("compile_layers true does not work with tiled_mlp true yet; use compile_layers auto "
                          "(eager with tiles) or false")
    if cfg.seq_chunks > 1 and cfg.compile_layers == "true":
        # The carried keys/values pass through a Python cache object the compiled layer cannot
        # capture, and a checkpointed layer then recomputes other tensors than its forward saved.
        raise ConfigError("compile_layers true does not work with seq_chunks > 1 yet; use compile_layers auto "
                          "(eager with segments) or false")
    if cfg.seq_chunks > 1 and cfg.fuse_last_stage == "true":
        # segment j's backward needs the gradients of its keys/values from the backwards of the
        # later segments, which have not run when its forward ends
        raise ConfigError("fuse_last_stage true does not work with seq_chunks > 1 (a segment's backward needs the "
                          "later segments'); use fuse_last_stage auto or false")


def _offload(cfg: TrainConfig, world_size: int) -> None:
    if cfg.delayed_update:
        # Each of these would see or save the weights between the two that the delay keeps apart.
        clash = [name for name, on in (("use_offload off", not cfg.use_offload),
                                       (f"resident_stages {cfg.resident_stages}", cfg.resident_stages > 0),
                                       (f"eval_every {cfg.eval_every}", cfg.eval_every > 0),
                                       (f"checkpoint_every {cfg.checkpoint_every}", cfg.checkpoint_every > 0),
                                       (f"resume {cfg.resume!r}", bool(cfg.resume))) if on]
        if clash:
            raise ConfigError(f"delayed_update needs use_offload with every stage offloaded and no evaluation, "
                              f"checkpoints or resume; got {', '.join(clash)}")
    per_rank = cfg.num_stages // (world_size // cfg.data_parallel) if cfg.num_stages > 0 else 0
    if not -1 <= cfg.resident_stages <= per_rank and cfg.num_stages != -1:
        raise ConfigError(f"resident_stages ({cfg.resident_stages}) must be -1 (auto) or 0..{per_rank} "
                          f"(the stages per process)")
    if cfg.device_steps:
        # the replicas' sharded steps are collective on the CPU; a delayed step must not touch the
        # masters the next iteration's loads read while it runs
        clash = [name for name, on in (("use_offload off", not cfg.use_offload),
                                       ("delayed_update", cfg.delayed_update),
                                       (f"data_parallel {cfg.data_parallel}", cfg.data_parallel > 1)) if on]
        if clash:
            raise ConfigError(f"device_steps ({cfg.device_steps}) needs use_offload without delayed_update or "
                              f"data_parallel; got {', '.join(clash)}")
        if cfg.num_stages != -1 and cfg.device_steps + max(cfg.resident_stages, 0) > per_rank:
            raise ConfigError(f"device_steps ({cfg.device_steps}) and resident_stages ({cfg.resident_stages}) "
                              f"together must be at most the {per_rank} stages per process")
    if cfg.activation_offload and cfg.keep_layers > 0:
        # the backward recomputes each stage whole: there is no layer whose activations could be kept
        raise ConfigError(f"activation_offload recomputes every stage whole in its backward; keep_layers "
                          f"({cfg.keep_layers}) must be 0 or -1 with it")


def _timeline(cfg: TrainConfig, world_size: int) -> None:
    if not -cfg.num_iterations <= cfg.timeline_iteration < cfg.num_iterations:
        raise ConfigError(f"timeline_iteration ({cfg.timeline_iteration}) must be in [-{cfg.num_iterations}, "
                          f"{cfg.num_iterations}) for num_iterations={cfg.num_iterations}; -1 = the last")


def _lora(cfg: TrainConfig, world_size: int) -> None:
    if not cfg.lora_rank:
        given = [k for k, on in (("lora_adapter", bool(cfg.lora_adapter)), ("merge_lora", cfg.merge_lora),
                                 ("load_in_4bit", cfg.load_in_4bit)) if on]
        if given:
            raise ConfigError(f"{' and '.join(given)} need lora_rank > 0 (the adapter's rank); got lora_rank 0")
        return
    if cfg.merge_lora_base and not (cfg.merge_lora and cfg.load_in_4bit):
        raise ConfigError(f"merge_lora_base ({cfg.merge_lora_base!r}) is the full-precision base that merge_lora "
                          "merges a 4-bit run's adapters into; it needs merge_lora and load_in_4bit (without "
                          "load_in_4bit the base the run trained on is merged)")
    if cfg.merge_lora and cfg.load_in_4bit and not cfg.merge_lora_base:
        raise ConfigError("merge_lora with load_in_4bit would merge the adapters into the 4-bit base weights, "
                          "baking their rounding into the model: give merge_lora_base, the full-precision Hugging "
                          f"Face directory of the base (model: {cfg.model!r}), or drop merge_lora and use "
                          "save_dir/adapter")
    if cfg.lora_alpha <= 0:
        raise ConfigError(f"lora_alpha ({cfg.lora_alpha}) must be > 0")
    if not 0 <= cfg.lora_dropout < 1:
        raise ConfigError(f"lora_dropout ({cfg.lora_dropout}) must be in [0, 1)")
    if cfg.lora_dropout and cfg.activation_offload:
        # the backward's recompute of a stage runs outside torch.utils.checkpoint: another mask
        raise ConfigError(f"lora_dropout ({cfg.lora_dropout}) does not work with activation_offload (its recompute "
                          "would draw other dropout masks than the forward); use lora_dropout 0")
    targets = lora_targets(cfg)
    if not targets:
        raise ConfigError("lora_target_modules is empty; give peft module names (q_proj,v_proj) or all-linear")
    if ALL_LINEAR in targets and len(targets) > 1:
        raise ConfigError(f"lora_target_modules {cfg.lora_target_modules!r}: all-linear stands alone")
    frozen = [t for t in targets if t in LORA_FROZEN]
    if frozen:
        raise ConfigError(f"lora_target_modules: {', '.join(frozen)} cannot take adapters here (the embedding and "
                          "head stay frozen); target the decoder layers' modules")
    if cfg.delayed_update or cfg.device_steps:
        what = "delayed_update" if cfg.delayed_update else f"device_steps ({cfg.device_steps})"
        raise ConfigError(f"{what} does not apply to lora_rank > 0: the adapters step on the GPU, no CPU "
                          f"AdamW step is left to overlap or move; drop it")


# The rules between fields, in the order they are checked (each field's own rule comes first).
SETTINGS_RULES: tuple[Callable[[TrainConfig, int], None], ...] = (_replicas, _stages, _segments, _offload, _timeline,
                                                                  _lora)


def check_settings(cfg: TrainConfig, world_size: int) -> None:
    """Every rule on the settings alone for a run of ``world_size`` processes: each field's own
    (``check=``), then ``SETTINGS_RULES``. The first broken one is a ConfigError of one line: the
    values given, what is allowed, what to change. The launch keys are train.sh's, checked where
    it resolves them (``launch_settings``)."""
    check_fields({name: getattr(cfg, name) for section, names in SECTIONS.items() if section != "launch"
                  for name in names})
    for rule in SETTINGS_RULES:
        rule(cfg, world_size)
