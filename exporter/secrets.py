"""Secret references: requests name a secret (``secret:NAME``), never carry one.

A reference resolves, in order, to the file NAME in the configured secrets
directory (how Kubernetes and systemd mount secrets) or to the environment
variable ``NUCLEUS_EXPORT_SECRET_<NAME>``. Only those two places are looked in,
so a request cannot make the service read an arbitrary variable or file. The
resolved value lives only in memory for the call that needs it: it is never
stored in an operation, an event or a log line.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from converters import errors as E
from converters.errors import ExportError

_REF = re.compile(r"secret:([A-Za-z0-9][A-Za-z0-9_.-]{0,63})")


def parse_ref(ref: str) -> str:
    """The secret's name; raises for anything that is not ``secret:NAME``."""
    m = _REF.fullmatch(ref or "")
    if not m:
        raise ExportError(E.SECRET_NOT_FOUND, f"{ref!r} is not a secret reference; write it as secret:NAME (letters, digits, '_', '-', '.').", field="hf_token_ref")
    return m.group(1)


def resolve(ref: str, secrets_dir: Path | None) -> str:
    name = parse_ref(ref)
    if secrets_dir is not None:
        path = Path(secrets_dir) / name
        if path.is_file():
            value = path.read_text().strip()
            if value:
                return value
    value = os.environ.get("NUCLEUS_EXPORT_SECRET_" + re.sub(r"[^A-Za-z0-9]", "_", name).upper(), "").strip()
    if value:
        return value
    where = f"{secrets_dir}/{name} or " if secrets_dir else ""
    raise ExportError(E.SECRET_NOT_FOUND, f"no secret named {name!r} is configured; put it in {where}NUCLEUS_EXPORT_SECRET_{re.sub(r'[^A-Za-z0-9]', '_', name).upper()} on the workers.", field="hf_token_ref")
