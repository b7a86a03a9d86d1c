"""``nucleus-export demo``: build a sample model and checkpoint offline, export it to every format, verify."""

from __future__ import annotations

import shutil
from pathlib import Path

from converters import ConvertOptions, convert, registry
from converters.errors import EXIT_INTERNAL, EXIT_OK, ExportError

from . import progress as progress_mod
from .errors import guarded

# A Qwen3-family model small enough to build in seconds. Untied, with a
# trained unembedding, so every format (GGUF LoRA included) can carry the head.
DEMO_CONFIG = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "initializer_range": 0.1,
}


def register(sub) -> None:
    p = sub.add_parser("demo", help="build a sample checkpoint offline and export it to every format")
    p.add_argument("--dir", default="demo-output", help="where to put the sample and the exports (default ./demo-output)")
    p.add_argument("--progress", choices=["auto", "bar", "json", "none"], default="none")
    p.set_defaults(func=run)


@guarded
def run(args) -> int:
    from converters import samples

    root = Path(args.dir).absolute()
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    print(f"building a sample base model and checkpoint in {root} …")
    tok = samples.build_tokenizer(root / "tokenizer")
    base = samples.build_base(root / "base-model", {**DEMO_CONFIG, "eos_token_id": 2, "pad_token_id": 0}, tok)
    archive = samples.build_archive(root / "checkpoint.tar.zst", base, rank=8, alpha=16, unembed=True, compression="zstd",
                                    meta={"run_id": "run_demo", "checkpoint_id": "sampler_weights/000001", "step": 1})
    print(f"  base model: {base}\n  archive:    {archive}")
    failures = 0
    for fmt in sorted(registry.available()):
        out = root / "exports" / fmt
        out.parent.mkdir(exist_ok=True)
        prog = progress_mod.make(args.progress)
        try:
            # The demo's freshly trained tokenizer is, by construction, unknown to
            # llama.cpp's pre-tokenizer table; real models are identified.
            opts = ConvertOptions(verify=True, quant="q8_0" if fmt == "gguf" else "f16", allow_unknown_pretokenizer=True)
            m = convert(archive, str(base), fmt, out, opts, prog)
        except ExportError as exc:
            failures += 1
            print(f"✗ {fmt}: [{exc.code}] {exc.message}")
            continue
        finally:
            prog.close()
        v = m.verification or {}
        detail = f"max |Δ log p| {v['max_abs_logprob_diff']:.1e}" if "max_abs_logprob_diff" in v else v.get("reason", "")
        print(f"✓ {fmt:<20} {out}  verification: {v.get('status', 'not run')} ({detail})")
    print("done." if not failures else f"{failures} format(s) failed.")
    return EXIT_OK if not failures else EXIT_INTERNAL
