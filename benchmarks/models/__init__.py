"""Models of the end-to-end benchmark (benchmarks/e2e.py), written the way users write them.

    build(name, sizes, device, dtype, seed) -> Built(model, x, to_local)

Registry (``MODELS``):

    llama_dtensor    Llama-style block, TP + SP with DTensor parallelize_module (torchtitan style;
                     overlap_compile.demo.models)
    llama_megatron   the same block with plain functional collectives and hand-sharded weights
                     (Megatron style), numerically equal to llama_dtensor for the same weights
    mixtral_ep       attention + expert-parallel MoE FFN (overlap_compile.demo.moe), when present

``sizes`` come from shapes.json's e2e set (hidden, intermediate, heads, seq, batch [, E, topk]).
All on the default process group (one rank per device).
"""
from __future__ import annotations

from typing import Callable

from .common import Built
from .llama import build_llama_dtensor, build_llama_megatron

MODELS: dict[str, Callable[..., Built]] = {
    "llama_dtensor": build_llama_dtensor,
    "llama_megatron": build_llama_megatron,
}

try:  # the MoE layer lands with issue #7; the registry says when it is missing
    from .mixtral import build_mixtral_ep

    MODELS["mixtral_ep"] = build_mixtral_ep
except ImportError:
    pass


def build(name: str, sizes: dict, device: str, dtype, seed: int = 0) -> Built:
    if name not in MODELS:
        raise ValueError(f"unknown e2e model {name!r}; available: {sorted(MODELS)}")
    return MODELS[name](sizes, device, dtype, seed)
