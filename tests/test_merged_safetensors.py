"""merged-safetensors against oracles: PEFT's merge_and_unload and the explicit formula."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from converters import ConvertOptions, ExportError, convert, samples
from converters import errors as E
from converters.io.safetensors_reader import SafetensorsFile
from converters.manifest import MANIFEST_NAME
from tests.conftest import DENSE, MOE, leftovers, load_state, write_peft_adapter

PROBE = [[1, 5, 9, 200, 17, 33, 4, 4, 90, 12, 7, 300]]


def export(tmp_path: Path, base: Path, tensors: dict, r: int = 8, alpha: float = 16, fmt: str = "merged-safetensors", name: str = "out", **opts) -> Path:
    archive = samples.write_archive(tmp_path / f"{name}.tar.gz", samples.archive_files(tensors, r=r, alpha=alpha, meta={"run_id": "r", "checkpoint_id": "c", "step": 1}))
    out = tmp_path / name
    convert(archive, str(base), fmt, out, ConvertOptions(**{"verify": False, **opts}))
    return out


def assert_close_bits(ours: torch.Tensor, ref: torch.Tensor, name: str) -> float:
    """bf16/fp16: >= 99.9% bit-identical, the rest within 1 ulp. Returns the identical fraction."""
    assert ours.shape == ref.shape and ours.dtype == ref.dtype, name
    if ours.dtype in (torch.bfloat16, torch.float16):
        a, b = ours.view(torch.int16).int(), ref.view(torch.int16).int()
        same = (a == b).float().mean().item()
        ulp = (a - b).abs().max().item()
        assert same >= 0.999, f"{name}: only {same:.4%} bit-identical"
        assert ulp <= 1, f"{name}: {ulp} ulp apart"
        return same
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    return float((ours == ref).float().mean())


def formula(base_sd: dict, tensors: dict, scale: float) -> dict[str, torch.Tensor]:
    """Expected merged tensors for dense modules: (W + s * B @ A in fp32) rounded once."""
    out = {}
    for k, a in tensors.items():
        if ".lora_A." not in k:
            continue
        b = tensors[k.replace("lora_A", "lora_B")]
        mod = k.removeprefix("base_model.model.").split(".lora_A.")[0]
        target = "lm_head.weight" if mod == "model.unembed_tokens" else f"{mod}.weight"
        w = base_sd.get(target, base_sd.get("model.embed_tokens.weight") if target == "lm_head.weight" else None)
        out[target] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return out


def logprobs(model) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(input_ids=torch.tensor(PROBE)).logits.float(), -1)


@pytest.mark.parametrize("arch", DENSE)
def test_dense_matches_peft_merge_and_unload(tmp_path, model_dir, arch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = model_dir(arch)
    tensors = samples.make_adapter_tensors(base, rank=8, seed=3)
    out = export(tmp_path, base, tensors)

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    peft_dir = write_peft_adapter(tmp_path / "peft", tensors, 8, 16, str(base))
    oracle = PeftModel.from_pretrained(model, peft_dir).merge_and_unload().state_dict()
    ours = load_state(out)
    base_sd = load_state(base)
    touched = {k.removeprefix("base_model.model.").split(".lora_")[0] + ".weight" for k in tensors}
    assert set(ours) == set(base_sd), "same tensor names as the base"
    for name, t in ours.items():
        if name in touched:
            assert_close_bits(t, oracle[name], name)
            assert not torch.equal(t, base_sd[name]), f"{name} was not merged"
        else:
            assert torch.equal(t.view(torch.uint8), base_sd[name].view(torch.uint8)), f"{name} must be copied byte-for-byte"
    # the formula, rounded once, is the stricter oracle
    for name, ref in formula(base_sd, tensors, 2.0).items():
        assert_close_bits(ours[name], ref, name)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_merged_logits_equal_peft_base_plus_adapter(tmp_path, model_dir, arch):
    """fp32 export vs PEFT running the unmerged adapter on the fp32 base (includes a trained lm_head)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = model_dir(arch)
    tensors = samples.make_adapter_tensors(base, rank=8, unembed=True, seed=4)
    out = export(tmp_path, base, tensors, dtype="F32")
    ref_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), write_peft_adapter(tmp_path / "peft", tensors, 8, 16, str(base)))
    ref = logprobs(ref_model.eval())
    got = logprobs(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval())
    assert (ref - got).abs().max().item() < 1e-3
    base_lp = logprobs(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval())
    assert (ref - base_lp).abs().max().item() > 0.05, "the adapter must visibly change the model for this test to mean anything"


@pytest.mark.parametrize("arch", ["qwen3-tied", "qwen2"])
def test_unembedding_on_tied_model_unties(tmp_path, model_dir, arch):
    from transformers import AutoModelForCausalLM

    base = model_dir(arch)
    base_cfg = json.loads((base / "config.json").read_text())
    assert base_cfg["tie_word_embeddings"] is True
    tensors = samples.make_adapter_tensors(base, rank=8, unembed=True, seed=5)
    out = export(tmp_path, base, tensors)
    ours, base_sd = load_state(out), load_state(base)
    assert "lm_head.weight" not in base_sd and "lm_head.weight" in ours
    assert torch.equal(ours["model.embed_tokens.weight"].view(torch.uint8), base_sd["model.embed_tokens.weight"].view(torch.uint8)), "input embeddings must stay unchanged"
    assert_close_bits(ours["lm_head.weight"], formula(base_sd, tensors, 2.0)["lm_head.weight"], "lm_head.weight")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    assert {k: v for k, v in cfg.items() if k != "tie_word_embeddings"} == {k: v for k, v in base_cfg.items() if k != "tie_word_embeddings"}
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(model.lm_head.weight, ours["lm_head.weight"].float())


def moe_expected(base_sd: dict, tensors: dict, config: dict, scale: float) -> dict[str, torch.Tensor]:
    """The explicit formula for 3-D expert LoRA (PEFT cannot express a shared A), in either layout."""
    out = {}
    n = config.get("num_experts") or config.get("num_local_experts")
    for k, a in tensors.items():
        if ".experts.w" not in k or ".lora_A." not in k:
            continue
        b = tensors[k.replace("lora_A", "lora_B")]
        layer = int(k.split(".")[4])
        w = k.split(".experts.")[1][:2]
        proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}[w]
        for e in range(n):
            delta = scale * (b[e if b.shape[0] > 1 else 0].float() @ a[e if a.shape[0] > 1 else 0].float())
            per = f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
            if per in base_sd:
                out[per] = (base_sd[per].float() + delta).to(base_sd[per].dtype)
                continue
            fused = f"model.layers.{layer}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
            cur = out.get(fused, base_sd[fused].float().clone()) if fused not in out else out[fused]
            rows = delta.shape[0]
            off = rows if proj == "up_proj" else 0
            cur[e, off : off + rows] += delta
            out[fused] = cur
    return {k: (v.to(base_sd[k].dtype) if v.dtype == torch.float32 and base_sd[k].dtype != torch.float32 else v) for k, v in out.items()}


@pytest.mark.parametrize("arch", MOE)
@pytest.mark.parametrize("shared_a", [False, True], ids=["per-expert-A", "shared-A"])
def test_moe_experts_merge(tmp_path, model_dir, arch, shared_a):
    base = model_dir(arch)
    config = json.loads((base / "config.json").read_text())
    tensors = samples.make_adapter_tensors(base, rank=4, shared_a=shared_a, seed=6)
    assert tensors["base_model.model.model.layers.0.mlp.experts.w1.lora_A.weight"].shape[0] == (1 if shared_a else 4)
    out = export(tmp_path, base, tensors, r=4, alpha=8, verify=True)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["verification"]["status"] == "passed"
    assert manifest["verification"]["reference"] == "formula"
    ours, base_sd = load_state(out), load_state(base)
    assert set(ours) == set(base_sd), "the on-disk expert layout is preserved"
    expected = moe_expected(base_sd, tensors, config, 2.0)
    assert expected
    for name, ref in expected.items():
        assert_close_bits(ours[name], ref, name)
    for name, ref in formula(base_sd, {k: v for k, v in tensors.items() if ".experts." not in k}, 2.0).items():
        assert_close_bits(ours[name], ref, name)
    router = "model.layers.0.mlp.gate.weight"
    assert torch.equal(ours[router], base_sd[router])


def test_sharded_output_with_index(tmp_path, model_dir):
    from transformers import AutoModelForCausalLM

    base = model_dir("qwen3")
    tensors = samples.make_adapter_tensors(base, rank=8)
    out = export(tmp_path, base, tensors, max_shard_size=12_000_000)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    sizes = 0
    for s in shards:
        with SafetensorsFile(out / s) as f:
            assert all(index["weight_map"][n] == s for n in f.tensors)
            sizes += sum(t.nbytes for t in f.tensors.values())
            # a single tensor may exceed the cap on its own; otherwise shards respect it
            assert len(f.tensors) == 1 or sum(t.nbytes for t in f.tensors.values()) <= 12_000_000
    assert index["metadata"]["total_size"] == sizes
    AutoModelForCausalLM.from_pretrained(out)


def test_aux_files_byte_for_byte_and_manifest(tmp_path, model_dir):
    base = model_dir("qwen3")
    tensors = samples.make_adapter_tensors(base, rank=8)
    out = export(tmp_path, base, tensors)
    for name in ("config.json", "generation_config.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        assert (out / name).read_bytes() == (base / name).read_bytes(), name
    m = json.loads((out / MANIFEST_NAME).read_text())
    assert m["format"] == "merged-safetensors"
    assert m["source"]["sha256"] == hashlib.sha256((tmp_path / "out.tar.gz").read_bytes()).hexdigest()
    assert m["source"]["run_id"] == "r" and m["base_model"]["architecture"] == "qwen3"
    listed = {f["name"]: f for f in m["files"]}
    assert set(listed) == {p.name for p in out.iterdir()} - {MANIFEST_NAME}
    for name, f in listed.items():
        data = (out / name).read_bytes()
        assert f["size"] == len(data) and f["sha256"] == hashlib.sha256(data).hexdigest(), name
    assert m["plan"]["lora_ops"] == 14 and m["plan"]["tensors_with_lora"] == 14


def test_dtype_option_converts_and_updates_config(tmp_path, model_dir):
    base = model_dir("qwen3")
    out = export(tmp_path, base, samples.make_adapter_tensors(base, rank=8), dtype="F32")
    with SafetensorsFile(out / "model.safetensors") as f:
        assert {t.dtype for t in f.tensors.values()} == {"F32"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


def test_failure_midway_leaves_nothing(tmp_path, model_dir, monkeypatch):
    import converters.execute as ex

    base = model_dir("qwen3")
    calls = {"n": 0}
    real = ex._stream_blocks

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(5, "simulated I/O error")
        return real(*a, **k)

    monkeypatch.setattr(ex, "_stream_blocks", flaky)
    with pytest.raises(OSError):
        export(tmp_path, base, samples.make_adapter_tensors(base, rank=8))
    assert not (tmp_path / "out").exists() and leftovers(tmp_path / "out") == []


def test_existing_output_kept_until_replacement_is_complete(tmp_path, model_dir):
    base = model_dir("qwen3")
    tensors = samples.make_adapter_tensors(base, rank=8)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with pytest.raises(ExportError) as ei:
        export(tmp_path, base, tensors)
    assert ei.value.code == E.OUTPUT_EXISTS and (out / "keep.txt").exists()
    export(tmp_path, base, tensors, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()
    assert leftovers(out) == []


def test_verification_catches_a_wrong_merge(tmp_path, model_dir, monkeypatch):
    """A merge that applies the wrong scale must fail verification and leave nothing behind."""
    import converters.formats.merged_safetensors as ms
    from converters.plan import LoraOp

    real = ms.ops_by_tensor

    def wrong_scale(adapter, base):
        return {k: [LoraOp(o.a, o.b, o.scale * 3, o.row_offset, o.module) for o in ops] for k, ops in real(adapter, base).items()}

    monkeypatch.setattr(ms, "ops_by_tensor", wrong_scale)
    base = model_dir("qwen3")
    with pytest.raises(ExportError) as ei:
        export(tmp_path, base, samples.make_adapter_tensors(base, rank=8), verify=True)
    assert ei.value.code == E.VERIFY_FAILED
    assert not (tmp_path / "out").exists() and leftovers(tmp_path / "out") == []


@pytest.mark.slow
def test_verification_passes_on_every_dense_arch(tmp_path, model_dir):
    for arch in DENSE:
        base = model_dir(arch)
        out = export(tmp_path, base, samples.make_adapter_tensors(base, rank=8), verify=True, name=arch)
        v = json.loads((out / MANIFEST_NAME).read_text())["verification"]
        assert v["status"] == "passed" and v["reference"] == "peft", (arch, v)
