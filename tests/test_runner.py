"""The job runner: stages, failures, retries, cancellation, and a worker killed mid-conversion."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from urllib.parse import parse_qsl, urlsplit

import pytest

from converters import errors as E
from converters.errors import ExportError
from converters import samples
from exporter.artifacts import LocalStore
from exporter.runner import RunnerConfig, Worker
from exporter.store import Store, sqlite_url

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def env(tmp_path, model_dir):
    base = model_dir("qwen3")
    archive = samples.build_archive(tmp_path / "ckpt.tar.gz", base, rank=8, meta={"run_id": "run_3Bz", "checkpoint_id": "000240", "step": 240})
    store = Store(sqlite_url(tmp_path / "ops.db"))
    artifacts = LocalStore(tmp_path / "artifacts", {"k1": b"test-secret"})
    config = RunnerConfig(work_dir=tmp_path / "work", lease_seconds=30, heartbeat_seconds=0.2, backoff_base=0.01, backoff_max=0.05)
    yield {"base": base, "archive": archive, "store": store, "artifacts": artifacts, "config": config, "tmp": tmp_path,
           "sha": hashlib.sha256(archive.read_bytes()).hexdigest()}
    store.close()


def request(env, fmt="merged-safetensors", **over) -> dict:
    return {"run_id": "run_3Bz", "checkpoint_id": "000240", "format": fmt, "destination": "signed-url",
            "source": {"uri": str(env["archive"]), "sha256": env["sha"]}, "base": str(env["base"]), "options": {"verify": False}, **over}


def download(artifacts: LocalStore, url: str) -> bytes:
    u = urlsplit(url)
    r = artifacts.serve("GET", u.path, dict(parse_qsl(u.query)), {})
    assert r.status == 200
    return b"".join(r.body)


def test_export_runs_through_every_stage(env):
    store, artifacts = env["store"], env["artifacts"]
    op, _ = store.create(request(env))
    done = Worker(store, artifacts, env["config"], "w1").run_once()
    assert done.status == "succeeded" and done.attempts == 1 and done.percent == 100.0
    stages = [e.data["stage"] for e in store.events(op.id) if e.kind == "stage"]
    assert stages == ["fetching", "verifying", "converting", "publishing"]
    files = {f["name"]: f for f in done.result["files"]}
    assert {"model.safetensors", "config.json", "nucleus-export.json"} <= set(files)
    for f in files.values():
        data = download(artifacts, f["url"])
        assert hashlib.sha256(data).hexdigest() == f["sha256"] and len(data) == f["size"]
    manifest = json.loads(download(artifacts, files["nucleus-export.json"]["url"]))
    assert manifest["source"]["sha256"] == env["sha"] and manifest["source"]["run_id"] == "run_3Bz"
    assert not (env["config"].work_dir / "jobs" / op.id).exists(), "the job's scratch space is removed"
    assert Worker(store, artifacts, env["config"], "w1").run_once() is None


def test_bad_input_fails_at_once(env, tmp_path):
    bad = samples.write_archive(tmp_path / "bad.tar", {k: v for k, v in samples.archive_files(samples.make_adapter_tensors(env["base"], rank=4), r=4, alpha=8).items() if k != "checkpoint_complete"}, None)
    op, _ = env["store"].create(request(env, source={"uri": str(bad)}))
    done = Worker(env["store"], env["artifacts"], env["config"], "w1").run_once()
    assert done.status == "failed" and done.error_code == E.ARCHIVE_INCOMPLETE and done.attempts == 1


def test_transient_errors_retry_with_backoff_then_fail(env):
    op, _ = env["store"].create(request(env, source={"uri": "http://127.0.0.1:9/unreachable.tar"}))
    worker = Worker(env["store"], env["artifacts"], env["config"], "w1")
    first = worker.run_once()
    assert first.status == "queued" and first.error_code == E.FETCH_FAILED and first.attempts == 1
    retry_in = [e.data["retry_in"] for e in env["store"].events(op.id) if e.kind == "status" and e.data["to"] == "queued"]
    assert len(retry_in) == 1 and 0 < retry_in[0] <= 0.05
    while (last := worker.run_once()) is None:
        time.sleep(0.02)
    while last.status == "queued":
        time.sleep(0.06)
        last = worker.run_once() or last
    assert last.status == "failed" and last.error_code == E.FETCH_FAILED and last.attempts == env["config"].max_attempts


def test_cancel_during_conversion(env):
    store = env["store"]
    op, _ = store.create(request(env))
    worker = Worker(store, env["artifacts"], env["config"], "w1")
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("op", worker.run_once()))
    t.start()
    deadline = time.monotonic() + 60
    while store.get(op.id).stage != "converting" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.cancel(op.id).status == "cancelling"
    t.join(120)
    final = store.get(op.id)
    assert final.status == "cancelled" and final.finished_at is not None
    assert not (env["artifacts"].root / "exports" / op.id).exists(), "nothing was published"
    assert not (env["config"].work_dir / "jobs" / op.id).exists(), "no partial output is left"


WORKER_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from exporter.artifacts import LocalStore
    from exporter.runner import RunnerConfig, Worker
    from exporter.store import Store
    db, art, work = sys.argv[1:4]
    cfg = RunnerConfig(work_dir=Path(work), lease_seconds=2, heartbeat_seconds=0.5)
    Worker(Store(db), LocalStore(art, {"k1": b"test-secret"}), cfg, "doomed").run_once()
""")


@pytest.mark.slow
def test_worker_killed_mid_conversion_is_resumed_by_another(env):
    store, artifacts, cfg = env["store"], env["artifacts"], env["config"]
    reference, _ = store.create(request(env), idempotency_key="undisturbed")
    assert Worker(store, artifacts, cfg, "w0").run_once().status == "succeeded"
    op, _ = store.create(request(env), idempotency_key="disturbed")
    proc = subprocess.Popen([sys.executable, "-c", WORKER_SCRIPT, store.url, str(artifacts.root), str(cfg.work_dir)], cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 120
    while store.get(op.id).stage != "converting" and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(1.0)  # let the conversion child get going
    os.killpg(proc.pid, signal.SIGKILL)  # the machine dies: worker and its child together
    proc.wait()
    assert store.get(op.id).status == "running", "the dead worker still holds the lease"
    time.sleep(2.5)  # its 2 s lease runs out
    done = Worker(store, artifacts, cfg, "w2").run_once()
    assert done.id == op.id and done.status == "succeeded" and done.attempts == 2
    claims = [e.data for e in store.events(op.id) if e.kind == "claimed"]
    assert [c["worker"] for c in claims] == ["doomed", "w2"] and claims[1]["reclaimed"]
    ref_files = {f["name"]: f["sha256"] for f in store.get(reference.id).result["files"]}
    got_files = {f["name"]: f["sha256"] for f in done.result["files"]}
    assert got_files == ref_files, "the resumed export is byte-identical to an undisturbed one, manifest included"


def test_worker_command_runs_a_queued_export(env, tmp_path):
    data = tmp_path / "data"
    environ = {**os.environ, "NUCLEUS_EXPORT_DATA_DIR": str(data), "HF_HUB_OFFLINE": "1"}
    from exporter.settings import Settings

    data.mkdir()
    store = Store(sqlite_url(data / "operations.db"))  # the worker's default database
    op, _ = store.create(request(env))
    r = subprocess.run([sys.executable, "-m", "exporter", "worker", "--once"], env=environ, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    done = store.get(op.id)
    assert done.status == "succeeded", done.error_message
    key = data / "signing.key"
    assert key.stat().st_mode & 0o777 == 0o600, "the generated signing key is private"
    assert key.read_text().strip() not in r.stdout + r.stderr, "secrets never reach the output"
    settings = Settings(data_dir=data)
    artifacts = LocalStore(data / "artifacts", settings.signing_key_map())
    assert download(artifacts, done.result["files"][0]["url"])
    store.close()


def test_signing_keys_setting():
    from exporter.settings import Settings

    assert Settings(signing_keys="k2:two, k1:one").signing_key_map() == {"k2": b"two", "k1": b"one"}
    secret = Settings(signing_keys="k2:s3cret-sign", hf_token="hf_s3cret", inbound_webhook_secret="whsec_s3cret", secret_key="s3cret-key")
    assert "s3cret" not in repr(secret), "secrets never appear in a settings repr"
    with pytest.raises(ValueError):
        Settings(signing_keys="no-colon").signing_key_map()


def test_worker_survives_losing_its_job(env, monkeypatch):
    """Cancelled while its lease had run out, another worker finished the cancel: no crash, no overwrite."""
    import exporter.runner as runner_mod

    store = env["store"]
    op, _ = store.create(request(env))
    real_fetch = runner_mod.fetch

    def fetch_while_the_world_moves_on(*a, **k):
        store.cancel(op.id)  # cancelling
        store.heartbeat(op.id, "slow", lease_seconds=-1)  # our lease runs out mid-fetch
        assert store.claim("other") is None  # the other worker finds it and marks it cancelled
        return real_fetch(*a, **k)

    monkeypatch.setattr(runner_mod, "fetch", fetch_while_the_world_moves_on)
    final = Worker(store, env["artifacts"], env["config"], "slow").run_once()
    assert final.status == "cancelled" and final.error_code is None
    assert not (env["config"].work_dir / "jobs" / op.id).exists()


class _SlowArchive:
    """An HTTP server that trickles a file out, so a test can act mid-download."""

    def __init__(self, data: bytes, chunk: int = 64 << 10, pause: float = 0.05):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_HEAD(self):
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()

            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    for i in range(0, len(data), chunk):
                        self.wfile.write(data[i : i + chunk])
                        self.wfile.flush()
                        time.sleep(outer.pause)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.pause = pause
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/ckpt.tar.gz"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.pause = 0
        self.server.shutdown()
        self.server.server_close()


def test_cancel_reaches_a_running_download(env):
    store = env["store"]
    slow = _SlowArchive(env["archive"].read_bytes() + b"\0" * (4 << 20))  # padded: ~70 chunks, ~3.5 s
    try:
        op, _ = store.create(request(env, source={"uri": slow.url}))
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("op", Worker(store, env["artifacts"], env["config"], "w1").run_once()))
        t.start()
        deadline = time.monotonic() + 30
        while not (store.get(op.id).bytes_done or 0) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert store.get(op.id).stage == "fetching"
        store.cancel(op.id)
        t.join(30)
        assert not t.is_alive(), "the download stopped"
        final = store.get(op.id)
        assert final.status == "cancelled" and final.bytes_done < final.bytes_total
    finally:
        slow.close()


def test_progress_rises_within_each_stage_and_ends_at_100(env, monkeypatch, tmp_path):
    store = env["store"]
    store.progress_interval = 0.02  # record more points than the production 1/s
    archive = samples.build_archive(tmp_path / "big.tar", env["base"], rank=256, compression=None, seed=5)  # ~2 MB: many chunks
    slow = _SlowArchive(archive.read_bytes(), chunk=32 << 10, pause=0.01)
    written: list[tuple[str | None, float | None]] = []
    real = store.progress

    def spy(op_id, **kw):
        ok = real(op_id, **kw)
        if ok:  # what the store recorded, read back in the worker's own thread: no sampling race
            cur = store.get(op_id)
            written.append((cur.stage, cur.percent))
        return ok

    monkeypatch.setattr(store, "progress", spy)
    try:
        op, _ = store.create(request(env, source={"uri": slow.url}))
        final = Worker(store, env["artifacts"], env["config"], "w1").run_once()
    finally:
        slow.close()
    assert final.status == "succeeded" and final.percent == 100.0
    by_stage: dict[str, list[float]] = {}
    for stage, pct in written:
        by_stage.setdefault(stage, []).append(pct)
    assert len(by_stage.get("fetching", [])) >= 3, f"download progress was reported: {written}"
    assert "converting" in by_stage
    for stage, values in by_stage.items():
        assert values == sorted(values), f"{stage} progress went backwards: {values}"
    assert written[-1] == ("publishing", 100.0)
    history = [e.data["stage"] for e in store.events(op.id) if e.kind == "stage"]
    assert history == ["fetching", "verifying", "converting", "publishing"]


@pytest.mark.slow
def test_worker_killed_mid_download_is_resumed_by_another(env, tmp_path):
    store, artifacts, cfg = env["store"], env["artifacts"], env["config"]
    archive = samples.build_archive(tmp_path / "big.tar", env["base"], rank=256, compression=None, seed=6)
    data = archive.read_bytes()
    slow = _SlowArchive(data, chunk=16 << 10, pause=0.05)
    assert len(data) // (16 << 10) * 0.05 > 4, "the download lasts several progress intervals, so the kill lands mid-way"
    try:
        op, _ = store.create(request(env, source={"uri": slow.url, "sha256": hashlib.sha256(data).hexdigest()}))
        proc = subprocess.Popen([sys.executable, "-c", WORKER_SCRIPT, store.url, str(artifacts.root), str(cfg.work_dir)], cwd=ROOT, start_new_session=True)
        deadline = time.monotonic() + 120
        while (store.get(op.id).bytes_done or 0) < len(data) // 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        from exporter.fetch import ArchiveCache

        partial = ArchiveCache(cfg.work_dir / "cache").partial_for(slow.url)
        kept = partial.stat().st_size
        assert 0 < kept < len(data), "the killed worker left a partial download"
        time.sleep(2.5)  # its lease runs out
        slow.pause = 0
        done = Worker(store, artifacts, cfg, "w2").run_once()
        assert done.status == "succeeded" and done.attempts == 2
    finally:
        slow.close()


def test_fresh_urls_without_exporting_again(env):
    from exporter.runner import fresh_urls

    store, artifacts = env["store"], env["artifacts"]
    op, _ = store.create(request(env, fmt="lora-adapter"))
    done = Worker(store, artifacts, env["config"], "w1").run_once()
    again = fresh_urls(store, artifacts, op.id, 60)
    assert [f["name"] for f in again["files"]] == [f["name"] for f in done.result["files"]]
    for old, new in zip(done.result["files"], again["files"]):
        assert new["expires_at"] < old["expires_at"] and new["sha256"] == old["sha256"]
        assert hashlib.sha256(download(artifacts, new["url"])).hexdigest() == new["sha256"]
    queued, _ = store.create(request(env, run_id="other"))
    with pytest.raises(ExportError) as ei:
        fresh_urls(store, artifacts, queued.id, 60)
    assert ei.value.code == E.INVALID_TRANSITION


PAUSING_WORKER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from exporter.artifacts import LocalStore
    from exporter.runner import RunnerConfig, Worker
    from exporter.store import Store
    db, art, work, pause_in = sys.argv[1:5]
    set_stage, put_file = Store.set_stage, LocalStore.put_file

    def pausing_set_stage(self, op_id, stage, worker_id):
        op = set_stage(self, op_id, stage, worker_id)
        if stage == pause_in == "verifying":
            time.sleep(3600)  # killed in here
        return op

    def pausing_put_file(self, src, key):
        out = put_file(self, src, key)
        if pause_in == "publishing":
            time.sleep(3600)  # killed after the first file was published, before the rest
        return out

    Store.set_stage, LocalStore.put_file = pausing_set_stage, pausing_put_file
    cfg = RunnerConfig(work_dir=Path(work), lease_seconds=2, heartbeat_seconds=0.5)
    Worker(Store(db), LocalStore(art, {"k1": b"test-secret"}), cfg, "doomed").run_once()
""")


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["verifying", "publishing"])
def test_worker_killed_during_a_stage_is_resumed_exactly_once(env, stage):
    store, artifacts, cfg = env["store"], env["artifacts"], env["config"]
    reference, _ = store.create(request(env), idempotency_key="undisturbed")
    ref = Worker(store, artifacts, cfg, "w0").run_once()
    op, _ = store.create(request(env), idempotency_key="disturbed")
    proc = subprocess.Popen([sys.executable, "-c", PAUSING_WORKER, store.url, str(artifacts.root), str(cfg.work_dir), stage], cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 120
    published = artifacts.root / "exports" / op.id
    while time.monotonic() < deadline:
        current = store.get(op.id)
        if current.stage == stage and (stage != "publishing" or (published.exists() and any(not p.name.startswith(".") for p in published.iterdir()))):
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert store.get(op.id).stage == stage
    if stage == "publishing":
        assert len([p for p in published.iterdir() if not p.name.startswith(".")]) == 1, "killed half-way through publishing"
    time.sleep(2.5)  # the dead worker's lease runs out
    done = Worker(store, artifacts, cfg, "w2").run_once()
    assert done.status == "succeeded" and done.attempts == 2
    finished = [e for e in store.events(op.id) if e.kind == "status" and e.data["to"] == "succeeded"]
    assert len(finished) == 1, "finished exactly once"
    ref_files = {f["name"]: f["sha256"] for f in ref.result["files"]}
    got_files = {f["name"]: f["sha256"] for f in done.result["files"]}
    assert sorted(p.name for p in published.iterdir()) == sorted(got_files)
    for name in got_files:  # the manifest too: the runner's manifests hold no paths or times
        data = download(artifacts, next(f["url"] for f in done.result["files"] if f["name"] == name))
        assert hashlib.sha256(data).hexdigest() == ref_files[name] == got_files[name], name
    manifest = json.loads(download(artifacts, next(f["url"] for f in done.result["files"] if f["name"] == "nucleus-export.json")))
    assert manifest["path"] is None and manifest["created_at"] is None and manifest["source"]["path"] is None


def test_settings_file_under_environment(tmp_path, monkeypatch):
    """One typed settings object: a TOML file, overridden by NUCLEUS_EXPORT_* variables; unknown keys refused."""
    from exporter.settings import Settings

    f = tmp_path / "settings.toml"
    f.write_text('port = 9001\nworkers = 3\nhf_token = "hf_from_file"\nwebhook_retry_schedule = "1,2"\nqueue = "embedded"\n')
    monkeypatch.setenv("NUCLEUS_EXPORT_SETTINGS_FILE", str(f))
    monkeypatch.setenv("NUCLEUS_EXPORT_WORKERS", "5")
    s = Settings.from_env()
    assert (s.port, s.workers, s.hf_token, s.retry_schedule(), s.queue) == (9001, 5, "hf_from_file", (1.0, 2.0), "embedded")
    assert "hf_from_file" not in repr(s)
    f.write_text("colour = 'blue'\n")
    with pytest.raises(ValueError, match="unknown settings colour"):
        Settings.from_env()


def test_worker_command_runs_jobs_concurrently(env, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    store = Store(sqlite_url(data / "operations.db"))
    ids = [store.create(request(env, fmt="lora-adapter"))[0].id for _ in range(3)]
    environ = {**os.environ, "NUCLEUS_EXPORT_DATA_DIR": str(data), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "exporter", "worker", "--concurrency", "2", "--poll-seconds", "0.2"], env=environ, cwd=ROOT)
    try:
        deadline = time.monotonic() + 300
        while not all(store.get(i).finished for i in ids) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)  # finishes the current job, then stops
        assert proc.wait(120) == 0
    assert [store.get(i).status for i in ids] == ["succeeded"] * 3, [(store.get(i).error_code, store.get(i).error_message) for i in ids]
    workers = {e.data["worker"] for i in ids for e in store.events(i) if e.kind == "claimed"}
    assert len(workers) == 2, f"two worker threads shared the jobs: {workers}"
    store.close()
