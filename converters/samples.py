"""Small sample models and checkpoint archives, built offline.

Used by ``nucleus-export demo``, the tests and the benchmarks. A base model is
a real transformers model built from a (shrunk) config with random weights and
saved with ``save_pretrained``; an archive is a real checkpoint archive in the
documented format (docs/checkpoint-archive.md).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import shutil
import tarfile
from pathlib import Path

import torch

from .arch import family_for
from .io.safetensors_reader import read_header

DENSE_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
ATTN_MODULES = DENSE_MODULES[:4]

# A chat template in the ChatML style the Qwen and SmolLM families use.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_DEMO_TEXT = (
    "Fine-tuned models should run anywhere. A LoRA adapter holds two small matrices per layer; "
    "merging folds them into the base weights. The tokenizer and the chat template must survive, "
    "or the model will not stop talking. 0123456789 def main(): return 42 "
)


def shrink(config: dict, **overrides) -> dict:
    """A copy of a real config with tiny dimensions (same structure, same families' quirks)."""
    c = dict(config)
    c.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.1)
    if "moe_intermediate_size" in c or "num_experts" in c:
        c.update(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    if c.get("max_window_layers"):
        c["max_window_layers"] = 2
    c.update(overrides)
    return c


def build_tokenizer(dst: str | os.PathLike, vocab_size: int = 512) -> Path:
    """Train a tiny byte-level BPE tokenizer with ChatML special tokens (for the offline demo)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    dst = Path(dst)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_DEMO_TEXT] * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None)
    fast.chat_template = CHATML_TEMPLATE
    dst.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(dst)
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": [fast.convert_tokens_to_ids("<|im_end|>"), fast.convert_tokens_to_ids("<|endoftext|>")], "pad_token_id": fast.pad_token_id}, indent=2) + "\n")
    return dst


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json", "added_tokens.json", "chat_template.jinja")


def _tokenizer_len(tokenizer_dir: Path) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(tokenizer_dir)))


def build_base(
    out_dir: str | os.PathLike,
    config: dict,
    tokenizer_dir: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    moe_layout: str = "per-expert",
    max_shard_size: str | int = "5GB",
) -> Path:
    """Build and save a random-weight model; copy the tokenizer files beside it byte-for-byte."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    config = dict(config)
    if tokenizer_dir is not None:
        n = _tokenizer_len(Path(tokenizer_dir))
        if config.get("vocab_size", 0) < n:
            config["vocab_size"] = -(-n // 64) * 64
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            ids = config.get(key)
            ids_list = ids if isinstance(ids, list) else [ids]
            if ids is not None and any(i >= config["vocab_size"] for i in ids_list):
                config[key] = None
    model_type = config.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k not in ("transformers_version",)})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():  # visible per-tensor structure, so misplaced rows change logits
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    del model
    if moe_layout == "fused":
        _fuse_experts(out)
    if tokenizer_dir is not None:
        for name in _TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.is_file():
                shutil.copyfile(src, out / name)
    return out


def _fuse_experts(model_dir: Path) -> None:
    """Rewrite per-expert tensors as transformers-5 fused gate_up_proj / down_proj."""
    from safetensors.torch import load_file, save_file

    files = sorted(model_dir.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError("fused sample layout is built for single-file models only")
    sd = load_file(files[0])
    layers = sorted({int(k.split(".")[2]) for k in sd if ".mlp.experts." in k})
    for layer in layers:
        pre = f"model.layers.{layer}.mlp.experts"
        n = 1 + max(int(k.split(".")[5]) for k in sd if k.startswith(pre + "."))
        gate_up = torch.stack([torch.cat([sd.pop(f"{pre}.{e}.gate_proj.weight"), sd.pop(f"{pre}.{e}.up_proj.weight")]) for e in range(n)])
        down = torch.stack([sd.pop(f"{pre}.{e}.down_proj.weight") for e in range(n)])
        sd[f"{pre}.gate_up_proj"] = gate_up.contiguous()
        sd[f"{pre}.down_proj"] = down.contiguous()
    save_file(sd, files[0], metadata={"format": "pt"})


def _base_shapes(base_dir: Path) -> dict[str, tuple[int, ...]]:
    idx = base_dir / "model.safetensors.index.json"
    names = sorted(set(json.loads(idx.read_text())["weight_map"].values())) if idx.exists() else [p.name for p in base_dir.glob("*.safetensors")]
    shapes = {}
    for n in names:
        tensors, _ = read_header(base_dir / n)
        shapes.update({k: v.shape for k, v in tensors.items()})
    return shapes


def make_adapter_tensors(
    base_dir: str | os.PathLike,
    *,
    rank: int = 8,
    modules: tuple[str, ...] = DENSE_MODULES,
    unembed: bool = False,
    experts: bool = True,
    shared_a: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 1,
    b_std: float = 0.1,
    ranks: dict[str, int] | None = None,
) -> dict[str, torch.Tensor]:
    """Random LoRA tensors named as in the checkpoint archive, fitted to a base model."""
    base_dir = Path(base_dir)
    config = json.loads((base_dir / "config.json").read_text())
    fam = family_for(config)
    shapes = _base_shapes(base_dir)
    g = torch.Generator().manual_seed(seed)

    def pair(key: str, out_f: int, in_f: int, lead: tuple[int, ...] = (), lead_a: tuple[int, ...] | None = None) -> None:
        r = (ranks or {}).get(key, rank)
        la = lead if lead_a is None else lead_a
        a = torch.randn(*la, r, in_f, generator=g) / math.sqrt(in_f)
        b = torch.randn(*lead, out_f, r, generator=g) * (b_std / math.sqrt(r))
        tensors[f"base_model.model.{key}.lora_A.weight"] = a.to(dtype).contiguous()
        tensors[f"base_model.model.{key}.lora_B.weight"] = b.to(dtype).contiguous()

    tensors: dict[str, torch.Tensor] = {}
    for layer in range(int(config["num_hidden_layers"])):
        sparse = fam.moe is not None and fam.moe.is_sparse(config, layer)
        for mod in modules:
            if sparse and mod.startswith("mlp."):
                continue
            out_f, in_f = shapes[fam.layer_linears[mod].format(layer=layer)]
            pair(f"model.layers.{layer}.{mod}", out_f, in_f)
        if sparse and experts:
            n = fam.moe.num_experts(config)
            inter, hidden = int(config["moe_intermediate_size"]), int(config["hidden_size"])
            for w, (out_f, in_f) in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter))):
                pair(f"model.layers.{layer}.mlp.experts.{w}", out_f, in_f, (n,), (1,) if shared_a else None)
    if unembed:
        vocab, hidden = shapes[fam.embed]
        pair("model.unembed_tokens", vocab, hidden)
    return tensors


def _tar_add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def write_archive(path: str | os.PathLike, files: dict[str, bytes], compression: str | None = "gzip") -> Path:
    """Pack files into a tar archive, plain, gzip or zstd."""
    path = Path(path)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            _tar_add(tar, name, data)
    raw = buf.getvalue()
    if compression == "gzip":
        import gzip

        raw = gzip.compress(raw, compresslevel=1)
    elif compression == "zstd":
        import zstandard

        raw = zstandard.ZstdCompressor(level=3).compress(raw)
    elif compression is not None:
        raise ValueError(f"unknown compression {compression}")
    path.write_bytes(raw)
    return path


def archive_files(
    tensors: dict[str, torch.Tensor],
    *,
    r: int,
    alpha: float,
    base_model: str | None = None,
    meta: dict | None = None,
    extra_config: dict | None = None,
    complete: bool = True,
) -> dict[str, bytes]:
    """The member files of a checkpoint archive (with checkpoint.json hashes)."""
    from safetensors.torch import save

    weights = save(tensors, metadata={"format": "pt"})
    config = {"r": r, "lora_alpha": alpha, **({"base_model_name_or_path": base_model} if base_model else {}), **(extra_config or {})}
    files = {"adapter_model.safetensors": weights, "adapter_config.json": json.dumps(config, indent=2).encode()}
    if meta is not None:
        listed = {n: {"sha256": hashlib.sha256(b).hexdigest(), "size": len(b)} for n, b in files.items()}
        files["checkpoint.json"] = json.dumps({**meta, **({"base_model": base_model} if base_model else {}), "files": listed}, indent=2).encode()
    if complete:
        files["checkpoint_complete"] = b""
    return files


def build_archive(
    path: str | os.PathLike,
    base_dir: str | os.PathLike,
    *,
    rank: int = 8,
    alpha: float = 16,
    compression: str | None = "gzip",
    base_model: str | None = None,
    meta: dict | None = None,
    extra_config: dict | None = None,
    **tensor_options,
) -> Path:
    tensors = make_adapter_tensors(base_dir, rank=rank, **tensor_options)
    meta = {"run_id": "run_demo", "checkpoint_id": "000001", "step": 1} if meta is None else meta
    return write_archive(path, archive_files(tensors, r=rank, alpha=alpha, base_model=base_model, meta=meta, extra_config=extra_config), compression)
