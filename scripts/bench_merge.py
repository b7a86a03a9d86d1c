#!/usr/bin/env python3
"""Benchmark: merged-safetensors export vs the PEFT path a user would otherwise run.

Builds a synthetic Llama-shaped model (bf16, two shards) and a rank-32 fp32
adapter on all seven linear modules, then runs, each in a fresh process:

  ours: nucleus-export convert ARCHIVE --base BASE -f merged-safetensors --no-verify
  peft: from_pretrained -> PeftModel.from_pretrained -> merge_and_unload -> save_pretrained

and prints wall time and peak RSS (the child's ru_maxrss) for each, with ratios.
Ours runs twice: durable (the default: outputs fsynced before they appear) and
with --no-fsync (what save_pretrained does). A third child writes the same
number of bytes with plain sequential writes: the disk's floor, which no tool
that writes the merged model can beat. The model is built in a child process
too, so this parent stays small (a child's ru_maxrss includes its parent's
resident set at fork time).
Usage: python scripts/bench_merge.py [--size 1b|3b] [--workdir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from benchlib import DISK_FLOOR_SCRIPT, build, build_in_child, nucleus, run

SIZES = {
    # Llama-shaped; parameter counts include embeddings and the untied head.
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4, vocab_size=32000),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, vocab_size=128256),
}

PEFT_SCRIPT = """
import sys, torch, warnings
warnings.simplefilter("ignore")
from transformers import AutoModelForCausalLM
from peft import PeftModel
base, adapter, out = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
model.save_pretrained(out, max_shard_size="5GB")
"""


def config(size: str) -> dict:
    return dict(SIZES[size], model_type="llama", max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--skip-peft", action="store_true", help="measure only our export")
    ap.add_argument("--build-into", help=argparse.SUPPRESS)  # internal: the build child
    args = ap.parse_args()
    if args.build_into:
        build(Path(args.build_into), config(args.size))
        return
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-merge-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        info = build_in_child(work, __file__, "--size", args.size)
        base, archive, peft_dir = work / "base", work / "ckpt.tar", work / "peft-adapter"
        print(f"model: {info['parameters'] / 1e9:.2f}B parameters, bf16, 2 shards ({info['bytes'] / 1e9:.2f} GB); adapter rank 32 fp32 on 7 modules")
        convert = nucleus("convert", str(archive), "--base", str(base), "-f", "merged-safetensors")
        rows = [("disk floor (plain writes)", run([sys.executable, "-c", DISK_FLOOR_SCRIPT, str(info["bytes"]), str(work / "floor.bin")]))]
        (work / "floor.bin").unlink()
        rows.append(("nucleus-export (durable)", run([*convert, "-o", str(work / "ours")])))
        shutil.rmtree(work / "ours")
        rows.append(("nucleus-export --no-fsync", run([*convert, "-o", str(work / "ours-nofsync"), "--no-fsync"])))
        shutil.rmtree(work / "ours-nofsync")
        if not args.skip_peft:
            rows.append(("PEFT merge_and_unload path", run([sys.executable, "-c", PEFT_SCRIPT, str(base), str(peft_dir), str(work / "peft")])))
        for name, (wall, rss) in rows:
            print(f"{name:<28} wall {wall:7.1f} s   peak RSS {rss / 2**20:7.0f} MiB")
        floor = rows[0][1][0]
        for name, (wall, rss) in rows[1:3]:
            line = f"{name:<28} {wall / floor:.2f}x the disk floor"
            if not args.skip_peft:
                peft = rows[3][1]
                line += f"; vs PEFT: {peft[0] / wall:.2f}x faster, {peft[1] / rss:.2f}x less memory"
            print(line)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
