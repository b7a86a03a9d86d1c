"""``convert``: the library's one entry point (the CLI and the job runner call it)."""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path

from . import errors as E
from . import registry
from .adapter import load_adapter
from .archive import Checkpoint, open_checkpoint
from .base_model import resolve_base
from .errors import ExportError, InputError, InternalError
from .execute import execute, fsync_dir
from .io.files import check_free_space
from .formats.base import ConvertContext, ConvertOptions
from .manifest import MANIFEST_NAME, OutputManifest
from .progress import ProgressEvent, ProgressFn, silent


def _check_output(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise InputError(E.OUTPUT_EXISTS, f"{out} already exists; choose another output path or pass --overwrite.", field="output")
    if not out.parent.exists():
        raise InputError(E.INVALID_OPTION, f"the parent directory of {out} does not exist; create it first.", field="output")


def _place(tmp: Path, out: Path, durable: bool) -> None:
    """Rename the finished temp dir into place; an old output is replaced only now."""
    if out.exists():
        old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)
    if durable:
        fsync_dir(out.parent)


def convert(
    source: str | os.PathLike | None,
    base: str | None,
    format: str,
    output: str | os.PathLike,
    options: ConvertOptions | None = None,
    progress: ProgressFn = silent,
) -> OutputManifest:
    """Convert a checkpoint archive (or adapter directory) plus its base model.

    ``source`` may be None only for formats that need no adapter. Writes into a
    temp directory beside ``output`` and renames it into place when complete and
    verified; on any error nothing is left at ``output``.
    """
    options = options or ConvertOptions()
    out = Path(output).absolute()
    converter = registry.get(format)
    _check_output(out, options.overwrite)
    if source is None and converter.needs_adapter:
        raise InputError(E.INVALID_OPTION, f"format {format} needs a checkpoint archive or adapter directory.", field="source")

    checkpoint: Checkpoint | None = None
    adapter = base_model = None
    tmp: Path | None = None
    try:
        progress(ProgressEvent("opening", 0, 0, "reading checkpoint"))
        if source is not None:
            checkpoint = open_checkpoint(source, options.limits)
            adapter = load_adapter(checkpoint.adapter_weights, checkpoint.adapter_config, options.limits.max_safetensors_header_bytes)
        progress(ProgressEvent("opening", 0, 0, "resolving base model"))
        base_model = resolve_base(
            base,
            archive_base=checkpoint.base_model if checkpoint else None,
            model_store=options.model_store,
            revision=options.base_revision,
            force=options.force_base,
            offline=options.offline,
            max_header_bytes=options.limits.max_safetensors_header_bytes,
            local_paths=options.allow_local_base,
        )
        ctx = ConvertContext(checkpoint, adapter, base_model, options)

        progress(ProgressEvent("planning", 0, 0))
        plan = converter.plan(ctx)
        plan.validate(str(adapter.path) if adapter else None, adapter.tensor_names if adapter else set())
        check_free_space(out.parent, plan.total_bytes, "the export")

        tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
        tmp.mkdir()
        records = execute(plan, tmp, ctx.readers(), progress, durable=options.durable)

        do_verify = options.verify if options.verify is not None else base_model.num_parameters <= options.verify_max_params
        verification = None
        if do_verify:
            progress(ProgressEvent("verifying", 0, 0))
            verification = converter.verify(ctx, tmp)
            if verification.get("status") == "failed":
                raise ExportError(E.VERIFY_FAILED, f"verification failed: the exported model's log-probabilities differ from the reference by {verification['max_abs_logprob_diff']:.3g} (tolerance {verification['tolerance']['max_abs_logprob_diff']}); the export was discarded.")

        meta = (checkpoint.meta or {}) if checkpoint else {}
        where = (lambda p: None) if options.reproducible else (lambda p: p)
        manifest = OutputManifest(
            format=format,
            path=where(str(out)),
            files=[asdict(r) for r in records.values()],
            source={
                "path": where(str(checkpoint.source)) if checkpoint else None,
                "sha256": checkpoint.source_sha256 if checkpoint else None,
                **{k: meta[k] for k in ("run_id", "checkpoint_id", "step") if k in meta},
            },
            base_model={**base_model.reference(), "architecture": base_model.family.name, **({"path": None} if options.reproducible else {})},
            options={"dtype": options.dtype, "max_shard_size": options.max_shard_size, "force_base": options.force_base,
                     **({"quant": options.quant, "split_max_size": options.split_max_size} if format.startswith("gguf") else {})},
            plan=plan.summary(),
            verification=verification,
            reports=converter.report(ctx, plan),
            notes=plan.notes,
            **({"created_at": None} if options.reproducible else {}),
        )
        with open(tmp / MANIFEST_NAME, "xb") as f:
            f.write(manifest.to_json())
            f.flush()
            if options.durable:
                os.fsync(f.fileno())
        _place(tmp, out, options.durable)
        tmp = None
        progress(ProgressEvent("done", plan.total_bytes, plan.total_bytes))
        return manifest
    except ExportError:
        raise
    except MemoryError:
        raise InternalError("ran out of memory during conversion") from None
    except OSError as exc:
        if exc.errno == 28:  # ENOSPC
            raise ExportError(E.DISK_FULL, f"the disk filled up while writing {out}; free some space and retry.") from None
        raise
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if adapter is not None:
            adapter.close()
        if base_model is not None:
            base_model.close()
        if checkpoint is not None:
            checkpoint.close()
