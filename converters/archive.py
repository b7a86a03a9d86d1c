"""Reading checkpoint archives safely (format: docs/checkpoint-archive.md).

An archive is a tar file, plain or gzip/zstd compressed (recognised by magic
bytes). It is streamed once: members are checked before a byte is extracted,
only regular files are written, each into a fresh temporary directory with
O_EXCL|O_NOFOLLOW, and size / ratio caps are enforced while copying so a
decompression bomb is stopped mid-member. The sha256 of the archive's own bytes
is computed in the same pass.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from . import errors as E
from .errors import InputError
from .io.files import sha256_file

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
COMPLETE_MARKER = "checkpoint_complete"
CHECKPOINT_META = "checkpoint.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")

_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_OTHER_MAGIC = {b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"PK\x03\x04": "zip"}
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ArchiveLimits:
    """Caps applied while reading an archive; the service sets them from its settings."""

    max_member_bytes: int = 32 << 30
    max_total_bytes: int = 64 << 30
    max_compression_ratio: float = 100.0
    max_members: int = 10_000
    max_safetensors_header_bytes: int = 100 << 20


@dataclass
class Checkpoint:
    """An opened checkpoint: its files on local disk plus parsed metadata."""

    root: Path
    source: Path
    source_sha256: str | None
    adapter_config: dict
    meta: dict | None = None
    _tmpdir: Path | None = field(default=None, repr=False)

    @property
    def adapter_weights(self) -> Path:
        return self.root / ADAPTER_WEIGHTS

    @property
    def base_model(self) -> str | None:
        if self.meta and self.meta.get("base_model"):
            return str(self.meta["base_model"])
        b = self.adapter_config.get("base_model_name_or_path")
        return str(b) if b else None

    def close(self) -> None:
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _HashingReader:
    """File wrapper that hashes and counts the compressed bytes as they are read."""

    def __init__(self, f):
        self._f = f
        self.sha = hashlib.sha256()
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        b = self._f.read(n)
        self.sha.update(b)
        self.count += len(b)
        return b

    def readable(self) -> bool:
        return True

    def finish(self) -> str:
        # Hash any trailing bytes tarfile did not need (padding after the end blocks).
        while self.read(_CHUNK):
            pass
        return self.sha.hexdigest()


def _decompressed_stream(raw: _HashingReader, head: bytes, path: Path):
    if head.startswith(_GZIP_MAGIC):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if head.startswith(_ZSTD_MAGIC):
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
    for magic, name in _OTHER_MAGIC.items():
        if head.startswith(magic):
            raise InputError(E.ARCHIVE_UNREADABLE, f"{path.name} is {name}-compressed, which is not supported; re-pack it as a plain, gzip or zstd tar.")
    return raw


def _member_path(name: str) -> PurePosixPath:
    if name.startswith("/") or (len(name) > 1 and name[1] == ":") or name.startswith("\\"):
        raise InputError(E.ARCHIVE_ABSOLUTE_PATH, f"archive member {name!r} has an absolute path; archives must hold relative paths only.")
    p = PurePosixPath(name.replace("\\", "/"))
    if any(part == ".." for part in p.parts):
        raise InputError(E.ARCHIVE_PATH_TRAVERSAL, f"archive member {name!r} climbs out of the archive with '..'; the archive is hostile or corrupt.")
    parts = [part for part in p.parts if part not in (".", "")]
    return PurePosixPath(*parts) if parts else PurePosixPath(".")


def _check_member_type(m: tarfile.TarInfo) -> None:
    if m.issym():
        raise InputError(E.ARCHIVE_SYMLINK, f"archive member {m.name!r} is a symbolic link; only regular files are accepted.")
    if m.islnk():
        raise InputError(E.ARCHIVE_HARDLINK, f"archive member {m.name!r} is a hard link; only regular files are accepted.")
    if not (m.isreg() or m.isdir()):
        raise InputError(E.ARCHIVE_SPECIAL_FILE, f"archive member {m.name!r} is a device, FIFO or other special file; only regular files are accepted.")


def _extract(path: Path, dest: Path, limits: ArchiveLimits) -> str:
    """Extract regular files of the tar at ``path`` into ``dest``; return the archive's sha256."""
    compressed_size = max(path.stat().st_size, 1)
    ratio_cap = limits.max_compression_ratio * compressed_size
    seen: set[str] = set()
    total = 0
    count = 0
    with open(path, "rb") as f:
        head = f.read(8)
        f.seek(0)
        raw = _HashingReader(f)
        stream = _decompressed_stream(raw, head, path)
        try:
            tar = tarfile.open(fileobj=stream, mode="r|")
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise InputError(E.ARCHIVE_UNREADABLE, f"{path.name} is not a readable tar archive ({exc}); re-pack the checkpoint as a tar file.") from None
        try:
            for m in tar:
                count += 1
                if count > limits.max_members:
                    raise InputError(E.ARCHIVE_TOO_MANY_MEMBERS, f"{path.name} has more than {limits.max_members} members; a checkpoint needs only a handful.")
                rel = _member_path(m.name)
                _check_member_type(m)
                key = str(rel)
                if key in seen:
                    raise InputError(E.ARCHIVE_DUPLICATE_MEMBER, f"archive member {key!r} appears twice; re-pack the checkpoint so every name is unique.")
                seen.add(key)
                if m.isdir():
                    continue
                if rel.name.lower().endswith(PICKLE_SUFFIXES):
                    raise InputError(E.ARCHIVE_PICKLE_WEIGHTS, f"archive member {key!r} is a pickle file, which is never loaded; export the adapter as adapter_model.safetensors.")
                if m.size > limits.max_member_bytes:
                    raise InputError(E.ARCHIVE_MEMBER_TOO_LARGE, f"archive member {key!r} is {m.size} bytes, over the {limits.max_member_bytes}-byte per-member cap.")
                if total + m.size > limits.max_total_bytes:
                    raise InputError(E.ARCHIVE_TOO_LARGE, f"{path.name} expands to more than the {limits.max_total_bytes}-byte cap.")
                target = dest.joinpath(*rel.parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(m)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
                with os.fdopen(fd, "wb") as out:
                    left = m.size
                    while left:
                        b = src.read(min(_CHUNK, left))
                        if not b:
                            raise InputError(E.ARCHIVE_UNREADABLE, f"{path.name} is truncated inside member {key!r}; re-upload the checkpoint.")
                        out.write(b)
                        left -= len(b)
                        total += len(b)
                        if total > ratio_cap:
                            raise InputError(E.ARCHIVE_COMPRESSION_RATIO, f"{path.name} expands more than {limits.max_compression_ratio:g}x its own size; it looks like a decompression bomb.")
            sha = raw.finish()
        except (tarfile.TarError, EOFError, OSError, gzip.BadGzipFile) as exc:
            if isinstance(exc, InputError):
                raise
            raise InputError(E.ARCHIVE_UNREADABLE, f"{path.name} is corrupt or truncated ({exc.__class__.__name__}: {exc}); re-upload the checkpoint.") from None
        except Exception as exc:  # zstandard raises its own ZstdError
            if isinstance(exc, InputError) or exc.__class__.__name__ != "ZstdError":
                raise
            raise InputError(E.ARCHIVE_UNREADABLE, f"{path.name} has a corrupt zstd stream ({exc}); re-upload the checkpoint.") from None
        finally:
            tar.close()
    return sha


def _find_root(d: Path) -> Path:
    """Files may sit at the archive's top level or inside one top-level folder."""
    entries = list(d.iterdir())
    if len(entries) == 1 and entries[0].is_dir() and not (d / ADAPTER_WEIGHTS).exists():
        return entries[0]
    return d


def _load_json(p: Path, code: str, what: str) -> dict:
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(code, f"{what} is not valid JSON ({exc}); fix the file and re-pack the checkpoint.") from None
    if not isinstance(data, dict):
        raise InputError(code, f"{what} must be a JSON object.")
    return data


def _check_meta(root: Path, meta: dict) -> None:
    files = meta.get("files", {})
    if not isinstance(files, dict):
        raise InputError(E.ARCHIVE_BAD_METADATA, "checkpoint.json 'files' must map file names to {sha256, size}.")
    for name, spec in files.items():
        if not isinstance(spec, dict):
            raise InputError(E.ARCHIVE_BAD_METADATA, f"checkpoint.json entry for {name!r} must be an object with sha256 and size.")
        rel = _member_path(str(name))
        p = root.joinpath(*rel.parts)
        if not p.is_file():
            raise InputError(E.ARCHIVE_MISSING_FILE, f"checkpoint.json lists {name!r} but the checkpoint does not contain it.")
        if "size" in spec and p.stat().st_size != spec["size"]:
            raise InputError(E.ARCHIVE_SIZE_MISMATCH, f"{name!r} is {p.stat().st_size} bytes but checkpoint.json says {spec['size']}; the checkpoint is corrupt.")
        if "sha256" in spec and sha256_file(p) != str(spec["sha256"]).lower():
            raise InputError(E.ARCHIVE_CHECKSUM_MISMATCH, f"{name!r} does not match its sha256 in checkpoint.json; the checkpoint is corrupt.")


def _check_contents(root: Path, *, require_marker: bool) -> tuple[dict, dict | None]:
    for p in root.rglob("*"):
        if p.is_symlink():
            raise InputError(E.ARCHIVE_SYMLINK, f"{p.relative_to(root)} is a symbolic link; only regular files are accepted.")
        if p.is_file() and p.name.lower().endswith(PICKLE_SUFFIXES):
            raise InputError(E.ARCHIVE_PICKLE_WEIGHTS, f"{p.relative_to(root)} is a pickle file, which is never loaded; export the adapter as adapter_model.safetensors.")
    if require_marker and not (root / COMPLETE_MARKER).is_file():
        raise InputError(E.ARCHIVE_INCOMPLETE, "the checkpoint has no checkpoint_complete marker, so it was not finished; export a completed checkpoint.")
    if not (root / ADAPTER_WEIGHTS).is_file():
        raise InputError(E.ARCHIVE_MISSING_FILE, f"the checkpoint has no {ADAPTER_WEIGHTS}; it must hold the LoRA weights in safetensors form.")
    if not (root / ADAPTER_CONFIG).is_file():
        raise InputError(E.ARCHIVE_MISSING_FILE, f"the checkpoint has no {ADAPTER_CONFIG}; it must name at least r and lora_alpha.")
    config = _load_json(root / ADAPTER_CONFIG, E.ADAPTER_CONFIG_INVALID, ADAPTER_CONFIG)
    meta = None
    if (root / CHECKPOINT_META).is_file():
        meta = _load_json(root / CHECKPOINT_META, E.ARCHIVE_BAD_METADATA, CHECKPOINT_META)
        _check_meta(root, meta)
    return config, meta


def open_checkpoint(source: str | os.PathLike, limits: ArchiveLimits | None = None, *, workdir: str | os.PathLike | None = None) -> Checkpoint:
    """Open an archive (extracted into a fresh temp dir) or an adapter directory (used in place).

    An archive must carry the ``checkpoint_complete`` marker; a plain adapter
    directory (for example one written by PEFT) need not.
    """
    limits = limits or ArchiveLimits()
    src = Path(source)
    if not src.exists():
        raise InputError(E.ARCHIVE_NOT_FOUND, f"{src} does not exist; pass the path of a checkpoint archive or adapter directory.")
    if src.is_dir():
        config, meta = _check_contents(src, require_marker=False)
        return Checkpoint(root=src, source=src, source_sha256=None, adapter_config=config, meta=meta)
    tmp = Path(tempfile.mkdtemp(prefix="nucleus-archive-", dir=workdir))
    try:
        sha = _extract(src, tmp, limits)
        root = _find_root(tmp)
        config, meta = _check_contents(root, require_marker=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Checkpoint(root=root, source=src, source_sha256=sha, adapter_config=config, meta=meta, _tmpdir=tmp)
