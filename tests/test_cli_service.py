"""The service's command line: keys, submit/status/wait/cancel/download and batch against a real server."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from exporter.api import create_app
from exporter.api.server import BackgroundServer

from .service_helpers import CKPT, RUN, client_for, keys, register

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, env=None, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exporter", *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


@pytest.fixture
def server(svc):
    s = BackgroundServer(create_app(svc, background={"workers": 1, "sweeper": False, "dispatcher": False}))
    svc.artifacts.base_url = s.url
    k = keys(svc)
    with client_for(svc) as c:
        assert register(c, k["train"]).status_code == 201
    yield {"url": s.url, "env": {"NUCLEUS_EXPORT_SERVER": s.url, "NUCLEUS_EXPORT_API_KEY": k["train"]}, "keys": k, "svc": svc}
    s.close()


def test_keys_create_list_revoke(tmp_path):
    env = {"NUCLEUS_EXPORT_DATA_DIR": str(tmp_path / "data")}
    r = cli("keys", "create", "--scopes", "train,read", "--tenant", "acme", "--name", "ci", env=env)
    assert r.returncode == 0, r.stderr
    key = r.stdout.splitlines()[0]
    assert key.startswith("nxk_") and "scopes read,train" in r.stdout
    listed = cli("keys", "list", env=env)
    assert key not in listed.stdout and key.split("_", 2)[2] not in listed.stdout and '"tenant": "acme"' in listed.stdout
    assert key.split("_", 2)[2].encode() not in (tmp_path / "data" / "operations.db").read_bytes()
    bad = cli("keys", "create", "--scopes", "admin", env=env)
    assert bad.returncode == 64 and "scopes must be" in bad.stdout
    assert cli("keys", "revoke", key.split("_")[1], env=env).returncode == 0
    assert cli("keys", "revoke", key.split("_")[1], env=env).returncode == 65, "already revoked"


def test_submit_wait_status_download_cancel(server, tmp_path):
    r = cli("submit", CKPT, "--format", "lora-adapter", "--no-verify", "--wait", env=server["env"])
    assert r.returncode == 0, r.stderr
    accepted = json.loads(r.stdout.splitlines()[0])
    op_id = accepted["operation"]
    assert '"status": "succeeded"' in r.stdout
    progress = [json.loads(line) for line in r.stderr.splitlines() if line.startswith("{")]
    assert progress[-1]["status"] == "succeeded", "wait reports progress as it goes"
    status = json.loads(cli("status", op_id, env=server["env"]).stdout)
    assert status["status"] == "succeeded"
    d = cli("download", op_id, "--dir", tmp_path / "dl", env=server["env"])
    assert d.returncode == 0, d.stderr
    for f in status["result"]["files"]:
        assert hashlib.sha256((tmp_path / "dl" / f["name"]).read_bytes()).hexdigest() == f["sha256"]
    # resumable: a partial file is completed, not restarted
    name = status["result"]["files"][0]["name"]
    data = (tmp_path / "dl" / name).read_bytes()
    (tmp_path / "dl" / name).unlink()
    (tmp_path / "dl" / f".{name}.part").write_bytes(data[: len(data) // 2])
    assert cli("download", op_id, "--dir", tmp_path / "dl", env=server["env"]).returncode == 0
    assert (tmp_path / "dl" / name).read_bytes() == data
    # errors keep their codes and exit codes across the wire
    r = cli("submit", f"nucleus://{RUN}/nope", "--format", "gguf", env=server["env"])
    assert r.returncode == 65 and "error [checkpoint_not_found]" in r.stderr
    r = cli("status", "op_missing", env=server["env"])
    assert r.returncode == 65 and "error [operation_not_found]" in r.stderr
    r = cli("status", op_id, env={**server["env"], "NUCLEUS_EXPORT_API_KEY": "nxk_bad"})
    assert r.returncode == 65 and "error [unauthorized]" in r.stderr
    queued = cli("submit", CKPT, "--format", "gguf", "--quant", "q4_k_m", "--no-verify", env=server["env"])
    q_id = json.loads(queued.stdout)["operation"]
    c = cli("cancel", q_id, env=server["env"])
    assert c.returncode == 0 and json.loads(c.stdout)["status"] in ("cancelled", "cancelling")


def test_batch_resumes_instead_of_duplicating(server, tmp_path):
    plan = tmp_path / "exports.yaml"
    plan.write_text(f"""
exports:
  - checkpoint: {CKPT}
    format: lora-adapter
    verify: false
  - checkpoint: {CKPT}
    format: gguf
    quant: q8_0
    verify: false
  - checkpoint: nucleus://{RUN}/missing
    format: gguf
""")
    r = cli("batch", plan, "--concurrency", "2", env=server["env"])
    assert r.returncode == 1, r.stdout + r.stderr
    assert "2 of 3 exports succeeded" in r.stdout and "checkpoint_not_found" in r.stdout
    svc = server["svc"]
    first = sorted(o.id for o in svc.store.list(limit=50)[0])
    assert len(first) == 2
    again = cli("batch", plan, env=server["env"])
    assert "2 of 3 exports succeeded" in again.stdout
    assert sorted(o.id for o in svc.store.list(limit=50)[0]) == first, "re-running reattached to the same exports"
    jsonl = tmp_path / "exports.jsonl"
    jsonl.write_text(json.dumps({"checkpoint": CKPT, "format": "lora-adapter", "verify": False}) + "\n")
    assert cli("batch", jsonl, env=server["env"]).returncode == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("exports:\n  - checkpoint: x\n    format: gguf\n    colour: blue\n")
    r = cli("batch", bad, env=server["env"])
    assert r.returncode == 65 and "unknown fields colour" in r.stderr


def test_serve_runs_the_embedded_service_and_stops_on_sigterm(tmp_path):
    import signal
    import socket
    import time

    import requests

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "NUCLEUS_EXPORT_DATA_DIR": str(tmp_path / "data"), "HF_HUB_OFFLINE": "1"}
    key = cli("keys", "create", "--scopes", "read", env={"NUCLEUS_EXPORT_DATA_DIR": str(tmp_path / "data")}).stdout.splitlines()[0]
    proc = subprocess.Popen([sys.executable, "-m", "exporter", "serve", "--port", str(port), "--workers", "2"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{url}/healthz", timeout=2).ok:
                    break
            except requests.ConnectionError:
                time.sleep(0.2)
        r = requests.get(f"{url}/v1/operations", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert r.status_code == 200 and r.json() == {"data": [], "next_cursor": None}
        assert requests.get(f"{url}/openapi.json", timeout=10).json()["info"]["title"] == "nucleus-export"
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    # uvicorn shuts down cleanly, then re-raises SIGTERM so the exit status says how it ended
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert "Application shutdown complete" in out and "2 in-process worker(s)" in out and (tmp_path / "data" / "operations.db").is_file()
