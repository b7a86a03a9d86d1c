"""gguf-lora: the adapter as a llama.cpp GGUF LoRA, loaded on top of a GGUF of the base.

Tensors are named ``<gguf base tensor>.lora_a`` / ``.lora_b`` with the same
name mapping, expert stacking and q/k permutation (of lora_b's rows) as the
base GGUF. llama.cpp scales every tensor by adapter.lora.alpha / rank, so a
module whose scale differs (rank_pattern / alpha_pattern / rsLoRA) has the
ratio folded into its lora_b.
"""

from __future__ import annotations

from collections import defaultdict

from .. import errors as E
from ..arch import GGUF_EXPERT_NAMES, GGUF_LAYER_NAMES, rope_permutation
from ..errors import InputError
from ..io.gguf_file import kv_f32, kv_string, kv_u32
from ..plan import FilePlan, Plan, TensorPlan
from ..targets import matrix, num_experts, placements
from .base import ConvertContext, Converter

ADAPTER_TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16"}


class GgufLora(Converter):
    name = "gguf-lora"
    description = "llama.cpp GGUF LoRA adapter (loads on a GGUF of the base model)"

    def plan(self, ctx: ConvertContext) -> Plan:
        base, cfg = ctx.base, ctx.base.config
        fam = base.family
        spec = fam.gguf
        if spec is None:
            raise InputError(E.UNSUPPORTED_ARCHITECTURE, f"{fam.name} cannot be exported to GGUF yet.")
        out_type = ADAPTER_TYPES.get(ctx.options.quant)
        if out_type is None:
            raise InputError(E.INVALID_OPTION, f"a GGUF LoRA is written as f32, f16 or bf16, not {ctx.options.quant}.", field="quant")
        placements(ctx.adapter, base)  # same target and shape checks as merging
        path = str(ctx.adapter.path)
        alpha = float(ctx.adapter.config["lora_alpha"])

        tensors: list[TensorPlan] = []
        stacked: dict[tuple[int, str], dict[int, tuple]] = defaultdict(dict)
        for m in ctx.adapter.modules:
            fold = m.scale * m.rank / alpha  # llama.cpp applies alpha / rank
            if m.kind == "linear":
                key = f"{m.module}.weight"
                gname = f"blk.{m.layer}.{GGUF_LAYER_NAMES[key]}"
                transform = rope_permutation(spec, m.module, cfg)  # lora_b's rows are the module's output rows
                a, b = matrix(path, m.a), matrix(path, m.b)
                tensors.append(TensorPlan(f"{gname}.lora_a", out_type, (a.rows, a.cols), (a,)))
                tensors.append(TensorPlan(f"{gname}.lora_b", out_type, (b.rows, b.cols), (b,), transform=transform, scale=fold))
            elif m.kind == "unembed":
                if base.tied:
                    raise InputError(E.INVALID_OPTION, "this model ties its output head to the embedding, so a trained unembedding cannot be a GGUF LoRA (llama.cpp has no output.weight to attach it to); export -f gguf instead.")
                a, b = matrix(path, m.a), matrix(path, m.b)
                tensors.append(TensorPlan("output.weight.lora_a", out_type, (a.rows, a.cols), (a,)))
                tensors.append(TensorPlan("output.weight.lora_b", out_type, (b.rows, b.cols), (b,), scale=fold))
            elif m.kind == "expert":
                stacked[(m.layer, m.module)][m.expert] = (matrix(path, m.a), matrix(path, m.b), fold)
            else:
                proj = fam.moe.archive_projections[m.module]
                for e in range(num_experts(base)):
                    stacked[(m.layer, proj)][e] = (matrix(path, m.a, e), matrix(path, m.b, e), fold)
        for (layer, proj), by_expert in sorted(stacked.items()):
            n = num_experts(base)
            if sorted(by_expert) != list(range(n)):
                raise InputError(E.ADAPTER_SHAPE_MISMATCH, f"layer {layer} {proj}: the adapter trains experts {sorted(by_expert)}, but a GGUF LoRA needs all {n}.")
            folds = {f for _, _, f in by_expert.values()}
            if len(folds) != 1:
                raise InputError(E.ADAPTER_RANK_MISMATCH, f"layer {layer} {proj}: experts have different scales, which one GGUF LoRA tensor cannot carry.")
            a_src = tuple(by_expert[e][0] for e in range(n))
            b_src = tuple(by_expert[e][1] for e in range(n))
            gname = f"blk.{layer}.{GGUF_EXPERT_NAMES[proj]}"
            tensors.append(TensorPlan(f"{gname}.lora_a", out_type, (n, a_src[0].rows, a_src[0].cols), a_src))
            tensors.append(TensorPlan(f"{gname}.lora_b", out_type, (n, b_src[0].rows, b_src[0].cols), b_src, scale=folds.pop()))

        model_id = base.model_id or (ctx.checkpoint.base_model if ctx.checkpoint else None) or base.path.name
        basename = model_id.rsplit("/", 1)[-1]
        meta = (ctx.checkpoint.meta or {}) if ctx.checkpoint else {}
        kvs = [
            kv_string("general.architecture", spec.arch),
            kv_string("general.type", "adapter"),
            kv_string("adapter.type", "lora"),
            kv_f32("adapter.lora.alpha", alpha),
            kv_string("general.name", f"{basename} {meta.get('run_id', 'lora')}"),
            kv_string("general.basename", basename),
            kv_u32("general.base_model.count", 1),
            kv_string("general.base_model.0.name", basename),
        ]
        if "/" in model_id:
            kvs.append(kv_string("general.base_model.0.organization", model_id.split("/")[0]))
        return Plan(self.name, files=[FilePlan(f"adapter-{ctx.options.quant.upper()}.gguf", tensors, kind="gguf", kvs=kvs)])
