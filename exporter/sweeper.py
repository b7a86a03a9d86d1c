"""Checkpoint expiry: warn before an archive expires, delete it after, never under a running export.

An expired archive is deleted only when no queued, running or cancelling
export needs it. The check runs before and again after the checkpoint is
marked deleted, and a new export re-reads its checkpoint after it is created,
so an export and the sweeper cannot both win: either the export sees the
checkpoint deleted (and is refused), or the sweeper sees the export (and
keeps the archive). Only archives inside our own artifact store are removed;
one elsewhere is marked deleted and left alone.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from .archive_uris import owned_location
from .store.util import utcnow

log = logging.getLogger("nucleus_export.sweeper")
BUSY = ("queued", "running", "cancelling")


class Sweeper:
    def __init__(self, services):
        self.s = services

    def _busy(self, ck) -> bool:
        ops, _ = self.s.store.list(tenant=ck.tenant, run_id=ck.run_id, checkpoint_id=ck.checkpoint_id, statuses=BUSY, limit=1)
        return bool(ops)

    def sweep(self, now=None) -> dict:
        now = now or utcnow()
        report = {"notified": [], "deleted": [], "kept": []}
        window = timedelta(seconds=self.s.settings.expiring_notice_seconds)
        for ck in self.s.checkpoints.expiring(now, window):
            if self.s.checkpoints.mark_notified(ck):
                self.s.dispatcher.notify(ck.tenant, "checkpoint.expiring", f"checkpoint-expiring:{ck.run_id}/{ck.checkpoint_id}@{ck.expires_at.isoformat()}", ck.to_dict())
                report["notified"].append(ck.ref)
        for ck in self.s.checkpoints.expired(now):
            if self._busy(ck) or not self.s.checkpoints.mark_deleted(ck):
                report["kept"].append(ck.ref)
                continue
            if self._busy(ck):  # an export was accepted in between: give the archive back to it
                self.s.checkpoints.unmark_deleted(ck)
                report["kept"].append(ck.ref)
                continue
            where = owned_location(ck.uri, self.s.artifacts)
            if where and where.kind == "local":
                where.location.unlink(missing_ok=True)
            elif where:
                self.s.artifacts.client.delete_object(Bucket=self.s.artifacts.bucket, Key=where.location)
            log.info("deleted expired checkpoint %s (%s)", ck.ref, "archive removed" if where else "archive not in our store; left in place")
            report["deleted"].append(ck.ref)
        self.s.idempotency.purge()
        return report

    def run(self, stop: threading.Event, interval: float) -> None:
        while not stop.is_set():
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - try again next round
                log.exception("sweep failed")
            stop.wait(interval)
