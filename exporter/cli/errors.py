"""How the CLI reports failures: one sentence on stderr and a distinct exit code."""

from __future__ import annotations

import functools
import json
import sys
import traceback

from converters.errors import EXIT_INTERNAL, ExportError


def report(exc: BaseException, as_json: bool = False) -> int:
    """Write the error (a JSON event first in JSON mode, then always one plain sentence)."""
    if isinstance(exc, ExportError):
        record, line, code = exc.to_dict(), f"error [{exc.code}]: {exc.message}", exc.exit_code
    else:
        message = f"{exc.__class__.__name__}: {exc}"
        record = {"code": "internal_error", "kind": "internal", "message": message}
        line = f"error [internal_error]: {message} (a bug in nucleus-export; set NUCLEUS_EXPORT_DEBUG=1 for a traceback)"
        code = EXIT_INTERNAL
    if as_json:
        sys.stderr.write(json.dumps({"event": "error", **record}) + "\n")
    sys.stderr.write(line + "\n")
    return code


def guarded(fn):
    """Run a command, turning exceptions into the CLI's error report and exit code."""

    @functools.wraps(fn)
    def wrapper(args) -> int:
        try:
            return fn(args)
        except KeyboardInterrupt:
            sys.stderr.write("interrupted; nothing was written\n")
            return 130
        except Exception as exc:  # noqa: BLE001 - the CLI's outermost boundary
            import os

            if os.environ.get("NUCLEUS_EXPORT_DEBUG"):
                traceback.print_exc()
            return report(exc, as_json=getattr(args, "progress", None) == "json")

    return wrapper
