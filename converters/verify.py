"""Logit parity of an export against a reference.

The exported model and a reference run the same probe sequences in fp32; we
compare next-token log-probabilities. References are chosen so that each
format is checked by an implementation other than the one that wrote it:

- merged-safetensors: the base model with the adapter applied by PEFT
  (``PeftModel`` on the PEFT-layout adapter) where PEFT can express the adapter;
  for MoE expert LoRA, which PEFT cannot attach to transformers' fused expert
  tensors, the explicit formula W + scale*B@A applied to the loaded base.
- lora-adapter: the explicit formula on the loaded base, against PEFT loading
  the exported adapter.

Models are loaded one at a time, so peak memory is one fp32 model.
"""

from __future__ import annotations

import gc
import tempfile
import warnings
from pathlib import Path

import torch

from .formats.base import ConvertContext
from .targets import placements

PROBE_TEXTS = [
    "The quick brown fox jumps over the lazy dog. 12345 + 678 = 13023",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "你好，世界！今日は良い天気ですね。 Привет, мир!",
    "    indented\n\n\nnewlines\tand\ttabs 🙂🚀",
]
MAX_PROBE_TOKENS = 48

# Pass thresholds on max |Δ log p| over every position and vocabulary entry, by
# the dtype the exported weights were rounded to (the reference runs unrounded
# fp32 deltas), and a floor on top-1 agreement.
TOLERANCE = {"F32": 2e-3, "F16": 0.05, "BF16": 0.3}
MIN_TOP1 = {"F32": 1.0, "F16": 0.95, "BF16": 0.9}
# Quantized GGUF: a sanity bound that catches layout and metadata bugs (which
# give near-random outputs), not a fidelity claim; fidelity is llama.cpp's own.
QUANT_TOLERANCE = {"q8_0": (1.0, 0.8), "q6_k": (1.5, 0.7), "q5_k_m": (2.0, 0.6), "q5_k_s": (2.0, 0.6), "q5_0": (2.0, 0.6),
                   "q4_k_m": (3.0, 0.4), "q4_k_s": (3.0, 0.4), "q4_0": (3.0, 0.4), "q3_k_m": (4.0, 0.3)}


def _probes(base_path: Path, vocab: int) -> list[list[int]]:
    try:
        from transformers import AutoTokenizer

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tok = AutoTokenizer.from_pretrained(str(base_path))
        seqs = [tok(t, add_special_tokens=False)["input_ids"][:MAX_PROBE_TOKENS] for t in PROBE_TEXTS]
        if getattr(tok, "chat_template", None):
            chat = tok.apply_chat_template([{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."}], tokenize=False)
            seqs.append(tok(chat, add_special_tokens=False)["input_ids"][:MAX_PROBE_TOKENS])
        seqs = [[i for i in s if i < vocab] for s in seqs]
        if all(len(s) >= 2 for s in seqs):
            return seqs
    except Exception:  # no or unusable tokenizer: random ids still exercise every weight
        pass
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (32,), generator=g).tolist() for _ in range(4)]


def _logprobs(model, probes: list[list[int]]) -> list[torch.Tensor]:
    out = []
    with torch.inference_mode():
        for ids in probes:
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
            out.append(torch.log_softmax(logits, dim=-1))
    return out


def _load(path: Path):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our caller renders progress

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return m.eval()


def apply_formula(model, ctx: ConvertContext) -> None:
    """W += scale * B @ A on the loaded model's parameters (the independent reference)."""
    fam = ctx.base.family
    params = dict(model.named_parameters())
    adapter = ctx.adapter
    with torch.no_grad():
        for p in placements(adapter, ctx.base):
            a = adapter.file.rows(p.a.tensor, p.a.r0, p.a.r1).float()
            b = adapter.file.rows(p.b.tensor, p.b.r0, p.b.r1).float()
            delta = p.module.scale * (b @ a)
            if p.tensor == fam.lm_head:
                head = model.get_output_embeddings()
                if head.weight is model.get_input_embeddings().weight:
                    head.weight = torch.nn.Parameter(head.weight.detach().clone())
                head.weight += delta
                continue
            if p.tensor in params:
                w = params[p.tensor]
                w.view(-1, w.shape[-1])[p.row_offset : p.row_offset + delta.shape[0]] += delta
                continue
            # transformers >= 5 holds experts fused in memory whatever the on-disk layout
            proj = fam.moe.archive_projections.get(p.module.module, p.module.module)
            slot = fam.moe.fused[proj]
            w = params[slot.tensor.format(layer=p.module.layer)]
            off = p.expert * w.shape[1] + slot.chunk * (w.shape[1] // slot.chunks)
            w.view(-1, w.shape[-1])[off : off + delta.shape[0]] += delta


def _peft_reference(ctx: ConvertContext, probes) -> list[torch.Tensor]:
    from peft import PeftModel

    from .execute import execute
    from .formats.lora_adapter import LoraAdapter

    with tempfile.TemporaryDirectory(prefix="nucleus-verify-") as tmp:
        plan = LoraAdapter().plan(ctx)
        execute(plan, Path(tmp), ctx.readers())
        base = _load(ctx.base.path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = PeftModel.from_pretrained(base, tmp).eval()
        lp = _logprobs(model, probes)
        del model, base
        gc.collect()
    return lp


def _formula_reference(ctx: ConvertContext, probes) -> list[torch.Tensor]:
    model = _load(ctx.base.path)
    apply_formula(model, ctx)
    lp = _logprobs(model, probes)
    del model
    gc.collect()
    return lp


def _gguf_lora_logprobs(ctx: ConvertContext, out_dir: Path, probes) -> list[torch.Tensor]:
    """The adapter on an f32 GGUF of the base, built in a temp dir for the check."""
    from dataclasses import replace

    from .execute import execute
    from .formats.base import ConvertContext as Ctx
    from .formats.gguf import Gguf

    with tempfile.TemporaryDirectory(prefix="nucleus-verify-") as tmp:
        plain = Ctx(None, None, ctx.base, replace(ctx.options, quant="f32", allow_unknown_pretokenizer=True))
        execute(Gguf().plan(plain), Path(tmp), plain.readers(), durable=False)
        adapter = sorted(Path(out_dir).glob("*.gguf"))[0]
        return _gguf_logprobs(Path(tmp), probes, lora=adapter)


def _gguf_logprobs(out_dir: Path, probes, lora: Path | None = None) -> list[torch.Tensor]:
    from llama_cpp import Llama

    first = sorted(p for p in Path(out_dir).glob("*.gguf"))[0]
    # f32 KV cache: the comparison measures the weights, not llama.cpp's f16 cache
    llm = Llama(model_path=str(first), logits_all=True, n_ctx=max(len(p) for p in probes) + 8, verbose=False, type_k=0, type_v=0, lora_path=str(lora) if lora else None)
    out = []
    try:
        for ids in probes:
            llm.reset()
            llm.eval(ids)
            out.append(torch.log_softmax(torch.tensor(llm.scores[: len(ids)]).float(), -1))
    finally:
        llm.close()
    return out


def _has_llama_cpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def compare(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict:
    max_abs = 0.0
    kl_sum, n, agree = 0.0, 0, 0
    for r, g in zip(ref, got):
        max_abs = max(max_abs, float((r - g).abs().max()))
        kl_sum += float((r.exp() * (r - g)).sum(-1).sum())
        agree += int((r.argmax(-1) == g.argmax(-1)).sum())
        n += r.shape[0]
    return {"max_abs_logprob_diff": max_abs, "mean_kl": kl_sum / n, "top1_agreement": agree / n, "positions": n}


def verify_output(fmt: str, ctx: ConvertContext, out_dir: Path) -> dict:
    out_dir = Path(out_dir)
    if fmt in ("gguf", "gguf-lora") and not _has_llama_cpp():
        return {"status": "skipped", "reason": "running a GGUF needs llama-cpp-python (pip install 'nucleus-export[gguf]')."}
    has_experts = ctx.adapter is not None and any(m.kind in ("experts", "expert") for m in ctx.adapter.modules)
    probes = _probes(ctx.base.path, int(ctx.base.config.get("vocab_size", 32000)))
    if fmt == "merged-safetensors":
        dtype = ctx.options.dtype or ctx.base.dtype
        if ctx.adapter is None:
            reference, ref = "base", _logprobs(_load(ctx.base.path), probes)
        elif has_experts:
            reference, ref = "formula", _formula_reference(ctx, probes)
        else:
            reference, ref = "peft", _peft_reference(ctx, probes)
        got = _logprobs(_load(out_dir), probes)
    elif fmt == "lora-adapter":
        dtype = "F32"
        if has_experts:
            return {"status": "skipped", "reason": "PEFT cannot attach per-expert LoRA modules to transformers' fused expert tensors, so the adapter cannot be run here; the merged-safetensors export of the same checkpoint is verified instead."}
        from peft import PeftModel

        reference, ref = "formula", _formula_reference(ctx, probes)
        base = _load(ctx.base.path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = PeftModel.from_pretrained(base, str(out_dir)).eval()
        got = _logprobs(model, probes)
        del model, base
    elif fmt == "gguf":
        quant = ctx.options.quant.lower()
        dtype = {"f32": ctx.base.dtype if ctx.adapter else "F32", "f16": "F16", "bf16": "BF16"}.get(quant, quant)
        reference, ref = ("formula", _formula_reference(ctx, probes)) if ctx.adapter else ("base", _logprobs(_load(ctx.base.path), probes))
        got = _gguf_logprobs(out_dir, probes)
    elif fmt == "gguf-lora":
        dtype = {"f32": "F32", "f16": "F16", "bf16": "BF16"}[ctx.options.quant]
        reference, ref = "formula", _formula_reference(ctx, probes)
        got = _gguf_lora_logprobs(ctx, out_dir, probes)
    else:
        return {"status": "skipped", "reason": f"no verifier for format {fmt}"}
    metrics = compare(ref, got)
    tol, min_top1 = QUANT_TOLERANCE.get(dtype) or (TOLERANCE.get(dtype, 0.3), MIN_TOP1.get(dtype, 0.9))
    ok = metrics["max_abs_logprob_diff"] <= tol and metrics["top1_agreement"] >= min_top1
    return {"status": "passed" if ok else "failed", "reference": reference, "weights_dtype": dtype, "tolerance": {"max_abs_logprob_diff": tol, "min_top1_agreement": min_top1}, **metrics}
