"""Distributed mode: API processes and worker processes sharing PostgreSQL (procrastinate) and an S3 store (moto)."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import requests

from exporter.service import Services

from .service_helpers import Receiver, pg_schema, settings_for, wait_for

ROOT = Path(__file__).resolve().parents[1]
RUN = "run_dist"
AWS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3():
    from moto.server import ThreadedMotoServer

    old = {k: os.environ.get(k) for k in AWS}
    os.environ.update(AWS)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    import boto3

    url = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=url).create_bucket(Bucket="nxexports")
    yield url
    server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


class Cluster:
    """One PostgreSQL schema, one S3 prefix; API and worker processes started on demand, each with its own data dir (a machine)."""

    def __init__(self, tmp: Path, db: str, s3_url: str, sample: dict):
        self.tmp, self.db, self.s3_url = tmp, db, s3_url
        self.prefix = "t-" + secrets.token_hex(4)
        self.env = {**os.environ, **AWS, "HF_HUB_OFFLINE": "1", "NUCLEUS_EXPORT_DATABASE_URL": db, "NUCLEUS_EXPORT_QUEUE": "procrastinate",
                    "NUCLEUS_EXPORT_ARTIFACT_STORE": f"s3://nxexports/{self.prefix}", "NUCLEUS_EXPORT_S3_ENDPOINT_URL": s3_url,
                    "NUCLEUS_EXPORT_SECRET_KEY": "cluster-secret", "NUCLEUS_EXPORT_STALLED_SECONDS": "3", "NUCLEUS_EXPORT_HEARTBEAT_SECONDS": "0.5",
                    "NUCLEUS_EXPORT_LEASE_SECONDS": "10", "NUCLEUS_EXPORT_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.0/8",
                    "NUCLEUS_EXPORT_WEBHOOK_RETRY_SCHEDULE": "0.2,0.2,0.2",
                    "NUCLEUS_EXPORT_MODEL_STORE": str(sample["model_store"])}
        self.services = Services(replace(settings_for(tmp / "local"), database_url=db, queue="procrastinate", artifact_store=f"s3://nxexports/{self.prefix}",
                                         s3_endpoint_url=s3_url, secret_key="cluster-secret", stalled_seconds=3, model_store=str(sample["model_store"])))
        self.procs: list[subprocess.Popen] = []
        key = f"{self.prefix}/checkpoints/acme/{RUN}/000240.tar.gz"
        self.services.artifacts.client.upload_file(str(sample["archive"]), "nxexports", key)
        _, self.key = self.services.keys.create("acme", ["train", "read"])
        self.ck, _ = self.services.checkpoints.register("acme", RUN, "sampler_weights/000240", uri=f"s3://nxexports/{key}", sha256=sample["sha"], base_model=sample["base_id"])

    def worker(self, name: str, concurrency: int = 1, extra: list[str] | None = None) -> subprocess.Popen:
        env = {**self.env, "NUCLEUS_EXPORT_DATA_DIR": str(self.tmp / name)}
        p = subprocess.Popen([sys.executable, "-m", "exporter", "worker", "--concurrency", str(concurrency), *(extra or [])], env=env, cwd=ROOT, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=open(self.tmp / f"{name}.log", "w"))
        self.procs.append(p)
        return p

    def api(self, name: str) -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**self.env, "NUCLEUS_EXPORT_DATA_DIR": str(self.tmp / name)}
        p = subprocess.Popen([sys.executable, "-m", "exporter", "serve", "--no-workers", "--port", str(port)], env=env, cwd=ROOT, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=open(self.tmp / f"{name}.log", "w"))
        self.procs.append(p)
        url = f"http://127.0.0.1:{port}"

        def up():
            try:
                return requests.get(f"{url}/healthz", timeout=2).ok
            except requests.ConnectionError:
                return False

        wait_for(up, timeout=60, interval=0.2)
        return url

    def submit(self, fmt: str, **extra):
        from exporter.exports import ExportSpec, submit

        return submit(self.services, "acme", self.ck, ExportSpec(format=fmt, verify=False, **extra))[0]

    def wait_all(self, ids, timeout=600):
        wait_for(lambda: all(self.services.store.get(i).finished for i in ids), timeout=timeout, interval=0.5)
        return [self.services.store.get(i) for i in ids]

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        self.services.close()


@pytest.fixture
def cluster(tmp_path, s3, sample):
    with pg_schema() as db:
        c = Cluster(tmp_path, db, s3, sample)
        try:
            yield c
        finally:
            c.close()


def _s3_files(c: Cluster, op_id: str) -> dict[str, str]:
    client = c.services.artifacts.client
    out = {}
    for o in client.list_objects_v2(Bucket="nxexports", Prefix=f"{c.prefix}/exports/{op_id}/").get("Contents", []):
        body = client.get_object(Bucket="nxexports", Key=o["Key"])["Body"].read()
        out[o["Key"].rsplit("/", 1)[1]] = hashlib.sha256(body).hexdigest()
    return out


def test_operation_and_job_are_created_together(cluster):
    from sqlalchemy import text

    op = cluster.submit("lora-adapter")
    with cluster.services.store.engine.connect() as conn:
        job = conn.execute(text("SELECT status, args FROM procrastinate_jobs WHERE id = :id"), {"id": op.job_id}).one()
    assert job.status == "todo" and job.args == {"operation_id": op.id}

    def boom(conn, op_id):
        cluster.services.queue.on_create(conn, op_id)
        raise RuntimeError("the process dies before the transaction commits")

    with pytest.raises(RuntimeError):
        cluster.services.store.create({"format": "gguf", "run_id": RUN}, in_tx=boom)
    with cluster.services.store.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM procrastinate_jobs")).scalar() == 1, "no job without its operation"
    assert len(cluster.services.store.list(limit=10)[0]) == 1, "no operation without its job"


@pytest.mark.slow
def test_three_workers_thirty_exports_each_exactly_once(cluster):
    receiver = Receiver()
    try:
        api_a = cluster.api("api-a")
        cluster.api("api-b")  # a second API process runs a second webhook dispatcher: deliveries must not double
        r = requests.post(f"{api_a}/v1/webhooks", json={"url": receiver.url, "events": ["export.succeeded"]}, headers={"Authorization": f"Bearer {cluster.key}"}, timeout=30)
        assert r.status_code == 201, r.text
        formats = ["lora-adapter", "merged-safetensors", "gguf", "gguf-lora"]
        ids = [cluster.submit(formats[i % 4]).id for i in range(30)]
        for i in range(3):
            cluster.worker(f"worker-{i}")
        ops = cluster.wait_all(ids)
        assert [o.status for o in ops] == ["succeeded"] * 30, [(o.id, o.error_code, o.error_message) for o in ops if o.status != "succeeded"]
        workers = Counter()
        for o in ops:
            events = cluster.services.store.events(o.id)
            claims = [e for e in events if e.kind == "claimed"]
            assert len(claims) == 1 and sum(e.kind == "status" and e.data["to"] == "succeeded" for e in events) == 1, "processed exactly once"
            workers[claims[0].data["worker"].split(":")[1]] += 1
            assert set(_s3_files(cluster, o.id)) == {f["name"] for f in o.result["files"]}, "published once, every file"
        assert len(workers) == 3, f"all three workers took jobs: {workers}"
        wait_for(lambda: len(receiver.received) >= 30, timeout=60)
        time.sleep(1.0)  # a duplicate would arrive now
        ids_delivered = [json.loads(r["body"])["data"]["operation"] for r in receiver.received]
        assert sorted(ids_delivered) == sorted(ids), "one export.succeeded per export, none duplicated"
        assert len({r["headers"]["webhook-id"] for r in receiver.received}) == 30
    finally:
        receiver.close()


@pytest.mark.slow
def test_worker_killed_mid_conversion_is_finished_by_another(cluster):
    reference = cluster.submit("merged-safetensors")
    a = cluster.worker("machine-a")
    [ref] = cluster.wait_all([reference.id])
    assert ref.status == "succeeded"
    op = cluster.submit("merged-safetensors", dtype="fp32")  # a bigger output: the kill lands mid-write
    wait_for(lambda: cluster.services.store.get(op.id).stage == "converting", timeout=120, interval=0.02)
    time.sleep(0.5)
    os.killpg(a.pid, signal.SIGKILL)  # the machine dies: worker and conversion child together
    a.wait()
    assert cluster.services.store.get(op.id).status == "running"
    cluster.worker("machine-b")  # its periodic task finds the stalled job and retries it
    [done] = cluster.wait_all([op.id], timeout=300)
    assert done.status == "succeeded" and done.attempts == 2, (done.error_code, done.error_message)
    claims = [e.data for e in cluster.services.store.events(op.id) if e.kind == "claimed"]
    assert len(claims) == 2 and claims[1]["reclaimed"] and claims[0]["worker"] != claims[1]["worker"]
    # byte-identical to an undisturbed fp32 export
    undisturbed = cluster.submit("merged-safetensors", dtype="fp32", commit_message=None)
    [u] = cluster.wait_all([undisturbed.id])
    assert _s3_files(cluster, op.id) == _s3_files(cluster, u.id), "byte-identical, the manifest too, though another machine wrote it"


@pytest.mark.slow
def test_cancel_reaches_a_job_on_another_machine(cluster):
    api = cluster.api("api")
    op = cluster.submit("gguf", quant="q4_k_m", dtype="fp32")
    cluster.worker("machine-x")
    wait_for(lambda: cluster.services.store.get(op.id).stage == "converting", timeout=120, interval=0.02)
    r = requests.post(f"{api}/v1/operations/{op.id}/cancel", headers={"Authorization": f"Bearer {cluster.key}"}, timeout=30)
    assert r.status_code == 202
    [done] = cluster.wait_all([op.id], timeout=120)
    assert done.status == "cancelled"
    assert _s3_files(cluster, op.id) == {}, "nothing published"
    assert not (cluster.tmp / "machine-x" / "work" / "jobs" / op.id).exists(), "the worker cleaned up"


@pytest.mark.slow
def test_idempotency_across_two_api_processes_and_200_distinct_submits(cluster):
    from sqlalchemy import text

    apis = [cluster.api("api-1"), cluster.api("api-2")]
    h = {"Authorization": f"Bearer {cluster.key}"}
    body = {"format": "lora-adapter", "verify": False}

    def post(i, key=None):
        headers = {**h, **({"Idempotency-Key": key} if key else {})}
        return requests.post(f"{apis[i % 2]}/v1/training-runs/{RUN}/checkpoints/000240/export", json=body, headers=headers, timeout=60)

    with ThreadPoolExecutor(max_workers=50) as pool:
        same = list(pool.map(lambda i: post(i, "one-key"), range(100)))
    assert set(r.status_code for r in same) <= {202, 409}
    assert len({r.json()["operation"] for r in same if r.status_code == 202}) == 1
    with ThreadPoolExecutor(max_workers=50) as pool:
        distinct = list(pool.map(lambda i: post(i, f"k-{i}"), range(200)))
    assert [r.status_code for r in distinct] == [202] * 200
    ids = {r.json()["operation"] for r in distinct}
    assert len(ids) == 200
    ops, _ = cluster.services.store.list(limit=500)
    assert len(ops) == 201, "none lost, none extra"
    with cluster.services.store.engine.connect() as conn:
        jobs = conn.execute(text("SELECT args->>'operation_id' FROM procrastinate_jobs WHERE task_name = 'nucleus_export.run_export'")).scalars().all()
    assert sorted(jobs) == sorted(o.id for o in ops), "every operation has exactly one job"


def test_serve_with_in_process_procrastinate_workers(cluster):
    """`serve` on PostgreSQL without --no-workers: the in-process workers are procrastinate workers, stopped with the app."""
    from .service_helpers import client_for

    with client_for(cluster.services, background={"workers": 1, "sweeper": False, "dispatcher": False}) as client:
        r = client.post(f"/v1/training-runs/{RUN}/checkpoints/000240/export", json={"format": "lora-adapter", "verify": False},
                        headers={"Authorization": f"Bearer {cluster.key}"})
        assert r.status_code == 202
        [op] = cluster.wait_all([r.json()["operation"]], timeout=120)
        assert op.status == "succeeded", op.error_message
        got = requests.get(next(f["url"] for f in op.result["files"] if f["name"] == "adapter_model.safetensors"), timeout=30)
        assert hashlib.sha256(got.content).hexdigest() == next(f["sha256"] for f in op.result["files"] if f["name"] == "adapter_model.safetensors")
        threads = list(cluster.services._threads)
    assert threads and not any(t.is_alive() for t in threads), "the workers stopped with the app"


def test_archive_download_url_is_presigned_s3(cluster):
    """The raw archive's URL points at S3 itself: its bytes never pass through the API."""
    from .service_helpers import client_for

    with client_for(cluster.services) as client:
        r = client.get(f"/v1/training-runs/{RUN}/checkpoints/000240/download-url", headers={"Authorization": f"Bearer {cluster.key}"})
    assert r.status_code == 200, r.text
    url = r.json()["url"]
    assert url.startswith(cluster.s3_url) and "Signature" in url
    got = requests.get(url, timeout=30)
    assert got.status_code == 200 and hashlib.sha256(got.content).hexdigest() == cluster.ck.sha256


@pytest.mark.slow
def test_sigterm_hands_a_running_export_back(cluster):
    op = cluster.submit("merged-safetensors", dtype="fp32")
    a = cluster.worker("graceful", extra=["--shutdown-timeout", "0.5"])
    wait_for(lambda: cluster.services.store.get(op.id).stage == "converting", timeout=120, interval=0.02)
    os.kill(a.pid, signal.SIGTERM)  # as Kubernetes and systemd's KillMode=mixed do: the main process only
    assert a.wait(60) == 0, "the worker stops cleanly"
    handed = cluster.services.store.get(op.id)
    events = cluster.services.store.events(op.id)
    assert handed.status == "queued" and any(e.kind == "handed_back" for e in events), [(e.kind, e.data) for e in events]
    cluster.worker("next")
    [done] = cluster.wait_all([op.id], timeout=300)
    assert done.status == "succeeded" and done.attempts == 2
