"""Finding and inspecting the base model a checkpoint was trained on.

A base model is a Hugging Face model directory with safetensors weights. It is
found, in order, as a local directory, as ``<model store>/<org>/<name>``, or in
the Hugging Face cache through huggingface_hub (downloading only config,
tokenizer and safetensors files when online). Pickle weights are never loaded.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from . import arch
from . import errors as E
from .arch import Family
from .errors import ExportError, InputError
from .io.dtypes import FLOAT_DTYPES
from .io.safetensors_reader import SafetensorsFile, TensorInfo

# Files fetched from the Hub: everything a loader needs, no pickles.
HUB_ALLOW_PATTERNS = [
    "*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken", "*.py", "LICENSE*",
]
# Files never copied from the base into an output: weights (rewritten), pickles,
# the base's own card, VCS and hidden files.
_NOT_AUX = re.compile(r"(\.safetensors|\.bin|\.pt|\.pth|\.ckpt|\.h5|\.msgpack|\.gguf|\.onnx|\.pkl)$|^model\.safetensors\.index\.json$|^README\.md$|^\.|^nucleus-export\.json$", re.I)


@dataclass
class BaseModel:
    path: Path
    model_id: str | None  # Hub id when known
    revision: str | None  # Hub commit when resolved from the cache
    config: dict
    family: Family
    files: dict[str, SafetensorsFile]  # weight file name -> reader
    tensors: dict[str, tuple[str, TensorInfo]]  # tensor name -> (file name, info)

    @property
    def tied(self) -> bool:
        return arch.is_tied(self.family, self.config) or self.family.lm_head not in self.tensors

    @property
    def dtype(self) -> str:
        """The dominant floating dtype on disk."""
        counts: dict[str, int] = {}
        for _f, info in self.tensors.values():
            if info.dtype in FLOAT_DTYPES:
                counts[info.dtype] = counts.get(info.dtype, 0) + info.numel
        return max(counts, key=counts.get) if counts else "F32"

    @property
    def num_parameters(self) -> int:
        return sum(info.numel for _f, info in self.tensors.values())

    def aux_files(self) -> list[Path]:
        """Config, tokenizer, chat template, generation config, model code, license."""
        return sorted(p for p in self.path.iterdir() if p.is_file() and not _NOT_AUX.search(p.name))

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name][1]

    def reference(self) -> dict:
        return {"id": self.model_id, "revision": self.revision, "path": str(self.path)}

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def _open_dir(path: Path, model_id: str | None, revision: str | None, max_header_bytes: int) -> BaseModel:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise InputError(E.BASE_INVALID, f"{path} has no config.json; a base model must be a Hugging Face model directory.")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(E.BASE_INVALID, f"{cfg_path} is not valid JSON ({exc}).") from None
    family = arch.family_for(config)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (KeyError, json.JSONDecodeError, TypeError):
            raise InputError(E.BASE_INVALID, f"{index} is malformed; it must hold a weight_map.") from None
        names = sorted(set(weight_map.values()))
    else:
        names = sorted(p.name for p in path.glob("*.safetensors"))
    if not names:
        pickles = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
        hint = " It has only pickle weights, which are never loaded; convert them to safetensors first." if pickles else ""
        raise InputError(E.BASE_NO_SAFETENSORS, f"{path} has no safetensors weights.{hint}")
    files: dict[str, SafetensorsFile] = {}
    tensors: dict[str, tuple[str, TensorInfo]] = {}
    try:
        _index_tensors(path, names, files, tensors, max_header_bytes)
    except BaseException:
        for f in files.values():
            f.close()
        raise
    return BaseModel(path, model_id, revision, config, family, files, tensors)


def _index_tensors(path: Path, names: list[str], files: dict, tensors: dict, max_header_bytes: int) -> None:
    for n in names:
        p = path / n
        if not p.is_file():
            raise InputError(E.BASE_INVALID, f"{path} index names {n} but the file is missing; re-download the base model.")
        f = SafetensorsFile(p, max_header_bytes)
        files[n] = f
        for tname, info in f.tensors.items():
            if tname in tensors:
                raise InputError(E.BASE_INVALID, f"tensor {tname} appears in both {tensors[tname][0]} and {n}; the base model is inconsistent.")
            tensors[tname] = (n, info)


def _from_hub(repo_id: str, revision: str | None, offline: bool) -> tuple[Path, str | None]:
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        p = huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        if offline:
            raise InputError(E.BASE_NOT_FOUND, f"base model {repo_id} is not in the Hugging Face cache and the Hub is offline; download it first or pass a local directory with --base.") from None
        try:
            p = huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS)
        except RepositoryNotFoundError:
            raise InputError(E.BASE_NOT_FOUND, f"base model {repo_id} does not exist on the Hub or needs a token (set HF_TOKEN).") from None
        except (HfHubHTTPError, OSError) as exc:
            raise ExportError(E.DOWNLOAD_FAILED, f"downloading base model {repo_id} failed ({exc.__class__.__name__}); retry, or pass a local directory with --base.") from None
    p = Path(p)
    rev = p.name if p.parent.name == "snapshots" else revision
    return p, rev


def _is_hub_id(s: str) -> bool:
    return bool(re.fullmatch(r"[\w.\-]+/[\w.\-]+", s))


def names_match(archive_base: str, given: str, resolved: Path, given_is_dir: bool) -> bool:
    """Does the user's base model plausibly equal the one the archive names?

    Two Hub ids must be equal (case-insensitive). A local directory matches when
    its last two path parts, its Hub-cache name, or just its folder name equal
    the archive's id (people keep ``/models/Qwen3-8B`` for ``Qwen/Qwen3-8B``).
    """
    norm = lambda s: s.strip().rstrip("/").lower()  # noqa: E731
    a = norm(archive_base)
    if a.startswith(("/", "./", "../", "~")):  # the trainer recorded a local path
        return a.rsplit("/", 1)[-1] in {norm(given).rsplit("/", 1)[-1], resolved.name.lower()}
    if not given_is_dir:
        return a == norm(given)
    parts = [x.lower() for x in resolved.parts]
    ids = {"/".join(parts[-2:])} | {x.removeprefix("models--").replace("--", "/") for x in parts if x.startswith("models--")}
    if a in ids:
        return True
    return a.rsplit("/", 1)[-1] in {i.rsplit("/", 1)[-1] for i in ids} | {resolved.name.lower()}


def resolve_base(
    spec: str | None,
    *,
    archive_base: str | None = None,
    model_store: str | os.PathLike | None = None,
    revision: str | None = None,
    force: bool = False,
    offline: bool | None = None,
    max_header_bytes: int = 100 << 20,
    local_paths: bool = True,
) -> BaseModel:
    """Find the base model. ``spec`` may be None when the archive names one. ``local_paths=False``
    (the service, where the name comes from a user) accepts only Hub ids: resolved in the model
    store or the Hub cache, never as a directory on the worker."""
    if spec is None:
        if not archive_base:
            raise InputError(E.BASE_REQUIRED, "the checkpoint does not name its base model; pass one with --base.")
        spec = archive_base
    if offline is None:
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    model_id = None
    rev = None
    if not local_paths and not _is_hub_id(spec):
        raise InputError(E.BASE_NOT_FOUND, f"base model {spec!r} is not a Hub id; the service accepts only org/name (from its model store or the Hub).")
    p = Path(spec).expanduser()
    if local_paths and p.is_dir():
        path = p.resolve()
        if _is_hub_id(spec) and not p.is_absolute():
            model_id = spec
    elif model_store and (Path(model_store) / spec).is_dir():
        path = (Path(model_store) / spec).resolve()
        model_id = spec
    elif _is_hub_id(spec):
        path, rev = _from_hub(spec, revision, offline)
        model_id = spec
    else:
        where = f" or under the model store {model_store}" if model_store else ""
        raise InputError(E.BASE_NOT_FOUND, f"base model {spec!r} is not a directory{where}, nor a Hub id like org/name.")
    if archive_base and not force and not names_match(archive_base, spec, path, p.is_dir()):
        raise InputError(E.BASE_MISMATCH, f"the checkpoint was trained on {archive_base} but the base given is {spec}; pass the matching base, or --force-base if you are sure.")
    return _open_dir(path, model_id, rev, max_header_bytes)
