"""``nucleus-export convert``: one archive + base model -> one output format."""

from __future__ import annotations

import json
import sys

from converters import ConvertOptions, convert, registry
from converters.errors import EXIT_OK
from converters.plan import parse_size

from ..settings import Settings
from . import progress as progress_mod
from .errors import guarded


def register(sub) -> None:
    p = sub.add_parser("convert", help="convert a checkpoint archive into a model format", description="Convert a checkpoint archive (or adapter directory) plus its base model into FORMAT.")
    p.add_argument("archive", nargs="?", help="checkpoint archive (.tar, .tar.gz, .tar.zst) or adapter directory")
    p.add_argument("--base", help="base model: local directory, org/name under --model-store, or a Hub id (default: the one the archive names)")
    p.add_argument("--format", "-f", required=True, choices=sorted(registry.available()), help="output format")
    p.add_argument("--output", "-o", required=True, help="output directory (must not exist unless --overwrite)")
    p.add_argument("--dtype", default="auto", help="output dtype for weights: auto (keep), bf16, fp16, fp32")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--verify", dest="verify", action="store_true", default=None, help="compare outputs with the reference (default: on below ~2B parameters)")
    p.add_argument("--no-verify", dest="verify", action="store_false")
    p.add_argument("--quant", default="f16", help="gguf: f32, f16, bf16, q8_0, q4_0, q5_0, q3_k_m, q4_k_s, q4_k_m, q5_k_s, q5_k_m, q6_k (default f16)")
    p.add_argument("--split-max-size", help="gguf: split files larger than this (e.g. 4GB) into -0000N-of-0000M.gguf parts")
    p.add_argument("--allow-unknown-pretokenizer", action="store_true", help="gguf: export a BPE tokenizer llama.cpp does not recognise, as 'default'")
    p.add_argument("--progress", choices=["auto", "bar", "json", "none"], default="auto", help="bar on a terminal, JSON lines otherwise (auto)")
    p.add_argument("--model-store", help="directory holding base models as org/name/ folders")
    p.add_argument("--base-revision", help="Hub revision of the base model")
    p.add_argument("--force-base", action="store_true", help="use --base even if the archive names a different base model")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output (atomically, once the new one is complete)")
    p.add_argument("--no-fsync", dest="durable", action="store_false", help="skip fsync (faster; a crash may leave a torn output). Default: outputs are fsynced before they appear")
    p.add_argument("--offline", action="store_true", default=None, help="never contact the Hub; use the local cache only")
    p.set_defaults(func=run)


@guarded
def run(args) -> int:
    settings = Settings.from_env()
    options = ConvertOptions(
        dtype=None if args.dtype == "auto" else args.dtype,
        max_shard_size=parse_size(args.max_shard_size),
        verify=args.verify,
        verify_max_params=settings.verify_max_params,
        force_base=args.force_base,
        overwrite=args.overwrite,
        durable=args.durable,
        quant=args.quant,
        split_max_size=parse_size(args.split_max_size) if args.split_max_size else None,
        allow_unknown_pretokenizer=args.allow_unknown_pretokenizer,
        model_store=args.model_store or settings.model_store,
        base_revision=args.base_revision,
        offline=args.offline if args.offline is not None else settings.hf_offline,
        limits=settings.archive_limits(),
    )
    mode = args.progress if args.progress != "auto" else ("bar" if sys.stderr.isatty() else "json")
    args.progress = mode
    prog = progress_mod.make(mode)
    try:
        manifest = convert(args.archive, args.base, args.format, args.output, options, prog)
    finally:
        prog.close()
    if mode == "json":
        sys.stdout.write(json.dumps({"event": "result", **manifest.to_dict()}) + "\n")
    else:
        print_summary(manifest)
    return EXIT_OK


def print_summary(manifest) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.print(f"[bold green]✓[/] {manifest.format} written to [bold]{manifest.path}[/]")
    table = Table(show_header=True, header_style="bold", box=None)
    table.add_column("file")
    table.add_column("size", justify="right")
    table.add_column("sha256")
    for f in manifest.files:
        table.add_row(f["name"], f"{f['size']:,}", f["sha256"][:16] + "…")
    con.print(table)
    v = manifest.verification
    if v is None:
        con.print("verification: not run (pass --verify to run it)")
    elif v["status"] == "skipped":
        con.print(f"verification: [yellow]skipped[/] — {v['reason']}")
    else:
        con.print(f"verification: [green]{v['status']}[/] against {v['reference']} — max |Δ log p| {v['max_abs_logprob_diff']:.2e}, top-1 agreement {v['top1_agreement']:.1%}")
    for engine, r in (manifest.reports.get("compatibility") or {}).items():
        if r["compatible"]:
            con.print(f"{engine}: [green]compatible[/] ({r['notes']})")
        else:
            con.print(f"{engine}: [yellow]not compatible[/] — {'; '.join(r['problems'])}")
    for note in manifest.notes:
        con.print(f"note: {note}")
