"""``explain``: compile a model with the overlap pass, run it once, return what the pass did.

    report = oc.explain(model, x, backward=True, force_template="p2p_ring")
    print(report)
    print(report.graphs["backward"].after)

Caches that would skip the pass (FX graph cache, AOTAutograd cache) are off while it compiles,
so every graph is seen. Keyword arguments are overlap_compile options for this call.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from . import config as oc_config
from .compile_caches import no_compile_caches
from .report import Report


def explain(model: Any, *inputs: Any, backward: bool = False, mode: str | None = None, **overrides: Any) -> Report:
    from .backend import overlap_backend

    report = Report()
    with oc_config.patch(**overrides), no_compile_caches():
        backend = functools.partial(overlap_backend, report=report, mode=mode)
        compiled = torch.compile(model, backend=backend)
        out = compiled(*inputs)
        if backward:
            loss = _sum_outputs(out)
            if loss is None:
                raise ValueError("explain(backward=True): the model returned no tensor that requires grad")
            loss.backward()
    if oc_config.current().dump_dir or overrides.get("dump_dir"):
        report.dump(overrides.get("dump_dir") or oc_config.current().dump_dir)
    return report


def _sum_outputs(out: Any) -> torch.Tensor | None:
    total = None
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            local = t.to_local() if hasattr(t, "to_local") else t
            s = local.float().sum()
            total = s if total is None else total + s
    return total

