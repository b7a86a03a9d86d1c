"""``nucleus-export demo``: a sample model and checkpoint, exported to every format through the embedded HTTP service, downloaded and checked."""

from __future__ import annotations

import shutil
from pathlib import Path

from converters import registry
from converters.errors import EXIT_INTERNAL, EXIT_OK

from .errors import guarded

# A Qwen3-family model small enough to build in seconds. Untied, with a
# trained unembedding, so every format (GGUF LoRA included) can carry the head.
DEMO_CONFIG = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "initializer_range": 0.1,
}


def register(sub) -> None:
    p = sub.add_parser("demo", help="build a sample checkpoint offline and export it to every format through the embedded HTTP service")
    p.add_argument("--dir", default="demo-output", help="where to put the sample, the service's data and the downloads (default ./demo-output)")
    p.add_argument("--workers", type=int, default=1, help="in-process workers (default 1: one conversion at a time)")
    p.set_defaults(func=run)


@guarded
def run(args) -> int:
    import json

    from converters import samples

    from ..api import create_app
    from ..api.server import BackgroundServer
    from ..client import ApiClient
    from ..service import Services
    from ..settings import Settings
    from .client import watch

    root = Path(args.dir).absolute()
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    print(f"building a sample base model and checkpoint in {root} …")
    tok = samples.build_tokenizer(root / "tokenizer")
    # the service names base models by Hub id and finds them in its model store
    base = samples.build_base(root / "models" / "demo" / "tiny-qwen3", {**DEMO_CONFIG, "eos_token_id": 2, "pad_token_id": 0}, tok)
    checkpoint = "nucleus://run_demo:train:0/sampler_weights/000001"

    # Embedded mode: SQLite operations store, local artifact store, in-process workers, the API on loopback.
    services = Services(Settings(data_dir=root / "service", model_store=str(root / "models")))
    (services.artifacts.root / "checkpoints" / "demo" / "run_demo").mkdir(parents=True)  # tenant demo's part of the store
    archive = samples.build_archive(services.artifacts.root / "checkpoints" / "demo" / "run_demo" / "000001.tar.zst", base, rank=8, alpha=16, unembed=True,
                                    compression="zstd", meta={"run_id": "run_demo", "checkpoint_id": "sampler_weights/000001", "step": 1})
    print(f"  base model: {base}\n  archive:    {archive}")
    server = BackgroundServer(create_app(services, background={"workers": max(1, args.workers), "sweeper": False}))
    services.artifacts.base_url = server.url  # signed URLs point at this server
    try:
        _, key = services.keys.create("demo", ["train", "read"], "demo")
        api = ApiClient(server.url, key)
        print(f"service on {server.url} (store {services.store.url}); registering {checkpoint}")
        api.register_checkpoint(checkpoint, archive.as_uri(), base_model="demo/tiny-qwen3", step=1)
        ops = {}
        for fmt in sorted(registry.available()):
            # The demo's freshly trained tokenizer is, by construction, unknown to
            # llama.cpp's pre-tokenizer table; real models are identified.
            body = {"format": fmt, "verify": True, **({"quant": "q8_0"} if fmt == "gguf" else {}),
                    **({"allow_unknown_pretokenizer": True} if fmt.startswith("gguf") else {})}
            ops[fmt] = api.submit(checkpoint, body, idempotency_key=f"demo-{fmt}")["operation"]
            print(f"  POST …/export {fmt:<20} -> 202 {ops[fmt]}")
        failures = 0
        for fmt, op_id in ops.items():
            op = watch(api, op_id)
            if op["status"] != "succeeded":
                failures += 1
                print(f"✗ {fmt:<20} {op['status']}: [{(op['error'] or {}).get('code')}] {(op['error'] or {}).get('message')}")
                continue
            files = api.download(op, root / "downloads" / fmt)  # through the signed URLs; each file's sha256 is checked
            manifest = json.loads((root / "downloads" / fmt / "nucleus-export.json").read_text())
            v = manifest.get("verification") or {}
            detail = f"max |Δ log p| {v['max_abs_logprob_diff']:.1e}" if "max_abs_logprob_diff" in v else v.get("reason", "")
            print(f"✓ {fmt:<20} {op_id}  verification: {v.get('status', 'not run')} ({detail}); {len(files)} files downloaded, sha256 checked")
            print(f"  files: {root / 'downloads' / fmt}")
    finally:
        server.close()
        services.close()
    print("done." if not failures else f"{failures} format(s) failed.")
    return EXIT_OK if not failures else EXIT_INTERNAL
