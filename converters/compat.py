"""What the serving engines accept in a PEFT LoRA adapter, as data.

The report is advisory: PEFT itself loads everything we write. vLLM and SGLang
load a subset; the report says which parts of this adapter they would reject
or ignore, so a user learns it before deploying.
"""

from __future__ import annotations

ENGINES: dict[str, dict] = {
    "vllm": {
        "ranks": {1, 8, 16, 32, 64, 128, 256, 320, 512},
        "target_modules": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj"},
        "moe_experts": True,  # per-expert modules (experts.N.gate_proj …) on fused-MoE models
        "lm_head": False,
        "modules_to_save": False,
        "patterns": False,  # applies lora_alpha / r uniformly
        "notes": "set --max-lora-rank to at least the adapter's rank",
    },
    "sglang": {
        "ranks": None,  # any rank up to --max-lora-rank
        "target_modules": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj"},
        "moe_experts": False,
        "lm_head": False,
        "modules_to_save": False,
        "patterns": False,
        "notes": "set --max-lora-rank and --lora-target-modules to cover this adapter",
    },
}


def report(adapter_config: dict, ranks: set[int], has_experts: bool) -> dict:
    """One entry per engine: compatible flag plus the reasons it is not."""
    targets = set(adapter_config.get("target_modules") or [])
    out = {}
    for engine, caps in ENGINES.items():
        problems = []
        if caps["ranks"] is not None and not ranks <= caps["ranks"]:
            problems.append(f"rank(s) {sorted(ranks - caps['ranks'])} not in supported ranks {sorted(caps['ranks'])}")
        unsupported = sorted(t for t in targets if t not in caps["target_modules"] and t != "lm_head")
        if unsupported:
            problems.append(f"unsupported target modules {unsupported}")
        if "lm_head" in targets and not caps["lm_head"]:
            problems.append("LoRA on lm_head (trained unembedding) is not supported")
        if adapter_config.get("modules_to_save") and not caps["modules_to_save"]:
            problems.append("modules_to_save is not supported")
        if has_experts and not caps["moe_experts"]:
            problems.append("LoRA on MoE experts is not supported")
        if (adapter_config.get("rank_pattern") or adapter_config.get("alpha_pattern")) and not caps["patterns"]:
            problems.append("per-module rank_pattern/alpha_pattern is ignored; scales would be wrong")
        out[engine] = {"compatible": not problems, "problems": problems, "notes": caps["notes"], "max_rank": max(ranks) if ranks else 0}
    return out
