"""Small file utilities shared by the library and the service: hashing and free-space checks."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .. import errors as E
from ..errors import ExportError

_CHUNK = 1 << 20
DISK_MARGIN = 64 << 20


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(_CHUNK):
            h.update(b)
    return h.hexdigest()


def check_free_space(directory: str | os.PathLike, need: int, what: str) -> None:
    """Refuse before writing when ``directory``'s filesystem cannot hold ``need`` bytes (plus a margin)."""
    st = os.statvfs(Path(directory))
    free = st.f_bavail * st.f_frsize
    if need and free < need + DISK_MARGIN:
        raise ExportError(E.DISK_FULL, f"{directory} has {free >> 20} MiB free but {what} needs {(need + DISK_MARGIN) >> 20} MiB; free some space or write elsewhere.")
