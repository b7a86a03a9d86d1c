"""Where each adapter module lands in the base model.

Turns the adapter's modules into LoRA ops on named base tensors, using the
family tables (dense linears, per-expert or fused expert layouts, tied output
head). Shared by every format that merges (merged-safetensors now, GGUF later)
and by verification.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from . import errors as E
from .adapter import Adapter, LoraModule
from .base_model import BaseModel
from .errors import InputError
from .io.safetensors_reader import TensorInfo
from .plan import LoraOp, Source


@dataclass(frozen=True)
class Placement:
    """One (module, expert) pair placed on a base tensor."""

    tensor: str  # output tensor name (lm_head.weight for an untied head on a tied model)
    row_offset: int
    a: Source
    b: Source
    module: LoraModule
    expert: int | None
    label: str


def matrix(path: str, info: TensorInfo, expert: int | None = None) -> Source:
    """The 2-D matrix of an adapter tensor; for 3-D tensors, expert ``expert``'s slice (or the shared one)."""
    if len(info.shape) == 2:
        return Source(path, info.name, info.dtype, 0, info.shape[0], info.shape[1])
    n, rows, cols = info.shape
    i = 0 if n == 1 else expert
    return Source(path, info.name, info.dtype, i * rows, (i + 1) * rows, cols)


def _need(base: BaseModel, name: str, m: LoraModule) -> TensorInfo:
    if name not in base.tensors:
        raise InputError(E.ADAPTER_SHAPE_MISMATCH, f"adapter module {m.key} targets {name}, which the base model does not have; the adapter was trained on a different base model.")
    return base.info(name)


def num_experts(base: BaseModel) -> int:
    return base.family.moe.num_experts(base.config)


def expert_target(base: BaseModel, layer: int, proj: str, expert: int, m: LoraModule) -> tuple[str, int]:
    """(tensor name, row offset) of one expert projection in the base's on-disk layout."""
    moe = base.family.moe
    per_expert = moe.per_expert.format(layer=layer, expert=expert, proj=proj)
    if per_expert in base.tensors:
        return per_expert, 0
    slot = moe.fused[proj]
    name = slot.tensor.format(layer=layer)
    info = _need(base, name, m)
    return name, expert * info.shape[1] + slot.chunk * (info.shape[1] // slot.chunks)


def place(m: LoraModule, base: BaseModel, adapter_path: str) -> list[Placement]:
    """Where one adapter module applies; 3-D expert modules fan out to every expert."""
    fam = base.family
    if m.kind == "linear":
        tmpl = fam.layer_linears.get(m.module)
        if tmpl is None:
            raise InputError(E.ADAPTER_UNKNOWN_TENSOR, f"adapter module {m.key} is not a linear module of {fam.name}; known: {', '.join(fam.layer_linears)}.")
        name = tmpl.format(layer=m.layer)
        _need(base, name, m)
        return [Placement(name, 0, matrix(adapter_path, m.a), matrix(adapter_path, m.b), m, None, m.key)]
    if m.kind == "unembed":
        # On a tied model the head is built from the embedding, then trained separately.
        _need(base, fam.embed if base.tied else fam.lm_head, m)
        return [Placement(fam.lm_head, 0, matrix(adapter_path, m.a), matrix(adapter_path, m.b), m, None, m.key)]
    if fam.moe is None:
        raise InputError(E.ADAPTER_UNKNOWN_TENSOR, f"adapter module {m.key} trains MoE experts but {fam.name} has no experts; the adapter was trained on a different base model.")
    if not fam.moe.is_sparse(base.config, m.layer):
        raise InputError(E.ADAPTER_SHAPE_MISMATCH, f"adapter module {m.key} trains experts on layer {m.layer}, which is a dense layer in the base model.")
    if m.kind == "expert":
        name, off = expert_target(base, m.layer, m.module, m.expert, m)
        return [Placement(name, off, matrix(adapter_path, m.a), matrix(adapter_path, m.b), m, m.expert, m.key)]
    proj = fam.moe.archive_projections[m.module]
    n = num_experts(base)
    for t in (m.a, m.b):
        if t.shape[0] not in (1, n):
            raise InputError(E.ADAPTER_SHAPE_MISMATCH, f"adapter module {m.key} has {t.shape[0]} experts in {t.name} but the base model has {n}.")
    out = []
    for e in range(n):
        name, off = expert_target(base, m.layer, proj, e, m)
        out.append(Placement(name, off, matrix(adapter_path, m.a, e), matrix(adapter_path, m.b, e), m, e, f"{m.key}[{e}]"))
    return out


def placements(adapter: Adapter, base: BaseModel) -> list[Placement]:
    path = str(adapter.path)
    return [p for m in adapter.modules for p in place(m, base, path)]


def ops_by_tensor(adapter: Adapter, base: BaseModel) -> dict[str, list[LoraOp]]:
    """Base (or new lm_head) tensor name -> LoRA ops to apply to it."""
    ops: dict[str, list[LoraOp]] = defaultdict(list)
    for p in placements(adapter, base):
        ops[p.tensor].append(LoraOp(p.a, p.b, p.module.scale, p.row_offset, p.label))
    return dict(ops)
