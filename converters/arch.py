"""Per-architecture knowledge, as data.

Each :class:`Family` says how a model family names its tensors, which linear
modules a LoRA may target, how its experts are laid out on disk, and how the
word embedding and output head relate. Code elsewhere reads these tables; it
never branches on a family's name. Adding a family means adding an entry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from . import errors as E
from .errors import InputError

# Dense decoder layers of the llama lineage share these names. Keys are the
# module paths inside a layer, as the checkpoint archive and PEFT name them.
_LLAMA_LAYER_LINEARS: dict[str, str] = {
    "self_attn.q_proj": "model.layers.{layer}.self_attn.q_proj.weight",
    "self_attn.k_proj": "model.layers.{layer}.self_attn.k_proj.weight",
    "self_attn.v_proj": "model.layers.{layer}.self_attn.v_proj.weight",
    "self_attn.o_proj": "model.layers.{layer}.self_attn.o_proj.weight",
    "mlp.gate_proj": "model.layers.{layer}.mlp.gate_proj.weight",
    "mlp.up_proj": "model.layers.{layer}.mlp.up_proj.weight",
    "mlp.down_proj": "model.layers.{layer}.mlp.down_proj.weight",
}


def _template_regex(template: str) -> re.Pattern:
    """A name template such as 'model.layers.{layer}.mlp.experts.{expert}.{proj}.weight' as a regex."""
    rx = re.escape(template)
    for key, pat in (("layer", r"\d+"), ("expert", r"\d+"), ("proj", r"[a-z_]+")):
        rx = rx.replace(re.escape("{" + key + "}"), f"(?P<{key}>{pat})")
    return re.compile(f"^{rx}$")


@dataclass(frozen=True)
class FusedSlot:
    """Where one expert projection lives inside a fused 3-D tensor [E, rows, in]."""

    tensor: str  # name template with {layer}
    chunk: int  # which of `chunks` equal row blocks per expert
    chunks: int


@dataclass(frozen=True)
class MoeLayout:
    num_experts_keys: tuple[str, ...]  # first present wins (transformers 5 renames some)
    # archive's expert projection names -> the HF projection they train
    archive_projections: dict[str, str]
    # per-expert on-disk layout (Hub checkpoints): one 2-D tensor per expert
    per_expert: str  # template with {layer}, {expert}, {proj}
    # fused on-disk layout (transformers >= 5 in-memory / some re-saves)
    fused: dict[str, FusedSlot]
    router: str
    # which layers are sparse: layer i is MoE if i not in mlp_only_layers and
    # (i + 1) % decoder_sparse_step == 0 (the Qwen MoE rule)
    sparse_step_key: str = "decoder_sparse_step"
    dense_layers_key: str = "mlp_only_layers"
    peft_per_expert: str = "model.layers.{layer}.mlp.experts.{expert}.{proj}"

    def num_experts(self, config: dict) -> int:
        for k in self.num_experts_keys:
            if config.get(k):
                return int(config[k])
        raise InputError(E.BASE_INVALID, f"config.json names no expert count ({' or '.join(self.num_experts_keys)}); the base model is incomplete.")

    def match_per_expert(self, name: str) -> tuple[int, int, str] | None:
        """(layer, expert, projection) if ``name`` is a per-expert tensor."""
        m = _template_regex(self.per_expert).match(name)
        return (int(m["layer"]), int(m["expert"]), m["proj"]) if m else None

    def match_fused(self, name: str) -> tuple[int, list[tuple[str, FusedSlot]]] | None:
        """(layer, [(projection, slot), …]) if ``name`` is a fused expert tensor."""
        for slot in dict.fromkeys(s.tensor for s in self.fused.values()):
            m = _template_regex(slot).match(name)
            if m:
                return int(m["layer"]), [(proj, s) for proj, s in self.fused.items() if s.tensor == slot]
        return None

    def is_sparse(self, config: dict, layer: int) -> bool:
        step = int(config.get(self.sparse_step_key, 1) or 1)
        dense = set(config.get(self.dense_layers_key) or [])
        return layer not in dense and (layer + 1) % step == 0


# --- GGUF ---------------------------------------------------------------------------------
# HF tensor names -> GGUF names (llama.cpp's). Layer tensors are "model.layers.{i}.<key>"
# and become "blk.{i}.<value>". Tensors matching GGUF_DROPPED are not model weights.
GGUF_GLOBAL_NAMES: dict[str, str] = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
GGUF_LAYER_NAMES: dict[str, str] = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
}
GGUF_DROPPED = ("rotary_emb.inv_freq",)
# Stacked expert tensors [E, out, in]: HF expert projection -> GGUF name in a layer.
GGUF_EXPERT_NAMES: dict[str, str] = {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight", "down_proj": "ffn_down_exps.weight"}
# Tensors llama.cpp (convert_hf_to_gguf) always stores as F32, besides 1-D ones.
GGUF_F32_SUFFIXES = ("_norm.weight", "ffn_gate_inp.weight", "rope_freqs.weight")


@dataclass(frozen=True)
class HParam:
    """One GGUF hyperparameter: key suffix after "{arch}.", config keys tried in order, type."""

    key: str
    config: tuple[str, ...]
    type: str  # u32 | f32
    required: bool = True


_COMMON_HPARAMS = (
    HParam("context_length", ("max_position_embeddings",), "u32"),
    HParam("embedding_length", ("hidden_size",), "u32"),
    HParam("block_count", ("num_hidden_layers",), "u32"),
    HParam("feed_forward_length", ("intermediate_size",), "u32"),
    HParam("attention.head_count", ("num_attention_heads",), "u32"),
    HParam("attention.head_count_kv", ("num_key_value_heads", "num_attention_heads"), "u32"),
    HParam("rope.freq_base", ("rope_parameters.rope_theta", "rope_theta"), "f32"),
    HParam("attention.layer_norm_rms_epsilon", ("rms_norm_eps",), "f32"),
    HParam("attention.key_length", ("head_dim",), "u32", required=False),
    HParam("attention.value_length", ("head_dim",), "u32", required=False),
)


@dataclass(frozen=True)
class GgufSpec:
    arch: str  # llama.cpp architecture name
    hparams: tuple[HParam, ...] = _COMMON_HPARAMS
    # llama-style rotary embedding: GGUF stores the q/k rows of each head
    # interleaved (convert_hf_to_gguf's permute); NEOX-style families permute
    # nothing. Layer module -> config keys giving its head count, first present wins.
    permuted: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # rope scaling types this family can export, and how (None = nothing to write)
    rope_scaling: tuple[str, ...] = ("default",)
    vocab_size_key: bool = False  # llama writes {arch}.vocab_size and rope.dimension_count


_LLAMA_GGUF = GgufSpec(
    "llama",
    permuted={"self_attn.q_proj": ("num_attention_heads",), "self_attn.k_proj": ("num_key_value_heads", "num_attention_heads")},
    rope_scaling=("default", "llama3"),
    vocab_size_key=True,
)
_QWEN3MOE_GGUF = GgufSpec(
    "qwen3moe",
    hparams=_COMMON_HPARAMS + (
        HParam("expert_count", ("num_experts", "num_local_experts"), "u32"),
        HParam("expert_used_count", ("num_experts_per_tok",), "u32"),
        HParam("expert_feed_forward_length", ("moe_intermediate_size",), "u32"),
    ),
)


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    layer_linears: dict[str, str] = field(default_factory=lambda: dict(_LLAMA_LAYER_LINEARS))
    layers_key: str = "num_hidden_layers"
    embed: str = "model.embed_tokens.weight"
    lm_head: str = "lm_head.weight"
    tie_key: str = "tie_word_embeddings"
    tie_default: bool = False  # transformers' default when config omits the key
    moe: MoeLayout | None = None
    gguf: GgufSpec | None = None


QWEN3_MOE_LAYOUT = MoeLayout(
    num_experts_keys=("num_experts", "num_local_experts"),
    archive_projections={"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
    per_expert="model.layers.{layer}.mlp.experts.{expert}.{proj}.weight",
    fused={
        # transformers 5: gate_up_proj [E, 2*I, H] (gate rows first), down_proj [E, H, I]
        "gate_proj": FusedSlot("model.layers.{layer}.mlp.experts.gate_up_proj", 0, 2),
        "up_proj": FusedSlot("model.layers.{layer}.mlp.experts.gate_up_proj", 1, 2),
        "down_proj": FusedSlot("model.layers.{layer}.mlp.experts.down_proj", 0, 1),
    },
    router="model.layers.{layer}.mlp.gate.weight",
)

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama",), ("LlamaForCausalLM",), gguf=_LLAMA_GGUF),
    # llama.cpp runs Mistral (without sliding window) as the llama architecture
    Family("mistral", ("mistral",), ("MistralForCausalLM",), gguf=_LLAMA_GGUF),
    Family("qwen2", ("qwen2",), ("Qwen2ForCausalLM",), gguf=GgufSpec("qwen2")),
    Family("qwen3", ("qwen3",), ("Qwen3ForCausalLM",), gguf=GgufSpec("qwen3")),
    Family("qwen3moe", ("qwen3_moe",), ("Qwen3MoeForCausalLM",), moe=QWEN3_MOE_LAYOUT, gguf=_QWEN3MOE_GGUF),
)


def supported() -> list[str]:
    return [f.name for f in FAMILIES]


def family_for(config: dict) -> Family:
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    for fam in FAMILIES:
        if model_type in fam.model_types or any(a in fam.architectures for a in archs):
            return fam
    raise InputError(
        E.UNSUPPORTED_ARCHITECTURE,
        f"architecture {model_type or archs or 'unknown'!s} is not supported; supported families: {', '.join(supported())}.",
    )


def rope_permutation(spec: GgufSpec, module: str, config: dict):
    """The GGUF row Transform for a layer module's output rows, or None."""
    keys = spec.permuted.get(module)
    if not keys:
        return None
    from .plan import Transform

    heads = next(int(config[k]) for k in keys if config.get(k))
    return Transform("permute_qk", heads)


def config_value(config: dict, dotted: str):
    """config["a"]["b"] for "a.b"; None when absent."""
    cur = config
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def rope_parameters(config: dict) -> dict:
    """Rope settings across transformers versions (rope_parameters in 5.x, rope_scaling before)."""
    params = dict(config.get("rope_scaling") or {})
    params.update(config.get("rope_parameters") or {})
    if "rope_theta" not in params and "rope_theta" in config:
        params["rope_theta"] = config["rope_theta"]
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def is_tied(fam: Family, config: dict) -> bool:
    return bool(config.get(fam.tie_key, fam.tie_default))
