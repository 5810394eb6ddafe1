"""Models of the end-to-end benchmark (benchmarks/e2e.py), written the way users write them.

    build(name, sizes, device, dtype, seed) -> Built(model, x, to_local, tokens, finalize_grads)

Registry (``MODELS``: name -> builder(sizes, device, dtype, seed); all on the default process
group, one rank per device):

    llama_dtensor    Llama-style block, TP + SP with DTensor parallelize_module (torchtitan style;
                     overlap_compile.demo.models)
    llama_megatron   the same block with plain functional collectives and hand-sharded weights
                     (Megatron style), numerically equal to llama_dtensor for the same weights
    llama70_dtensor  llama_dtensor pinned to the Llama-3-70B block shape (``PINNED_SHAPE``): e2e.py
                     runs it on that shape only, and names every 70B llama_dtensor row after it
    mixtral_ep       attention + expert-parallel MoE FFN (overlap_compile.demo.moe), when present

The model zoo, one module per form as its framework parallelizes it, each pinned to the 8B, 70B
and 8B long-context (seq 16384) shapes as ``<form>_8b``, ``<form>_70b``, ``<form>_8b_16k``:

    megatron_fused   Megatron-LM style: fused QKV and gate/up GEMMs, GQA, [seq, batch, hidden]
    dtensor_gqa      a DTensor plan over separate wq / wk / wv, GQA
    titan_llama3     the real torchtitan Llama 3 with its own plan and per-block compile
                     (benchmarks extra ``[bench]``; listed in MISSING where it does not import)

``sizes`` come from shapes.json's e2e set (hidden, intermediate, heads, seq, batch [, E, topk]);
``FAMILY`` says which shapes a model takes ("llama": dense, "moe": needs E and topk).
"""
from __future__ import annotations

from typing import Callable

from .common import Built
from .dtensor_gqa import build_dtensor_gqa
from .llama import build_llama_dtensor, build_llama_megatron
from .megatron_fused import build_megatron_fused

MODELS: dict[str, Callable[..., Built]] = {
    "llama_dtensor": build_llama_dtensor,
    "llama_megatron": build_llama_megatron,
    "megatron_fused": build_megatron_fused,
    "dtensor_gqa": build_dtensor_gqa,
}
FAMILY = {"llama_dtensor": "llama", "llama_megatron": "llama", "llama70_dtensor": "llama"}
ZOO = ("megatron_fused", "dtensor_gqa", "titan_llama3")
# a zoo form's sizes: e2e.py's shape key on GPUs and its CPU stand-in on dry runs
ZOO_SIZES = {"8b": ("8b", "tiny"), "70b": ("70b", "tiny-70b"), "8b_16k": ("8b-16k", "tiny-long")}
# A model that is another model on one shape: name -> (the model it builds, e2e.py's shape key on
# GPUs, the key of its CPU stand-in on dry runs).
#
# Llama-3-70B block (hidden 8192, intermediate 28672, 64 heads, seq 8192, batch 1) at world 2, bf16:
# the demo block has full multi-head K/V (kv_heads is not modelled), so 4 x 8192^2 attention +
# 3 x 8192 x 28672 FFN = 973M parameters, 487M per rank. Parameters 0.97 GB + gradients 0.97 GB +
# AdamW's two moments in the parameter dtype 1.95 GB = 3.9 GB per rank. Activations per rank: a full
# [8192, 8192] bf16 tensor is 128 MiB (the all-gathered inputs), q/k/v/attention out 64 MiB each
# (32 local heads, flash attention keeps no seq^2 scores), the FFN's w1/w3/SwiGLU outputs 224 MiB each:
# what backward keeps is ~1.5 GiB, the step's peak a few GiB. Well inside 141 GB without activation
# checkpointing (--ckpt on still works for it).
PINNED_SHAPE = {"llama70_dtensor": ("llama_dtensor", "70b", "tiny-70b")}
MODELS["llama70_dtensor"] = build_llama_dtensor
MISSING: dict[str, str] = {}  # model -> why it is not in the registry

from .titan import available as _titan_missing  # noqa: E402

if _titan_missing() is None:
    from .titan import build_titan_llama3

    MODELS["titan_llama3"] = build_titan_llama3
for _form in ZOO:
    FAMILY[_form] = "llama"
    for _suffix, (_key, _dry_key) in ZOO_SIZES.items():
        _name = f"{_form}_{_suffix}"
        FAMILY[_name] = "llama"
        if _form in MODELS:
            PINNED_SHAPE[_name] = (_form, _key, _dry_key)
            MODELS[_name] = MODELS[_form]
        else:
            MISSING[_name] = _titan_missing() or f"{_form} is not registered"
if "titan_llama3" not in MODELS:
    MISSING["titan_llama3"] = _titan_missing()
REQUIRED = {"llama": ("hidden", "intermediate", "heads", "seq", "batch"),
            "moe": ("hidden", "intermediate", "heads", "seq", "batch", "E", "topk")}
try:  # the MoE layer is optional: the registry says when it is missing
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
