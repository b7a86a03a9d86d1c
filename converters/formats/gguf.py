"""gguf: archive + base model straight to a llama.cpp file in one streaming pass.

Base tensors are read in row blocks, the LoRA delta is added in fp32, the
result is rounded to the base model's dtype (exactly the merged model), put in
GGUF's layout (q/k rows interleaved for llama-style rope, experts stacked into
ffn_*_exps) and encoded or quantized with ggml's own routines as it streams to
disk. No merged model is ever written. Without an archive it is a plain
HF -> GGUF converter.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

import numpy as np
from gguf import GGUFValueType

from .. import errors as E
from .. import gguf_vocab
from ..arch import GGUF_DROPPED, GGUF_EXPERT_NAMES, GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES, config_value, rope_parameters, rope_permutation
from ..errors import InputError
from ..gguf_quant import ModelFacts, quant_type, tensor_types
from ..io.gguf_file import KV, kv_f32, kv_string, kv_u32
from ..plan import FilePlan, LoraOp, Plan, Source, TensorPlan, Transform
from ..targets import ops_by_tensor
from .base import ConvertContext, Converter

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
GGML_QUANT_VERSION = 2


def remap_ops(sources: tuple[Source, ...], ops: dict[str, list[LoraOp]]) -> tuple[LoraOp, ...]:
    """LoRA ops on base tensors -> ops on the output tensor built from ``sources`` (in row order)."""
    out, start = [], 0
    for src in sources:
        for op in ops.get(src.tensor, ()):
            n = op.b.rows
            if src.r0 <= op.row_offset and op.row_offset + n <= src.r1:
                out.append(LoraOp(op.a, op.b, op.scale, start + op.row_offset - src.r0, op.module))
        start += src.rows
    return tuple(out)


def llama3_rope_factors(params: dict, head_dim: int) -> np.ndarray:
    """The per-frequency factors llama.cpp reads from rope_freqs for llama3 rope scaling."""
    base = float(params["rope_theta"])
    factor = float(params.get("factor", 8.0))
    low, high = float(params.get("low_freq_factor", 1.0)), float(params.get("high_freq_factor", 4.0))
    old_ctx = float(params.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wl, high_wl = old_ctx / low, old_ctx / high
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(factor)
        else:
            smooth = (old_ctx / wl - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


class Gguf(Converter):
    name = "gguf"
    needs_adapter = False
    description = "llama.cpp GGUF file, f32/f16/bf16 or quantized (q8_0 … q4_k_m)"

    def plan(self, ctx: ConvertContext) -> Plan:
        base, opts = ctx.base, ctx.options
        fam, cfg = base.family, base.config
        spec = fam.gguf
        if spec is None:
            raise InputError(E.UNSUPPORTED_ARCHITECTURE, f"{fam.name} cannot be exported to GGUF yet.")
        q = quant_type(opts.quant)
        ops = ops_by_tensor(ctx.adapter, base) if ctx.adapter else {}
        n_head = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // n_head)
        rope = rope_parameters(cfg)
        if rope["rope_type"] not in spec.rope_scaling:
            raise InputError(E.UNSUPPORTED_ARCHITECTURE, f"rope scaling {rope['rope_type']!r} of this {fam.name} model cannot be exported to GGUF yet (supported: {', '.join(spec.rope_scaling)}).")

        pending: list[tuple[str, tuple[int, ...], tuple[Source, ...], Transform | None]] = []
        experts: dict[tuple[int, str], dict[int, Source]] = defaultdict(dict)

        def src(name: str, r0: int | None = None, r1: int | None = None) -> Source:
            fname, info = base.tensors[name]
            return Source(str(base.path / fname), name, info.dtype, r0 or 0, info.rows if r1 is None else r1, info.cols)

        for name, (fname, info) in sorted(base.tensors.items(), key=lambda kv: (kv[1][0], kv[1][1].start)):
            if name in GGUF_GLOBAL_NAMES:
                pending.append((GGUF_GLOBAL_NAMES[name], info.shape, (src(name),), None))
                continue
            m = _LAYER.match(name)
            key = m.group(2) if m else None
            if m and key in GGUF_LAYER_NAMES:
                gname = f"blk.{m.group(1)}.{GGUF_LAYER_NAMES[key]}"
                module, _, param = key.rpartition(".")
                transform = rope_permutation(spec, module, cfg)
                if transform is not None and param == "bias":
                    raise InputError(E.UNSUPPORTED_ARCHITECTURE, "llama-style models with q/k biases cannot be exported to GGUF yet.")
                pending.append((gname, info.shape, (src(name),), transform))
            elif fam.moe and (pe := fam.moe.match_per_expert(name)):
                layer, expert, proj = pe
                experts[(layer, proj)][expert] = src(name)
            elif fam.moe and (fu := fam.moe.match_fused(name)):
                layer, slots = fu
                n_exp, rows = info.shape[0], info.shape[1]
                for proj, slot in slots:
                    per = rows // slot.chunks
                    lo = slot.chunk * per
                    experts[(layer, proj)].update({e: src(name, e * rows + lo, e * rows + lo + per) for e in range(n_exp)})
            elif name.endswith(GGUF_DROPPED):
                continue
            else:
                raise InputError(E.PLAN_INCOMPLETE, f"base tensor {name} has no GGUF counterpart for {fam.name}; the model has weights this exporter does not know.")
        for (layer, proj), by_expert in sorted(experts.items()):
            n = len(by_expert)
            if sorted(by_expert) != list(range(n)):
                raise InputError(E.BASE_INVALID, f"layer {layer} {proj}: experts {sorted(by_expert)} are not numbered 0..{n - 1}.")
            srcs = tuple(by_expert[e] for e in range(n))
            pending.append((f"blk.{layer}.{GGUF_EXPERT_NAMES[proj]}", (n, srcs[0].rows, srcs[0].cols), srcs, None))
        head_ops = None
        if fam.lm_head in ops and fam.lm_head not in base.tensors:
            # tied model with a trained head: output.weight starts as the embedding
            # and takes the head's ops; token_embd itself stays unchanged
            pending.append(("output.weight", base.info(fam.embed).shape, (src(fam.embed),), None))
            head_ops = {fam.embed: ops[fam.lm_head]}

        generated: list[tuple[str, np.ndarray]] = []
        if rope["rope_type"] == "llama3":
            generated.append(("rope_freqs.weight", llama3_rope_factors(rope, head_dim)))

        shapes = [(g, shape) for g, shape, _, _ in pending] + [(g, arr.shape) for g, arr in generated]
        n_experts = fam.moe.num_experts(cfg) if fam.moe else 0
        types = tensor_types(q, shapes, ModelFacts(n_layer=int(cfg["num_hidden_layers"]), n_expert=n_experts, is_70b=spec.arch == "llama" and int(cfg["num_hidden_layers"]) == 80))
        tensors = []
        for gname, shape, srcs, transform in pending:
            t_ops = remap_ops(srcs, head_ops if head_ops and gname == "output.weight" else ops)
            tensors.append(TensorPlan(gname, types[gname], tuple(shape), srcs, t_ops, round_to=srcs[0].dtype if t_ops else None, transform=transform))
        for gname, arr in generated:
            tensors.append(TensorPlan(gname, "F32", arr.shape, (), data=arr.astype("<f4").tobytes()))

        vocab, notes = gguf_vocab.build(base.path, cfg, allow_unknown_pre=opts.allow_unknown_pretokenizer)
        kvs = self._metadata(ctx, spec, q, head_dim, vocab, sum(math.prod(s) for _, s in shapes))
        plan = Plan(self.name, files=self._split(tensors, kvs, q, opts.split_max_size))
        plan.notes.extend(notes)
        return plan

    def _metadata(self, ctx: ConvertContext, spec, q, head_dim: int, vocab, n_params: int) -> list[KV]:
        from gguf.utility import size_label

        base, cfg = ctx.base, ctx.base.config
        arch = spec.arch
        model_id = base.model_id or (ctx.checkpoint.base_model if ctx.checkpoint else None) or base.path.name
        basename = model_id.rsplit("/", 1)[-1]
        kvs = [kv_string("general.architecture", arch), kv_string("general.type", "model")]
        meta = (ctx.checkpoint.meta or {}) if ctx.checkpoint else {}
        finetune = meta.get("run_id") if ctx.adapter else None
        kvs.append(kv_string("general.name", f"{basename} {finetune}" if finetune else basename))
        kvs.append(kv_string("general.basename", basename))
        if finetune:
            kvs.append(kv_string("general.finetune", str(finetune)))
        n_exp = base.family.moe.num_experts(cfg) if base.family.moe else 0
        kvs.append(kv_string("general.size_label", size_label(n_params, 0, 0, n_exp)))
        if ctx.adapter:
            kvs.append(kv_u32("general.base_model.count", 1))
            kvs.append(kv_string("general.base_model.0.name", basename))
            if "/" in model_id:
                kvs.append(kv_string("general.base_model.0.organization", model_id.split("/")[0]))
                kvs.append(kv_string("general.base_model.0.repo_url", f"https://huggingface.co/{model_id}"))
        kvs.append(kv_u32("general.file_type", int(q.file_type)))
        kvs.append(kv_u32("general.quantization_version", GGML_QUANT_VERSION))
        for hp in spec.hparams:
            value = next((v for k in hp.config if (v := config_value(cfg, k)) is not None), None)
            if value is None:
                if hp.required:
                    raise InputError(E.BASE_INVALID, f"config.json lacks {hp.config[0]}, which llama.cpp needs as {arch}.{hp.key}.")
                continue
            kvs.append(kv_u32(f"{arch}.{hp.key}", value) if hp.type == "u32" else kv_f32(f"{arch}.{hp.key}", value))
        if spec.vocab_size_key:
            kvs.append(kv_u32(f"{arch}.vocab_size", int(cfg["vocab_size"])))
            kvs.append(kv_u32(f"{arch}.rope.dimension_count", head_dim))
        return kvs + vocab.kvs()

    def _split(self, tensors: list[TensorPlan], kvs: list[KV], q, max_size: int | None) -> list[FilePlan]:
        stem = f"model-{q.name.upper()}"
        groups: list[list[TensorPlan]] = [[]]
        size = 0
        for t in tensors:
            if max_size and groups[-1] and size + t.nbytes > max_size:
                groups.append([])
                size = 0
            groups[-1].append(t)
            size += t.nbytes
        if len(groups) == 1:
            return [FilePlan(f"{stem}.gguf", tensors, kind="gguf", kvs=kvs)]
        n = len(groups)
        files = []
        for i, g in enumerate(groups):
            # the types llama.cpp's split loader expects (gguf-split's)
            split = [KV("split.no", GGUFValueType.UINT16, i), KV("split.count", GGUFValueType.UINT16, n), KV("split.tensors.count", GGUFValueType.INT32, len(tensors))]
            # llama.cpp reads the model's metadata from the first split only
            files.append(FilePlan(f"{stem}-{i + 1:05d}-of-{n:05d}.gguf", g, kind="gguf", kvs=(kvs + split) if i == 0 else split))
        return files
