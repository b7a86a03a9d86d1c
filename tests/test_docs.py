"""The docs stay true: every error code is documented."""

from __future__ import annotations

from pathlib import Path

from converters.errors import catalogue

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_error_docs_list_every_code():
    text = (DOCS / "errors.md").read_text()
    missing = [c for c in catalogue() if f"`{c}`" not in text]
    assert not missing, f"docs/errors.md lacks {missing}"
