"""Finding the base model: local dir, model store, Hugging Face cache; refusing the wrong one."""

from __future__ import annotations

import json
import shutil

import pytest

from converters import ConvertOptions, ExportError, convert, samples
from converters import errors as E
from converters.base_model import names_match, resolve_base


@pytest.fixture
def archive_for(tmp_path, model_dir):
    def make(base_name: str | None, arch: str = "qwen3"):
        base = model_dir(arch)
        files = samples.archive_files(samples.make_adapter_tensors(base, rank=4), r=4, alpha=8, base_model=base_name, meta={})
        return samples.write_archive(tmp_path / "a.tar", files, None)

    return make


def test_model_store_and_archive_named_base(tmp_path, model_dir, archive_for):
    store = tmp_path / "store"
    shutil.copytree(model_dir("qwen3"), store / "Qwen" / "Qwen3-8B")
    archive = archive_for("Qwen/Qwen3-8B")
    m = convert(archive, None, "lora-adapter", tmp_path / "out", ConvertOptions(verify=False, model_store=str(store)))
    assert m.base_model["id"] == "Qwen/Qwen3-8B"
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["base_model_name_or_path"] == "Qwen/Qwen3-8B"


def test_hf_cache_offline(tmp_path, model_dir, monkeypatch):
    import huggingface_hub.constants as C

    cache = tmp_path / "hub"
    sha = "0123456789abcdef0123456789abcdef01234567"
    snap = cache / "models--Qwen--Qwen3-8B" / "snapshots" / sha
    shutil.copytree(model_dir("qwen3"), snap)
    (cache / "models--Qwen--Qwen3-8B" / "refs").mkdir()
    (cache / "models--Qwen--Qwen3-8B" / "refs" / "main").write_text(sha)
    monkeypatch.setattr(C, "HF_HUB_CACHE", str(cache))
    base = resolve_base("Qwen/Qwen3-8B", offline=True)
    try:
        assert base.revision == sha and base.model_id == "Qwen/Qwen3-8B" and base.family.name == "qwen3"
    finally:
        base.close()
    with pytest.raises(ExportError) as ei:
        resolve_base("Qwen/Not-Cached", offline=True)
    assert ei.value.code == E.BASE_NOT_FOUND and "cache" in ei.value.message


def test_mismatched_base_refused_unless_forced(tmp_path, model_dir, archive_for):
    archive = archive_for("meta-llama/Llama-3.1-8B")
    base = model_dir("qwen3")
    with pytest.raises(ExportError) as ei:
        convert(archive, str(base), "lora-adapter", tmp_path / "out", ConvertOptions(verify=False))
    assert ei.value.code == E.BASE_MISMATCH and "--force-base" in ei.value.message
    assert not (tmp_path / "out").exists()
    convert(archive, str(base), "lora-adapter", tmp_path / "out", ConvertOptions(verify=False, force_base=True))


def test_no_base_anywhere(tmp_path, archive_for):
    with pytest.raises(ExportError) as ei:
        convert(archive_for(None), None, "lora-adapter", tmp_path / "out", ConvertOptions(verify=False))
    assert ei.value.code == E.BASE_REQUIRED


def test_pickle_only_base_refused(tmp_path, model_dir, archive_for):
    base = tmp_path / "pickled"
    shutil.copytree(model_dir("qwen3"), base)
    (base / "model.safetensors").rename(base / "pytorch_model.bin")
    with pytest.raises(ExportError) as ei:
        convert(archive_for(None), str(base), "lora-adapter", tmp_path / "out", ConvertOptions(verify=False))
    assert ei.value.code == E.BASE_NO_SAFETENSORS and "pickle" in ei.value.message


def test_unknown_architecture_lists_supported(tmp_path, model_dir, archive_for):
    base = tmp_path / "weird"
    shutil.copytree(model_dir("qwen3"), base)
    cfg = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_bigcode", "architectures": ["GPTBigCodeForCausalLM"]}))
    with pytest.raises(ExportError) as ei:
        convert(archive_for(None), str(base), "merged-safetensors", tmp_path / "out", ConvertOptions(verify=False))
    assert ei.value.code == E.UNSUPPORTED_ARCHITECTURE
    for fam in ("llama", "mistral", "qwen2", "qwen3", "qwen3moe"):
        assert fam in ei.value.message


def test_moe_adapter_on_dense_base_refused(tmp_path, model_dir):
    tensors = samples.make_adapter_tensors(model_dir("qwen3moe"), rank=4)
    archive = samples.write_archive(tmp_path / "a.tar", samples.archive_files(tensors, r=4, alpha=8), None)
    with pytest.raises(ExportError) as ei:
        convert(archive, str(model_dir("qwen3")), "merged-safetensors", tmp_path / "out", ConvertOptions(verify=False))
    assert ei.value.code in (E.ADAPTER_UNKNOWN_TENSOR, E.ADAPTER_SHAPE_MISMATCH)


@pytest.mark.parametrize(
    "archive_base,given,resolved,is_dir,expected",
    [
        ("Qwen/Qwen3-8B", "Qwen/Qwen3-8B", "/c/models--Qwen--Qwen3-8B/snapshots/abc", False, True),
        ("Qwen/Qwen3-8B", "qwen/qwen3-8b", "/c/x", False, True),
        ("Qwen/Qwen3-8B", "Other/Qwen3-8B", "/c/x", False, False),
        ("Qwen/Qwen3-8B", "/models/Qwen3-8B", "/models/Qwen3-8B", True, True),
        ("Qwen/Qwen3-8B", "/models/Llama-3.1-8B", "/models/Llama-3.1-8B", True, False),
        ("/home/u/models/Qwen3-8B", "/data/Qwen3-8B", "/data/Qwen3-8B", True, True),
    ],
)
def test_names_match(archive_base, given, resolved, is_dir, expected):
    from pathlib import Path

    assert names_match(archive_base, given, Path(resolved), is_dir) is expected


def test_service_mode_accepts_hub_ids_only(tmp_path, model_dir):
    """Where a user names the base (the service), a local path is refused, also when the archive names it."""
    base = model_dir("qwen3")
    for spec, archive_base in ((str(base), None), (None, str(base)), ("../../etc", None)):
        with pytest.raises(ExportError) as e:
            resolve_base(spec, archive_base=archive_base, local_paths=False, offline=True)
        assert e.value.code == "base_not_found" and "Hub id" in e.value.message
    store = tmp_path / "store"
    (store / "org").mkdir(parents=True)
    (store / "org" / "tiny").symlink_to(base, target_is_directory=True)
    found = resolve_base("org/tiny", model_store=store, local_paths=False, offline=True)
    assert found.model_id == "org/tiny"
