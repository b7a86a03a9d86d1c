"""The job runner: one export operation through fetch -> verify -> convert -> publish.

Every stage leaves a durable, checkable output, so an operation picked up again
after a crash resumes at the first stage whose output is missing or wrong:
the archive cache is keyed by sha256, a converted output carries its manifest
(every file's sha256 is re-checked before publishing), and publishing skips
files the artifact store already holds with the same content.

The conversion runs in a spawned child process: an out-of-memory kill or a
crash fails the attempt (transient, retried), never the worker. A heartbeat
thread keeps the lease alive and notices a cancellation, which kills the
child. Bad input fails the operation at once with the engine's error code;
transient errors go back to the queue with exponential backoff and jitter
until the attempts run out.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import shutil
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from converters import errors as E
from converters.errors import ExportError
from converters.io.files import sha256_file
from converters.manifest import MANIFEST_NAME

from .fetch import ArchiveCache, fetch
from .publish import PublishContext, preflight, publish
from .publish.signed_url import fresh_urls as _fresh_urls
from .store import Operation, Store


@dataclass(frozen=True)
class RunnerConfig:
    work_dir: Path
    lease_seconds: float = 60.0
    heartbeat_seconds: float = 10.0
    max_attempts: int = 3
    backoff_base: float = 5.0
    backoff_max: float = 600.0
    url_ttl_seconds: int = 7 * 24 * 3600
    model_store: str | None = None
    s3_endpoint_url: str | None = None
    hf_endpoint: str | None = None
    hf_token: str | None = field(default=None, repr=False)  # a secret: never in reprs or logs
    secrets_dir: Path | None = None
    hub_retries: int = 4
    hub_backoff_base: float = 1.0


class Cancelled(Exception):
    pass


def output_is_valid(out: Path) -> bool:
    """A converted output is reusable only if its manifest lists it exactly and every hash matches."""
    mf = out / MANIFEST_NAME
    if not mf.is_file():
        return False
    try:
        files = json.loads(mf.read_text())["files"]
    except (ValueError, KeyError):
        return False
    present = {p.name for p in out.iterdir()} - {MANIFEST_NAME}
    return present == {f["name"] for f in files} and all((out / f["name"]).stat().st_size == f["size"] and sha256_file(out / f["name"]) == f["sha256"] for f in files)


# --- the conversion child -------------------------------------------------------------------


def _child(conn, source: str, base: str | None, fmt: str, out: str, options: dict) -> None:
    """Runs in a fresh process: convert, streaming progress back over ``conn``."""
    import signal

    # the worker decides when this process ends (SIGKILL on cancel; outputs appear by rename, so
    # nothing is left half-written): a SIGTERM or Ctrl-C sent to the whole process group must
    # reach the worker's graceful shutdown, not kill the conversion under it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        from converters import ConvertOptions, convert

        last = [0.0]

        def progress(ev):
            now = time.monotonic()
            if ev.stage != "writing" or now - last[0] >= 0.25 or ev.done == ev.total:
                last[0] = now
                conn.send(("progress", ev.stage, ev.done, ev.total, ev.message))

        manifest = convert(source, base, fmt, out, ConvertOptions(**options), progress)
        conn.send(("ok", manifest.to_dict()))
    except ExportError as exc:
        conn.send(("error", exc.code, exc.message))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as our fault
        conn.send(("error", E.INTERNAL, f"{exc.__class__.__name__}: {exc}\n{traceback.format_exc(limit=5)}"[:2000]))
    finally:
        conn.close()


class Worker:
    def __init__(self, store: Store, artifacts, config: RunnerConfig, worker_id: str, queue=None):
        from .queue import EmbeddedQueue

        self.store, self.artifacts, self.config, self.worker_id = store, artifacts, config, worker_id
        self.queue = queue if queue is not None else EmbeddedQueue()
        self._handback = False
        self.cache = ArchiveCache(config.work_dir / "cache")
        self._cancel = threading.Event()
        self._child: mp.Process | None = None

    # --- loop -------------------------------------------------------------------------------

    def run_once(self) -> Operation | None:
        """Claim and run one operation; returns it as it ended, or None when nothing was queued."""
        op = self.store.claim(self.worker_id, lease_seconds=self.config.lease_seconds, max_attempts=self.config.max_attempts)
        return None if op is None else self._execute(op)

    def run_operation(self, op_id: str, *, abort=None, shutting_down=None) -> Operation | None:
        """Run one given operation (the distributed queue handed us its job). ``abort()``: the queue
        asks us to stop (a cancel); ``shutting_down()``: our own worker is stopping, so the job
        is handed back to the queue rather than cancelled."""
        op = self.store.claim_operation(op_id, self.worker_id, lease_seconds=self.config.lease_seconds, max_attempts=self.config.max_attempts)
        return None if op is None else self._execute(op, abort=abort, shutting_down=shutting_down)

    def _execute(self, op: Operation, *, abort=None, shutting_down=None) -> Operation:
        self._cancel.clear()
        self._handback = False
        stop = threading.Event()
        self._stop_beat = stop
        beat = threading.Thread(target=self._heartbeat, args=(op.id, abort, shutting_down), daemon=True)
        beat.start()
        try:
            try:
                self._run(op)
            except Cancelled:
                if self.store.get(op.id).worker_id != self.worker_id:
                    self._cleanup(op.id)  # our lease was lost: another worker runs it now; its files are not ours to remove
                elif self._handback:
                    self._hand_back(op.id)
                else:
                    self._cleanup(op.id, published=True)
                    self._finish_cancel(op.id)
            except ExportError as exc:
                self._failed(op, exc)
            except Exception as exc:  # noqa: BLE001 - the worker survives any one job
                self._failed(op, ExportError(E.INTERNAL, f"{exc.__class__.__name__}: {exc}"))
        except ExportError as exc:
            # the operation moved on without us (lease lost, or cancelled by a
            # worker that found our lease expired): nothing left for us to record
            if exc.code not in (E.LEASE_LOST, E.INVALID_TRANSITION):
                raise
            self._cleanup(op.id)
        finally:
            stop.set()
            beat.join()
        return self.store.get(op.id)

    def _hand_back(self, op_id: str) -> None:
        """Our worker is shutting down: the job goes back to the queue; its converted output stays for the next taker."""
        if self.store.get(op_id).status == "cancelling":
            self._cleanup(op_id, published=True)
            self._finish_cancel(op_id)
            return
        self.store.append_event(op_id, "handed_back", {"worker": self.worker_id})
        self.store.transition(op_id, "queued", worker_id=self.worker_id, retry_in=0, in_tx=self.queue.on_requeue(0))

    def _finish_cancel(self, op_id: str) -> None:
        status = self.store.get(op_id).status
        if status == "running":  # the queue aborted the job without the store's cancel (procrastinate's own tools)
            self.store.transition(op_id, "cancelling", worker_id=self.worker_id)
            status = "cancelling"
        if status == "cancelling":
            self.store.transition(op_id, "cancelled", worker_id=self.worker_id)

    def run_forever(self, poll_seconds: float = 1.0, stop: threading.Event | None = None, max_jobs: int | None = None) -> int:
        done = 0
        while not (stop and stop.is_set()) and (max_jobs is None or done < max_jobs):
            if self.run_once() is None:
                time.sleep(poll_seconds)
            else:
                done += 1
        return done

    def _heartbeat(self, op_id: str, abort=None, shutting_down=None) -> None:
        beat_every = self.config.heartbeat_seconds
        last_beat = time.monotonic()
        while not self._stop_beat.wait(min(0.5, beat_every) if abort else beat_every):
            if abort is not None and abort():  # the queue asks us to stop: a cancel, or our own shutdown
                self._handback = bool(shutting_down and shutting_down())
                op = None
            elif time.monotonic() - last_beat < beat_every:
                continue
            else:
                last_beat = time.monotonic()
                try:
                    op = self.store.heartbeat(op_id, self.worker_id, lease_seconds=self.config.lease_seconds)
                except ExportError:  # lease lost: another worker has it now; stop our copy
                    op = None
            if op is None or op.status == "cancelling":
                self._cancel.set()
                child = self._child
                if child is not None and child.is_alive():
                    child.kill()
                return

    def _failed(self, op: Operation, exc: ExportError) -> None:
        current = self.store.get(op.id)
        if exc.code == E.LEASE_LOST or current.worker_id != self.worker_id:
            return  # someone else runs it now
        if current.status == "cancelling":
            self._cleanup(op.id, published=True)
            self._finish_cancel(op.id)
            return
        self.store.append_event(op.id, "error", {"code": exc.code, "message": exc.message[:500], "attempt": current.attempts})
        if exc.retryable and current.attempts < self.config.max_attempts:
            delay = min(self.config.backoff_max, self.config.backoff_base * 2 ** (current.attempts - 1))
            delay *= random.uniform(0.5, 1.0)  # jitter: retries of many jobs do not arrive together
            self.store.transition(op.id, "queued", error=exc, worker_id=self.worker_id, retry_in=round(delay, 3), in_tx=self.queue.on_requeue(round(delay, 3)))
        else:
            self.store.transition(op.id, "failed", error=exc, worker_id=self.worker_id)

    def _check_cancel(self) -> None:
        if self._cancel.is_set():
            raise Cancelled()

    def _job_dir(self, op_id: str) -> Path:
        return self.config.work_dir / "jobs" / op_id

    def _cleanup(self, op_id: str, published: bool = False) -> None:
        shutil.rmtree(self._job_dir(op_id), ignore_errors=True)
        if published:  # a cancel during publishing: no half-published export stays behind
            self.artifacts.delete_prefix(f"exports/{op_id}")

    # --- stages -----------------------------------------------------------------------------

    def _run(self, op: Operation) -> None:
        req = op.request
        preflight(req, self._publish_context())  # a bad destination fails before any download or conversion
        self.store.set_stage(op.id, "fetching", self.worker_id)
        src = req.get("source") or {}
        if not src.get("uri"):
            raise ExportError(E.INVALID_OPTION, "the export request names no checkpoint archive (source.uri).", field="source")
        def fetch_progress(done: int, total: int) -> None:
            self._check_cancel()  # a cancel stops a download between chunks; the partial file stays for reuse
            self.store.progress(op.id, bytes_done=done, bytes_total=total, message="downloading")

        fetched = fetch(src["uri"], self.cache, expected_sha256=src.get("sha256"), expected_size=src.get("size"),
                        s3_endpoint_url=self.config.s3_endpoint_url, progress=fetch_progress)
        self._check_cancel()

        self.store.set_stage(op.id, "verifying", self.worker_id)
        from converters.adapter import load_adapter
        from converters.archive import open_checkpoint

        with open_checkpoint(fetched.path) as ck:  # every safety check, before any conversion work
            load_adapter(ck.adapter_weights, ck.adapter_config, 100 << 20).close()
        self._check_cancel()

        self.store.set_stage(op.id, "converting", self.worker_id)
        out = self._job_dir(op.id) / "output"
        if not output_is_valid(out):
            shutil.rmtree(self._job_dir(op.id), ignore_errors=True)  # a previous attempt's leftovers
            out.parent.mkdir(parents=True)
            self._convert(op, str(fetched.path), out)
        self._check_cancel()

        self.store.set_stage(op.id, "publishing", self.worker_id)
        result = self._publish(op, out)
        self.store.progress(op.id, bytes_done=1, bytes_total=1, message="done", force=True)
        self.store.transition(op.id, "succeeded", result=result, worker_id=self.worker_id)
        self._cleanup(op.id)

    def _convert(self, op: Operation, archive: str, out: Path) -> None:
        req = op.request
        # reproducible: a resumed attempt, on any worker, writes the same manifest bytes as an undisturbed one
        options = {"model_store": self.config.model_store, **(req.get("options") or {}), "reproducible": True}
        ctx = mp.get_context("spawn")  # never fork a process holding threads and torch state
        parent, child_end = ctx.Pipe(duplex=False)
        self._child = child = ctx.Process(target=_child, args=(child_end, archive, req.get("base"), req["format"], str(out), options), daemon=True)
        child.start()
        child_end.close()
        outcome = None
        try:
            while True:
                if parent.poll(0.2):
                    try:
                        msg = parent.recv()
                    except EOFError:
                        break
                    if msg[0] == "progress":
                        _, stage, done, total, message = msg
                        if stage == "writing":
                            self.store.progress(op.id, bytes_done=done, bytes_total=total, message=message or "writing")
                    else:
                        outcome = msg
                        break
                elif not child.is_alive():
                    break
                self._check_cancel()
        except Cancelled:
            child.kill()
            child.join(10)
            raise
        finally:
            child.join(30)
            if child.is_alive():
                child.kill()
            self._child = None
            parent.close()
        if self._cancel.is_set():
            raise Cancelled()
        if outcome is None:
            raise ExportError(E.CONVERSION_CRASHED, f"the conversion process died with exit code {child.exitcode} (killed by the system if negative: often out of memory); it will be retried.")
        if outcome[0] == "error":
            raise ExportError(outcome[1], outcome[2])

    def _publish_context(self) -> PublishContext:
        c = self.config
        return PublishContext(self.artifacts, c.url_ttl_seconds, hf_endpoint=c.hf_endpoint, hf_token=c.hf_token, secrets_dir=c.secrets_dir,
                              hub_retries=c.hub_retries, hub_backoff_base=c.hub_backoff_base)

    def _publish(self, op: Operation, out: Path) -> dict:
        ctx = self._publish_context()

        def progress(done: int, total: int, message: str) -> None:
            self._check_cancel()
            self.store.progress(op.id, bytes_done=done, bytes_total=total, message=message)

        return publish(op, out, ctx, progress)


def fresh_urls(store: Store, artifacts, op_id: str, ttl_seconds: int) -> dict:
    """New signed URLs for a finished signed-url export, without exporting again."""
    op = store.get(op_id)
    if op.status != "succeeded" or not op.result or op.result.get("destination") != "signed-url":
        raise ExportError(E.INVALID_TRANSITION, f"operation {op_id} has no downloadable files ({op.status}).", field="id")
    return _fresh_urls(op, artifacts, ttl_seconds)
