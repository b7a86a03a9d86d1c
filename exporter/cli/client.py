"""``nucleus-export submit|status|wait|cancel|download``: talk to a running server."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from converters import errors as E
from converters.errors import EXIT_OK, ExportError

from .errors import guarded


def add_connection(p) -> None:
    p.add_argument("--server", default=os.environ.get("NUCLEUS_EXPORT_SERVER", "http://127.0.0.1:8000"), help="the API (default NUCLEUS_EXPORT_SERVER or http://127.0.0.1:8000)")
    p.add_argument("--key", default=os.environ.get("NUCLEUS_EXPORT_API_KEY"), help="API key (default NUCLEUS_EXPORT_API_KEY)")


def client(args):
    from ..client import ApiClient

    return ApiClient(args.server, args.key)


def add_export_options(p) -> None:
    p.add_argument("--format", required=True, choices=["merged-safetensors", "lora-adapter", "gguf", "gguf-lora"])
    p.add_argument("--destination", default="signed-url", choices=["signed-url", "hf-hub"])
    p.add_argument("--hf-repo")
    p.add_argument("--hf-token-ref", help="secret:NAME, resolved on the workers")
    p.add_argument("--quant")
    p.add_argument("--dtype")
    p.add_argument("--public", action="store_true", help="hf-hub: create the repo public")
    p.add_argument("--revision")
    p.add_argument("--no-verify", action="store_true")


def export_body(args) -> dict:
    body = {"format": args.format, "destination": args.destination, "hf_repo": args.hf_repo, "hf_token_ref": args.hf_token_ref, "quant": args.quant,
            "dtype": args.dtype, "revision": args.revision, "private": False if args.public else None, "verify": False if args.no_verify else None}
    return {k: v for k, v in body.items() if v is not None}


def register(sub) -> None:
    p = sub.add_parser("submit", help="start an export on the server")
    p.add_argument("checkpoint", help="nucleus://run/checkpoint")
    add_export_options(p)
    p.add_argument("--idempotency-key")
    p.add_argument("--wait", action="store_true", help="wait for it, with a progress bar")
    add_connection(p)
    p.set_defaults(func=submit)
    for name, fn, text in (("status", status, "show an operation"), ("wait", wait, "wait for an operation, with a live progress bar"),
                           ("cancel", cancel, "cancel an operation")):
        q = sub.add_parser(name, help=text)
        q.add_argument("operation")
        add_connection(q)
        q.set_defaults(func=fn)
    d = sub.add_parser("download", help="download a finished export's files (resumable, sha256 checked)")
    d.add_argument("operation")
    d.add_argument("--dir", default=".", help="where to put the files (default .)")
    add_connection(d)
    d.set_defaults(func=download)


@guarded
def submit(args) -> int:
    c = client(args)
    accepted = c.submit(args.checkpoint, export_body(args), idempotency_key=args.idempotency_key)
    print(json.dumps(accepted), flush=True)
    return _wait(c, accepted["operation"]) if args.wait else EXIT_OK


@guarded
def status(args) -> int:
    print(json.dumps(client(args).operation(args.operation), indent=2))
    return EXIT_OK


@guarded
def wait(args) -> int:
    return _wait(client(args), args.operation)


@guarded
def cancel(args) -> int:
    print(json.dumps(client(args).cancel(args.operation)))
    return EXIT_OK


@guarded
def download(args) -> int:
    c = client(args)
    for p in c.download(c.operation(args.operation), Path(args.dir)):
        print(p)
    return EXIT_OK


def _wait(c, op_id: str) -> int:
    op = watch(c, op_id)
    print(json.dumps({k: op[k] for k in ("operation", "status", "result", "error")}, indent=2))
    if op["status"] == "succeeded":
        return EXIT_OK
    err = op.get("error") or {}
    code = err.get("code") if err.get("code") in E.catalogue() else E.INTERNAL
    raise ExportError(code, err.get("message") or f"operation {op_id} ended {op['status']}.")


def watch(c, op_id: str) -> dict:
    """Poll until finished, showing stage and progress (a rich bar on a terminal, lines otherwise)."""
    if not sys.stderr.isatty():
        last = [None]

        def line(op):
            state = (op["status"], op["stage"], op["progress"]["percent"])
            if state != last[0]:
                last[0] = state
                sys.stderr.write(json.dumps({"operation": op_id, "status": op["status"], "stage": op["stage"], "percent": op["progress"]["percent"]}) + "\n")

        return c.wait(op_id, on_update=line)
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>5.1f}%"), TimeElapsedColumn(), transient=False) as bar:
        task = bar.add_task(op_id, total=100)

        def update(op):
            pct = op["progress"]["percent"] or 0
            bar.update(task, completed=pct, description=f"{op_id} {op['status']} {op['stage'] or ''}")

        return c.wait(op_id, on_update=update)
