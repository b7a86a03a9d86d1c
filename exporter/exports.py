"""Starting an export: validate what can be validated now, then create the operation.

Shared by the export route, the inbound checkpoint hook and the export rules,
so all three accept and refuse the same things with the same codes.
"""

from __future__ import annotations

from dataclasses import dataclass

from converters import errors as E
from converters import registry
from converters.errors import ExportError

from . import secrets as secret_refs
from .publish import DESTINATIONS
from .publish.hf_hub import validate_repo_id
from .store import Operation
from .store.checkpoints import Checkpoint


@dataclass(frozen=True)
class ExportSpec:
    format: str
    destination: str = "signed-url"
    hf_repo: str | None = None
    hf_token_ref: str | None = None
    quant: str | None = None
    dtype: str | None = None
    verify: bool | None = None
    private: bool | None = None
    revision: str | None = None
    commit_message: str | None = None
    replace_card: bool = False
    allow_unknown_pretokenizer: bool | None = None


def validate(spec: ExportSpec) -> None:
    if spec.format not in registry.available():
        raise ExportError(E.UNKNOWN_FORMAT, f"format {spec.format!r} is not available; use one of {', '.join(sorted(registry.available()))}.", field="format")
    if spec.destination not in DESTINATIONS:
        raise ExportError(E.DESTINATION_UNSUPPORTED, f"destination {spec.destination!r} is not known; use one of {', '.join(DESTINATIONS)}.", field="destination")
    hub_only = {"hf_repo": spec.hf_repo, "hf_token_ref": spec.hf_token_ref, "private": spec.private, "revision": spec.revision, "commit_message": spec.commit_message}
    if spec.destination == "hf-hub":
        validate_repo_id(spec.hf_repo)
        if spec.hf_token_ref:
            secret_refs.parse_ref(spec.hf_token_ref)  # its value lives on the workers; only the form is checked here
    else:
        given = [k for k, v in hub_only.items() if v is not None] + (["replace_card"] if spec.replace_card else [])
        if given:
            raise ExportError(E.VALIDATION_FAILED, f"{given[0]} applies only to destination hf-hub.", field=given[0])
    if spec.quant is not None and spec.format != "gguf":
        raise ExportError(E.VALIDATION_FAILED, "quant applies only to format gguf.", field="quant")
    from converters import ConvertOptions

    ConvertOptions(**_convert_options(spec))  # refuses an unknown quant type or dtype with its own message


def _convert_options(spec: ExportSpec) -> dict:
    opts = {k: v for k, v in {"quant": spec.quant, "dtype": spec.dtype, "verify": spec.verify, "allow_unknown_pretokenizer": spec.allow_unknown_pretokenizer}.items() if v is not None}
    return opts


def runner_request(ck: Checkpoint, spec: ExportSpec) -> dict:
    req = {
        "run_id": ck.run_id, "checkpoint_id": ck.checkpoint_id, "checkpoint": ck.ref, "format": spec.format, "destination": spec.destination,
        "source": {k: v for k, v in {"uri": ck.uri, "sha256": ck.sha256, "size": ck.size}.items() if v is not None},
        # base models come from the workers' model store or the Hub, never from a path a user names
        "base": ck.base_model, "options": {**_convert_options(spec), "allow_local_base": False},
    }
    if spec.destination == "hf-hub":
        req["hf_repo"] = spec.hf_repo
        if spec.hf_token_ref:
            req["hf_token_ref"] = spec.hf_token_ref
        req["hub"] = {k: v for k, v in {"private": spec.private, "revision": spec.revision, "commit_message": spec.commit_message,
                                        "replace_card": spec.replace_card or None}.items() if v is not None}
    return req


def submit(services, tenant: str, ck: Checkpoint, spec: ExportSpec, *, op_key: str | None = None) -> tuple[Operation, bool]:
    """Create the export operation (once per ``op_key``); refuses a checkpoint the sweeper deleted meanwhile."""
    validate(spec)
    op, created = services.store.create(runner_request(ck, spec), idempotency_key=op_key, tenant=tenant, in_tx=services.queue.on_create)
    if created:
        # the sweeper may have deleted the archive between our read and the insert: it checks for
        # exports after marking, we check for the mark after inserting; one of us sees the other
        now = services.checkpoints.get(tenant, ck.run_id, ck.checkpoint_id, include_deleted=True)
        if now.deleted_at is not None:
            services.queue.cancel(services.store.cancel(op.id))
            raise ExportError(E.CHECKPOINT_DELETED, f"checkpoint {ck.checkpoint_id} of run {ck.run_id} expired and its archive was deleted; register it again to export it.", field="checkpoint_id")
    return op, created
