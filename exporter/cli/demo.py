"""``nucleus-export demo``: build a sample model and checkpoint offline, export it to every format, verify."""

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
    p = sub.add_parser("demo", help="build a sample checkpoint offline and export it to every format through the job runner")
    p.add_argument("--dir", default="demo-output", help="where to put the sample, the operations store and the exports (default ./demo-output)")
    p.add_argument("--workers", type=int, default=1, help="in-process workers (default 1: one conversion at a time)")
    p.set_defaults(func=run)


@guarded
def run(args) -> int:
    import json
    import threading

    from converters import samples

    from ..settings import Settings
    from .worker import build_worker

    root = Path(args.dir).absolute()
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    print(f"building a sample base model and checkpoint in {root} …")
    tok = samples.build_tokenizer(root / "tokenizer")
    base = samples.build_base(root / "base-model", {**DEMO_CONFIG, "eos_token_id": 2, "pad_token_id": 0}, tok)
    archive = samples.build_archive(root / "checkpoint.tar.zst", base, rank=8, alpha=16, unembed=True, compression="zstd",
                                    meta={"run_id": "run_demo", "checkpoint_id": "sampler_weights/000001", "step": 1})
    print(f"  base model: {base}\n  archive:    {archive}")

    # Embedded mode: SQLite operations store, local artifact store, in-process workers.
    settings = Settings(data_dir=root / "service")
    workers = [build_worker(settings, f"demo-worker-{i}") for i in range(max(1, args.workers))]
    store, artifacts = workers[0].store, workers[0].artifacts
    ops = {}
    for fmt in sorted(registry.available()):
        # The demo's freshly trained tokenizer is, by construction, unknown to
        # llama.cpp's pre-tokenizer table; real models are identified.
        options = {"verify": True, "quant": "q8_0" if fmt == "gguf" else "f16", "allow_unknown_pretokenizer": True}
        request = {"run_id": "run_demo", "checkpoint_id": "sampler_weights/000001", "format": fmt, "destination": "signed-url",
                   "source": {"uri": archive.as_uri()}, "base": str(base), "options": options}
        ops[fmt], _ = store.create(request, idempotency_key=f"demo-{fmt}")
    print(f"queued {len(ops)} exports in {settings.store_url()}; running them with {len(workers)} worker(s) …")
    threads = [threading.Thread(target=w.run_forever, kwargs={"poll_seconds": 0.1, "max_jobs": None, "stop": _until_idle(store)}) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    failures = 0
    for fmt, op in ops.items():
        op = store.get(op.id)
        if op.status != "succeeded":
            failures += 1
            print(f"✗ {fmt:<20} {op.status}: [{op.error_code}] {op.error_message}")
            continue
        manifest = json.loads(artifacts.path(f"exports/{op.id}/nucleus-export.json").read_text())
        v = manifest.get("verification") or {}
        detail = f"max |Δ log p| {v['max_abs_logprob_diff']:.1e}" if "max_abs_logprob_diff" in v else v.get("reason", "")
        print(f"✓ {fmt:<20} {op.id}  verification: {v.get('status', 'not run')} ({detail})")
        print(f"  files: {artifacts.path(f'exports/{op.id}')}")
    print("done." if not failures else f"{failures} format(s) failed.")
    return EXIT_OK if not failures else EXIT_INTERNAL


def _until_idle(store):
    """A stop flag that turns on once nothing is queued or running."""
    import threading

    class Idle:
        def __init__(self):
            self._event = threading.Event()

        def is_set(self) -> bool:
            if not self._event.is_set() and not store.list(status="queued", limit=1)[0] and not store.list(status="running", limit=1)[0]:
                self._event.set()
            return self._event.is_set()

    return Idle()
