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
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = {
    # Llama-shaped; parameter counts include embeddings and the untied head.
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4, vocab_size=32000),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, vocab_size=128256),
}
MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

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

DISK_FLOOR_SCRIPT = """
import os, sys
n, path = int(sys.argv[1]), sys.argv[2]
buf = os.urandom(16 << 20)
with open(path, "wb") as f:
    while n > 0:
        f.write(buf[: min(n, len(buf))])
        n -= len(buf)
"""


def shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", (v, h))]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        out += [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.self_attn.q_proj.weight", (h, h)), (f"{p}.self_attn.k_proj.weight", (kv, h)),
            (f"{p}.self_attn.v_proj.weight", (kv, h)), (f"{p}.self_attn.o_proj.weight", (h, h)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{p}.mlp.gate_proj.weight", (i, h)), (f"{p}.mlp.up_proj.weight", (i, h)), (f"{p}.mlp.down_proj.weight", (h, i)),
        ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return out


def build(workdir: Path, size: str) -> tuple[Path, Path, Path, int]:
    """Write the base model tensor by tensor (never the whole model in memory)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from converters import samples
    from converters.io.stream_writer import SafetensorsWriter

    cfg = dict(SIZES[size], max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False, dtype="bfloat16")
    base = workdir / "base"
    base.mkdir(parents=True)
    LlamaConfig(**cfg).save_pretrained(base)
    entries = shapes(cfg)
    nparams = sum(math.prod(s) for _, s in entries)
    half = nparams // 2
    groups, acc = [[], []], 0
    for name, s in entries:
        groups[0 if acc < half else 1].append((name, s))
        acc += math.prod(s)
    weight_map = {}
    g = torch.Generator().manual_seed(0)
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-00002.safetensors"
        w = SafetensorsWriter(base / fname, [(n, "BF16", s) for n, s in group], {"format": "pt"})
        for n, s in group:
            t = (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) if len(s) > 1 else torch.ones(s, dtype=torch.bfloat16)
            w.write(t.view(torch.uint8).numpy())
            weight_map[n] = fname
        w.close()
    (base / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 2 * nparams}, "weight_map": weight_map}))
    # rank-32 fp32 adapter on all seven linear modules
    tensors = {}
    shape_of = dict(entries)
    for layer in range(cfg["num_hidden_layers"]):
        for m in MODULES:
            out_f, in_f = shape_of[f"model.layers.{layer}.{m}.weight"]
            key = f"base_model.model.model.layers.{layer}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(32, in_f, generator=g) / math.sqrt(in_f)
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, 32, generator=g) * 0.01
    files = samples.archive_files(tensors, r=32, alpha=64, meta={"run_id": "bench", "checkpoint_id": "c", "step": 1})
    archive = samples.write_archive(workdir / "ckpt.tar", files, None)
    peft_dir = workdir / "peft-adapter"
    peft_dir.mkdir()
    save_file(tensors, peft_dir / "adapter_model.safetensors")
    (peft_dir / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 32, "lora_alpha": 64, "target_modules": [m.split(".")[1] for m in MODULES]}))
    return base, archive, peft_dir, nparams


def run(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of a child process."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    err = p.stderr.read().decode()
    p.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"command failed: {' '.join(cmd)}\n{err}")
    return wall, ru.ru_maxrss * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--skip-peft", action="store_true", help="measure only our export")
    ap.add_argument("--build-into", help=argparse.SUPPRESS)  # internal: the build child
    args = ap.parse_args()
    if args.build_into:
        *_, nparams = build(Path(args.build_into), args.size)
        (Path(args.build_into) / "built.json").write_text(json.dumps({"parameters": nparams}))
        return
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-merge-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        t = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--build-into", str(work), "--size", args.size], check=True)
        base, archive, peft_dir = work / "base", work / "ckpt.tar", work / "peft-adapter"
        nbytes = sum(p.stat().st_size for p in base.glob("*.safetensors"))
        nparams = json.loads((work / "built.json").read_text())["parameters"]
        print(f"model: {nparams / 1e9:.2f}B parameters, bf16, 2 shards ({nbytes / 1e9:.2f} GB); adapter rank 32 fp32 on 7 modules; built in {time.perf_counter() - t:.0f}s")
        convert = [sys.executable, "-m", "exporter", "convert", str(archive), "--base", str(base), "-f", "merged-safetensors", "--no-verify", "--progress", "none"]
        rows = []
        subprocess.run(["sync"])
        rows.append(("disk floor (plain writes)", run([sys.executable, "-c", DISK_FLOOR_SCRIPT, str(nbytes), str(work / "floor.bin")])))
        (work / "floor.bin").unlink()
        subprocess.run(["sync"])
        rows.append(("nucleus-export (durable)", run([*convert, "-o", str(work / "ours")])))
        shutil.rmtree(work / "ours")
        subprocess.run(["sync"])
        rows.append(("nucleus-export --no-fsync", run([*convert, "-o", str(work / "ours-nofsync"), "--no-fsync"])))
        shutil.rmtree(work / "ours-nofsync")
        if not args.skip_peft:
            subprocess.run(["sync"])
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
