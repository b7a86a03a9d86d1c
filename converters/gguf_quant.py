"""Which ggml type each GGUF tensor gets, per output type (--quant).

The unquantized outputs (f32/f16/bf16) follow convert_hf_to_gguf: 1-D tensors,
norms, the MoE router and rope factors stay F32, everything else takes the
output type. The quantized ones follow llama.cpp's quantizer
(llama_tensor_get_type in llama-quant.cpp) applied to that bf16 file, so a
one-pass export has the same per-tensor types as `llama-quantize` would
produce: the output head's upgrade, attn_v / ffn_down upgrades on the layers
llama.cpp upgrades, and the fallback when a row length is not a multiple of
the block size. The rules are data below plus the few functions that need
layer position.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, LlamaFileType

from . import errors as E
from .arch import GGUF_F32_SUFFIXES
from .errors import InputError
from .io.gguf_file import ggml_type


@dataclass(frozen=True)
class QuantType:
    name: str
    file_type: LlamaFileType
    default: str  # ggml type of ordinary weights

    @property
    def quantized(self) -> bool:
        return self.default not in ("F32", "F16", "BF16")


QUANT_TYPES: dict[str, QuantType] = {q.name: q for q in (
    QuantType("f32", LlamaFileType.ALL_F32, "F32"),
    QuantType("f16", LlamaFileType.MOSTLY_F16, "F16"),
    QuantType("bf16", LlamaFileType.MOSTLY_BF16, "BF16"),
    QuantType("q8_0", LlamaFileType.MOSTLY_Q8_0, "Q8_0"),
    QuantType("q4_0", LlamaFileType.MOSTLY_Q4_0, "Q4_0"),
    QuantType("q5_0", LlamaFileType.MOSTLY_Q5_0, "Q5_0"),
    QuantType("q3_k_m", LlamaFileType.MOSTLY_Q3_K_M, "Q3_K"),
    QuantType("q4_k_s", LlamaFileType.MOSTLY_Q4_K_S, "Q4_K"),
    QuantType("q4_k_m", LlamaFileType.MOSTLY_Q4_K_M, "Q4_K"),
    QuantType("q5_k_s", LlamaFileType.MOSTLY_Q5_K_S, "Q5_K"),
    QuantType("q5_k_m", LlamaFileType.MOSTLY_Q5_K_M, "Q5_K"),
    QuantType("q6_k", LlamaFileType.MOSTLY_Q6_K, "Q6_K"),
)}

# llama.cpp's fallback when a row is not a multiple of the type's block size.
_FALLBACK = {"Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def quant_type(name: str) -> QuantType:
    q = QUANT_TYPES.get(name.lower())
    if q is None:
        raise InputError(E.INVALID_OPTION, f"quant type {name!r} is not supported; choose one of {', '.join(QUANT_TYPES)}.", field="quant")
    return q


@dataclass(frozen=True)
class ModelFacts:
    """What llama.cpp's type choice looks at besides the tensor itself."""

    n_layer: int
    n_expert: int
    is_70b: bool = False


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    for key, cat in (("attn_qkv.weight", "attn_v"), ("attn_v.weight", "attn_v"), ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down")):
        if key in name:
            return cat
    return "other"


def _more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _block(t: str) -> int:
    return GGML_QUANT_SIZES[ggml_type(t)][0]


def base_type(name: str, shape: tuple[int, ...], q: QuantType) -> str:
    """The type convert_hf_to_gguf would write (the input llama-quantize sees, for quantized q)."""
    if len(shape) <= 1 or name.endswith(GGUF_F32_SUFFIXES):
        return "F32"
    if q.quantized:
        return "BF16"
    return q.default


def _layer_of(name: str) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def _quantizable(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) >= 2 and name.endswith("weight") and "_norm.weight" not in name and "ffn_gate_inp.weight" not in name


def tensor_types(q: QuantType, tensors: list[tuple[str, tuple[int, ...]]], facts: ModelFacts) -> dict[str, str]:
    """GGUF name -> ggml type name for every tensor (numpy-order shapes)."""
    if not q.quantized:
        return {n: base_type(n, s, q) for n, s in tensors}
    # llama.cpp visits tensors ordered by layer, then name; its counters follow that order.
    order = sorted(tensors, key=lambda t: (_layer_of(t[0]), t[0]))
    has_output = any(n == "output.weight" for n, _ in tensors)
    n_attn_v = sum(1 for n, _ in tensors if _category(n) == "attn_v")
    counters = {"attn_v": 0, "ffn_down": 0}
    out = {}
    for name, shape in order:
        if not _quantizable(name, shape):
            out[name] = base_type(name, shape, q)
            continue
        t = _choose(name, shape, q, facts, has_output, n_attn_v, counters)
        if shape[-1] % _block(t):
            t = _FALLBACK.get(t, t)
            if shape[-1] % _block(t):
                t = "F16"
        out[name] = t
    return out


def _choose(name: str, shape, q: QuantType, facts: ModelFacts, has_output: bool, n_attn_v: int, counters: dict) -> str:
    cat = _category(name)
    t = q.default
    ft = q.name
    if cat == "output" or (not has_output and cat == "token_embd"):
        if shape[-1] % _block(t):
            return "Q8_0"
        return t if t == "Q8_0" else "Q6_K"
    if cat == "attn_v":
        i = counters["attn_v"]
        counters["attn_v"] += 1
        if ft == "q3_k_m":
            t = "Q5_K" if i < 2 else "Q4_K"
        elif ft in ("q4_k_m", "q5_k_m") and _more_bits(i, n_attn_v):
            t = "Q6_K"
        elif ft == "q4_k_s" and i < 4:
            t = "Q5_K"
        if facts.is_70b and t in ("Q3_K", "Q4_K"):
            t = "Q5_K"
        if facts.n_expert == 8:
            t = "Q8_0"
        return t
    if cat == "attn_k":
        return "Q8_0" if facts.n_expert == 8 else t
    if cat == "ffn_down":
        i = _layer_of(name) if facts.n_expert > 1 else counters["ffn_down"]
        counters["ffn_down"] += 1
        n = facts.n_layer
        if ft == "q3_k_m":
            t = "Q5_K" if i < n // 16 else "Q4_K"
        elif ft == "q4_k_m" and _more_bits(i, n):
            t = "Q6_K"
        elif ft == "q5_k_m" and _more_bits(i, n):
            t = "Q6_K"
        elif ft == "q4_k_s" and i < n // 8:
            t = "Q5_K"
        return t
    if cat == "attn_output":
        if facts.n_expert == 8:
            return "Q5_K" if ft in ("q3_k_m", "q4_k_s", "q4_k_m") else t
        return "Q4_K" if ft == "q3_k_m" else t
    return t
