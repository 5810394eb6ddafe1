"""The Dynamo backend ``"overlap"``: Inductor with the overlap pass installed.

    torch.compile(model, backend="overlap")                      # entry point torch_dynamo_backends
    torch.compile(model, backend="overlap", mode="reduce-overhead")
    torch.compile(model, backend="overlap", options={"max_autotune": True})   # inductor options

The options of overlap_compile in effect when Dynamo hands over the forward graph are
snapshotted into the pass; Inductor re-applies its config patches when it compiles the backward
graph later, so backward is governed by the same snapshot. A compile given its own ``report``
runs the passes even where Inductor's FX graph cache or AOTAutograd's cache holds the graph: a hit
skips the post-grad passes, and the Report asked for would stay empty. So does a host-launched
compile with symbolic sizes: where its record says every rewritten site runs as written up to
some M, calls there run torch.compile's own compile of the graph, made beside it (row_dispatch.py).
"""
from __future__ import annotations

from typing import Any

import torch

from .inductor_hook import inductor_patches, make_pass
from .report import Report


def overlap_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], mode: str | None = None,
                    options: dict | None = None, report: Report | None = None) -> Any:
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    from .compile_caches import compile_cache_settings
    from .predictor import launch_mode
    from .row_dispatch import symbol_sources

    patches: dict[str, Any] = {}
    if mode and mode != "default":
        patches.update(torch._inductor.list_mode_options(mode))
    if options:
        patches.update(options)
    plain_patches = dict(patches)  # torch.compile's own compile: the mode and options only
    p = make_pass(report=report)
    patches.update(inductor_patches(p))
    with inductor_config.patch(plain_patches):
        host_launched = launch_mode() == "eager"
    # a host-launched dynamic graph may get a second compile for the row counts it runs as
    # written (row_dispatch.py), which the pass's record decides: that record must be made
    sources = symbol_sources(example_inputs)
    rows_dispatch = p.options.enabled and p.options.whole_graph_as_written and host_launched and bool(sources)
    no_aot_cache: dict[str, bool] = {}
    if report is not None or rows_dispatch:
        # Inductor re-applies config_patches when it compiles the backward later: the FX graph cache
        # stays off there too; AOTAutograd's cache is looked up now, for both graphs
        no_cache, no_aot_cache = compile_cache_settings()
        patches.update(no_cache)
    seen = len(p.records)
    with functorch_config.patch(no_aot_cache):
        compiled = compile_fx(gm, example_inputs, config_patches=patches)
    if not rows_dispatch:
        return compiled
    return _with_plain_rows(compiled, gm, example_inputs, sources, p.records[seen:], plain_patches)


def _with_plain_rows(compiled: Any, gm: torch.fx.GraphModule, example_inputs: list[Any], sources: dict,
                     records: list, plain_patches: dict[str, Any]) -> Any:
    """``compiled``, or where this compile's graphs allow it (every rewritten site symbolic and
    as written up to some M: passes/as_written_rows.py), a function that runs calls at those M
    through torch.compile's own compile of ``gm``, made here (row_dispatch.py). ``sources``: where
    a call carries each size symbol (row_dispatch.symbol_sources of ``example_inputs``)."""
    from torch._inductor.compile_fx import compile_fx

    from .row_dispatch import RowDispatch, dispatching

    if not records or any(r.as_written_up_to is None and any(s.rewritten for s in r.sites) for r in records):
        return compiled  # nothing rewritten, or a graph with a site rewritten at every M
    limits = [x for r in records for x in r.as_written_up_to or []]
    if not limits:
        return compiled
    try:
        dispatch = RowDispatch(limits, sources)
    except ValueError as e:
        for r in records:
            r.dispatched.append(f"every call runs the rewritten graph ({e})")
        return compiled
    try:
        plain = compile_fx(gm, example_inputs, config_patches=plain_patches)
    except Exception as e:  # the rewritten compile stands on its own: keep it, say why
        for r in records:
            r.dispatched.append(f"every call runs the rewritten graph (torch.compile's own compile failed: "
                                f"{type(e).__name__}: {e})")
        return compiled
    for r in records:
        r.dispatched.append("calls there run torch.compile's own compile of the graph")
    return dispatching(compiled, plain, dispatch)


def register() -> None:
    """Register ``"overlap"`` without the package entry point (e.g. running from a checkout)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "overlap" not in _BACKENDS:
        register_backend(name="overlap")(overlap_backend)
