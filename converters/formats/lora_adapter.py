"""lora-adapter: a PEFT LoRA adapter that loads next to the base model.

Archive names are already PEFT's for dense modules; the trained unembedding
becomes ``lm_head``, and 3-D expert tensors are expanded into per-expert 2-D
modules (``mlp.experts.{e}.{gate,up,down}_proj``), the layout vLLM reads.
Per-module ranks and alphas that differ from the most common one are written
as PEFT rank_pattern / alpha_pattern entries (escaped full module names).
"""

from __future__ import annotations

import json
import re
from collections import Counter

from .. import compat
from ..plan import Plan, TensorPlan, shard
from ..targets import matrix, num_experts
from .base import ConvertContext, Converter

ADAPTER_FILE = "adapter_model.safetensors"


def peft_module_names(ctx: ConvertContext) -> list[tuple[str, object, int | None]]:
    """(PEFT module path, adapter module, expert index) for every output module."""
    base = ctx.base
    out = []
    for m in ctx.adapter.modules:
        if m.kind == "linear":
            out.append((f"model.layers.{m.layer}.{m.module}", m, None))
        elif m.kind == "unembed":
            out.append(("lm_head", m, None))
        elif m.kind == "expert":
            out.append((base.family.moe.peft_per_expert.format(layer=m.layer, expert=m.expert, proj=m.module), m, m.expert))
        else:
            proj = base.family.moe.archive_projections[m.module]
            for e in range(num_experts(base)):
                out.append((base.family.moe.peft_per_expert.format(layer=m.layer, expert=e, proj=proj), m, e))
    return out


class LoraAdapter(Converter):
    name = "lora-adapter"
    description = "PEFT LoRA adapter (PEFT, vLLM, SGLang)"

    def plan(self, ctx: ConvertContext) -> Plan:
        # Placement checks (targets exist, shapes fit) are the same as for merging.
        from ..targets import placements

        placements(ctx.adapter, ctx.base)
        path = str(ctx.adapter.path)
        tensors = []
        modules = peft_module_names(ctx)
        for peft_name, m, e in modules:
            for ab, info in (("A", m.a), ("B", m.b)):
                src = matrix(path, info, e)
                dtype = ctx.options.dtype or src.dtype
                tensors.append(TensorPlan(f"base_model.model.{peft_name}.lora_{ab}.weight", dtype, (src.rows, src.cols), (src,)))
        plan = Plan(self.name, files=shard(tensors, 1 << 62, stem="adapter_model"))
        plan.generated["adapter_config.json"] = (json.dumps(self.adapter_config(ctx, modules), indent=2) + "\n").encode()
        for p in ctx.base.aux_files():
            # Tokenizer and chat template travel with the adapter so serving
            # engines render prompts exactly as in training.
            if p.name.startswith(("tokenizer", "special_tokens_map", "chat_template", "vocab", "merges", "added_tokens")):
                plan.copied.append((p, p.name))
        return plan

    def adapter_config(self, ctx: ConvertContext, modules) -> dict:
        src = ctx.adapter.config
        pairs = Counter((m.rank, m.alpha) for _, m, _ in modules)
        (r, alpha), _ = pairs.most_common(1)[0]
        rank_pattern, alpha_pattern = {}, {}
        for name, m, _e in modules:
            key = re.escape(name)
            if m.rank != r:
                rank_pattern[key] = m.rank
            if m.alpha != alpha:
                alpha_pattern[key] = m.alpha
        targets = sorted({name.rsplit(".", 1)[-1] for name, _, _ in modules})
        base_name = ctx.base.model_id or (ctx.checkpoint.base_model if ctx.checkpoint else None) or str(ctx.base.path)
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_name,
            "r": r,
            "lora_alpha": alpha if alpha != int(alpha) else int(alpha),
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": bool(src.get("use_rslora", False)),
            "use_dora": False,
            "target_modules": targets,
            "rank_pattern": rank_pattern,
            "alpha_pattern": alpha_pattern,
            "modules_to_save": None,
            "inference_mode": True,
        }

    def report(self, ctx: ConvertContext, plan: Plan) -> dict:
        config = json.loads(plan.generated["adapter_config.json"])
        ranks = {m.rank for m in ctx.adapter.modules}
        has_experts = any(m.kind in ("experts", "expert") for m in ctx.adapter.modules)
        return {"compatibility": compat.report(config, ranks, has_experts)}
