"""runtime.teardown's bookkeeping on CPU (gloo): what the ops keep per process group goes when the
group is destroyed (torch has no callback for it: destroy_process_group is wrapped on the first
op call), and the steps of a rank's ending are bounded."""
from __future__ import annotations

import time

import pytest
import torch

from overlap_compile.testing.multiprocess import run_distributed


def destroy_releases_the_group() -> dict:
    import torch.distributed as dist

    from overlap_compile import templates
    from overlap_compile.runtime import agreement, symm, teardown
    from overlap_compile.templates import base
    from overlap_compile.templates.plans import AllGatherGemmPlan

    templates.load_all_ops()
    sub = dist.new_group(list(range(dist.get_world_size())))
    group = sub.group_name
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = AllGatherGemmPlan("tile_fused", 8 * world, 16, (12,), world, 1, 8, (False,),
                             {"block_m": 16, "block_n": 16, "group_m": 8, "comm_ctas": 8})
    shard, b = torch.randn(8, 16), torch.randn(16, 12)
    torch.ops.overlap_compile.tile_fused_allgather_gemm(shard, [b], [None], group, plan.to_json())
    before = {"routes": sum(k[2] == group for k in base._routes), "agreed": sum(k[0] == group for k in agreement._checked),
              "wrapped": getattr(dist.destroy_process_group, "__wrapped_by_overlap_compile__", False)}
    symm._cache[(group, "test/buffer", (4,), torch.float32, "cpu", 0)] = object()  # as symm_buffer keeps one
    symm._cache[("another group", "test/buffer", (4,), torch.float32, "cpu", 0)] = object()
    dist.destroy_process_group(sub)
    after = {"routes": sum(k[2] == group for k in base._routes), "agreed": sum(k[0] == group for k in agreement._checked),
             "symm": sorted(k[0] for k in symm._cache if k[1] == "test/buffer"), "released": list(teardown.released)}
    symm._cache.pop(("another group", "test/buffer", (4,), torch.float32, "cpu", 0), None)
    return {"rank": rank, "before": before, "after": after}


def test_destroy_process_group_releases_what_the_ops_keep():
    for r in run_distributed(destroy_releases_the_group, world_size=2, timeout_s=120):
        assert r["before"]["routes"] >= 1 and r["before"]["agreed"] >= 1 and r["before"]["wrapped"], r
        assert r["after"]["routes"] == 0 and r["after"]["agreed"] == 0, r
        assert r["after"]["symm"] == ["another group"], r  # only the destroyed group's resources go
        assert r["after"]["released"][-1].startswith("group "), r


def test_release_of_one_group_keeps_the_others():
    from overlap_compile.runtime import agreement, symm, teardown

    keys = [(g, "test/one", (2,), torch.float32, "cpu", 0) for g in ("g1", "g2")]
    for k in keys:
        symm._cache[k] = object()
    agreement._checked.update({("g1", "abc"), ("g2", "abc")})
    try:
        assert teardown.release("g1")
        assert keys[0] not in symm._cache and keys[1] in symm._cache
        assert ("g1", "abc") not in agreement._checked and ("g2", "abc") in agreement._checked
        assert teardown.released[-1] == "group g1"
    finally:
        symm._cache.pop(keys[1], None)
        agreement._checked.discard(("g2", "abc"))


def test_teardown_steps_are_bounded():
    from overlap_compile.runtime import teardown

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="a stuck step did not return within"):
        teardown._bounded(lambda: time.sleep(3), 0.2, "a stuck step")
    assert time.monotonic() - start < 2
    assert teardown.quiesce(0.5)  # no GPU work here
    assert teardown.finish(timeout_s=1) < 1  # no process group: release only



def destroy_order() -> list:
    """What the wrapped destroy_process_group does, in order, for a subgroup then the default
    group, on a process that (as far as teardown can tell) used a GPU."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    import torch._inductor.cudagraph_trees as trees

    from overlap_compile.runtime import teardown

    order = []
    real = c10d.destroy_process_group

    def recorded(group=None):
        order.append("destroy " + ("default group" if group is None else "subgroup"))
        return real(group)

    c10d.destroy_process_group = dist.destroy_process_group = recorded
    teardown._installed = False
    teardown.install()  # wraps the recorder, as it wraps torch's on the first op call
    trees.reset_cudagraph_trees = lambda: order.append("cuda graphs freed")
    torch.cuda.is_available = torch.cuda.is_initialized = lambda: True  # as after GPU work
    sub = dist.new_group(list(range(dist.get_world_size())))
    dist.destroy_process_group(sub)
    dist.destroy_process_group()
    return order


def test_destroying_the_default_group_frees_inductors_cuda_graphs_first():
    """Graphs that captured NCCL kernels can keep destroy_process_group from returning: they go
    before the default group does (a subgroup's destroy leaves them)."""
    for order in run_distributed(destroy_order, world_size=2, timeout_s=120):
        assert order == ["destroy subgroup", "cuda graphs freed", "destroy default group"], order
