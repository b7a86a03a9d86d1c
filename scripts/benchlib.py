"""Shared pieces of the benchmark scripts: synthetic models, adapters, measured child processes."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
CHILD_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}

DISK_FLOOR_SCRIPT = """
import os, sys
n, path = int(sys.argv[1]), sys.argv[2]
buf = os.urandom(16 << 20)
with open(path, "wb") as f:
    while n > 0:
        f.write(buf[: min(n, len(buf))])
        n -= len(buf)
"""


def build(workdir: Path, config: dict, tokenizer_dir: Path | None = None, rank: int = 32) -> dict:
    """Write a random bf16 model (two shards, tensor by tensor) and a rank-`rank` fp32 adapter
    on all seven linear modules: ckpt.tar (our archive) and peft-adapter/ (PEFT's layout)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from converters import samples
    from converters.io.stream_writer import SafetensorsWriter

    base = workdir / "base"
    base.mkdir(parents=True)
    cfg = dict(config)
    model_type = cfg.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **cfg)
    with torch.device("meta"):
        entries = [(n, tuple(p.shape)) for n, p in AutoModelForCausalLM.from_config(hf_config).named_parameters()]
    hf_config.dtype = "bfloat16"
    hf_config.save_pretrained(base)
    if tokenizer_dir:
        for f in Path(tokenizer_dir).iterdir():
            if f.is_file() and f.name != "config.json":
                shutil.copyfile(f, base / f.name)
    nparams = sum(math.prod(s) for _, s in entries)
    groups, acc = [[], []], 0
    for name, s in entries:
        groups[0 if acc < nparams // 2 else 1].append((name, s))
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
    shapes = dict(entries)
    tensors = {}
    for layer in range(int(config["num_hidden_layers"])):
        for m in MODULES:
            out_f, in_f = shapes[f"model.layers.{layer}.{m}.weight"]
            key = f"base_model.model.model.layers.{layer}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) / math.sqrt(in_f)
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.01
    files = samples.archive_files(tensors, r=rank, alpha=2 * rank, meta={"run_id": "bench", "checkpoint_id": "c", "step": 1})
    samples.write_archive(workdir / "ckpt.tar", files, None)
    peft_dir = workdir / "peft-adapter"
    peft_dir.mkdir()
    save_file(tensors, peft_dir / "adapter_model.safetensors")
    (peft_dir / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "target_modules": [m.split(".")[1] for m in MODULES]}))
    info = {"parameters": nparams, "bytes": sum(p.stat().st_size for p in base.glob("*.safetensors"))}
    (workdir / "built.json").write_text(json.dumps(info))
    return info


def build_in_child(workdir: Path, script: str, *args: str) -> dict:
    """Build in a child so this process stays small: a child's ru_maxrss includes its parent's
    resident set at fork time."""
    subprocess.run([sys.executable, script, "--build-into", str(workdir), *args], check=True)
    return json.loads((workdir / "built.json").read_text())


def run(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of a child process (after a sync, so earlier writes don't bleed in)."""
    subprocess.run(["sync"])
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env={**os.environ, **CHILD_ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    err = p.stderr.read().decode()
    p.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"command failed: {' '.join(cmd)}\n{err}")
    return wall, ru.ru_maxrss * 1024


def nucleus(*args: str) -> list[str]:
    return [sys.executable, "-m", "exporter", *args, "--no-verify", "--progress", "none"]
