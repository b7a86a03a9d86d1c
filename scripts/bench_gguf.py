#!/usr/bin/env python3
"""Benchmark: one-pass archive -> GGUF against our own two-step path.

Builds a synthetic Qwen3-shaped model of ~1.1B parameters (bf16, two shards,
tied embeddings) with the real Qwen3 tokenizer and a rank-32 fp32 adapter on
all seven linear modules, then, for q8_0 and q4_k_m, runs in fresh processes:

  one pass:  nucleus-export convert ckpt.tar --base base -f gguf --quant Q
  two steps: nucleus-export convert ckpt.tar --base base -f merged-safetensors -o merged
             nucleus-export convert --base merged -f gguf --quant Q

and prints wall time and peak RSS (the child's ru_maxrss; for two steps the
sum of times and the larger RSS) with the ratio.
Usage: python scripts/bench_gguf.py [--tokenizer DIR] [--workdir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from benchlib import ROOT, build, build_in_child, nucleus, run

QWEN3_1B = dict(
    model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=16, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
    rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", default=str(ROOT.parent / "shared" / "testdata" / "tokenizers" / "qwen3"))
    ap.add_argument("--workdir")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--quants", default="q8_0,q4_k_m")
    ap.add_argument("--build-into", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.build_into:
        build(Path(args.build_into), QWEN3_1B, Path(args.tokenizer))
        return
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-gguf-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        info = build_in_child(work, __file__, "--tokenizer", args.tokenizer)
        print(f"model: {info['parameters'] / 1e9:.2f}B parameters, bf16 ({info['bytes'] / 1e9:.2f} GB), Qwen3 tokenizer; adapter rank 32 fp32 on 7 modules")
        archive, base = str(work / "ckpt.tar"), str(work / "base")
        for q in args.quants.split(","):
            one = run(nucleus("convert", archive, "--base", base, "-f", "gguf", "--quant", q, "-o", str(work / f"one-{q}")))
            shutil.rmtree(work / f"one-{q}")
            merge = run(nucleus("convert", archive, "--base", base, "-f", "merged-safetensors", "-o", str(work / "merged")))
            gguf = run(nucleus("convert", "--base", str(work / "merged"), "-f", "gguf", "--quant", q, "-o", str(work / f"two-{q}")))
            shutil.rmtree(work / "merged")
            shutil.rmtree(work / f"two-{q}")
            two = (merge[0] + gguf[0], max(merge[1], gguf[1]))
            print(f"{q:<7} one pass   wall {one[0]:6.1f} s   peak RSS {one[1] / 2**20:6.0f} MiB")
            print(f"{q:<7} two steps  wall {two[0]:6.1f} s   peak RSS {two[1] / 2**20:6.0f} MiB   (merge {merge[0]:.1f} s + gguf {gguf[0]:.1f} s)")
            print(f"{q:<7} one pass is {two[0] / one[0]:.2f}x faster")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
