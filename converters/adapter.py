"""The LoRA adapter inside a checkpoint: its tensors, ranks and scales.

Tensor names are matched against a table of patterns (the archive's own
naming plus the standard PEFT names, so our lora-adapter output reads back
in). Every tensor must match a pattern and pair up as lora_A/lora_B, or the
adapter is refused. Scales follow PEFT: alpha / r, or alpha / sqrt(r) with
use_rslora, with per-module rank_pattern / alpha_pattern.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from . import errors as E
from .errors import InputError
from .io.safetensors_reader import SafetensorsFile, TensorInfo

ADAPTER_DTYPES = {"F32", "BF16", "F16"}

# (regex, kind). Named groups: layer, module, expert, proj, ab.
# kind: "linear" (a module inside a layer), "unembed", "experts" (3-D, archive
# naming w1/w2/w3), "expert" (one expert's 2-D module, PEFT/vLLM naming).
_NAME_PATTERNS: tuple[tuple[re.Pattern, str], ...] = tuple(
    (re.compile(p), kind)
    for p, kind in (
        (r"^base_model\.model\.model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<proj>w[123])\.lora_(?P<ab>[AB])\.weight$", "experts"),
        (r"^base_model\.model\.model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.lora_(?P<ab>[AB])\.weight$", "expert"),
        (r"^base_model\.model\.model\.layers\.(?P<layer>\d+)\.(?P<module>(?:self_attn|mlp)\.[a-z_]+_proj)\.lora_(?P<ab>[AB])\.weight$", "linear"),
        (r"^base_model\.model\.(?:model\.unembed_tokens|lm_head)\.lora_(?P<ab>[AB])\.weight$", "unembed"),
    )
)


@dataclass(frozen=True)
class LoraModule:
    """One trained module: a pair of A/B tensors and its scale.

    For ``experts`` (3-D archive tensors) A is [E|1, r, in] and B is
    [E|1, out, r]; a leading size of 1 is shared by every expert.
    """

    key: str  # module path without "base_model.model.", used for rank/alpha patterns
    kind: str  # linear | unembed | experts | expert
    layer: int | None
    module: str | None  # e.g. "self_attn.q_proj", or the expert projection ("gate_proj")
    expert: int | None
    a: TensorInfo
    b: TensorInfo
    rank: int
    alpha: float
    scale: float

    @property
    def in_features(self) -> int:
        return self.a.shape[-1]

    @property
    def out_features(self) -> int:
        return self.b.shape[-2]


@dataclass
class Adapter:
    path: Path
    file: SafetensorsFile
    config: dict
    modules: list[LoraModule]

    @property
    def tensor_names(self) -> set[str]:
        return set(self.file.tensors)

    def close(self) -> None:
        self.file.close()


def _pattern_value(patterns: dict, key: str, default):
    """PEFT's rule: a pattern matches a module name if the name ends with it (regex)."""
    for pat, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pat})$", key):
            return value
    return default


def _config_number(config: dict, name: str, kind) -> float:
    v = config.get(name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 or (kind is int and int(v) != v):
        raise InputError(E.ADAPTER_CONFIG_INVALID, f"adapter_config.json must set {name} to a positive {'integer' if kind is int else 'number'} (got {v!r}).")
    return kind(v)


def _validate_config(config: dict) -> None:
    _config_number(config, "r", int)
    _config_number(config, "lora_alpha", float)
    for k in ("rank_pattern", "alpha_pattern"):
        if k in config and config[k] is not None and not isinstance(config[k], dict):
            raise InputError(E.ADAPTER_CONFIG_INVALID, f"adapter_config.json {k} must be an object mapping module patterns to numbers.")
    if config.get("use_dora"):
        raise InputError(E.ADAPTER_CONFIG_INVALID, "DoRA adapters (use_dora: true) are not supported; train a plain LoRA adapter.")
    if config.get("peft_type") not in (None, "LORA"):
        raise InputError(E.ADAPTER_CONFIG_INVALID, f"peft_type {config.get('peft_type')!r} is not supported; only LORA adapters can be exported.")


def _check_finite(f: SafetensorsFile, info: TensorInfo) -> None:
    t = f.rows(info.name, 0, info.rows)
    finite = bool(torch.isfinite(t).all())
    del t
    f.release(info.start, info.end)  # keep the resident set small; re-read when merged
    if not finite:
        raise InputError(E.ADAPTER_NONFINITE, f"adapter tensor {info.name!r} holds NaN or Inf values; the training run diverged, export an earlier checkpoint.")


def load_adapter(path: str | Path, config: dict, max_header_bytes: int) -> Adapter:
    """Open and validate adapter_model.safetensors against adapter_config.json."""
    _validate_config(config)
    f = SafetensorsFile(path, max_header_bytes)
    try:
        modules = _parse_modules(f, config)
    except BaseException:
        f.close()
        raise
    return Adapter(Path(path), f, config, modules)


def _parse_modules(f: SafetensorsFile, config: dict) -> list[LoraModule]:
    pairs: dict[tuple, dict] = {}
    for name, info in f.tensors.items():
        for rx, kind in _NAME_PATTERNS:
            m = rx.match(name)
            if m:
                break
        else:
            raise InputError(E.ADAPTER_UNKNOWN_TENSOR, f"adapter tensor {name!r} is not a LoRA weight this tool knows (expected …layers.N.(self_attn|mlp).X_proj.lora_A/B.weight, unembed_tokens or experts.w1/w2/w3); remove it or rename it.")
        if info.dtype not in ADAPTER_DTYPES:
            raise InputError(E.ADAPTER_DTYPE_UNSUPPORTED, f"adapter tensor {name!r} is {info.dtype}; LoRA weights must be F32, BF16 or F16.")
        g = m.groupdict()
        layer = int(g["layer"]) if g.get("layer") is not None else None
        expert = int(g["expert"]) if g.get("expert") is not None else None
        module = g.get("module") or g.get("proj")
        key = name.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
        ident = (kind, layer, module, expert)
        slot = pairs.setdefault(ident, {"key": key})
        slot[g["ab"]] = info
        _check_finite(f, info)

    r_default = int(config["r"])
    alpha_default = float(config["lora_alpha"])
    rslora = bool(config.get("use_rslora", False))
    modules = []
    for (kind, layer, module, expert), slot in sorted(pairs.items(), key=lambda kv: (kv[0][1] if kv[0][1] is not None else 1 << 30, str(kv[0]))):
        key = slot["key"]
        if "A" not in slot or "B" not in slot:
            missing = "lora_B" if "A" in slot else "lora_A"
            raise InputError(E.ADAPTER_UNPAIRED, f"adapter module {key!r} has no {missing} tensor; the adapter file is incomplete.")
        a, b = slot["A"], slot["B"]
        ndim = 3 if kind == "experts" else 2
        if len(a.shape) != ndim or len(b.shape) != ndim:
            raise InputError(E.ADAPTER_SHAPE_MISMATCH, f"adapter module {key!r} must have {ndim}-D lora_A/lora_B tensors, got {list(a.shape)} and {list(b.shape)}.")
        rank = a.shape[-2]
        if b.shape[-1] != rank:
            raise InputError(E.ADAPTER_SHAPE_MISMATCH, f"adapter module {key!r}: lora_A has rank {rank} but lora_B has {b.shape[-1]} columns.")
        if ndim == 3 and a.shape[0] != b.shape[0] and 1 not in (a.shape[0], b.shape[0]):
            raise InputError(E.ADAPTER_SHAPE_MISMATCH, f"adapter module {key!r}: lora_A has {a.shape[0]} experts and lora_B {b.shape[0]}; they must match or one must be 1 (shared).")
        r_cfg = int(_pattern_value(config.get("rank_pattern"), key, r_default))
        if r_cfg != rank:
            raise InputError(E.ADAPTER_RANK_MISMATCH, f"adapter module {key!r} has rank {rank} but adapter_config.json implies {r_cfg}; fix r/rank_pattern.")
        alpha = float(_pattern_value(config.get("alpha_pattern"), key, alpha_default))
        scale = alpha / math.sqrt(rank) if rslora else alpha / rank
        modules.append(LoraModule(key, kind, layer, module, expert, a, b, rank, alpha, scale))
    if not modules:
        raise InputError(E.ADAPTER_UNKNOWN_TENSOR, "adapter_model.safetensors holds no LoRA tensors.")
    return modules
