"""Registry of overlap templates: name -> the template's package, one folder per template.

* ``spec.py``: ``SPEC``, what it supports, its configurations, the graph it emits (``get_spec``)
* ``op.py``: its ops, ``torch.ops.overlap_compile.<name>_*``, registered on import (``load_all_ops``)
* ``model.py``: its latency model, ``MODEL(site, config, profile, ctx) -> Schedule or None``;
  optionally ``CONFIGS(site, profile, ctx)`` and ``PEER_ONLY`` (``get_model``)
* ``reference.py``: the decomposed algorithm on any device: the oracle
* ``kernels*.py``: the GPU implementation

Beside them: ``base.py`` (``TemplateSpec``, the ops' shared definitions) and ``plans.py`` (the
plans an op is called with). Importing this package touches neither CUDA nor any process group.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from .base import TemplateSpec

# name -> package holding ``spec`` (``SPEC``), ``op`` (registering the ops) and ``model``
_REGISTRY: dict[str, str] = {
    "signal_reorder": "overlap_compile.templates.signal_reorder",
    "p2p_ring": "overlap_compile.templates.p2p_ring",
    "priority_stream": "overlap_compile.templates.priority_stream",
    "tile_fused": "overlap_compile.templates.tile_fused",
    "moe_fused": "overlap_compile.templates.moe_fused",
}


def register(name: str, package: str) -> None:
    """Add a template package (``spec.py`` with ``SPEC``, ``op.py`` registering its ops and,
    optionally, ``model.py`` with its latency model ``MODEL``)."""
    _REGISTRY[name] = package


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get_spec(name: str) -> TemplateSpec:
    if name not in _REGISTRY:
        raise ValueError(f"unknown template {name!r}; implemented: {sorted(_REGISTRY)}")
    importlib.import_module(_REGISTRY[name] + ".op")
    return importlib.import_module(_REGISTRY[name] + ".spec").SPEC


def get_model(name: str) -> ModuleType | None:
    """The template's latency model module (``model.py``, ``MODEL`` in it); None for a name not
    registered or a package without one (the predictor then asks ``spec.predict``)."""
    if name not in _REGISTRY:
        return None
    module = _REGISTRY[name] + ".model"
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        return None


def load_all_ops() -> None:
    for pkg in _REGISTRY.values():
        importlib.import_module(pkg + ".op")
    importlib.import_module(__name__ + ".bucketed")  # the ops of sites with a symbolic row count
