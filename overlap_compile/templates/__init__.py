"""Registry of overlap templates: name -> TemplateSpec.

Importing this package registers every template's ops (``torch.ops.overlap_compile.*``); it
touches neither CUDA nor any process group.
"""
from __future__ import annotations

import importlib

from .base import TemplateSpec

# name -> module holding ``SPEC`` (and, beside it, ``op`` registering the ops)
_REGISTRY: dict[str, str] = {
    "signal_reorder": "overlap_compile.templates.signal_reorder",
    "p2p_ring": "overlap_compile.templates.p2p_ring",
    "priority_stream": "overlap_compile.templates.priority_stream",
    "tile_fused": "overlap_compile.templates.tile_fused",
    "moe_fused": "overlap_compile.templates.moe_fused",
}


def register(name: str, package: str) -> None:
    """Add a template package (``spec.py`` with ``SPEC``, ``op.py`` registering its ops)."""
    _REGISTRY[name] = package


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get_spec(name: str) -> TemplateSpec:
    if name not in _REGISTRY:
        raise ValueError(f"unknown template {name!r}; implemented: {sorted(_REGISTRY)}")
    importlib.import_module(_REGISTRY[name] + ".op")
    return importlib.import_module(_REGISTRY[name] + ".spec").SPEC


def load_all_ops() -> None:
    for pkg in _REGISTRY.values():
        importlib.import_module(pkg + ".op")
