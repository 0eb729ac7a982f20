"""LoRA's settings resolved once, before anything is built: which modules get adapters (peft's
names, ``all-linear`` expanded against the model the way peft expands it), how many adapter
elements each stage holds and, with ``load_in_4bit`` (QLoRA), how the base's linear weights are
quantized and what they then cost. No weights, no peft: the counts read the model's skeleton on the meta
device, so ``--plan`` of a 70B-class model runs on a laptop. The combinations refused are
checked before launch: on the settings in ``pipeline.plan.settings_rules``, against the model in
``pipeline.plan.model_rules``, the saved adapter's files in ``pipeline.plan.preflight``. A saved
adapter is read here too, without a tensor: its ``adapter_config.json`` and the shapes its
safetensors header gives (``adapter_mismatches``: everything in it that differs from the run)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from offload.slices import PACK_ALIGN
from inputs import InputError, read_json
from pipeline.config import ALL_LINEAR, TrainConfig, lora_targets
from pipeline.spec.shapes import SIZE_KEYS, size_differences
from pipeline.spec.weight_files import tensor_shapes

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # what a PeftModel's saved keys start with
# peft settings an adapter may carry whose training the stages do not do (another scaling, other
# weights), with the values that mean "off": continuing such an adapter here would train another model.
_NOT_TRAINED_HERE = {"use_rslora": (False, None), "use_dora": (False, None), "bias": ("none", None),
                     "modules_to_save": (None, []), "layers_to_transform": (None, []), "rank_pattern": ({}, None),
                     "alpha_pattern": ({}, None), "fan_in_fan_out": (False, None)}


@dataclass(frozen=True)
class LoraSettings:
    """One run's adapters: rank, alpha, dropout, the target modules' names (expanded) and the
    base they adapt (4-bit or not)."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    base: Base4bit | None = None  # load_in_4bit: the base's linear weights in 4 bits (None: the compute dtype)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class Base4bit:
    """``load_in_4bit``: the base's linear weights in bitsandbytes' 4-bit blocks, as transformers'
    ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type, bnb_4bit_use_double_quant)``
    quantizes them: blocks of ``blocksize`` elements with an fp32 absmax each (with double
    quantization the absmax in 8 bits, in blocks of ``NESTED_BLOCKSIZE`` with an fp32 absmax and
    one fp32 offset), the data type's 16-value code beside them; uint8 storage."""

    quant_type: str = "nf4"
    double_quant: bool = False
    blocksize: int = 64  # bitsandbytes' Params4bit default, which transformers keeps

    NESTED_BLOCKSIZE = 256  # bitsandbytes' blocks of the quantized absmax (quantize_blockwise)
    NESTED_CODE = 256       # its dynamic map's entries (fp32)

    def weight_bytes(self, numel: int) -> int:
        """Bytes of one quantized weight of ``numel`` elements in the store's buffer: two elements
        a byte, the scales, the code(s), each part aligned to ``PACK_ALIGN``."""
        blocks = -(-numel // self.blocksize)
        parts = [(numel + 1) // 2, 16 * 4]  # packed weight, code
        if self.double_quant:
            parts += [blocks, 4, -(-blocks // self.NESTED_BLOCKSIZE) * 4, self.NESTED_CODE * 4]
        else:
            parts += [blocks * 4]
        return sum(-(-n // PACK_ALIGN) * PACK_ALIGN for n in parts)

    def record(self, compute_dtype: str) -> dict:
        """``BitsAndBytesConfig``'s arguments for this quantization (an adapter's record of its
        base, ``data.generation.BASE_QUANTIZATION``; the reference model of the tests)."""
        return {"load_in_4bit": True, "bnb_4bit_quant_type": self.quant_type,
                "bnb_4bit_use_double_quant": self.double_quant, "bnb_4bit_compute_dtype": compute_dtype}

    def describe(self) -> str:
        return f"4-bit {self.quant_type}{' with double quantization' if self.double_quant else ''}"


def base_4bit(cfg: TrainConfig) -> Base4bit | None:
    """The run's 4-bit base (None: the base in the compute dtype)."""
    if not (cfg.lora_rank and cfg.load_in_4bit):
        return None
    return Base4bit(cfg.bnb_4bit_quant_type, cfg.bnb_4bit_use_double_quant)


def adapter_config(path: str | Path) -> dict:
    """A saved peft adapter's ``adapter_config.json``; InputError (one line) where it is not
    UTF-8, not JSON or not a mapping."""
    file = Path(path) / ADAPTER_CONFIG
    value = read_json(file, "adapter config")
    if not isinstance(value, dict):
        raise InputError(f"adapter config {str(file)!r} holds a JSON {type(value).__name__}, not peft's mapping of "
                         "settings")
    return value


def saved_targets(config: dict) -> list[str]:
    """The target modules a saved adapter's config names, by their last names as this run's
    lora_target_modules gives them (peft writes a list of last or whole names, or one name)."""
    targets = config.get("target_modules") or []
    return sorted({_short(t) for t in ([targets] if isinstance(targets, str) else targets)})


def adapter_flags(config: dict) -> str:
    """The flags of a run whose adapters are those of a saved adapter's ``config``."""
    return (f"--lora_rank {config.get('r')} --lora_alpha {config.get('lora_alpha')} "
            f"--lora_target_modules {','.join(saved_targets(config))}")


# Per model config (its JSON): each decoder layer's linear modules as (name within the layer, in
# features, out features). The memory plan asks for them many times while it resolves the
# automatic choices.
_LINEARS: dict[str, list[list[tuple[str, int, int]]]] = {}


def _layer_linears(hf_config) -> list[list[tuple[str, int, int]]]:
    key = hf_config.to_json_string(use_diff=False)
    if key not in _LINEARS:
        from torch import nn

        from models import skeleton

        sk = skeleton(hf_config)
        _LINEARS[key] = [[(n, m.in_features, m.out_features) for n, m in layer.named_modules()
                          if isinstance(m, nn.Linear)] for layer in sk.model.layers]
    return _LINEARS[key]


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def linear_names(hf_config) -> list[str]:
    """The last names of the decoder layers' linear modules (what peft's all-linear targets: every
    linear layer but the output head; stacked experts are parameters, not linear layers)."""
    return sorted({_short(name) for layer in _layer_linears(hf_config) for name, _, _ in layer})


def adapter_shapes(hf_config, rank: int, targets) -> dict[str, tuple[int, int]]:
    """The tensors a peft adapter of ``rank`` on ``targets`` (last names) holds for this model, by
    their saved keys: A is (rank, in features), B (out features, rank)."""
    out = {}
    for i, layer in enumerate(_layer_linears(hf_config)):
        for name, fan_in, fan_out in layer:
            if _short(name) in targets:
                key = f"{PEFT_PREFIX}model.layers.{i}.{name}"
                out[f"{key}.lora_A.weight"] = (rank, fan_in)
                out[f"{key}.lora_B.weight"] = (fan_out, rank)
    return out


def _base_differs(config: dict, whole) -> str | None:
    """How the base model a saved adapter records differs from the model ``whole`` (its config),
    where that base is still there to read; None when it is not, or does not differ."""
    base = config.get("base_model_name_or_path")
    if not isinstance(base, str) or not (Path(base) / "config.json").is_file():
        return None
    try:
        theirs = read_json(Path(base) / "config.json", "model config")
    except InputError:
        return None
    differ = size_differences(theirs, whole, (*SIZE_KEYS, "num_hidden_layers"))
    return f"it records the base model {base!r}, another model ({'; '.join(differ)})" if differ else None


def adapter_mismatches(adapter: str | Path, whole, kept,
                       settings: LoraSettings | None) -> tuple[list[str], list[str]]:
    """Everything in the saved peft adapter ``adapter`` that does not fit a run: what differs from
    its ``settings`` (rank, alpha, target modules: a run with the adapter's settings would take
    it), and what no settings change (peft settings the stages do not train; the tensors' shapes
    against the model, ``whole`` its config and ``kept`` the layers the run keeps; the base model
    it records). ``settings`` None (generate.py) checks the model alone. Reads the config and the
    safetensors header, no tensor. Two empty lists when the adapter fits."""
    config = adapter_config(adapter)
    problems: list[str] = []
    rank, alpha, targets = config.get("r"), config.get("lora_alpha"), saved_targets(config)
    if settings is not None:
        if rank != settings.rank:
            problems.append(f"r {rank} (this run's lora_rank {settings.rank})")
        if alpha is None or float(alpha) != float(settings.alpha):
            problems.append(f"lora_alpha {alpha} (this run's {settings.alpha:g})")
        if targets != sorted(settings.targets):
            problems.append(f"target_modules {','.join(targets)} (this run's {','.join(sorted(settings.targets))})")
    model = [f"{key} {config[key]!r} (not trained here)" for key, off in _NOT_TRAINED_HERE.items()
             if settings is not None and config.get(key, off[0]) not in off]
    if not isinstance(rank, int) or rank < 1:
        return problems, model + [f"r {rank!r} is not a rank"]
    expected = adapter_shapes(kept, rank, set(targets))
    saved = tensor_shapes(Path(adapter) / ADAPTER_WEIGHTS)
    wrong = [k for k in expected if k in saved and tuple(saved[k]) != expected[k]]
    missing = [k for k in expected if k not in saved]
    known = adapter_shapes(whole, rank, set(targets))  # the layers num_layers leaves out: not read, not wrong
    extra = [k for k in saved if k not in known]
    if wrong:
        k = wrong[0]
        model.append(f"{len(wrong)} of its tensors have other shapes than this model's (e.g. "
                     f"{k.removeprefix(PEFT_PREFIX)} {tuple(saved[k])}, this model {expected[k]})")
    if missing:
        model.append(f"{len(missing)} of this model's adapter tensors are not in it (e.g. "
                     f"{missing[0].removeprefix(PEFT_PREFIX)})")
    if extra:
        model.append(f"{len(extra)} of its tensors are for modules this model does not have (e.g. "
                     f"{extra[0].removeprefix(PEFT_PREFIX)})")
    base = _base_differs(config, whole)
    if base:
        model.append(base)
    elif model and config.get("base_model_name_or_path"):
        model.append(f"it was trained on {config['base_model_name_or_path']!r}")
    return problems, model


def adapter_fits(adapter: Path, base: Path) -> list[str]:
    """What in the saved adapter ``adapter`` does not fit the model in the directory ``base``
    (generate.py's check before it loads either)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base)
    return adapter_mismatches(adapter, config, config, None)[1]


@dataclass(frozen=True)
class Quantized:
    """What ``load_in_4bit`` does to some decoder layers: elements of their linear weights held
    in 4 bits, those weights' bytes (``Base4bit.weight_bytes``) and the largest one's elements
    (it is dequantized whole to the compute dtype for each product)."""

    numel: int = 0
    nbytes: int = 0
    largest: int = 0


def quantized(hf_config, base: Base4bit | None, layer_ids) -> Quantized:
    """``load_in_4bit`` of the decoder layers ``layer_ids``: every linear weight of theirs, the
    modules transformers' bitsandbytes integration converts (it keeps only the head, which is no
    decoder layer's, and tied matrices in the compute dtype)."""
    if base is None:
        return Quantized()
    weights = [i * o for layer in (_layer_linears(hf_config)[i] for i in layer_ids) for _, i, o in layer]
    return Quantized(sum(weights), sum(base.weight_bytes(n) for n in weights), max(weights, default=0))


def lora_settings(cfg: TrainConfig, hf_config) -> LoraSettings | None:
    """The run's adapters (None for full fine-tuning), ``all-linear`` expanded to the model's
    decoder layers' linear modules (``model_rules.adapters_fit`` checked the targets)."""
    if not cfg.lora_rank:
        return None
    targets = lora_targets(cfg)
    if targets == [ALL_LINEAR]:
        targets = linear_names(hf_config)
    return LoraSettings(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, tuple(sorted(targets)), base_4bit(cfg))


def adapter_numel(hf_config, settings: LoraSettings | None, layer_ids) -> int:
    """Adapter elements of the decoder layers ``layer_ids``: r * (in + out) per targeted linear."""
    if settings is None:
        return 0
    per_layer = _adapter_per_layer(hf_config, settings)
    return sum(per_layer[i] for i in layer_ids)


def trained_adapters(hf_config, settings: LoraSettings | None) -> int | None:
    """The adapter parameters a LoRA run trains over every decoder layer; None for full fine-tuning."""
    return None if settings is None else adapter_numel(hf_config, settings, range(hf_config.num_hidden_layers))


def _adapter_per_layer(hf_config, settings: LoraSettings) -> list[int]:
    return [sum(settings.rank * (fan_in + fan_out) for name, fan_in, fan_out in layer
                if _short(name) in settings.targets) for layer in _layer_linears(hf_config)]


def adapted_per_layer(hf_config, settings: LoraSettings | None) -> int:
    """Targeted linear modules in one decoder layer (the most of any layer): each keeps an r-wide
    activation per token for its backward."""
    if settings is None:
        return 0
    return max((sum(_short(name) in settings.targets for name, _, _ in layer) for layer in _layer_linears(hf_config)),
               default=0)


def adapts_mlp_width(hf_config, settings: LoraSettings | None) -> bool:
    """Whether an adapted linear of a decoder layer makes an MLP-wide output (gate, up): peft adds
    its adapter's output to the base output as a new tensor of that width, and a compiled layer's
    backward then holds more MLP-wide tensors (``pipeline.spec.compute_bytes.mlp_work``)."""
    if settings is None:
        return False
    width = getattr(hf_config, "intermediate_size", 0)
    return any(_short(name) in settings.targets and fan_out > fan_in and fan_out >= width
               for layer in _layer_linears(hf_config) for name, fan_in, fan_out in layer)


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "ALL_LINEAR", "PEFT_PREFIX", "Base4bit", "LoraSettings", "Quantized",
           "adapted_per_layer", "adapter_config", "adapter_fits", "adapter_flags", "adapter_mismatches", "adapter_numel",
           "adapter_shapes", "adapts_mlp_width", "base_4bit", "linear_names", "lora_settings", "quantized",
           "saved_targets", "trained_adapters"]
