"""``nucleus-export batch FILE``: many exports from a YAML or JSONL file, resumable by re-running.

Each entry's Idempotency-Key is derived from its content, so running the same
file again reattaches to the exports already started instead of duplicating them.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from converters import errors as E
from converters.errors import EXIT_OK, ExportError

from .client import add_connection, client
from .errors import guarded

FIELDS = {"checkpoint", "format", "destination", "hf_repo", "hf_token_ref", "quant", "dtype", "verify", "private", "revision", "commit_message", "replace_card", "allow_unknown_pretokenizer"}


def register(sub) -> None:
    p = sub.add_parser("batch", help="run the exports listed in a YAML or JSONL file; re-running resumes")
    p.add_argument("file")
    p.add_argument("--concurrency", type=int, default=4, help="exports in flight at once (default 4)")
    add_connection(p)
    p.set_defaults(func=run)


def load(path: Path) -> list[dict]:
    text = path.read_text()
    if path.suffix in (".jsonl", ".ndjson"):
        entries = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    entries.append(json.loads(line))
                except ValueError as exc:
                    raise ExportError(E.INVALID_OPTION, f"{path}:{n} is not valid JSON ({exc.msg}).", field="file") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ExportError(E.INVALID_OPTION, f"{path} is not valid YAML ({str(exc).splitlines()[0]}).", field="file") from None
        entries = data.get("exports") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise ExportError(E.INVALID_OPTION, f"{path} lists no exports; write a list of {{checkpoint, format, …}} entries (YAML) or one JSON object per line (.jsonl).", field="file")
    for i, e in enumerate(entries, 1):
        if not isinstance(e, dict) or "checkpoint" not in e or "format" not in e:
            raise ExportError(E.INVALID_OPTION, f"entry {i} of {path} needs at least checkpoint and format.", field="file")
        unknown = set(e) - FIELDS
        if unknown:
            raise ExportError(E.INVALID_OPTION, f"entry {i} of {path} has unknown fields {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(FIELDS))}.", field="file")
    return entries


def key_for(entry: dict) -> str:
    return "batch-" + hashlib.sha256(json.dumps(entry, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:40]


@guarded
def run(args) -> int:
    entries = load(Path(args.file))
    c = client(args)
    rows = [{"checkpoint": e["checkpoint"], "format": e["format"], "operation": "", "status": "pending", "stage": "", "percent": None, "error": ""} for e in entries]
    lock = threading.Lock()

    def one(i: int) -> None:
        e = entries[i]
        body = {k: v for k, v in e.items() if k != "checkpoint"}
        try:
            accepted = c.submit(e["checkpoint"], body, idempotency_key=key_for(e))
            with lock:
                rows[i].update(operation=accepted["operation"], status=accepted["status"])

            def update(op):
                with lock:
                    rows[i].update(status=op["status"], stage=op["stage"] or "", percent=op["progress"]["percent"],
                                   error=(op.get("error") or {}).get("code") or "")

            c.wait(accepted["operation"], on_update=update, poll=1.0)
        except ExportError as exc:
            with lock:
                rows[i].update(status="failed", error=f"{exc.code}: {exc.message}")

    with ThreadPoolExecutor(max_workers=max(1, args.concurrency)) as pool:
        futures = [pool.submit(one, i) for i in range(len(entries))]
        _live(rows, lock, futures)
    ok = sum(r["status"] == "succeeded" for r in rows)
    print(f"{ok} of {len(rows)} exports succeeded" + ("" if ok == len(rows) else f"; {len(rows) - ok} did not:"))
    for r in rows:
        if r["status"] != "succeeded":
            print(f"  {r['checkpoint']} {r['format']} {r['operation'] or '-'}: {r['status']} {r['error']}")
    return EXIT_OK if ok == len(rows) else 1


def _live(rows, lock, futures) -> None:
    """A live table on a terminal; one line per change otherwise."""
    import time

    if not sys.stdout.isatty():
        seen = {}
        while True:
            with lock:
                for i, r in enumerate(rows):
                    state = (r["status"], r["stage"], r["operation"])
                    if seen.get(i) != state:
                        seen[i] = state
                        print(json.dumps({"entry": i + 1, **r}), flush=True)
            if all(f.done() for f in futures):
                return
            time.sleep(0.5)
    from rich.live import Live
    from rich.table import Table

    def table() -> Table:
        t = Table("checkpoint", "format", "operation", "status", "stage", "%", "error")
        with lock:
            for r in rows:
                t.add_row(r["checkpoint"], r["format"], r["operation"], r["status"], r["stage"], "" if r["percent"] is None else f"{r['percent']:.0f}", r["error"])
        return t

    with Live(table(), refresh_per_second=4) as live:
        while not all(f.done() for f in futures):
            live.update(table())
            time.sleep(0.25)
        live.update(table())
