"""Tokenizer metadata for GGUF, as llama.cpp reads it.

BPE tokenizers are written as ``gpt2`` with ``tokenizer.ggml.pre`` identified
from the tokenizer itself (llama.cpp's method: hash the token ids of a fixed
check text; the table of known hashes is data below). SentencePiece models are
written as ``llama`` with scores and token types. Special-token ids, add_bos,
the chat template, and every end-of-generation id of generation_config.json
travel too, so the exported model stops where the original does.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path

from gguf import GGUFValueType, TokenType

from . import errors as E
from .errors import InputError
from .io.gguf_file import KV, kv_array, kv_bool, kv_string, kv_u32

# llama.cpp's pre-tokenizer check text (convert_hf_to_gguf_update.py).
CHK_TXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 "
    "3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? "
    "'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
# sha256(str(token ids of CHK_TXT)) -> llama.cpp pre-tokenizer name, for the
# families we export and their common fine-tune bases.
PRE_TOKENIZERS: dict[str, str] = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Llama 3
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5-3
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM/SmolLM2
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",  # Mistral Nemo
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
    "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5": "deepseek-r1-qwen",
    "877081d19cf6996e2c4ff0e1236341e9b7bde288f5311a56a937f0afbbb3aeb5": "deepseek-v3",
    "049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754": "deepseek-llm",
    "347715f544604f9118bb75ed199f68779f423cabb20db6de6f31b908d04d7821": "deepseek-coder",
    "9d032fcbd5501f4a38150912590928bfb36091efb5df11b8e2124b0390e3fb1e": "falcon3",
    "d353350c764d8c3b39c763113960e4fb4919bea5fbf208a0e3b22e8469dc7406": "llama4",
    "ccc2ef013c104be7bae2965776d611e1d7a8a2a9c547dd93a682c9a9fc80352e": "gpt-4o",
}
# Added tokens llama.cpp's converter marks CONTROL even when the tokenizer does
# not flag them special (convert_hf_to_gguf's does_token_look_special).
LOOKS_SPECIAL_EXACT = {"<pad>", "<mask>", "<2mass>", "[@BOS@]"}
LOOKS_SPECIAL_WRAPS = (("<|", "|>"), ("<｜", "｜>"), ("<start_of_", ">"), ("<end_of_", ">"))


def looks_special(text: str) -> bool:
    return text in LOOKS_SPECIAL_EXACT or any(text.startswith(a) and text.endswith(b) for a, b in LOOKS_SPECIAL_WRAPS)


# Texts llama.cpp itself treats as end of generation (llama-vocab.cpp).
LLAMA_CPP_EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>", "<|eom_id|>", "</s>"}


@dataclass
class Vocab:
    kind: str  # "gpt2" | "llama"
    pre: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] = field(default_factory=list)
    special: dict[str, int] = field(default_factory=dict)  # bos, eos, eot, eom, unk, pad
    add_bos: bool | None = None
    add_eos: bool | None = None
    chat_template: str | None = None

    def kvs(self) -> list[KV]:
        out = [kv_string("tokenizer.ggml.model", self.kind), kv_string("tokenizer.ggml.pre", self.pre),
               kv_array("tokenizer.ggml.tokens", self.tokens, GGUFValueType.STRING)]
        if self.scores is not None:
            out.append(kv_array("tokenizer.ggml.scores", self.scores, GGUFValueType.FLOAT32))
        out.append(kv_array("tokenizer.ggml.token_type", self.types, GGUFValueType.INT32))
        if self.merges:
            out.append(kv_array("tokenizer.ggml.merges", self.merges, GGUFValueType.STRING))
        keys = {"bos": "bos_token_id", "eos": "eos_token_id", "eot": "eot_token_id", "eom": "eom_token_id", "unk": "unknown_token_id", "pad": "padding_token_id"}
        for typ, tid in self.special.items():
            out.append(kv_u32(f"tokenizer.ggml.{keys[typ]}", tid))
        if self.add_bos is not None:
            out.append(kv_bool("tokenizer.ggml.add_bos_token", self.add_bos))
        if self.add_eos is not None:
            out.append(kv_bool("tokenizer.ggml.add_eos_token", self.add_eos))
        if self.chat_template:
            out.append(kv_string("tokenizer.chat_template", self.chat_template))
        return out


def _json(p: Path) -> dict:
    return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}


def _token_text(v) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict):
        return v.get("content")
    return None


def _bpe(model_dir: Path, vocab_size: int, allow_unknown_pre: bool) -> Vocab:
    from transformers import AutoTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = AutoTokenizer.from_pretrained(str(model_dir))
    chkhsh = sha256(str(tok.encode(CHK_TXT)).encode()).hexdigest()
    pre = PRE_TOKENIZERS.get(chkhsh)
    if pre is None:
        if not allow_unknown_pre:
            raise InputError(E.UNKNOWN_PRETOKENIZER, f"the tokenizer's pre-tokenizer is not one llama.cpp knows (check hash {chkhsh[:16]}…), so llama.cpp would split text differently; pass --allow-unknown-pretokenizer to export it as 'default' anyway.", field="tokenizer")
        pre = "default"
    vocab = tok.get_vocab()
    reverse = {i: t for t, i in vocab.items()}
    added = tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
            continue
        text = reverse[i]
        if i in added:
            types.append(TokenType.CONTROL if added[i].special or looks_special(text) else TokenType.USER_DEFINED)
        else:
            types.append(TokenType.NORMAL)
        tokens.append(text)
    return Vocab("gpt2", pre, tokens, [int(t) for t in types], merges=_merges(model_dir))


def _merges(model_dir: Path) -> list[str]:
    tj = _json(model_dir / "tokenizer.json")
    merges = (tj.get("model") or {}).get("merges")
    if merges:
        return [m if isinstance(m, str) else " ".join(m) for m in merges]
    mt = model_dir / "merges.txt"
    if mt.is_file():
        lines = mt.read_text(encoding="utf-8").splitlines()
        return [ln for ln in lines if ln and not ln.startswith("#version")]
    return []


def _sentencepiece(model_dir: Path, vocab_size: int) -> Vocab:
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor()
    sp.LoadFromFile(str(model_dir / "tokenizer.model"))
    n = max(vocab_size, sp.vocab_size())
    tokens = [f"[PAD{i}]" for i in range(n)]
    scores = [-1000.0] * n
    types = [int(TokenType.UNUSED)] * n
    for i in range(sp.vocab_size()):
        tokens[i] = sp.IdToPiece(i)
        scores[i] = sp.GetScore(i)
        t = TokenType.NORMAL
        if sp.IsUnknown(i):
            t = TokenType.UNKNOWN
        elif sp.IsControl(i):
            t = TokenType.CONTROL
        elif sp.IsUnused(i):
            t = TokenType.UNUSED
        elif sp.IsByte(i):
            t = TokenType.BYTE
        types[i] = int(t)
    for i, spec in (_json(model_dir / "tokenizer_config.json").get("added_tokens_decoder") or {}).items():
        i = int(i)
        if i < n:
            tokens[i] = spec["content"]
            types[i] = int(TokenType.CONTROL if spec.get("special") else TokenType.USER_DEFINED)
    v = Vocab("llama", "default", tokens, types, scores=scores)
    v.special.update({"bos": sp.bos_id(), "eos": sp.eos_id(), "unk": sp.unk_id()})
    v.special = {k: i for k, i in v.special.items() if i >= 0}
    v.add_bos = True  # SentencePiece llama/mistral models prepend <s> unless the config says otherwise
    return v


def _chat_template(model_dir: Path, tcfg: dict) -> str | None:
    if isinstance(tcfg.get("chat_template"), str):
        return tcfg["chat_template"]
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    cj = _json(model_dir / "chat_template.json").get("chat_template")
    return cj if isinstance(cj, str) else None


def build(model_dir: Path, config: dict, *, allow_unknown_pre: bool = False) -> tuple[Vocab, list[str]]:
    """The GGUF vocabulary of a model directory, and notes for the manifest."""
    vocab_size = int(config["vocab_size"])
    notes: list[str] = []
    if (model_dir / "tokenizer.json").is_file() and _json(model_dir / "tokenizer.json").get("model", {}).get("type") == "BPE" and not (model_dir / "tokenizer.model").is_file():
        v = _bpe(model_dir, vocab_size, allow_unknown_pre)
    elif (model_dir / "vocab.json").is_file() and (model_dir / "merges.txt").is_file():
        v = _bpe(model_dir, vocab_size, allow_unknown_pre)
    elif (model_dir / "tokenizer.model").is_file():
        v = _sentencepiece(model_dir, vocab_size)
    else:
        raise InputError(E.BASE_INVALID, f"{model_dir} has no tokenizer (tokenizer.json, vocab.json + merges.txt, or tokenizer.model); GGUF files must carry one.")
    tcfg = _json(model_dir / "tokenizer_config.json")
    ids = {t: i for i, t in enumerate(v.tokens)}
    for typ in ("bos", "eos", "unk", "pad"):
        text = _token_text(tcfg.get(f"{typ}_token"))
        if text is not None and text in ids:
            v.special[typ] = ids[text]
        elif isinstance(config.get(f"{typ}_token_id"), int) and typ not in v.special:
            v.special[typ] = config[f"{typ}_token_id"]
    if isinstance(tcfg.get("add_bos_token"), bool):
        v.add_bos = tcfg["add_bos_token"]
    elif v.kind == "gpt2":
        v.add_bos = False
    if isinstance(tcfg.get("add_eos_token"), bool):
        v.add_eos = tcfg["add_eos_token"]
    v.chat_template = _chat_template(model_dir, tcfg)
    _end_of_generation(v, model_dir, config, notes)
    return v, notes


def _end_of_generation(v: Vocab, model_dir: Path, config: dict, notes: list[str]) -> None:
    """Every id generation_config.json stops on must be an end-of-generation id in llama.cpp."""
    gen = _json(model_dir / "generation_config.json")
    eos = gen.get("eos_token_id", config.get("eos_token_id"))
    wanted = [e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int)]
    if "eos" not in v.special and wanted:
        v.special["eos"] = wanted[0]
    covered = {v.special.get("eos")} | {i for i, t in enumerate(v.tokens) if t in LLAMA_CPP_EOG_TEXTS and v.types[i] in (TokenType.CONTROL, TokenType.USER_DEFINED)}
    slots = [s for s in ("eot", "eom") if s not in v.special]
    for tid in wanted:
        if tid in covered:
            continue
        if not slots:
            raise InputError(E.BASE_INVALID, f"generation_config.json stops on more end-of-turn ids than GGUF can carry (eos, eot, eom); id {tid} would not stop generation in llama.cpp.")
        slot = slots.pop(0)
        v.special[slot] = tid
        covered.add(tid)
        notes.append(f"end-of-generation id {tid} ({v.tokens[tid]!r}) written as {slot}_token_id")
