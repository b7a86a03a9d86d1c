"""The ``nucleus-export`` command line. One module per command group."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from converters.errors import EXIT_USAGE


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.print_usage(sys.stderr)
        sys.stderr.write(f"error [invalid_option]: {message}\n")
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    from . import batch, client, convert, demo, keys, serve, worker

    parser = _Parser(prog="nucleus-export", description="Export LoRA checkpoints as merged models, PEFT adapters and more.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    convert.register(sub)
    demo.register(sub)
    worker.register(sub)
    serve.register(sub)
    keys.register(sub)
    client.register(sub)
    batch.register(sub)
    return parser


def _version() -> str:
    from converters.manifest import tool_version

    return tool_version()


def _quiet_libraries() -> None:
    # transformers/huggingface_hub chatter would bury our own progress and errors.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.getLogger("transformers").setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    _quiet_libraries()
    args = build_parser().parse_args(argv)
    code = args.func(args)
    if argv is None:
        raise SystemExit(code)
    return code
