"""Service throughput: N small exports through the HTTP API to 1, 2 and 3 distributed workers.

Prints, for each worker count, the throughput (exports/minute) and its ratio
to what a user would otherwise run (the same conversions, one
`nucleus-export convert` after another, measured in the same run), the submit
latency (p50/p99 over N POSTs through a real uvicorn server, 8 at a time), and
the peak RSS of a worker process tree (worker + conversion child).

Needs PostgreSQL (default postgresql+psycopg://postgres@127.0.0.1:5432/test;
a scratch schema is created and dropped).

    python scripts/bench_service.py [--n 12] [--workers 1,2,3] [--format lora-adapter]
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PG = os.environ.get("NUCLEUS_BENCH_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def build_sample(d: Path):
    from converters import samples

    cfg = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
           "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "vocab_size": 4096, "max_position_embeddings": 1024,
           "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "eos_token_id": 2}
    base = samples.build_base(d / "models" / "bench" / "tiny-qwen3", cfg, samples.build_tokenizer(d / "tok", vocab_size=4096))
    return base, samples.build_archive(d / "ckpt.tar.gz", base, rank=16)


def rss_tree(pid: int) -> int:
    """Resident bytes of a process and its children now (sampled: the peak is the largest sample)."""
    import psutil

    try:
        p = psutil.Process(pid)
        return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)])
    except psutil.Error:
        return 0


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def baseline(base, archive, fmt, n, d: Path) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        subprocess.run([sys.executable, "-m", "exporter", "convert", str(archive), "--base", str(base), "-f", fmt, "-o", str(d / f"cli-{i}"),
                        "--no-verify", "--progress", "none"], check=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True)
    return time.perf_counter() - t0


def run_round(db: str, d: Path, base, archive, fmt: str, n: int, workers: int) -> dict:
    import requests

    from exporter.api import create_app
    from exporter.api.server import BackgroundServer
    from exporter.service import Services
    from exporter.settings import Settings

    settings = replace(Settings(data_dir=d / "api"), database_url=db, queue="procrastinate", heartbeat_seconds=1.0, archive_roots=str(archive.parent))
    services = Services(settings)
    server = BackgroundServer(create_app(services))
    _, key = services.keys.create("bench", ["train", "read"])
    h = {"Authorization": f"Bearer {key}"}
    requests.post(f"{server.url}/v1/training-runs/run_bench/checkpoints", headers=h, timeout=30,
                  json={"checkpoint_id": "000001", "uri": archive.as_uri(), "base_model": "bench/tiny-qwen3"}).raise_for_status()
    url = f"{server.url}/v1/training-runs/run_bench/checkpoints/000001/export"

    def submit(i):
        t = time.perf_counter()
        r = requests.post(url, json={"format": fmt, "verify": False}, headers={**h, "Idempotency-Key": f"bench-{workers}-{i}"}, timeout=60)
        r.raise_for_status()
        return time.perf_counter() - t, r.json()["operation"]

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(submit, range(n)))
    latencies = [r[0] for r in results]
    ids = [r[1] for r in results]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NUCLEUS_EXPORT_DATABASE_URL": db, "NUCLEUS_EXPORT_QUEUE": "procrastinate",
           "NUCLEUS_EXPORT_ARTIFACT_STORE": "", "NUCLEUS_EXPORT_SIGNING_KEYS": "bench:bench-secret",
           "NUCLEUS_EXPORT_MODEL_STORE": str(base.parent.parent)}
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "exporter", "worker"], cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env={**env, "NUCLEUS_EXPORT_DATA_DIR": str(d / f"w{i}")}) for i in range(workers)]
    peaks = [0] * workers
    stop = threading.Event()

    def sample_rss():
        while not stop.wait(0.1):
            for i, p in enumerate(procs):
                peaks[i] = max(peaks[i], rss_tree(p.pid))

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    while not all(services.store.get(i).finished for i in ids):
        time.sleep(0.2)
    elapsed = time.perf_counter() - t0
    stop.set()
    failed = [i for i in ids if services.store.get(i).status != "succeeded"]
    for p in procs:
        os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        p.wait(60)
    server.close()
    services.close()
    return {"elapsed": elapsed, "per_min": 60 * n / elapsed, "p50": percentile(latencies, 50), "p99": percentile(latencies, 99),
            "failed": len(failed), "peak_rss_mib": max(peaks) / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--workers", default="1,2,3")
    ap.add_argument("--format", default="lora-adapter")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sqlalchemy import create_engine, text

    d = Path(tempfile.mkdtemp(prefix="bench-service-"))
    admin = create_engine(PG)
    try:
        base, archive = build_sample(d)
        print(f"{args.n} {args.format} exports of a {sum(f.stat().st_size for f in base.glob('*.safetensors')) / 2**20:.1f} MiB model; {os.cpu_count()} cores")
        t_cli = baseline(base, archive, args.format, args.n, d)
        cli_rate = 60 * args.n / t_cli
        print(f"baseline: {args.n} x `nucleus-export convert` one after another: {t_cli:.1f} s, {cli_rate:.1f} exports/min")
        for w in [int(x) for x in args.workers.split(",")]:
            schema = "bench_" + secrets.token_hex(4)
            with admin.begin() as conn:
                conn.execute(text(f'CREATE SCHEMA "{schema}"'))
            try:
                r = run_round(f"{PG}?options=-csearch_path%3D{schema}", d / f"round-{w}", base, archive, args.format, args.n, w)
            finally:
                with admin.begin() as conn:
                    conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
            print(f"{w} worker(s): {r['elapsed']:.1f} s, {r['per_min']:.1f} exports/min ({r['per_min'] / cli_rate:.2f}x the CLI loop); "
                  f"submit latency p50 {r['p50'] * 1000:.0f} ms, p99 {r['p99'] * 1000:.0f} ms; peak RSS per worker {r['peak_rss_mib']:.0f} MiB"
                  + (f"; {r['failed']} FAILED" if r["failed"] else ""))
    finally:
        admin.dispose()
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
