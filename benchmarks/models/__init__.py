"""Models of the end-to-end benchmark (benchmarks/e2e.py), written the way users write them.

    build(name, sizes, device, dtype, seed) -> Built(model, x, to_local, tokens, finalize_grads)

Registry (``MODELS``: name -> builder(sizes, device, dtype, seed); all on the default process
group, one rank per device):

    llama_dtensor    Llama-style block, TP + SP with DTensor parallelize_module (torchtitan style;
                     overlap_compile.demo.models)
    llama_megatron   the same block with plain functional collectives and hand-sharded weights
                     (Megatron style), numerically equal to llama_dtensor for the same weights
    mixtral_ep       attention + expert-parallel MoE FFN (overlap_compile.demo.moe), when present

``sizes`` come from shapes.json's e2e set (hidden, intermediate, heads, seq, batch [, E, topk]);
``FAMILY`` says which shapes a model takes ("llama": dense, "moe": needs E and topk).
"""
from __future__ import annotations

from typing import Callable

from .common import Built
from .llama import build_llama_dtensor, build_llama_megatron

MODELS: dict[str, Callable[..., Built]] = {
    "llama_dtensor": build_llama_dtensor,
    "llama_megatron": build_llama_megatron,
}
FAMILY = {"llama_dtensor": "llama", "llama_megatron": "llama"}
REQUIRED = {"llama": ("hidden", "intermediate", "heads", "seq", "batch"),
            "moe": ("hidden", "intermediate", "heads", "seq", "batch", "E", "topk")}
MISSING: dict[str, str] = {}  # model -> why it is not in the registry

try:  # the MoE layer is another issue's work: the registry says when it is missing
    from .mixtral import build_mixtral_ep

    MODELS["mixtral_ep"] = build_mixtral_ep
    FAMILY["mixtral_ep"] = "moe"
except ImportError as e:
    MISSING["mixtral_ep"] = f"overlap_compile.demo.moe not importable: {e}"


def build(name: str, sizes: dict, device: str, dtype, seed: int = 0) -> Built:
    import torch.distributed as dist

    if name not in MODELS:
        why = f" ({MISSING[name]})" if name in MISSING else ""
        raise ValueError(f"unknown e2e model {name!r}{why}; available: {sorted(MODELS)}")
    missing = [k for k in REQUIRED[FAMILY[name]] if k not in sizes]
    if missing:
        raise ValueError(f"{name}: shape {sizes.get('name', sizes)!r} lacks {missing}; it needs {list(REQUIRED[FAMILY[name]])}")
    world = dist.get_world_size()
    if FAMILY[name] == "llama" and (sizes["seq"] % world or sizes["heads"] % world):  # sequence / head shards
        raise ValueError(f"{name}: seq ({sizes['seq']}) and heads ({sizes['heads']}) must be multiples of the world size {world}")
    return MODELS[name](sizes, device, dtype, seed)
