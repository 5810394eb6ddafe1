"""tile_fused's GEMM + reduce-scatter / all-reduce symmetric buffers on CPU (kernels._rs_buffers,
the part of kernels._run_rs that picks them): one set per (group, N, tile, W, dtype) whatever M,
grown to the largest M, its flags zeroed when made. runtime.symm.symm_buffer is stood in for by
plain CPU tensors kept in symm._cache under symm.cache_key, as the real one keeps them."""
from __future__ import annotations

import types

import pytest
import torch

from overlap_compile.runtime import symm
from overlap_compile.templates.plans import GemmCollectivePlan, allreduce_stripes

K = pytest.importorskip("overlap_compile.templates.tile_fused.kernels")
from overlap_compile.templates.tile_fused import launch  # noqa: E402
from overlap_compile.templates.tile_fused.reference import stripe_grid  # noqa: E402

DEV = torch.device("cpu")
GARBAGE = 7  # what a buffer made without ``zero`` holds here: flags must not start from it


@pytest.fixture
def fake_symm(monkeypatch):
    made = []

    def symm_buffer(group_name, key, shape, dtype, device, zero=False):
        ck = symm.cache_key(group_name, key, shape, dtype, device)
        if ck not in symm._cache:
            local = torch.zeros(shape, dtype=dtype) if zero else torch.full(shape, GARBAGE, dtype=dtype)
            symm._cache[ck] = types.SimpleNamespace(local=local, ptrs=torch.tensor([len(made)]))
            made.append(key)
        return symm._cache[ck]

    monkeypatch.setattr(symm, "symm_buffer", symm_buffer)
    monkeypatch.setattr(symm, "_cache", {})
    monkeypatch.setattr(symm, "_grown", {})
    monkeypatch.setattr(launch, "_local", {})  # _zeros_cached's flags
    return made


def _plan(kind, m, n=1000, k=520, w=2, bm=128, bn=128):
    outer, chunk = (1, m) if kind == "gemm_allreduce" else (1, m // w)
    cfg = {"block_m": bm, "block_n": bn, "group_m": 8, "comm_ctas": 8}
    return GemmCollectivePlan("tile_fused", kind, m, n, k, w, "sum", outer, chunk, False, cfg)


def _buffers(plan, dtype=torch.bfloat16, group="g"):
    """What _run_rs takes for ``plan`` (the all-reduce's reduce-scatter half, as it does)."""
    gather = plan.kind == "gemm_allreduce"
    if gather:
        plan = allreduce_stripes(plan)
    return K._rs_buffers(group, plan, stripe_grid(plan), dtype, DEV, gather)


def _keys(what):
    return sorted(ck[1] for ck in symm._cache if f"tile_fused/{what}/" in ck[1])


def _tiles(plan):
    if plan.kind == "gemm_allreduce":
        plan = allreduce_stripes(plan)
    return plan.world * stripe_grid(plan).num_tiles


@pytest.mark.parametrize("kind", ["gemm_reducescatter", "gemm_allreduce"])
def test_calls_of_any_m_share_one_set_grown_to_the_largest(fake_symm, kind):
    """M 2000, then 2400 (and another K), then 1400 at one N and tile: one buffer each until the
    larger M grows it; the smaller M after that takes the start of the larger (the smaller is
    kept: a captured graph may address it). The data and the flags alike."""
    names = ["recv", "arrived"] + (["gather", "done"] if kind == "gemm_allreduce" else [])
    first = _buffers(_plan(kind, 2000))
    assert [len(_keys(x)) for x in names] == [1] * len(names)
    _buffers(_plan(kind, 2000, k=64))  # K changes nothing
    assert [len(_keys(x)) for x in names] == [1] * len(names)

    big_plan = _plan(kind, 2400, k=1024)
    big = _buffers(big_plan)
    assert [len(_keys(x)) for x in names] == [2] * len(names)
    assert big[0].data_ptr() != first[0].data_ptr() and big[1].data_ptr() != first[1].data_ptr()

    small_plan = _plan(kind, 1400)
    small = _buffers(small_plan)
    assert [len(_keys(x)) for x in names] == [2] * len(names)
    tiles_small, tiles_big = _tiles(small_plan), _tiles(big_plan)
    assert tiles_small < tiles_big
    recv, recv_tbl, arrived, arrived_tbl, ready, gathered = small
    assert tuple(recv.shape) == (tiles_small, 128, 128) and tuple(arrived.shape) == tuple(ready.shape) == (tiles_small,)
    # the start of the largest, with its address tables
    assert recv.data_ptr() == big[0].data_ptr() and recv_tbl is big[1]
    assert arrived.data_ptr() == big[2].data_ptr() and arrived_tbl is big[3]
    assert ready.data_ptr() == big[4].data_ptr()
    if gathered is not None:
        gat, gat_tbl, done, done_tbl = gathered
        assert tuple(gat.shape) == (tiles_small, 128, 128) and tuple(done.shape) == (tiles_small,)
        assert gat.data_ptr() == big[5][0].data_ptr() and gat_tbl is big[5][1]
        assert done.data_ptr() == big[5][2].data_ptr() and done_tbl is big[5][3]
        assert gat.data_ptr() != recv.data_ptr()


def test_the_local_ready_flags_grow_with_the_peer_flags(fake_symm):
    """The GEMM's local flags: as many as ``arrived`` holds, one tensor per size (the smaller kept
    for captured graphs), a smaller M after a larger taking the larger's start."""
    small = _buffers(_plan("gemm_reducescatter", 1400))[4]
    big = _buffers(_plan("gemm_reducescatter", 2400))[4]
    again = _buffers(_plan("gemm_reducescatter", 1400))[4]
    assert big.data_ptr() != small.data_ptr() and again.data_ptr() == big.data_ptr()
    assert len(launch._local) == 2
    assert sorted(t.numel() for t in launch._local.values()) == sorted(
        ck[2][0] for ck in symm._cache if "tile_fused/arrived/" in ck[1])


def test_flags_start_zeroed_and_data_need_not(fake_symm):
    """The flags of every buffer made, the grown ones included, are zeroed when made (peers
    signal into them); the tiles are not (every slot is written before it is read)."""
    for m in (1400, 2400):
        recv, _, arrived, _, ready, (gat, _, done, _) = _buffers(_plan("gemm_allreduce", m))
        assert not arrived.any() and not done.any() and not ready.any()
    for ck, buf in symm._cache.items():
        flags = any(f"tile_fused/{x}/" in ck[1] for x in ("arrived", "done"))
        assert bool(buf.local.eq(0).all()) == flags, ck


def test_sets_differ_by_what_does_not_vary_with_m(fake_symm):
    """N, the tile, W, dtype and group each get their own set; the reduce-scatter and the
    all-reduce of one N share the receive buffer."""
    _buffers(_plan("gemm_reducescatter", 2000))
    _buffers(_plan("gemm_allreduce", 2000))
    assert len(_keys("recv")) == 1
    _buffers(_plan("gemm_reducescatter", 2000, n=512))
    _buffers(_plan("gemm_reducescatter", 2000, bm=64, bn=64))
    _buffers(_plan("gemm_reducescatter", 2000, w=4))
    _buffers(_plan("gemm_reducescatter", 2000), dtype=torch.float16)
    _buffers(_plan("gemm_reducescatter", 2000), group="h")
    assert len(set(_keys("recv"))) == 4  # n512, 64x64, w4 in the key
    assert len(_keys("recv")) == 6  # dtype and group in symm's
