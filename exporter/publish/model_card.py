"""The Hub model card (README.md) for an export, built with huggingface_hub's card classes.

What differs per format is data: the library a user loads it with, how it
relates to its base model (the Hub's ``base_model_relation``), extra tags, and
a usage snippet.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from huggingface_hub import ModelCard, ModelCardData


@dataclass(frozen=True)
class CardSpec:
    library_name: str
    relation: str  # the Hub's base_model_relation
    tags: tuple[str, ...]
    usage: str  # format string: {repo}, {base}, {file}


CARDS = {
    "merged-safetensors": CardSpec("transformers", "merge", ("lora", "merged"), '''```python
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{repo}")
model = AutoModelForCausalLM.from_pretrained("{repo}", dtype="auto", device_map="auto")
messages = [{{"role": "user", "content": "Hello!"}}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt").to(model.device)
print(tokenizer.decode(model.generate(inputs, max_new_tokens=128)[0][inputs.shape[-1]:], skip_special_tokens=True))
```'''),
    "lora-adapter": CardSpec("peft", "adapter", ("lora", "peft"), '''```python
from peft import AutoPeftModelForCausalLM
from transformers import AutoTokenizer

model = AutoPeftModelForCausalLM.from_pretrained("{repo}", dtype="auto", device_map="auto")
tokenizer = AutoTokenizer.from_pretrained("{repo}")
```

With vLLM: `vllm serve {base} --enable-lora --lora-modules adapter={repo}`'''),
    "gguf": CardSpec("gguf", "quantized", ("gguf", "llama.cpp"), '''```sh
llama-server --hf-repo {repo} --hf-file {file}
```'''),
    "gguf-lora": CardSpec("gguf", "adapter", ("gguf", "llama.cpp", "lora"), '''```sh
llama-server -m <base model .gguf> --lora {file}
```'''),
}

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def build(fmt: str, repo_id: str, manifest: dict, files: list[str]) -> ModelCard:
    """A card that is a pure function of the export: the same export renders the same bytes."""
    spec = CARDS[fmt]
    base = (manifest.get("base_model") or {}).get("id")
    base_id = base if base and _REPO_ID.fullmatch(base) else None  # the Hub only accepts repo ids here
    family = (manifest.get("base_model") or {}).get("architecture")
    data = ModelCardData(
        base_model=base_id,
        base_model_relation=spec.relation if base_id else None,
        library_name=spec.library_name,
        pipeline_tag="text-generation",
        tags=sorted({"nucleus-export", *spec.tags, *([family] if family else [])}),
    )
    source = manifest.get("source") or {}
    main_file = next((f for f in files if f.endswith(".gguf")), files[0] if files else "")
    lines = [
        f"# {repo_id.split('/')[-1]}",
        "",
        f"A {fmt} export of a LoRA fine-tune" + (f" of [{base_id}](https://huggingface.co/{base_id})" if base_id else "") + ", made with nucleus-export.",
        "",
    ]
    if source.get("run_id") or source.get("checkpoint_id"):
        lines += [f"- Training run: `{source.get('run_id')}`, checkpoint `{source.get('checkpoint_id')}`" + (f", step {source['step']}" if source.get("step") is not None else "")]
    if fmt == "gguf" and manifest.get("options", {}).get("quant"):
        lines += [f"- Quantization: `{manifest['options']['quant']}`"]
    lines += ["- Checksums of every file: `nucleus-export.json`", "", "## Usage", "", spec.usage.format(repo=repo_id, base=base_id or "<base model>", file=main_file), ""]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines))
