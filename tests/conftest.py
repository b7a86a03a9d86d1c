"""Shared fixtures: tiny random models built from the real configs and tokenizers in shared/testdata."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ["HF_HUB_OFFLINE"] = "1"  # tests never touch the network
logging.getLogger("transformers").setLevel(logging.ERROR)

from converters import samples  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TESTDATA = Path(os.environ.get("NUCLEUS_TESTDATA", ROOT.parent / "shared" / "testdata"))
if not (TESTDATA / "SOURCES.md").is_file():
    raise RuntimeError(f"test data not found at {TESTDATA}; the tests need shared/testdata beside the checkout (or NUCLEUS_TESTDATA)")
TOKENIZERS = TESTDATA / "tokenizers"
CONFIGS = TESTDATA / "configs"


def _json(p: Path) -> dict:
    return json.loads(p.read_text())


MISTRAL_CONFIG = {
    "model_type": "mistral", "architectures": ["MistralForCausalLM"], "vocab_size": 32768,
    "rope_theta": 1000000.0, "sliding_window": None, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}

# name -> (config, tokenizer dir, build options). Each is a real family's config, shrunk.
MODEL_SPECS = {
    "llama": (lambda: samples.shrink(_json(CONFIGS / "Meta-Llama-3.1-8B.json")), TOKENIZERS / "smollm2", {}),
    "mistral": (lambda: samples.shrink(MISTRAL_CONFIG), TOKENIZERS / "mistral", {}),
    "qwen2": (lambda: samples.shrink(_json(TOKENIZERS / "qwen2.5" / "config.json")), TOKENIZERS / "qwen2.5", {}),  # tied, q/k/v bias
    "qwen3": (lambda: samples.shrink(_json(CONFIGS / "Qwen3-8B.json")), TOKENIZERS / "qwen3", {}),
    "qwen3-tied": (lambda: samples.shrink(_json(TOKENIZERS / "qwen3" / "config.json")), TOKENIZERS / "qwen3", {}),
    "qwen3moe": (lambda: samples.shrink(_json(CONFIGS / "Qwen3-30B-A3B.json")), TOKENIZERS / "qwen3", {}),
    "qwen3moe-fused": (lambda: samples.shrink(_json(CONFIGS / "Qwen3-30B-A3B.json")), TOKENIZERS / "qwen3", {"moe_layout": "fused"}),
}
DENSE = ["llama", "mistral", "qwen2", "qwen3", "qwen3-tied"]
MOE = ["qwen3moe", "qwen3moe-fused"]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """model_dir(name) -> path of a saved tiny model (built once per session)."""
    cache: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("models")

    def get(name: str) -> Path:
        if name not in cache:
            make_config, tok, opts = MODEL_SPECS[name]
            cache[name] = samples.build_base(root / name, make_config(), tok, **opts)
        return cache[name]

    return get


@pytest.fixture
def isolated_tmp(tmp_path, monkeypatch):
    """Point tempfile at a private dir so tests can assert nothing is left behind."""
    d = tmp_path / "sys-tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def load_state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    sd = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        sd.update(load_file(f))
    return sd


def write_peft_adapter(dst: Path, tensors: dict[str, torch.Tensor], r: int, alpha: float, base: str) -> Path:
    """A PEFT adapter written directly from archive tensors (the oracle's input, not our converter's)."""
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    renamed = {k.replace("model.unembed_tokens", "lm_head"): v for k, v in tensors.items()}
    targets = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in renamed})
    save_file(renamed, dst / "adapter_model.safetensors")
    (dst / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "target_modules": targets, "base_model_name_or_path": base}))
    return dst


def leftovers(out: Path) -> list[str]:
    """Temp or partial outputs beside ``out``."""
    return [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


# Per-module rank (layer 1 q_proj: 4), per-module alpha (o_proj: 4) and rsLoRA.
PATTERN_CONFIG = {"rank_pattern": {"layers.1.self_attn.q_proj": 4}, "alpha_pattern": {"o_proj": 4}, "use_rslora": True}


def patterned_archive(base: Path, dst: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """An archive whose scales differ per module; returns (archive, its tensors)."""
    tensors = samples.make_adapter_tensors(base, rank=8, ranks={"model.layers.1.self_attn.q_proj": 4}, seed=9)
    archive = samples.write_archive(dst, samples.archive_files(tensors, r=8, alpha=16, extra_config=PATTERN_CONFIG), None)
    return archive, tensors


# --- the HTTP service ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def sample(model_dir, tmp_path_factory):
    """A qwen3 base and a checkpoint archive of run_3Bz, step 240."""
    from .service_helpers import RUN

    base = model_dir("qwen3")
    root = tmp_path_factory.mktemp("sample")
    archive = samples.build_archive(root / "ckpt.tar.gz", base, rank=8, meta={"run_id": RUN, "checkpoint_id": "sampler_weights/000240", "step": 240})
    # the service names base models by Hub id; the workers find this one in their model store
    (root / "models" / "test-org").mkdir(parents=True)
    (root / "models" / "test-org" / "tiny-qwen3").symlink_to(base, target_is_directory=True)
    return {"base": base, "base_id": "test-org/tiny-qwen3", "model_store": root / "models", "archive": archive,
            "sha": hashlib.sha256(archive.read_bytes()).hexdigest()}


@pytest.fixture
def svc(tmp_path, sample):
    """The service on a temp data dir (SQLite), with the sample archive in its artifact store."""
    import shutil

    from exporter.service import Services

    from .service_helpers import RUN, settings_for

    services = Services(settings_for(tmp_path, model_store=str(sample["model_store"])))
    # the archive lives in tenant acme's part of the artifact store, as the trainer's uploads do
    dest = services.artifacts.root / "checkpoints" / "acme" / RUN / "000240.tar.gz"
    dest.parent.mkdir(parents=True)
    shutil.copy(sample["archive"], dest)
    services.sample = {**sample, "uri": dest.as_uri()}
    yield services
    services.close()


