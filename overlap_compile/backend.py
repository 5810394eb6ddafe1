"""The Dynamo backend ``"overlap"``: Inductor with the overlap pass installed.

    torch.compile(model, backend="overlap")                      # entry point torch_dynamo_backends
    torch.compile(model, backend="overlap", mode="reduce-overhead")
    torch.compile(model, backend="overlap", options={"max_autotune": True})   # inductor options

The options of overlap_compile in effect when Dynamo hands over the forward graph are
snapshotted into the pass; Inductor re-applies its config patches when it compiles the backward
graph later, so backward is governed by the same snapshot. A compile given its own ``report``
runs the passes even where Inductor's FX graph cache or AOTAutograd's cache holds the graph: a hit
skips the post-grad passes, and the Report asked for would stay empty.
"""
from __future__ import annotations

from typing import Any

import torch

from .inductor_hook import inductor_patches, make_pass
from .report import Report


def overlap_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], mode: str | None = None,
                    options: dict | None = None, report: Report | None = None) -> Any:
    from torch._inductor.compile_fx import compile_fx

    patches: dict[str, Any] = {}
    if mode and mode != "default":
        patches.update(torch._inductor.list_mode_options(mode))
    if options:
        patches.update(options)
    patches.update(inductor_patches(make_pass(report=report)))
    if report is None:
        return compile_fx(gm, example_inputs, config_patches=patches)
    from torch._functorch import config as functorch_config

    from .compile_caches import compile_cache_settings

    # Inductor re-applies config_patches when it compiles the backward later: the FX graph cache
    # stays off there too; AOTAutograd's cache is looked up now, for both graphs
    no_cache, no_aot_cache = compile_cache_settings()
    patches.update(no_cache)
    with functorch_config.patch(no_aot_cache):
        return compile_fx(gm, example_inputs, config_patches=patches)


def register() -> None:
    """Register ``"overlap"`` without the package entry point (e.g. running from a checkout)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "overlap" not in _BACKENDS:
        register_backend(name="overlap")(overlap_backend)
