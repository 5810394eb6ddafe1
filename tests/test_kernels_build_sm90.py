"""Every Triton kernel of the project builds for Hopper (sm_90), on CPU (tests/sm90_build.py).

Each case calls a launcher (or a kernel, where the launcher needs a GPU around it) on CPU
tensors with the shapes and configs the GPU runs use, and checks that the variant the launcher
chose first was built: no build error anywhere (a launcher's fallback chain would otherwise
hide it behind a slower variant), and the Hopper features the variant promises are in the
code: TMA copies, wgmma, the inline PTX of the signals and waits. Triton's interpreter accepts
kernels the sm_90 build rejects (the moe_fused expert kernel with block_f != block_h once).
"""
from __future__ import annotations

import os
import types

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed")

from tests.sm90_build import building  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="builds real kernels; the interpreter is on")


def _ttgir(build) -> str:
    return build.compiled.asm["ttgir"]


def _ptx(build) -> str:
    return build.compiled.asm["ptx"]


def _assert_built(builds, kernel: str, count: int = 1) -> list:
    assert not builds.failures, [f"{b.kernel} {b.constexprs}: {b.error}" for b in builds.failures]
    done = builds.of(kernel)
    assert len(done) == count, [b.kernel for b in builds.done]
    return done


@pytest.fixture(autouse=True)
def _no_remembered_fallbacks():
    """The launchers remember which variant built per config; start and end clean."""
    from overlap_compile.templates.signal_reorder import kernels as SR
    from overlap_compile.templates.tile_fused import kernels as TF

    SR._compile_fallbacks.clear()
    TF._fallbacks.clear()
    yield
    SR._compile_fallbacks.clear()
    TF._fallbacks.clear()


def _operands(m, n, k, dtype=torch.bfloat16, kmajor=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, k, generator=g).to(dtype).t() if kmajor else torch.randn(k, n, generator=g).to(dtype)
    return a, b


# ---- signal_reorder: the persistent GEMM, plain and with each signalling point ------------------

@pytest.mark.parametrize("warp_specialize", [False, True])
def test_signal_reorder_plain_gemm(warp_specialize):
    from overlap_compile.templates.signal_reorder import kernels as K

    a, b = _operands(1000, 768, 512)
    cfg = K.GemmConfig(128, 256, 64, 8, 3, 8, True, warp_specialize)
    with building() as builds:
        K.gemm(a, b, config=cfg)
    (done,) = _assert_built(builds, "_gemm_kernel")
    assert done.constexprs["A_TMA"] and done.constexprs["B_TMA"] and done.constexprs["C_TMA"]
    assert done.constexprs["WARP_SPEC"] == warp_specialize and not done.constexprs["SIGNAL"]
    assert "wgmma.mma_async" in _ptx(done) and "async_tma_copy_global_to_local" in _ttgir(done)


@pytest.mark.parametrize("kind,signal_at,dtype,bias,kmajor", [
    ("gemm_allreduce", "group_end", torch.bfloat16, False, False),
    ("gemm_reducescatter", "next_tile", torch.bfloat16, True, False),
    ("gemm_alltoall", "none", torch.float16, False, True),
])
def test_signal_reorder_signalling_gemm(kind, signal_at, dtype, bias, kmajor):
    from benchmarks.gemm import signal_plan

    from overlap_compile.templates.signal_reorder import kernels as K

    m, n, k = 2048, 1024, 512
    a, b = _operands(m, n, k, dtype, kmajor)
    cfg = K.GemmConfig(128, 256, 64, 8, 3, 8, True, False)
    plan = signal_plan(kind, m, n, k, cfg, 32)  # several waves, so several wave groups
    bias_t = torch.randn(n).to(dtype) if bias else None
    with building() as builds:
        K.gemm_signal_into(a, b, bias_t, plan, config=cfg, signal_at=signal_at)
    (done,) = _assert_built(builds, "_gemm_kernel")
    assert done.constexprs["SIGNAL"] and done.constexprs["SIGNAL_AT"] == K.SIGNAL_AT[signal_at]
    assert done.constexprs["B_KMAJOR"] == kmajor and done.constexprs["C_TMA"]
    ptx = _ptx(done)
    assert "wgmma.mma_async" in ptx
    if signal_at == "none":
        assert ".release" not in ptx  # no group is ever counted
    else:  # the group count: bulk-store wait, CTA barrier, release add on the group's counter
        assert "cp.async.bulk.wait_group" in ptx and "bar.sync" in ptx and "gpu.release.add" in ptx


# ---- moe_fused: the persistent SwiGLU expert kernel ----------------------------------------------

@pytest.mark.parametrize("tiles,arrived,sized", [({}, False, False), ({}, True, False),
                                                 ({"block_f": 64, "block_h": 128, "tma": False}, False, False),
                                                 ({"schedule": "static"}, True, False),
                                                 ({}, False, True)])  # sized: routed sizes skip tiles
def test_expert_kernel(tiles, arrived, sized):
    from overlap_compile.templates.moe_fused import expert_kernel as EK

    w, e, c, h, f = 2, 2, 300, 1024, 768
    g = torch.Generator().manual_seed(1)
    x = torch.randn(w, e, c, h, generator=g).bfloat16()
    ws = [torch.randn(e, h, f, generator=g).bfloat16(), torch.randn(e, h, f, generator=g).bfloat16(),
          torch.randn(e, f, h, generator=g).bfloat16()]
    cfg = EK.ExpertTiles(**tiles)
    sizes = torch.tensor([[300, 17], [0, 128]], dtype=torch.int32) if sized else None
    with building() as builds:
        EK.swiglu_experts(x, *ws, 1, cfg, arrived=arrived, sizes=sizes)
    (done,) = _assert_built(builds, "_swiglu_experts_kernel")
    assert done.constexprs["W_TMA"] == cfg.tma and done.constexprs["X_TMA"] == cfg.tma
    assert done.constexprs["A_TMA"] == cfg.tma  # phase 2's act rows
    assert done.constexprs["USE_SIZES"] == sized
    assert done.constexprs["DYNAMIC"] == (cfg.schedule == "dynamic")
    ptx = _ptx(done)
    assert "wgmma.mma_async" in ptx and "red.release.gpu" in ptx  # the act / y counters
    # the ticket: one relaxed atomic add per tile taken (none under the static schedule)
    assert ("atom.global.gpu.relaxed.add" in ptx) == (cfg.schedule == "dynamic")
    # TMA reads of data other agents wrote (act rows; x after an arrival wait) follow a proxy fence
    assert ("fence.proxy.async.global" in ptx) == cfg.tma
    if not arrived:  # arrival waits: relaxed polls, one acquire at system scope
        assert "ld.relaxed.sys" in ptx and "ld.acquire.sys" in ptx and "%globaltimer" in ptx


def test_expert_kernel_keeping_training_intermediates():
    """x and act/gate/up in the saved expert-major layout: TMA for x and act, two more stores."""
    from overlap_compile.templates.moe_fused import expert_kernel as EK

    w, e, c, h, f = 2, 2, 300, 1024, 768
    x = torch.randn(e, w, c, h).bfloat16().permute(1, 0, 2, 3)
    ws = [torch.randn(e, h, f).bfloat16(), torch.randn(e, h, f).bfloat16(), torch.randn(e, f, h).bfloat16()]
    keep = {r: torch.empty(e, w, c, f).bfloat16().permute(1, 0, 2, 3) for r in ("act", "gate", "up")}
    with building() as builds:
        EK.swiglu_experts(x, *ws, 1, EK.ExpertTiles(), arrived=False, keep=keep,
                          sizes=torch.tensor([[300, 17], [0, 128]], dtype=torch.int32))
    (done,) = _assert_built(builds, "_swiglu_experts_kernel")
    c_ = done.constexprs
    assert c_["X_TMA"] and c_["A_TMA"] and c_["SAVE_GATE"] and c_["SAVE_UP"] and c_["WHOLE_ACT"]
    assert "wgmma.mma_async" in _ptx(done)


# ---- tile_fused: GEMM with tile signals, push / reduce / gather, barriers ------------------------

@pytest.mark.parametrize("mode", ["rs", "ag"])
def test_tile_fused_gemm(mode):
    from overlap_compile.templates.signal_reorder import kernels as SR
    from overlap_compile.templates.tile_fused import kernels as K

    world, chunk, n, k = 2, 512, 1024, 512
    a, b = _operands(world * chunk, n, k)
    cfg = SR.GemmConfig(128, 128, 64, 8, 3, 8, True, False)
    tiles = (chunk // 128) * (n // 128)
    plan = types.SimpleNamespace(timeout_ms=1000)
    if mode == "rs":
        c = torch.empty(world * tiles, 128, 128, dtype=a.dtype)
        flags = torch.zeros(world * tiles, dtype=torch.int32)
        args = (K.MODE_RS, a, b, None, c, flags, chunk, n, k, tiles, world, 0, chunk, 8, cfg, True, True,
                c.view(-1, 128), plan)
    else:
        c = torch.empty(world * chunk, n, dtype=a.dtype)
        flags = torch.zeros(world, dtype=torch.int32)
        args = (K.MODE_AG, a, b, None, c, flags, chunk, n, k, tiles, world, 0, chunk, 8, cfg, True, True, c, plan)
    with building() as builds:
        K._launch_gemm(*args)
    (done,) = _assert_built(builds, "_tile_gemm_kernel")
    assert done.constexprs["USE_ASM"] and done.constexprs["A_TMA"] and done.constexprs["B_TMA"]
    ptx = _ptx(done)
    assert "wgmma.mma_async" in ptx
    # the all-gather's TMA loads of a landed chunk follow a proxy fence after the acquire
    assert ("red.release.gpu" in ptx) if mode == "rs" else ("ld.acquire.sys" in ptx and "fence.proxy.async" in ptx)


def test_tile_fused_communication_kernels():
    from overlap_compile.runtime.spin_wait import bound_us
    from overlap_compile.templates.tile_fused import kernels as K

    world, tiles, bm, bn, rows, n = 4, 6, 128, 128, 256, 384
    part = torch.empty(world * tiles, bm, bn, dtype=torch.bfloat16)
    flags = torch.zeros(world * tiles, dtype=torch.int32)
    err = torch.zeros(5, dtype=torch.int32)
    tbl = torch.zeros(world, dtype=torch.int64)
    out = torch.empty(world * rows, n, dtype=torch.bfloat16)
    common = dict(USE_ASM=False, USE_TIMER=False)  # building() turns both on
    BOUND = bound_us(10000)  # the bound as the library passes it (an int32 of microseconds)
    with building() as builds:
        K._push_kernel[(4,)](part, flags, tbl, tbl, flags, err, tiles, world, 1, BOUND, 1 << 20, BM=bm, BN=bn,
                             SUB_M=32, **common)
        K._reduce_kernel[(4,)](part, flags, part, flags, out, err, tbl, part, tbl, flags, rows, n, out.stride(0),
                               tiles, world, 1, BOUND, 1 << 20, 0.25, BM=bm, BN=bn, SUB_M=32, GROUP_M=8, GATHER=True,
                               **common)
        K._gather_kernel[(4,)](part, flags, out, err, rows, n, out.stride(0), rows, tiles, world, 1, BOUND, 1 << 20,
                               BM=bm, BN=bn, SUB_M=32, GROUP_M=8, **common)
        K._barrier_kernel[(1,)](tbl, flags, err, world, 1, BOUND, 1 << 20, NOTIFY=True, WAIT=True, **common)
        K._notify_kernel[(1,)](flags, 3, USE_ASM=False)
        K._wait_kernel[(1,)](flags, 3, 1, err, BOUND, 1 << 20, **common)
    for name in ("_push_kernel", "_reduce_kernel", "_gather_kernel", "_barrier_kernel", "_notify_kernel",
                 "_wait_kernel"):
        (done,) = _assert_built(builds, name)
        ptx = _ptx(done)
        assert "red.release.sys" in ptx or "red.release.gpu" in ptx or "ld.acquire" in ptx, name


# ---- p2p_ring's sum and the bounded spin wait ----------------------------------------------------

def test_p2p_ring_sum_and_spin_wait():
    from overlap_compile.runtime import spin_wait
    from overlap_compile.templates.p2p_ring import sum_kernel as S

    out, own, arrived = (torch.empty(5000, dtype=torch.bfloat16) for _ in range(3))
    acc = torch.empty(5000, dtype=torch.float32)
    flags = torch.zeros(4, dtype=torch.int32)
    with building() as builds:
        S._sum_kernel[(3,)](out, own, arrived, acc, out.numel(), 0.5, HAS_ACC=True, BLOCK=S.BLOCK, num_warps=8)
        spin_wait.wait_value(flags, 2, 1, 1000, 7, until_equal=False, sys_scope=True)
    _assert_built(builds, "_sum_kernel")
    (wait,) = _assert_built(builds, "wait_kernel")
    assert "globaltimer" in _ptx(wait) and "sys.acquire" in _ptx(wait)  # bounded by time; acquire at system scope


# ---- moe_fused's dispatch-buffer scatter -------------------------------------------------------

def test_moe_scatter_kernels():
    """The three launches of scatter.scatter_add_rows for bf16 rows: int32 atomics for the counts,
    plain vectorised stores for rows with one writer, bf16 atomic adds for the others."""
    from overlap_compile.templates.moe_fused import scatter as S

    n, rows, width = 4096, 3000, 2048
    index, counts = torch.zeros(n, dtype=torch.int64), torch.zeros(rows, dtype=torch.int32)
    src, out = torch.empty(n, width, dtype=torch.bfloat16), torch.empty(rows, width, dtype=torch.bfloat16)
    cols = triton.cdiv(width, S.BLOCK_W)
    with building() as builds:
        S._count_kernel[(triton.cdiv(n, S.BLOCK_CHOICES),)](index, counts, n, rows, BLOCK=S.BLOCK_CHOICES)
        S._clear_kernel[(triton.cdiv(rows, S.BLOCK_ROWS), cols)](out, counts, rows, width, BLOCK_ROWS=S.BLOCK_ROWS,
                                                                 BLOCK_W=S.BLOCK_W)
        S._scatter_kernel[(triton.cdiv(n, S.BLOCK_ROWS), cols)](out, src, index, counts, n, rows, width, width,
                                                                BLOCK_ROWS=S.BLOCK_ROWS, BLOCK_W=S.BLOCK_W)
    (count,) = _assert_built(builds, "_count_kernel")
    _assert_built(builds, "_clear_kernel")
    (scatter,) = _assert_built(builds, "_scatter_kernel")
    assert "atom.global" in _ptx(count) or "red.global" in _ptx(count)
    ptx = _ptx(scatter)
    assert "bf16" in ptx and ("atom.global" in ptx or "red.global" in ptx), "no bf16 atomic add"
    assert "st.global.v" in ptx, "the rows with one writer are not stored vectorised"


# ---- moe_fused's one-pass SwiGLU elementwise steps --------------------------------------------

def test_moe_swiglu_elementwise_kernels():
    """silu_mul and its backward for bf16 [B, R, F] operands with strided rows (a column block of
    the saved layout), the backward also with gate and up read through a row index (the packed
    path): one kernel each, vectorised loads of the contiguous columns."""
    from overlap_compile.templates.moe_fused import swiglu_kernels as K

    full = torch.empty(2, 96, 1024, dtype=torch.bfloat16)
    t = full[:, 32:64]
    sb, sr = t.stride(0), t.stride(1)
    index = torch.zeros(64, dtype=torch.int64)
    grid = (triton.cdiv(32, K.BLOCK_R), triton.cdiv(1024, K.BLOCK_F), 2)
    blocks = {"BLOCK_R": K.BLOCK_R, "BLOCK_F": K.BLOCK_F, "num_warps": 4}
    with building() as builds:  # (the launchers take the torch path on CPU tensors: the kernels directly)
        K._silu_mul_kernel[grid](t, t, t, 32, 1024, sb, sr, sb, sr, sb, sr, **blocks)
        for gather in (False, True):
            K._silu_mul_backward_kernel[grid](t, t, t, t, t, index, 32, 1024, 32, *(sb, sr) * 5, GATHER=gather,
                                              **blocks)
    (fwd,) = _assert_built(builds, "_silu_mul_kernel")
    bwd = _assert_built(builds, "_silu_mul_backward_kernel", count=2)  # with and without the row index
    for build in (fwd, *bwd):
        assert "ld.global.v" in _ptx(build), "the columns are not loaded vectorised"


def test_moe_packed_move_rows_kernel():
    """packed.move_rows for bf16 rows: a strided [E, C, F] column block gathered into packed rows."""
    from overlap_compile.templates.moe_fused import packed as P

    full = torch.empty(4, 96, 1024, dtype=torch.bfloat16)
    src, out, index = full[:, 32:64], torch.empty(128, 1024, dtype=torch.bfloat16), torch.zeros(128, dtype=torch.int64)
    grid = (triton.cdiv(128, P.BLOCK_R), triton.cdiv(1024, P.BLOCK_C))
    with building() as builds:
        P._move_rows_kernel[grid](src, out, index, 128, 1024, 32, src.stride(0), src.stride(1), 128, 0, 1024,
                                  BLOCK_R=P.BLOCK_R, BLOCK_C=P.BLOCK_C, num_warps=4)
    (build,) = _assert_built(builds, "_move_rows_kernel")
    assert "ld.global.v" in _ptx(build) and "st.global.v" in _ptx(build), "rows are not moved vectorised"


def test_moe_packed_silu_mul_unpack_kernel():
    """packed.silu_mul_unpack for bf16: packed gate/up rows in, the product packed and gate, up and
    act into a strided [E, C, F] column block of the saved layout, vectorised both ways."""
    from overlap_compile.templates.moe_fused import packed as P

    full = torch.empty(4, 96, 1024, dtype=torch.bfloat16)
    slots, packed, index = full[:, 32:64], torch.empty(128, 1024, dtype=torch.bfloat16), torch.zeros(128, dtype=torch.int64)
    grid = (triton.cdiv(128, P.BLOCK_R), triton.cdiv(1024, P.BLOCK_C))
    with building() as builds:
        P._silu_mul_unpack_kernel[grid](packed, packed, packed, index, slots, slots, slots, 128, 1024, 1024, 32,
                                        slots.stride(0), slots.stride(1), BLOCK_R=P.BLOCK_R, BLOCK_C=P.BLOCK_C,
                                        num_warps=4)
    (build,) = _assert_built(builds, "_silu_mul_unpack_kernel")
    assert "ld.global.v" in _ptx(build) and "st.global.v" in _ptx(build), "rows are not moved vectorised"


def test_moe_packed_piece_maps_kernel():
    """packed.piece_maps' one-launch index maps (int32 sizes in, int64 maps and int32 group ends
    out) build for sm_90."""
    from overlap_compile.templates.moe_fused import packed as P

    sizes, pack = torch.zeros(4, dtype=torch.int32), torch.empty(4 * 2560, dtype=torch.int64)
    with building() as builds:
        P._piece_maps_kernel[(4,)](sizes, pack, pack, sizes, 4, 2560, BLOCK_G=4, BLOCK_C=1024, num_warps=4)
    _assert_built(builds, "_piece_maps_kernel")
