"""merged-safetensors: a standalone Hugging Face model with the LoRA folded in.

W' = W + scale * B @ A in fp32, rounded once to the output dtype; tensors the
adapter does not touch are copied byte-for-byte. An unembedding LoRA on a tied
model produces a separate lm_head.weight and flips tie_word_embeddings off,
leaving the input embedding unchanged.
"""

from __future__ import annotations

import json

from ..io.dtypes import FLOAT_DTYPES, torch_name
from ..plan import Plan, Source, TensorPlan, index_json, shard
from ..targets import ops_by_tensor
from .base import ConvertContext, Converter


def patched_config(raw: bytes, changes: dict) -> bytes:
    config = json.loads(raw)
    config.update(changes)
    return (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode()


class MergedSafetensors(Converter):
    name = "merged-safetensors"
    description = "standalone Hugging Face model directory (transformers)"

    def plan(self, ctx: ConvertContext) -> Plan:
        base, opts = ctx.base, ctx.options
        fam = base.family
        ops = ops_by_tensor(ctx.adapter, base) if ctx.adapter else {}

        def out_dtype(dtype: str) -> str:
            return opts.dtype if opts.dtype and dtype in FLOAT_DTYPES else dtype

        ordered = sorted(base.tensors.items(), key=lambda kv: (kv[1][0], kv[1][1].start))
        tensors = []
        for name, (fname, info) in ordered:
            src = Source(str(base.path / fname), name, info.dtype, 0, info.rows, info.cols)
            tensors.append(TensorPlan(name, out_dtype(info.dtype), info.shape, (src,), tuple(ops.get(name, ()))))
        config_changes = {}
        if fam.lm_head in ops and fam.lm_head not in base.tensors:
            # Tied model with a trained head: the head starts as a copy of the embedding.
            fname, emb = base.tensors[fam.embed]
            src = Source(str(base.path / fname), fam.embed, emb.dtype, 0, emb.rows, emb.cols)
            tensors.append(TensorPlan(fam.lm_head, out_dtype(emb.dtype), emb.shape, (src,), tuple(ops[fam.lm_head])))
            config_changes[fam.tie_key] = False
        elif fam.lm_head in ops and base.tied:
            config_changes[fam.tie_key] = False
        if opts.dtype:
            for key in ("torch_dtype", "dtype"):
                if key in base.config:
                    config_changes[key] = torch_name(opts.dtype)
        plan = Plan(self.name, files=shard(tensors, opts.max_shard_size))
        if len(plan.files) > 1:
            plan.generated["model.safetensors.index.json"] = index_json(plan.files)
        for p in base.aux_files():
            if p.name == "config.json" and config_changes:
                plan.generated["config.json"] = patched_config(p.read_bytes(), config_changes)
                plan.notes.append(f"config.json: set {', '.join(f'{k}={v}' for k, v in config_changes.items())}")
            else:
                plan.copied.append((p, p.name))
        return plan
