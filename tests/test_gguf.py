"""GGUF export against the real consumer (llama-cpp-python) and llama.cpp's own quantizer."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from converters import ConvertOptions, ExportError, convert, samples
from converters import errors as E
from converters.gguf_quant import QUANT_TYPES
from tests.conftest import CONFIGS, DENSE, MOE, TOKENIZERS, patterned_archive

import llama_cpp  # a hard dependency of the tests (.[test]): never skip these silently
from llama_cpp import Llama

PROBES = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "def main(argv):\n    return sum(int(x) for x in argv[1:]) // 2  # code",
    "Numbers: 3 33 333 3333 3.14159 1,000,000 2024-11-29",
    "你好，世界！今日は良い天気です。 한국어 텍스트",
    "emoji 🙂🚀🦙 and accents: café naïve",
    "    four spaces\n\n\n\tthen tabs   and  runs   of spaces",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
]


def reference_tokenizer(arch: str, model: Path):
    """The tokenizer llama.cpp must agree with (SmolLM2 through tokenizer.json, see testdata/SOURCES.md)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if (model / "tokenizer.json").is_file() and arch == "llama":
        return PreTrainedTokenizerFast(tokenizer_file=str(model / "tokenizer.json"))
    return AutoTokenizer.from_pretrained(str(model))


def load(path: Path) -> Llama:
    files = sorted(path.glob("*.gguf"))
    assert files, f"no .gguf in {path}"
    return Llama(model_path=str(files[0]), logits_all=True, n_ctx=512, verbose=False, type_k=0, type_v=0, n_threads=2)


def cpp_logits(llm: Llama, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float64)


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].double().numpy()


def export(tmp_path: Path, base: Path, archive: Path | None, name: str, **opts) -> Path:
    out = tmp_path / name
    fmt = "merged-safetensors" if name == "merged" else "gguf-lora" if name.startswith("lora") else "gguf"
    convert(archive, str(base), fmt, out, ConvertOptions(**{"verify": False, **opts}))
    return out


@pytest.fixture(scope="module")
def exported(model_dir, tmp_path_factory):
    """arch -> (base, merged dir, {quant: gguf dir}) with an adapter on every linear (and the head where it exists)."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            base = model_dir(arch)
            tmp = tmp_path_factory.mktemp(f"gguf-{arch}")
            unembed = arch in ("llama", "qwen3-tied")
            archive = samples.build_archive(tmp / "a.tar", base, rank=8, unembed=unembed, compression=None, seed=11)
            merged = export(tmp, base, archive, "merged")
            ggufs = {q: export(tmp, base, archive, q, quant=q) for q in ("f32", "f16", "bf16", "q8_0")}
            cache[arch] = (base, merged, ggufs)
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", DENSE + MOE)
def test_tokenization_parity(exported, arch):
    base, merged, ggufs = exported(arch)
    tok = reference_tokenizer(arch, merged)
    llm = load(ggufs["f32"])
    for text in PROBES:
        expected = tok(text, add_special_tokens=False)["input_ids"]
        got = llm.tokenize(text.encode(), add_bos=False, special=True)
        assert got == expected, f"{arch}: {text!r}"


@pytest.mark.parametrize("arch", DENSE + MOE)
def test_logits_parity_with_merged_model(exported, arch):
    from transformers import AutoModelForCausalLM

    base, merged, ggufs = exported(arch)
    tok = reference_tokenizer(arch, merged)
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    seqs = [tok(t, add_special_tokens=False)["input_ids"] for t in PROBES]
    refs = [hf_logits(model, ids) for ids in seqs]
    base_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    assert max(np.abs(hf_logits(base_model, s) - r).max() for s, r in zip(seqs, refs)) > 0.05, "the adapter must change the model"
    # f32: to 1e-3 relative
    llm = load(ggufs["f32"])
    for ids, ref in zip(seqs, refs):
        got = cpp_logits(llm, ids)
        assert np.abs(got - ref).max() <= 1e-3 * np.abs(ref).max(), arch
    # f16/bf16: the same top-1 at every position that is not a tie within the
    # half-precision arithmetic's own noise (llama.cpp computes activations in
    # that precision; a random model has some near-ties): margin > 1% of scale
    decided = [np.diff(np.sort(ref, -1)[:, -2:], axis=-1)[:, 0] > 0.01 * np.abs(ref).max() for ref in refs]
    assert np.concatenate(decided).mean() >= 0.5, "most positions must be decided for this check to mean anything"
    for q in ("f16", "bf16"):
        llm = load(ggufs[q])
        for ids, ref, ok in zip(seqs, refs, decided):
            same = cpp_logits(llm, ids).argmax(-1) == ref.argmax(-1)
            assert same[ok].all(), f"{arch} {q}: top-1 differs at decided positions {np.where(~same & ok)[0]}"
    # q8_0: top-1 agreement >= 95% over the decided positions (llama.cpp also
    # quantizes activations to 8 bits, so near-ties flip more often)
    llm = load(ggufs["q8_0"])
    agree = np.concatenate([(cpp_logits(llm, ids).argmax(-1) == ref.argmax(-1))[ok] for ids, ref, ok in zip(seqs, refs, decided)])
    assert agree.mean() >= 0.95, f"{arch}: q8_0 top-1 agreement {agree.mean():.1%} on {agree.size} decided positions"


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_chat_template_and_stopping(exported, arch):
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    base, merged, ggufs = exported(arch)
    tok = reference_tokenizer(arch, merged) if arch != "llama" else __import__("transformers").AutoTokenizer.from_pretrained(str(merged))
    llm = load(ggufs["f32"])
    template = llm.metadata["tokenizer.chat_template"]
    assert template == tok.chat_template
    messages = [{"role": "user", "content": "Hello world! 你好，世界"}, {"role": "assistant", "content": "Hi! 你好！"}]
    eos_text = tok.convert_ids_to_tokens(tok.eos_token_id)
    rendered = Jinja2ChatFormatter(template, eos_token=eos_text, bos_token=tok.bos_token or "")(messages=messages).prompt
    assert rendered == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # every id generation_config.json stops on is an end-of-generation token for llama.cpp
    gen = json.loads((merged / "generation_config.json").read_text())
    eos_ids = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    for tid in eos_ids:
        assert llama_cpp.llama_vocab_is_eog(vocab, tid), f"{arch}: id {tid} does not stop generation"
    # and generation really stops there: make the model emit the end-of-turn token on its 3rd step
    end = tok.convert_tokens_to_ids("<|im_end|>")
    steps = {"n": 0}

    def force_end(input_ids, scores):
        steps["n"] += 1
        if steps["n"] == 3:
            scores = np.full_like(scores, -1e9)
            scores[end] = 0.0
        return scores

    prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    result = llm.create_completion(prompt, max_tokens=32, temperature=0.0, logits_processor=[force_end])
    assert result["choices"][0]["finish_reason"] == "stop"
    assert result["usage"]["completion_tokens"] == 2


def _quantize_with_llama_cpp(src: Path, dst: Path, quant: str) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(QUANT_TYPES[quant].file_type)
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    assert rc == 0


def _tensors(path: Path) -> dict[str, tuple[str, bytes]]:
    from gguf import GGUFReader

    r = GGUFReader(path)
    return {t.name: (t.tensor_type.name, bytes(np.asarray(t.data).tobytes())) for t in r.tensors}


@pytest.fixture(scope="module")
def quant_model(tmp_path_factory):
    """Llama-shaped, 8 layers, rows a multiple of 256 so K-quants apply, with an adapter."""
    tmp = tmp_path_factory.mktemp("quant")
    cfg = samples.shrink(json.loads((CONFIGS / "Meta-Llama-3.1-8B.json").read_text()), hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    base = samples.build_base(tmp / "base", cfg, TOKENIZERS / "smollm2")
    archive = samples.build_archive(tmp / "a.tar", base, rank=16, compression=None, seed=12)
    bf16 = export(tmp, base, archive, "bf16", quant="bf16")
    return tmp, base, archive, next(bf16.glob("*.gguf"))


@pytest.mark.slow
@pytest.mark.parametrize("quant", [q for q, t in QUANT_TYPES.items() if t.quantized])
def test_quantization_matches_llama_quantize(quant_model, quant):
    tmp, base, archive, bf16 = quant_model
    ours = next(export(tmp, base, archive, f"ours-{quant}", quant=quant).glob("*.gguf"))
    ref = tmp / f"ref-{quant}.gguf"
    _quantize_with_llama_cpp(bf16, ref, quant)
    a, b = _tensors(ours), _tensors(ref)
    assert set(a) == set(b)
    types = {n: t for n, (t, _) in a.items()}
    assert types == {n: t for n, (t, _) in b.items()}, "per-tensor types differ from llama.cpp's"
    for name in a:
        assert a[name][1] == b[name][1], f"{quant}: {name} bytes differ"
    if quant == "q4_k_m":  # the mix really is a mix
        assert {"Q4_K", "Q6_K"} <= set(types.values())


@pytest.mark.slow
def test_moe_quantization_matches_llama_quantize(model_dir, tmp_path):
    cfg = samples.shrink(json.loads((CONFIGS / "Qwen3-30B-A3B.json").read_text()), hidden_size=256, moe_intermediate_size=256, intermediate_size=512, num_hidden_layers=4, head_dim=64)
    base = samples.build_base(tmp_path / "base", cfg, TOKENIZERS / "qwen3")
    archive = samples.build_archive(tmp_path / "a.tar", base, rank=8, compression=None, shared_a=True)
    bf16 = next(export(tmp_path, base, archive, "bf16", quant="bf16").glob("*.gguf"))
    ours = next(export(tmp_path, base, archive, "ours", quant="q4_k_m").glob("*.gguf"))
    _quantize_with_llama_cpp(bf16, tmp_path / "ref.gguf", "q4_k_m")
    a, b = _tensors(ours), _tensors(tmp_path / "ref.gguf")
    assert {n: t for n, (t, _) in a.items()} == {n: t for n, (t, _) in b.items()}
    assert all(a[n][1] == b[n][1] for n in a)
    assert "blk.0.ffn_down_exps.weight" in a


def test_split_files_load_and_match(exported, tmp_path):
    base, merged, ggufs = exported("qwen3")
    archive = next(ggufs["f32"].parent.glob("a.tar"))
    out = export(tmp_path, base, archive, "split", quant="f32", split_max_size=15_000_000)
    parts = sorted(p.name for p in out.glob("*.gguf"))
    assert len(parts) >= 3 and parts[0] == f"model-F32-00001-of-{len(parts):05d}.gguf"
    ids = [9707, 1879, 0, 220, 108386, 3837, 99489]
    np.testing.assert_allclose(cpp_logits(load(out), ids), cpp_logits(load(ggufs["f32"]), ids), rtol=0, atol=1e-5)


def test_plain_hf_to_gguf_without_archive(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    base = model_dir("qwen3")
    out = export(tmp_path, base, None, "plain", quant="f32")
    ids = [9707, 1879, 0, 220, 108386]
    ref = hf_logits(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval(), ids)
    assert np.abs(cpp_logits(load(out), ids) - ref).max() <= 1e-3 * np.abs(ref).max()


def test_unknown_pretokenizer_refused_unless_allowed(tmp_path):
    from exporter.cli.demo import DEMO_CONFIG

    tok = samples.build_tokenizer(tmp_path / "tok")
    base = samples.build_base(tmp_path / "base", {**DEMO_CONFIG, "eos_token_id": 2}, tok)
    with pytest.raises(ExportError) as ei:
        export(tmp_path, base, None, "refused", quant="f16")
    assert ei.value.code == E.UNKNOWN_PRETOKENIZER and "--allow-unknown-pretokenizer" in ei.value.message
    assert not (tmp_path / "refused").exists()
    out = export(tmp_path, base, None, "allowed", quant="f16", allow_unknown_pretokenizer=True)
    assert load(out).metadata["tokenizer.ggml.pre"] == "default"


def test_metadata(exported):
    base, merged, ggufs = exported("qwen3moe")
    md = load(ggufs["q8_0"]).metadata
    assert md["general.architecture"] == "qwen3moe" and md["general.type"] == "model"
    assert md["general.file_type"] == str(int(QUANT_TYPES["q8_0"].file_type))
    assert md["qwen3moe.expert_count"] == "4" and md["qwen3moe.expert_used_count"] == "2"
    assert md["qwen3moe.expert_feed_forward_length"] == "32"
    assert md["tokenizer.ggml.pre"] == "qwen2" and md["tokenizer.ggml.model"] == "gpt2"
    assert md["general.finetune"] == "run_demo" and md["general.base_model.count"] == "1"


# --- gguf-lora ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_f32(model_dir, tmp_path_factory):
    """arch -> an f32 GGUF of the base model (no adapter)."""
    cache = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = export(tmp_path_factory.mktemp(f"plain-{arch}"), model_dir(arch), None, "base", quant="f32")
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3moe-fused"])
def test_gguf_lora_on_base_gguf_matches_merged(exported, plain_f32, tmp_path, arch):
    base, merged, ggufs = exported(arch)
    archive = next(ggufs["f32"].parent.glob("a.tar"))
    adapter = export(tmp_path, base, archive, "lora", quant="f32")
    files = sorted(adapter.glob("*.gguf"))
    from gguf import GGUFReader

    md = {f.name: f.contents() for f in GGUFReader(files[0]).fields.values()}
    assert md["general.type"] == "adapter" and md["adapter.type"] == "lora" and md["adapter.lora.alpha"] == 16.0
    tok = reference_tokenizer(arch, merged)
    with_lora = Llama(model_path=str(next(plain_f32(arch).glob("*.gguf"))), lora_path=str(files[0]), logits_all=True, n_ctx=512, verbose=False, type_k=0, type_v=0, n_threads=2)
    plain = load(plain_f32(arch))
    merged_llm = load(ggufs["f32"])
    for text in PROBES[:4]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        ref = cpp_logits(merged_llm, ids)
        got = cpp_logits(with_lora, ids)
        # the merged file's weights are rounded to bf16 once; the runtime LoRA is not
        assert np.abs(got - ref).max() <= 0.02 * np.abs(ref).max(), arch
        assert np.abs(cpp_logits(plain, ids) - ref).max() > 5 * np.abs(got - ref).max(), "the adapter must do the work"


def test_gguf_lora_folds_per_module_scales(model_dir, tmp_path):
    base = model_dir("qwen3")
    archive, _ = patterned_archive(base, tmp_path / "a.tar")
    merged = export(tmp_path, base, archive, "merged-gguf", quant="f32")
    adapter = export(tmp_path, base, archive, "lora", quant="f32")
    plain = export(tmp_path, base, None, "plain", quant="f32")
    with_lora = Llama(model_path=str(next(plain.glob("*.gguf"))), lora_path=str(next(adapter.glob("*.gguf"))), logits_all=True, n_ctx=256, verbose=False, type_k=0, type_v=0)
    ids = [9707, 1879, 0, 220, 108386, 3837, 99489, 151645]
    ref = cpp_logits(load(merged), ids)
    assert np.abs(cpp_logits(with_lora, ids) - ref).max() <= 0.02 * np.abs(ref).max()


def test_gguf_lora_refuses_head_on_tied_model(exported, tmp_path):
    base, merged, ggufs = exported("qwen3-tied")
    archive = next(ggufs["f32"].parent.glob("a.tar"))  # trains the unembedding
    with pytest.raises(ExportError) as ei:
        export(tmp_path, base, archive, "lora", quant="f32")
    assert ei.value.code == E.INVALID_OPTION and "-f gguf" in ei.value.message
    assert not (tmp_path / "lora").exists()
