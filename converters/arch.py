"""Per-architecture knowledge, as data.

Each :class:`Family` says how a model family names its tensors, which linear
modules a LoRA may target, how its experts are laid out on disk, and how the
word embedding and output head relate. Code elsewhere reads these tables; it
never branches on a family's name. Adding a family means adding an entry.
"""

from __future__ import annotations

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

    def is_sparse(self, config: dict, layer: int) -> bool:
        step = int(config.get(self.sparse_step_key, 1) or 1)
        dense = set(config.get(self.dense_layers_key) or [])
        return layer not in dense and (layer + 1) % step == 0


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
    Family("llama", ("llama",), ("LlamaForCausalLM",)),
    Family("mistral", ("mistral",), ("MistralForCausalLM",)),
    Family("qwen2", ("qwen2",), ("Qwen2ForCausalLM",)),
    Family("qwen3", ("qwen3",), ("Qwen3ForCausalLM",)),
    Family("qwen3moe", ("qwen3_moe",), ("Qwen3MoeForCausalLM",), moe=QWEN3_MOE_LAYOUT),
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


def is_tied(fam: Family, config: dict) -> bool:
    return bool(config.get(fam.tie_key, fam.tie_default))
