"""The compile caches that would let a compile skip the overlap pass, and how to turn them off.

Inductor's FX graph cache and AOTAutograd's cache return a compiled graph without running the
post-grad passes: the graph keeps its rewrites (the pass's uuid is in the key), but a Report
asked for sees nothing. ``explain``, ``plan`` and a backend compile given its own Report compile
with them off.
"""
from __future__ import annotations

import contextlib
from typing import Iterator


def compile_cache_settings() -> tuple[dict[str, bool], dict[str, bool]]:
    """The Inductor and AOTAutograd config that turns off the caches which would let a compile
    skip the post-grad passes (and so leave the Report empty): (inductor, functorch) patches."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    no_cache = {k: False for k in ("fx_graph_cache", "fx_graph_remote_cache") if hasattr(inductor_config, k)}
    no_aot_cache = {k: False for k in ("enable_autograd_cache",) if hasattr(functorch_config, k)}
    return no_cache, no_aot_cache


@contextlib.contextmanager
def no_compile_caches() -> Iterator[None]:
    """Turn off the caches that would let Inductor skip the post-grad passes (and so the Report)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    no_cache, no_aot_cache = compile_cache_settings()
    with inductor_config.patch(no_cache), functorch_config.patch(no_aot_cache):
        yield
