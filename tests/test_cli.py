"""The command line: exit codes, one-sentence errors, JSON progress, the demo."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from converters import samples
from converters.errors import EXIT_INPUT, EXIT_USAGE


def cli(*args, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "exporter", *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd, timeout=600)


@pytest.fixture(scope="module")
def archive(model_dir, tmp_path_factory):
    base = model_dir("qwen3")
    d = tmp_path_factory.mktemp("cli")
    return base, samples.build_archive(d / "ckpt.tar.zst", base, rank=8, compression="zstd")


def test_convert_json_progress_and_result(tmp_path, archive):
    base, arc = archive
    r = cli("convert", arc, "--base", base, "-f", "merged-safetensors", "-o", tmp_path / "out", "--progress", "json", "--verify")
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in r.stderr.splitlines()]
    stages = [e["stage"] for e in events]
    assert stages[0] == "opening" and "writing" in stages and "verifying" in stages and stages[-1] == "done"
    writing = [e for e in events if e["stage"] == "writing"]
    assert writing[-1]["bytes_done"] == writing[-1]["bytes_total"] > 0
    assert all(0 <= e.get("percent", 0) <= 100 for e in events)
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["event"] == "result" and result["verification"]["status"] == "passed"


def test_convert_human_summary(tmp_path, archive):
    base, arc = archive
    r = cli("convert", arc, "--base", base, "-f", "lora-adapter", "-o", tmp_path / "out", "--progress", "bar", "--no-verify")
    assert r.returncode == 0, r.stderr
    assert "lora-adapter written to" in r.stdout and "adapter_model.safetensors" in r.stdout
    assert "vllm: compatible" in r.stdout


def test_bad_input_exit_code_and_one_sentence(tmp_path, archive):
    base, _ = archive
    bad = samples.write_archive(tmp_path / "x.tar", {"adapter_config.json": b"{}"}, None)
    r = cli("convert", bad, "--base", base, "-f", "merged-safetensors", "-o", tmp_path / "out", "--progress", "none")
    assert r.returncode == EXIT_INPUT
    lines = r.stderr.strip().splitlines()
    assert lines == [lines[0]] and lines[0].startswith("error [archive_incomplete]: ")
    assert not (tmp_path / "out").exists()


def test_usage_errors(tmp_path, archive):
    base, arc = archive
    r = cli("convert", arc, "--base", base, "-f", "onnx", "-o", tmp_path / "out")
    assert r.returncode == EXIT_USAGE and "invalid choice" in r.stderr
    r = cli("convert", arc, "--base", base, "-f", "lora-adapter", "-o", tmp_path / "out", "--dtype", "int3", "--progress", "none")
    assert r.returncode == EXIT_INPUT and "error [invalid_option]" in r.stderr
    r = cli("convert", arc, "--base", base, "-f", "lora-adapter", "-o", tmp_path / "out", "--max-shard-size", "lots", "--progress", "none")
    assert r.returncode == EXIT_INPUT and "max_shard_size" not in r.stderr.split(":")[0]


@pytest.mark.slow
def test_demo(tmp_path):
    """The main job: sample model and archive, every format through the HTTP API, in-process workers, downloads checked."""
    from exporter.store import Store, sqlite_url

    r = cli("demo", "--dir", tmp_path / "demo")
    assert r.returncode == 0, r.stdout + r.stderr
    formats = ("merged-safetensors", "lora-adapter", "gguf", "gguf-lora")
    for fmt in formats:
        assert f"✓ {fmt}" in r.stdout
    assert r.stdout.count("verification: passed") == len(formats)
    store = Store(sqlite_url(tmp_path / "demo" / "service" / "operations.db"))
    ops, _ = store.list(limit=10)
    assert sorted(op.format for op in ops) == sorted(formats) and all(op.status == "succeeded" for op in ops)
    for op in ops:
        assert op.tenant == "demo", "submitted through the API with a key"
        for f in op.result["files"]:
            downloaded = tmp_path / "demo" / "downloads" / op.format / f["name"]
            assert hashlib.sha256(downloaded.read_bytes()).hexdigest() == f["sha256"]
    assert r.stdout.count("sha256 checked") == len(formats)
    store.close()
