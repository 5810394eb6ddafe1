"""The GEMM/collective patterns as a model writes them (functional collectives), for benchmarks,
calibration and tests: one definition, so every tool measures and decides the same graph.

    fn = gemm_then_collective("gemm_reducescatter", group_name, world)   # fn(a, b)
    site = traced_site("gemm_allreduce", m, n, k, world)                  # the Match find() returns
"""
from __future__ import annotations

import torch

c10d = torch.ops._c10d_functional
KINDS = ("gemm_allreduce", "gemm_reducescatter", "gemm_alltoall", "allgather_gemm")


def collective(kind: str, t: torch.Tensor, group: str, world: int) -> torch.Tensor:
    """The collective of a site, on ``t`` (sum; equal all-to-all splits; for allgather_gemm the shard)."""
    if kind == "gemm_allreduce":
        return c10d.wait_tensor(c10d.all_reduce(t, "sum", group))
    if kind == "gemm_reducescatter":
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(t, "sum", world, group))
    if kind == "gemm_alltoall":
        rows = [t.shape[0] // world] * world
        return c10d.wait_tensor(c10d.all_to_all_single(t, rows, rows, group))
    if kind == "allgather_gemm":  # t is the shard; the collective comes before the GEMM
        return c10d.wait_tensor(c10d.all_gather_into_tensor(t, world, group))
    raise ValueError(f"unknown pattern kind {kind!r}; known: {list(KINDS)}")


def gemm_then_collective(kind: str, group: str, world: int):
    """``fn(a, b)``: the sequential pattern of ``kind`` (for allgather_gemm, ``a`` is the shard)."""
    if kind == "allgather_gemm":
        def ag(x, b):
            return c10d.wait_tensor(c10d.all_gather_into_tensor(x, world, group)) @ b
        return ag

    def fn(a, b):
        return collective(kind, a @ b, group, world)

    return fn


def traced_site(kind: str, m: int, n: int, k: int, world: int, dtype: torch.dtype = torch.bfloat16):
    """The Match the finder returns for this pattern (fake tensors: no memory), on the current
    default process group (a fake one is enough)."""
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx

    from ..passes.find import find

    rows = m // world if kind == "allgather_gemm" else m
    fn = gemm_then_collective(kind, dist.group.WORLD.group_name, world)
    gm = make_fx(fn, tracing_mode="fake")(torch.empty(rows, k, dtype=dtype), torch.empty(k, n, dtype=dtype))
    (match,) = find(gm.graph)
    return match


def site_op(kind: str, template: str, a: torch.Tensor, b: torch.Tensor, group: str, world: int,
            config: dict | None = None):
    """``fn()``: the template's op called directly on the plan of this site (``site_plan``), with
    no graph around it and no decision: also at W=1, where the pass keeps every site as written,
    so an op's own path runs on one GPU. Returns the op's output (allgather_gemm:
    ``[gathered, gathered @ b]``)."""
    from .. import templates

    templates.load_all_ops()
    rows = a.shape[0] * world if kind == "allgather_gemm" else a.shape[0]
    plan = site_plan(kind, template, rows, b.shape[1], a.shape[1], world, config)
    ops = torch.ops.overlap_compile
    if kind == "allgather_gemm":
        op = getattr(ops, f"{template}_allgather_gemm").default
        return lambda: op(a, [b], [None], group, plan)
    op = getattr(ops, f"{template}_gemm_collective").default
    return lambda: op(a, b, None, group, plan)


def site_plan(kind: str, template: str, m: int, n: int, k: int, world: int, config: dict | None = None) -> str:
    """The JSON plan of an M x N x K site of ``kind`` (row stripes along dim 0, no bias) under
    ``template``'s ``config`` (default: one that fits any site, ``_default_config``)."""
    from ..templates.plans import AllGatherGemmPlan, GemmCollectivePlan

    cfg = config if config is not None else _default_config(template)
    if kind == "allgather_gemm":
        return AllGatherGemmPlan(template, m, k, (n,), world, 1, m // world, (False,), cfg).to_json()
    return GemmCollectivePlan(template, kind, m, n, k, world, None if kind == "gemm_alltoall" else "sum", 1,
                              m if kind == "gemm_allreduce" else m // world, False, cfg).to_json()


def _default_config(template: str) -> dict:
    """A configuration of ``template`` that fits any site (what site_op runs unless told)."""
    from .. import templates

    if template == "priority_stream":
        return {"chunks": 2, "block_m": None, "block_n": None, "stages": None}
    if template == "p2p_ring":
        return {"slices": 1, "bidirectional": False, "transport": "p2p"}
    raise ValueError(f"site_op: give the {template} configuration explicitly (config=...); defaults are known for "
                     f"{['priority_stream', 'p2p_ring']} (available templates: {templates.names()})")
