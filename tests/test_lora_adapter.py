"""lora-adapter: PEFT loads it and reproduces the merged model; experts expand per expert."""

from __future__ import annotations

import json

import pytest
import torch

from converters import ConvertOptions, convert, samples
from converters.manifest import MANIFEST_NAME
from tests.conftest import DENSE, MOE, PATTERN_CONFIG, load_state, patterned_archive
from tests.test_merged_safetensors import export, logprobs


@pytest.mark.parametrize("arch", DENSE)
def test_peft_loads_adapter_and_matches_merged_model(tmp_path, model_dir, arch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = model_dir(arch)
    tensors = samples.make_adapter_tensors(base, rank=8, unembed=arch in ("llama", "qwen3"), seed=7)
    adapter = export(tmp_path, base, tensors, fmt="lora-adapter", name="adapter")
    merged = export(tmp_path, base, tensors, dtype="F32", name="merged")
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM" and cfg["r"] == 8 and cfg["lora_alpha"] == 16
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
    got = logprobs(model)
    ref = logprobs(AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval())
    assert (got - ref).abs().max().item() < 1e-3
    # every adapter weight was loaded (PEFT warns, not fails, on missing keys)
    loaded = {k for k in model.state_dict() if "lora_" in k}
    assert len(loaded) == len(tensors)
    for name in ("tokenizer_config.json",):
        if (base / name).exists():
            assert (adapter / name).read_bytes() == (base / name).read_bytes()


def test_adapter_tensor_names_and_lm_head(tmp_path, model_dir):
    base = model_dir("qwen3")
    tensors = samples.make_adapter_tensors(base, rank=8, unembed=True)
    adapter = export(tmp_path, base, tensors, fmt="lora-adapter")
    sd = load_state(adapter)
    assert "base_model.model.lm_head.lora_A.weight" in sd
    assert not any("unembed" in k for k in sd)
    for k, v in tensors.items():
        assert torch.equal(sd[k.replace("model.unembed_tokens", "lm_head")], v)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"])
    report = json.loads((adapter / MANIFEST_NAME).read_text())["reports"]["compatibility"]
    assert report["vllm"]["compatible"] is False and any("lm_head" in p for p in report["vllm"]["problems"])


@pytest.mark.parametrize("arch", MOE)
@pytest.mark.parametrize("shared_a", [False, True], ids=["per-expert-A", "shared-A"])
def test_moe_experts_expand_to_per_expert_modules(tmp_path, model_dir, arch, shared_a):
    base = model_dir(arch)
    tensors = samples.make_adapter_tensors(base, rank=8, shared_a=shared_a, seed=8)
    adapter = export(tmp_path, base, tensors, r=8, alpha=16, fmt="lora-adapter", verify=True)
    sd = load_state(adapter)
    for layer in (0, 1):
        for w, proj in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            a = tensors[f"base_model.model.model.layers.{layer}.mlp.experts.{w}.lora_A.weight"]
            b = tensors[f"base_model.model.model.layers.{layer}.mlp.experts.{w}.lora_B.weight"]
            for e in range(4):
                pre = f"base_model.model.model.layers.{layer}.mlp.experts.{e}.{proj}"
                assert torch.equal(sd[f"{pre}.lora_A.weight"], a[0 if shared_a else e])
                assert torch.equal(sd[f"{pre}.lora_B.weight"], b[e])
                assert sd[f"{pre}.lora_A.weight"].dim() == 2
    assert not any(".w1." in k or ".w2." in k for k in sd)
    m = json.loads((adapter / MANIFEST_NAME).read_text())
    assert m["verification"]["status"] == "skipped" and "fused" in m["verification"]["reason"]
    assert m["reports"]["compatibility"]["vllm"]["compatible"] is True
    assert m["reports"]["compatibility"]["sglang"]["compatible"] is False


def test_rank_and_alpha_patterns_and_rslora(tmp_path, model_dir):
    """Per-module ranks/alphas and rsLoRA scale exactly as PEFT would, in both formats."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = model_dir("qwen3")
    archive, tensors = patterned_archive(base, tmp_path / "a.tar")
    opts = ConvertOptions(verify=False)
    convert(archive, str(base), "lora-adapter", tmp_path / "adapter", opts)
    convert(archive, str(base), "merged-safetensors", tmp_path / "merged", ConvertOptions(verify=False, dtype="F32"))
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["use_rslora"] is True and cfg["r"] == 8
    assert cfg["rank_pattern"] == {r"model\.layers\.1\.self_attn\.q_proj": 4}
    assert set(cfg["alpha_pattern"].values()) == {4}
    # the oracle: PEFT on the original archive config
    from tests.conftest import write_peft_adapter

    ref_dir = write_peft_adapter(tmp_path / "ref", tensors, 8, 16, str(base))
    ref_cfg = json.loads((ref_dir / "adapter_config.json").read_text())
    (ref_dir / "adapter_config.json").write_text(json.dumps({**ref_cfg, **PATTERN_CONFIG}))
    ref = logprobs(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), ref_dir).eval())
    ours_adapter = logprobs(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), tmp_path / "adapter").eval())
    ours_merged = logprobs(AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval())
    assert (ref - ours_adapter).abs().max().item() < 1e-4
    assert (ref - ours_merged).abs().max().item() < 1e-3
    m = json.loads((tmp_path / "adapter" / MANIFEST_NAME).read_text())
    assert any("rank_pattern" in p for p in m["reports"]["compatibility"]["vllm"]["problems"])


def test_adapter_directory_round_trips(tmp_path, model_dir):
    """Our lora-adapter output is itself a valid input; merging it gives the same bytes."""
    base = model_dir("qwen3moe")
    tensors = samples.make_adapter_tensors(base, rank=4, shared_a=True)
    adapter = export(tmp_path, base, tensors, r=4, alpha=8, fmt="lora-adapter", name="adapter")
    direct = export(tmp_path, base, tensors, r=4, alpha=8, name="direct")
    convert(adapter, str(base), "merged-safetensors", tmp_path / "again", ConvertOptions(verify=False))
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (direct / "model.safetensors").read_bytes()


def test_vllm_rank_support_reported(tmp_path, model_dir):
    base = model_dir("qwen3")
    adapter = export(tmp_path, base, samples.make_adapter_tensors(base, rank=12), r=12, alpha=24, fmt="lora-adapter")
    report = json.loads((adapter / MANIFEST_NAME).read_text())["reports"]["compatibility"]
    assert report["vllm"]["compatible"] is False and "rank" in report["vllm"]["problems"][0]
    assert report["sglang"]["compatible"] is True


def test_reproducible_manifest_holds_no_paths_or_times(tmp_path, model_dir):
    """The job runner's outputs are byte-identical wherever and whenever they are written, manifest included."""
    from converters import ConvertOptions, convert, samples

    base = model_dir("qwen3")
    archive = samples.build_archive(tmp_path / "a.tar.gz", base, rank=4)
    for name in ("one", "two"):
        convert(str(archive), str(base), "lora-adapter", tmp_path / name, ConvertOptions(verify=False, reproducible=True))
    assert (tmp_path / "one" / "nucleus-export.json").read_bytes() == (tmp_path / "two" / "nucleus-export.json").read_bytes()
    plain = convert(str(archive), str(base), "lora-adapter", tmp_path / "three", ConvertOptions(verify=False))
    assert plain.path == str(tmp_path / "three") and plain.created_at and plain.source["path"]
