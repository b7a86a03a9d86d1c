"""Converter plugins, discovered through the ``nucleus_export.converters`` entry-point group.

A converter is a class with a ``name`` and a ``plan(ctx)`` method (see
converters.formats.base.Converter). Third-party packages register their own
formats by declaring an entry point in that group; the built-ins are declared
in this project's pyproject.toml the same way.
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import entry_points

from . import errors as E
from .errors import InputError

GROUP = "nucleus_export.converters"

# Used only when the distribution's metadata is not installed (running from a
# source tree without `pip install -e`); mirrors pyproject.toml's entry points.
_BUILTIN = {
    "merged-safetensors": "converters.formats.merged_safetensors:MergedSafetensors",
    "lora-adapter": "converters.formats.lora_adapter:LoraAdapter",
    "gguf": "converters.formats.gguf:Gguf",
    "gguf-lora": "converters.formats.gguf_lora:GgufLora",
}


def _load(target: str):
    module, _, attr = target.partition(":")
    return getattr(import_module(module), attr)


def available() -> dict[str, str]:
    """Format name -> 'module:Class'."""
    found = {ep.name: ep.value for ep in entry_points(group=GROUP)}
    return found or dict(_BUILTIN)


def get(name: str):
    targets = available()
    if name not in targets:
        raise InputError(E.UNKNOWN_FORMAT, f"format {name!r} is not available; choose one of: {', '.join(sorted(targets))}.", field="format")
    return _load(targets[name])()
