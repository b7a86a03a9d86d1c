"""One error hierarchy for the whole project.

Every failure the engine reports is an :class:`ExportError` carrying a stable
``code`` (documented in docs/errors.md), a one-sentence message that names the
problem and the fix, and a ``kind`` that tells callers what to do with it:

- ``input``: the user's archive, base model or options are wrong; retrying will
  not help. The CLI exits with ``EXIT_INPUT``, the API answers 4xx, the runner
  fails the operation at once.
- ``transient``: network, disk pressure, a busy remote; worth retrying.
- ``internal``: our fault. Reported as such, never blamed on the user.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["input", "transient", "internal"]

# Process exit codes (sysexits.h values, so shells and schedulers read them).
EXIT_OK = 0
EXIT_INPUT = 65  # EX_DATAERR
EXIT_INTERNAL = 70  # EX_SOFTWARE
EXIT_TRANSIENT = 75  # EX_TEMPFAIL
EXIT_USAGE = 64  # EX_USAGE

_EXIT_BY_KIND = {"input": EXIT_INPUT, "internal": EXIT_INTERNAL, "transient": EXIT_TRANSIENT}


@dataclass(frozen=True)
class ErrorCode:
    code: str
    kind: Kind
    summary: str


# The catalogue: code -> kind and a short description. Stable: codes are never
# renamed or reused, only added.
_CODES: dict[str, ErrorCode] = {}


def _code(code: str, kind: Kind, summary: str) -> str:
    _CODES[code] = ErrorCode(code, kind, summary)
    return code


# archive structure and safety
ARCHIVE_NOT_FOUND = _code("archive_not_found", "input", "the archive path does not exist")
ARCHIVE_UNREADABLE = _code("archive_unreadable", "input", "not a tar archive, or truncated/corrupt")
ARCHIVE_SYMLINK = _code("archive_symlink", "input", "archive member is a symbolic link")
ARCHIVE_HARDLINK = _code("archive_hardlink", "input", "archive member is a hard link")
ARCHIVE_SPECIAL_FILE = _code("archive_special_file", "input", "archive member is a device, FIFO or other non-regular file")
ARCHIVE_ABSOLUTE_PATH = _code("archive_absolute_path", "input", "archive member has an absolute path")
ARCHIVE_PATH_TRAVERSAL = _code("archive_path_traversal", "input", "archive member path contains '..'")
ARCHIVE_DUPLICATE_MEMBER = _code("archive_duplicate_member", "input", "two archive members have the same name")
ARCHIVE_MEMBER_TOO_LARGE = _code("archive_member_too_large", "input", "one member exceeds the per-member size cap")
ARCHIVE_TOO_LARGE = _code("archive_too_large", "input", "the extracted archive exceeds the total size cap")
ARCHIVE_COMPRESSION_RATIO = _code("archive_compression_ratio", "input", "the archive expands beyond the compression-ratio cap")
ARCHIVE_TOO_MANY_MEMBERS = _code("archive_too_many_members", "input", "the archive has more members than allowed")
ARCHIVE_PICKLE_WEIGHTS = _code("archive_pickle_weights", "input", "the archive holds pickle weights (.bin/.pt/.pkl)")
ARCHIVE_INCOMPLETE = _code("archive_incomplete", "input", "the checkpoint_complete marker is missing")
ARCHIVE_MISSING_FILE = _code("archive_missing_file", "input", "a required file is missing from the checkpoint")
ARCHIVE_CHECKSUM_MISMATCH = _code("archive_checksum_mismatch", "input", "a file's sha256 differs from checkpoint.json")
ARCHIVE_SIZE_MISMATCH = _code("archive_size_mismatch", "input", "a file's size differs from checkpoint.json")
ARCHIVE_BAD_METADATA = _code("archive_bad_metadata", "input", "checkpoint.json is malformed")
# safetensors validation
SAFETENSORS_HEADER_TOO_LARGE = _code("safetensors_header_too_large", "input", "safetensors header exceeds the size cap")
SAFETENSORS_BAD_HEADER = _code("safetensors_bad_header", "input", "safetensors header is not valid")
SAFETENSORS_OFFSETS_OUT_OF_RANGE = _code("safetensors_offsets_out_of_range", "input", "a tensor's data lies outside the file or disagrees with its shape")
SAFETENSORS_OVERLAP = _code("safetensors_overlap", "input", "two tensors' data ranges overlap")
SAFETENSORS_UNKNOWN_DTYPE = _code("safetensors_unknown_dtype", "input", "a tensor has an unknown dtype")
# adapter content
ADAPTER_CONFIG_INVALID = _code("adapter_config_invalid", "input", "adapter_config.json is missing fields or malformed")
ADAPTER_NONFINITE = _code("adapter_nonfinite", "input", "an adapter tensor holds NaN or Inf")
ADAPTER_UNKNOWN_TENSOR = _code("adapter_unknown_tensor", "input", "an adapter tensor name is not a known LoRA target")
ADAPTER_UNPAIRED = _code("adapter_unpaired", "input", "a lora_A has no lora_B (or the reverse)")
ADAPTER_SHAPE_MISMATCH = _code("adapter_shape_mismatch", "input", "adapter tensor shapes do not fit the base model")
ADAPTER_RANK_MISMATCH = _code("adapter_rank_mismatch", "input", "adapter rank disagrees with adapter_config.json")
ADAPTER_DTYPE_UNSUPPORTED = _code("adapter_dtype_unsupported", "input", "adapter tensors must be fp32, bf16 or fp16")
# base model
BASE_NOT_FOUND = _code("base_not_found", "input", "the base model could not be found")
BASE_MISMATCH = _code("base_model_mismatch", "input", "the archive was trained on a different base model")
BASE_NO_SAFETENSORS = _code("base_no_safetensors", "input", "the base model has no safetensors weights")
BASE_INVALID = _code("base_invalid", "input", "the base model directory is inconsistent")
BASE_REQUIRED = _code("base_required", "input", "no base model given and the archive names none")
UNSUPPORTED_ARCHITECTURE = _code("unsupported_architecture", "input", "the base model's architecture is not supported")
# options / output
UNKNOWN_FORMAT = _code("unknown_format", "input", "no converter is registered for the requested format")
INVALID_OPTION = _code("invalid_option", "input", "an option value is not valid")
OUTPUT_EXISTS = _code("output_exists", "input", "the output path already exists")
UNKNOWN_PRETOKENIZER = _code("unknown_pretokenizer", "input", "llama.cpp does not know the tokenizer's pre-tokenizer")
PLAN_INCOMPLETE = _code("plan_incomplete", "input", "the conversion plan does not account for every tensor")
# operations store
OPERATION_NOT_FOUND = _code("operation_not_found", "input", "no operation has this id")
IDEMPOTENCY_CONFLICT = _code("idempotency_conflict", "input", "the Idempotency-Key was used with a different request")
INVALID_TRANSITION = _code("invalid_transition", "input", "the operation cannot move to that status from its current one")
LEASE_LOST = _code("lease_lost", "transient", "another worker took over the operation")
ATTEMPTS_EXHAUSTED = _code("attempts_exhausted", "internal", "the operation failed on every allowed attempt")
# fetching archives
FETCH_FAILED = _code("fetch_failed", "transient", "downloading the archive failed (network, 5xx, 429, timeout)")
FETCH_NOT_FOUND = _code("fetch_not_found", "input", "the archive URI does not exist or is not accessible")
FETCH_UNSUPPORTED = _code("fetch_unsupported", "input", "the archive URI scheme is not supported")
# artifact stores and signed URLs
URL_EXPIRED = _code("url_expired", "input", "the signed URL has expired")
URL_BAD_SIGNATURE = _code("url_bad_signature", "input", "the signed URL's signature is not valid")
ARTIFACT_NOT_FOUND = _code("artifact_not_found", "input", "no artifact is stored under this key")
# job runner
CONVERSION_CRASHED = _code("conversion_crashed", "transient", "the conversion process died (out of memory, or a crash)")
DESTINATION_UNSUPPORTED = _code("destination_unsupported", "input", "the export destination is not available")
HUB_REPO_INVALID = _code("hub_repo_invalid", "input", "hf_repo is not a valid Hugging Face repo id (namespace/name)")
HUB_UNAUTHORIZED = _code("hub_unauthorized", "input", "the Hugging Face Hub token is missing, invalid or expired")
HUB_FORBIDDEN = _code("hub_forbidden", "input", "the Hub token may not write to this repo or namespace")
HUB_REJECTED = _code("hub_rejected", "input", "the Hub refused the repo, branch or commit (4xx)")
HUB_UNAVAILABLE = _code("hub_unavailable", "transient", "the Hub is unreachable, rate-limiting (429) or failing (5xx)")
UNAUTHORIZED = _code("unauthorized", "input", "no API key, or an unknown or revoked one (HTTP 401)")
FORBIDDEN = _code("forbidden", "input", "the API key lacks the scope this route needs (HTTP 403)")
NOT_FOUND = _code("not_found", "input", "no such route or resource (HTTP 404)")
VALIDATION_FAILED = _code("validation_failed", "input", "the request body or parameters are not valid (HTTP 422)")
IDEMPOTENCY_IN_PROGRESS = _code("idempotency_in_progress", "input", "a request with this Idempotency-Key is still being processed (HTTP 409)")
CHECKPOINT_NOT_FOUND = _code("checkpoint_not_found", "input", "no checkpoint with this id is registered for the run")
CHECKPOINT_EXISTS = _code("checkpoint_exists", "input", "a different checkpoint is already registered under this id")
CHECKPOINT_DELETED = _code("checkpoint_deleted", "input", "the checkpoint's archive expired and was deleted")
ARCHIVE_URI_REFUSED = _code("archive_uri_refused", "input", "the archive URI is outside the places this tenant may register archives from")
ARCHIVE_NOT_DOWNLOADABLE = _code("archive_not_downloadable", "input", "the archive is not in a store that can sign download URLs")
WEBHOOK_NOT_FOUND = _code("webhook_not_found", "input", "no webhook endpoint or delivery with this id")
WEBHOOK_URL_REFUSED = _code("webhook_url_refused", "input", "the webhook URL is not http(s) or resolves to a non-public address")
RULE_NOT_FOUND = _code("rule_not_found", "input", "no export rule with this id")
HOOK_BAD_SIGNATURE = _code("hook_bad_signature", "input", "an inbound webhook's signature or timestamp is not valid")
SECRET_NOT_FOUND = _code("secret_not_found", "input", "a secret reference names no configured secret")
# runtime
VERIFY_FAILED = _code("verify_failed", "internal", "the exported model's outputs differ from the reference")
DISK_FULL = _code("disk_full", "transient", "not enough disk space")
DOWNLOAD_FAILED = _code("download_failed", "transient", "downloading from the Hugging Face Hub failed")
INTERNAL = _code("internal_error", "internal", "an unexpected internal error")


def catalogue() -> dict[str, ErrorCode]:
    return dict(_CODES)


class ExportError(Exception):
    """Base class. ``code`` must be one of the catalogue's codes."""

    def __init__(self, code: str, message: str, *, field: str | None = None):
        if code not in _CODES:
            raise ValueError(f"unregistered error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field

    @property
    def kind(self) -> Kind:
        return _CODES[self.code].kind

    @property
    def exit_code(self) -> int:
        return _EXIT_BY_KIND[self.kind]

    @property
    def retryable(self) -> bool:
        return self.kind == "transient"

    def to_dict(self) -> dict:
        d = {"code": self.code, "message": self.message, "kind": self.kind}
        if self.field:
            d["field"] = self.field
        return d

    def __str__(self) -> str:
        return self.message


class InputError(ExportError):
    """Raised for the user's input; kind comes from the code."""


class InternalError(ExportError):
    def __init__(self, message: str, code: str = INTERNAL):
        super().__init__(code, message)
