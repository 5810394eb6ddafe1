"""The launch mode a decision is made for: whether Inductor will capture the graph being compiled.
Its own module so that the measuring code (exhaustive.py) and the package read it alike."""
from __future__ import annotations


def launch_mode() -> str:
    """"cuda_graph" when Inductor will capture the graph (mode="reduce-overhead"), else "eager"."""
    try:
        from torch._inductor import config as ic

        return "cuda_graph" if ic.triton.cudagraphs else "eager"
    except Exception:
        return "eager"
