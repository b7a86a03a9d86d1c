"""The operations store on SQLite and on a real PostgreSQL (its own schema per test)."""

from __future__ import annotations

import os
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import create_engine, text

from converters import errors as E
from converters.errors import ExportError
from exporter.store import Store, sqlite_url

HEAD = "0003"  # the newest migration
PG_URL = os.environ.get("NUCLEUS_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    if request.param == "sqlite":
        s = Store(sqlite_url(tmp_path / "ops.db"))
        yield s
        s.close()
        return
    schema = "nx_test_" + secrets.token_hex(6)
    admin = create_engine(PG_URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    s = Store(f"{PG_URL}?options=-csearch_path%3D{schema}")
    try:
        yield s
    finally:
        s.close()
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def req(run: str = "run_3Bz", fmt: str = "gguf", **extra) -> dict:
    return {"run_id": run, "checkpoint_id": "000240", "format": fmt, "destination": "signed-url", **extra}


def test_schema_is_migrated_and_reopening_is_a_no_op(store):
    assert store.schema_revision() == HEAD
    again = Store(store.url)
    assert again.schema_revision() == HEAD
    again.close()


def test_migrations_upgrade_an_existing_database_and_go_back(store):
    """A database created at 0001 keeps its operations through the upgrade; downgrade undoes it."""
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import inspect

    from exporter.store import MIGRATIONS

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with store.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0001")
    assert "checkpoints" not in inspect(store.engine).get_table_names()
    old = Store(store.url, migrate=False)
    with old.engine.begin() as conn:  # an operation written by the 0001 schema
        from sqlalchemy import text

        conn.execute(text("INSERT INTO operations (id, type, status, request, attempts, fingerprint, available_at, version, created_at, updated_at) "
                          "VALUES ('op_old', 'export', 'queued', '{}', 0, 'f', :t, 1, :t, :t)"), {"t": "2026-01-01 00:00:00"})
    store.migrate()
    assert store.schema_revision() == HEAD
    assert {"api_keys", "checkpoints", "webhook_deliveries", "export_rules"} <= set(inspect(store.engine).get_table_names())
    assert store.get("op_old").tenant is None
    old.close()


def test_create_get_and_not_found(store):
    op, created = store.create(req())
    assert created and op.id.startswith("op_") and op.status == "queued" and op.attempts == 0
    assert store.get(op.id) == op
    assert op.to_dict()["operation"] == op.id and op.to_dict()["error"] is None
    with pytest.raises(ExportError) as ei:
        store.get("op_missing")
    assert ei.value.code == E.OPERATION_NOT_FOUND


def test_idempotency_key(store):
    a, created_a = store.create(req(), idempotency_key="key-1")
    b, created_b = store.create(req(), idempotency_key="key-1")
    assert created_a and not created_b and a.id == b.id
    with pytest.raises(ExportError) as ei:
        store.create(req(fmt="lora-adapter"), idempotency_key="key-1")
    assert ei.value.code == E.IDEMPOTENCY_CONFLICT


def test_concurrent_creates_with_one_key_make_one_operation(store):
    barrier = threading.Barrier(16)

    def submit(_):
        barrier.wait()
        return store.create(req(), idempotency_key="same")

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(submit, range(16)))
    assert len({op.id for op, _ in results}) == 1
    assert sum(created for _, created in results) == 1
    assert len(store.list(limit=100)[0]) == 1


def test_list_filters_and_cursor_pagination(store):
    made = [store.create(req(run=f"run_{i % 2}", fmt="gguf" if i % 3 else "lora-adapter"))[0].id for i in range(7)]
    seen, cursor = [], None
    while True:
        page, cursor = store.list(limit=3, cursor=cursor)
        seen += [op.id for op in page]
        if cursor is None:
            break
    assert sorted(seen) == sorted(made) and len(seen) == 7
    assert seen == sorted(seen, key=lambda i: made.index(i), reverse=True), "newest first"
    assert {op.run_id for op in store.list(run_id="run_1")[0]} == {"run_1"}
    assert {op.format for op in store.list(format="lora-adapter")[0]} == {"lora-adapter"}
    assert store.list(status="running")[0] == []
    with pytest.raises(ExportError) as ei:
        store.list(cursor="not-a-cursor")
    assert ei.value.code == E.INVALID_OPTION


def test_transitions_are_validated_and_logged(store):
    op, _ = store.create(req())
    with pytest.raises(ExportError) as ei:
        store.transition(op.id, "succeeded")
    assert ei.value.code == E.INVALID_TRANSITION
    running = store.claim("w1")
    store.set_stage(running.id, "fetching", "w1")
    store.set_stage(running.id, "converting", "w1")
    done = store.transition(running.id, "succeeded", result={"files": []}, worker_id="w1")
    assert done.status == "succeeded" and done.finished_at is not None and done.worker_id is None and done.result == {"files": []}
    kinds = [(e.kind, (e.data or {}).get("stage") or (e.data or {}).get("to")) for e in store.events(op.id)]
    assert kinds == [("created", None), ("claimed", None), ("stage", "fetching"), ("stage", "converting"), ("status", "succeeded")]
    with pytest.raises(ExportError):
        store.transition(op.id, "running")


def test_failure_records_the_engine_error_code(store):
    store.create(req())
    op = store.claim("w1")
    err = ExportError(E.ARCHIVE_INCOMPLETE, "the checkpoint has no checkpoint_complete marker.")
    failed = store.transition(op.id, "failed", error=err, worker_id="w1")
    assert failed.to_dict()["error"] == {"code": "archive_incomplete", "message": err.message}


def test_progress_is_throttled_per_operation(store):
    op, _ = store.create(req())
    assert store.progress(op.id, bytes_done=10, bytes_total=100, eta_seconds=9.0, message="converting")
    assert not store.progress(op.id, bytes_done=20, bytes_total=100), "a second write within the interval is dropped"
    assert store.progress(op.id, bytes_done=100, bytes_total=100, force=True)
    got = store.get(op.id)
    assert (got.bytes_done, got.percent) == (100, 100.0)
    assert got.version == op.version, "progress never invalidates a concurrent status change"


def test_each_operation_is_claimed_by_exactly_one_worker(store):
    ids = {store.create(req())[0].id for _ in range(10)}
    barrier = threading.Barrier(4)

    def worker(n):
        barrier.wait()
        mine = []
        while (op := store.claim(f"w{n}")) is not None:
            mine.append(op.id)
        return mine

    with ThreadPoolExecutor(4) as pool:
        claims = [i for part in pool.map(worker, range(4)) for i in part]
    assert sorted(claims) == sorted(ids), "every operation claimed once, none twice"


def test_dead_worker_is_replaced_and_attempts_are_capped(store):
    op, _ = store.create(req())
    first = store.claim("w1", lease_seconds=-1)  # a lease already expired: the worker died
    assert first.attempts == 1
    second = store.claim("w2", lease_seconds=60, max_attempts=2)
    assert second.id == op.id and second.worker_id == "w2" and second.attempts == 2
    assert [e.data["reclaimed"] for e in store.events(op.id) if e.kind == "claimed"] == [False, True]
    with pytest.raises(ExportError) as ei:
        store.heartbeat(op.id, "w1")
    assert ei.value.code == E.LEASE_LOST
    with pytest.raises(ExportError) as ei:
        store.transition(op.id, "succeeded", worker_id="w1")
    assert ei.value.code == E.LEASE_LOST
    assert store.heartbeat(op.id, "w2", lease_seconds=120).lease_expires_at > second.lease_expires_at
    assert store.claim("w3", max_attempts=2) is None, "w2's lease is valid: nothing to take"
    store.heartbeat(op.id, "w2", lease_seconds=-1)  # w2 dies right after this heartbeat
    assert store.claim("w3", max_attempts=2) is None, "both allowed attempts are used up"
    final = store.get(op.id)
    assert final.status == "failed" and final.error_code == E.ATTEMPTS_EXHAUSTED and final.finished_at is not None


def test_cancel(store):
    queued, _ = store.create(req())
    assert store.cancel(queued.id).status == "cancelled"
    store.create(req())
    running = store.claim("w1")
    assert store.cancel(running.id).status == "cancelling"
    assert store.heartbeat(running.id, "w1").status == "cancelling", "the worker sees the request on its next heartbeat"
    assert store.transition(running.id, "cancelled", worker_id="w1").finished_at is not None
    assert store.cancel(running.id).status == "cancelled", "cancelling a finished operation changes nothing"


def test_retry_backoff(store):
    store.create(req())
    op = store.claim("w1")
    store.transition(op.id, "queued", worker_id="w1", retry_in=3600)
    assert store.claim("w2") is None, "not before its backoff ends"
    store.create(req(run="other"))
    other = store.claim("w2")
    assert other.id != op.id
    retried = store.events(op.id)[-1]
    assert retried.data["to"] == "queued" and retried.data["retry_in"] == 3600
