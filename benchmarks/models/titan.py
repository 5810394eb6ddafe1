"""The real torchtitan Llama 3 (the PyPI package, ``torchtitan.models.llama3``): its model, its own
tensor + sequence parallel plan (``parallelize_llama``) and its per-TransformerBlock compile
(``apply_compile``, ``fullgraph=True``, the backend from its ``CompileConfig.backend``).

    build_titan_llama3(sizes, device, dtype)  -> Built whose compile_with(backend) compiles it

The model is torchtitan's 8B or 70B configuration (``llama3_args``) with ``sizes["layers"]``
layers (default 1); a shape that is neither (CPU dry runs) takes the debug model's configuration at
the shape's hidden size and heads. After the plan is applied the embedding, final norm and output
projection are set to None, torchtitan's own way of running a slice of the layers (its pipeline
stages do the same), so the step times the transformer blocks alone, fed what the sharded
embedding would give them: this rank's sequence shard ``[batch, seq / W, hidden]``.

Needs ``pip install .[bench]`` (torchtitan 0.2.2, the newest release that runs on torch 2.11;
0.3.0 needs torch.distributed.fsdp APIs newer than 2.11's).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.distributed as dist

from .common import Built, local

FLAVORS = {(4096, 32): "8B", (8192, 64): "70B"}  # (hidden, heads) -> torchtitan's configuration


@functools.lru_cache(maxsize=None)
def available() -> str | None:
    """None when torchtitan's Llama 3 imports here, else why not."""
    try:
        import torchtitan.models.llama3  # noqa: F401
    except Exception as e:  # ImportError, or a torch it does not support
        return f"torchtitan not importable ({type(e).__name__}: {e}); pip install .[bench]"
    return None


def _model_args(sizes: dict) -> Any:
    from torchtitan.models.llama3 import llama3_args

    flavor = FLAVORS.get((sizes["hidden"], sizes["heads"]))
    base = llama3_args[flavor] if flavor else dataclasses.replace(
        llama3_args["debugmodel"], dim=sizes["hidden"], n_heads=sizes["heads"],
        n_kv_heads=sizes.get("kv_heads"))
    return dataclasses.replace(base, n_layers=sizes.get("layers", 1), max_seq_len=max(sizes["seq"], 2048))


def _job_config(world: int, seq: int) -> Any:
    from torchtitan.config import JobConfig

    jc = JobConfig()
    jc.parallelism.tensor_parallel_degree = world
    jc.parallelism.data_parallel_shard_degree = 1
    jc.training.seq_len = seq
    jc.compile.enable = False  # compile_with applies torchtitan's compile once the backend is known
    return jc


def build_titan_llama3(sizes: dict, device: str, dtype, seed: int = 0) -> Built:
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import Transformer, parallelize_llama

    world = dist.get_world_size()
    args, jc = _model_args(sizes), _job_config(world, sizes["seq"])
    if device == "cpu":  # torchtitan builds its meshes on CUDA unless told otherwise (dry runs)
        import torchtitan.distributed.parallel_dims as parallel_dims

        parallel_dims.device_type = "cpu"
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world, pp=1, ep=1, etp=1, world_size=world)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(args)
    model = parallelize_llama(model, dims, jc)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(device))
    model.to(dtype)  # the complex RoPE table stays complex64
    model.tok_embeddings = model.norm = model.output = None

    def compile_with(backend: Any, async_tp: bool = False) -> None:
        from torchtitan.models.llama3.infra.parallelize import apply_compile

        jc.compile.enable, jc.compile.backend = True, backend
        if async_tp:  # torchtitan's own switch: Inductor's micro-pipeline TP on its TP mesh
            from torchtitan.distributed.tensor_parallel import maybe_enable_async_tp

            jc.parallelism.enable_async_tensor_parallel = True
            maybe_enable_async_tp(jc, dims.get_mesh("tp"))
        apply_compile(model, jc.compile)

    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(sizes["batch"], sizes["seq"] // world, sizes["hidden"], generator=g).to(device=device, dtype=dtype)
    return Built(model, x, local, sizes["batch"] * sizes["seq"], compile_with=compile_with)
