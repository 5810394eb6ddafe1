"""signal_reorder's Triton kernels on the CPU through Triton's interpreter (TRITON_INTERPRET=1).

What this proves without a GPU: the @triton.jit index twins equal tiling.py's formulas; the
persistent GEMM with its signalling epilogue writes exactly reference.py's send-buffer layout
(every exec id's tile at WaveSchedule.send_slot, padding zeroed, rows from RowStripes) and
counts every tile once on its group's counter; the plain GEMM equals a @ b; the bounded wait
consumes a full counter and reports a short one. Small tiles (16x16/32) keep it fast.

The kernels module (and gemm_kernel.py, where the GEMM's @triton.jit functions live) is loaded as
a private copy with TRITON_INTERPRET=1 set only while its @triton.jit decorators run, so the
interpreter setting leaks into no other test.
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
import types

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed")

from overlap_compile.templates.plans import GemmCollectivePlan  # noqa: E402
from overlap_compile.templates.signal_reorder import reference  # noqa: E402
from overlap_compile.tiling import RowStripes, TileGrid, WaveSchedule, cdiv, even_wave_groups, tile_coords  # noqa: E402

KERNELS = pathlib.Path(__file__).resolve().parents[1] / "overlap_compile/templates/signal_reorder/kernels.py"
GEMM_KERNEL = KERNELS.parent / "gemm_kernel.py"
PACKAGE = "overlap_compile.templates.signal_reorder"


class _interpreting:
    """TRITON_INTERPRET=1 only while @triton.jit decorators run (they read it then)."""

    def __enter__(self):
        self.old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = self.old


def _private_copy(path: pathlib.Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def K():
    with _interpreting():
        gemm_kernel = _private_copy(GEMM_KERNEL, f"{PACKAGE}._gemm_kernel_interpreted")
        # kernels.py takes the GEMM from .gemm_kernel: hand it the interpreted copy while it loads,
        # then put back whatever the real name held (the package's own module stays uninterpreted)
        real = f"{PACKAGE}.gemm_kernel"
        saved = sys.modules.get(real)
        sys.modules[real] = gemm_kernel
        try:
            mod = _private_copy(KERNELS, f"{PACKAGE}._kernels_interpreted")
        finally:
            if saved is None:
                del sys.modules[real]
            else:
                sys.modules[real] = saved
    if not getattr(mod, "_HAVE_TRITON", False):
        pytest.skip("Triton could not be imported by the kernels module")
    if type(mod._gemm_kernel).__name__ != "InterpretedFunction":
        pytest.skip("this Triton does not honour TRITON_INTERPRET at decoration time")
    if mod.TensorDescriptor is None:
        pytest.skip("this Triton has no triton.tools.tensor_descriptor")
    _probe_persistent_loop()
    return mod


def _probe(out, n, step):
    for i in tl.range(tl.program_id(0), n, step):
        tl.store(out + i, i)


def _probe_persistent_loop():
    """The kernels loop over ``tl.range(program_id, n, programs)``; Triton 3.6's interpreter
    cannot (its program_id is not a scalar there), 3.9's can."""
    with _interpreting():
        k = triton.jit(types.FunctionType(_probe.__code__, dict(globals()), "_probe"))
    out = torch.zeros(8, dtype=torch.int32)
    try:
        k[(2,)](out, 8, 2)
    except Exception as e:
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot run a persistent tl.range loop: {e!r}")


def _interp_or_skip(fn):
    """Run fn; skip (with the reason) if the interpreter cannot run one of its constructs."""
    try:
        return fn()
    except (NotImplementedError, AttributeError) as e:
        pytest.skip(f"Triton's interpreter cannot run this construct: {e}")


# ---- index twins -----------------------------------------------------------------------------

tl = triton.language


def _twin(out_m, out_n, out_slot, out_group, out_end, out_row, wave_tbl, n_tiles, tiles_m, tiles_n, programs, stripes,
          chunk, GROUP_M: tl.constexpr, BLOCK: tl.constexpr):
    """Calls the kernels' index helpers on many ids and stores the answers."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = t < n_tiles
    t = tl.minimum(t, n_tiles - 1)  # keep masked lanes in range (no division by zero)
    tm, tn = tile_coords_jit(t, tiles_m, tiles_n, GROUP_M)  # noqa: F821 (bound in _twin_kernel)
    tl.store(out_m + t, tm, mask=ok)
    tl.store(out_n + t, tn, mask=ok)
    row = global_row_jit(t % stripes, t, stripes, chunk)  # noqa: F821
    tl.store(out_row + t, row, mask=ok)
    for i in range(BLOCK):
        e = tl.program_id(0) * BLOCK + i
        if e < n_tiles * stripes:
            g, slot, lo, hi = send_slot_jit(e, programs, stripes, wave_tbl)  # noqa: F821
            tl.store(out_slot + e, slot)
            tl.store(out_group + e, g)
            tl.store(out_end + e, hi * 65536 + lo)


def _twin_kernel(K):
    # The interpreter resolves helpers through the function's globals: give it the private copy's.
    scope = dict(globals(), tile_coords_jit=K.tile_coords_jit, global_row_jit=K.global_row_jit,
                 send_slot_jit=K.send_slot_jit)
    fn = types.FunctionType(_twin.__code__, scope, "_twin")
    with _interpreting():
        return triton.jit(fn)


@pytest.mark.parametrize("tiles_m,tiles_n,group_m", [(1, 1, 8), (5, 3, 2), (17, 4, 8), (9, 7, 4), (3, 11, 8)])
def test_tile_coords_twin(K, tiles_m, tiles_n, group_m):
    twin = _twin_kernel(K)
    n = tiles_m * tiles_n
    om, on = torch.full((n,), -1, dtype=torch.int32), torch.full((n,), -1, dtype=torch.int32)
    scratch = torch.zeros(4 * n + 64, dtype=torch.int32)
    tbl = torch.tensor(K.wave_table(WaveSchedule(n, n, (1,))), dtype=torch.int32)
    _interp_or_skip(lambda: twin[(cdiv(n, 16),)](om, on, scratch, scratch[2 * n:], scratch, scratch[3 * n:], tbl, n, tiles_m,
                                                 tiles_n, n, 1, max(n, 1), GROUP_M=group_m, BLOCK=16))
    want = [tile_coords(t, tiles_m, tiles_n, group_m) for t in range(n)]
    assert list(zip(om.tolist(), on.tolist())) == want
    # every tile exactly once
    assert sorted(want) == [(i, j) for i in range(tiles_m) for j in range(tiles_n)]


@pytest.mark.parametrize("tiles,programs,groups,stripes,outer,chunk", [
    (23, 4, 3, 1, 1, 23), (24, 4, 2, 2, 1, 24), (40, 8, 4, 4, 3, 7), (12, 6, 1, 2, 2, 5), (36, 4, 5, 4, 1, 36),
])
def test_send_slot_and_row_twins(K, tiles, programs, groups, stripes, outer, chunk):
    twin = _twin_kernel(K)
    waves = cdiv(tiles * stripes, programs)
    sched = WaveSchedule(tiles * stripes, programs, even_wave_groups(waves, groups), stripes)
    tbl = torch.tensor(K.wave_table(sched), dtype=torch.int32)
    n_exec = sched.num_exec
    slot = torch.full((n_exec,), -1, dtype=torch.int32)
    grp = torch.full((n_exec,), -1, dtype=torch.int32)
    end = torch.full((n_exec,), -1, dtype=torch.int32)
    row = torch.full((tiles,), -1, dtype=torch.int32)
    tm = torch.zeros(tiles, dtype=torch.int32)
    _interp_or_skip(lambda: twin[(cdiv(n_exec, 16),)](tm, tm.clone(), slot, grp, end, row, tbl, tiles, tiles, 1, programs,
                                                      stripes, chunk, GROUP_M=8, BLOCK=16))
    assert slot.tolist() == [sched.send_slot(e) for e in range(n_exec)]
    assert grp.tolist() == [sched.group_of(e) for e in range(n_exec)]
    assert end.tolist() == [hi * 65536 + lo for lo, hi in (sched.exec_ranges()[sched.group_of(e)] for e in range(n_exec))]
    rs = RowStripes(outer, stripes, chunk)
    assert row.tolist() == [rs.global_row(t % stripes, t) for t in range(tiles)]


# ---- the GEMM and its epilogue ------------------------------------------------------------------

def _plan(kind, m, n, k, world, bm, bn, group_m, programs, groups, outer=1, has_bias=False):
    if kind == "gemm_allreduce":
        outer, chunk, stripes, rows = 1, m, 1, m
    else:
        chunk, stripes = m // (outer * world), world
        rows = outer * chunk
    waves = cdiv(TileGrid(rows, n, bm, bn, group_m).num_tiles * stripes, programs)
    return GemmCollectivePlan(template="signal_reorder", kind=kind, m=m, n=n, k=k, world=world, reduce_op="sum",
                              outer=outer, chunk=chunk, has_bias=has_bias,
                              config={"block_m": bm, "block_n": bn, "group_m": group_m, "programs": programs,
                                      "wave_groups": list(even_wave_groups(waves, groups))})


def _expected_send(a, b, bias, plan):
    grid, sched = reference.layout(plan)
    out = torch.empty(sched.num_exec, grid.block_m, grid.block_n, dtype=a.dtype)
    for e in range(sched.num_exec):
        out[sched.send_slot(e)] = reference.compute_tile(a, b, bias, plan, grid, sched, e)
    return out, sched


CASES = [
    # kind, m, n, k, world, bm, bn, group_m, programs, groups, outer, bias, b_transposed
    ("gemm_allreduce", 50, 40, 24, 2, 16, 16, 2, 4, 3, 1, False, False),       # odd M, N, K; edge tiles
    ("gemm_allreduce", 45, 37, 19, 1, 16, 32, 8, 3, 2, 1, True, False),        # N unaligned -> pointer B
    ("gemm_allreduce", 48, 64, 32, 4, 16, 32, 2, 5, 2, 1, True, True),        # transposed weight (K-major TMA)
    ("gemm_reducescatter", 72, 40, 32, 2, 16, 16, 2, 4, 3, 1, True, False),        # outer=1: TMA rows + offset, chunk%BM!=0
    ("gemm_reducescatter", 96, 48, 16, 4, 16, 16, 3, 8, 2, 2, False, True),       # outer=2, chunk=12: gather path
    ("gemm_alltoall", 128, 32, 16, 2, 16, 16, 8, 6, 4, 2, True, False),           # outer=2, chunk=32: TMA (chunk%BM==0)
]


@pytest.mark.parametrize("signal_at", ["group_end", "next_tile"])
@pytest.mark.parametrize("kind,m,n,k,world,bm,bn,group_m,programs,groups,outer,bias,bt", CASES)
def test_signal_epilogue_layout(K, kind, m, n, k, world, bm, bn, group_m, programs, groups, outer, bias, bt,
                                signal_at):
    """Both signalling points count every tile of every group exactly once (a deferred count
    that lost a program's final group, or counted one twice, would leave a counter off)."""
    torch.manual_seed(m * 1000 + n)
    plan = _plan(kind, m, n, k, world, bm, bn, group_m, programs, groups, outer if kind != "gemm_allreduce" else 1,
                 has_bias=bias)
    a = torch.randn(m, k)
    b = torch.randn(n, k).t() if bt else torch.randn(k, n)
    bvec = torch.randn(n) if bias else None
    want, sched = _expected_send(a, b, bvec, plan)
    send = torch.full_like(want, float("nan"))  # poison: every element must be written
    cfg = K.GemmConfig(bm, bn, 16, group_m, 2, 4, True, False)
    send, counters = _interp_or_skip(lambda: K.gemm_signal_into(a, b, bvec, plan, send=send, config=cfg,
                                                                 signal_at=signal_at))
    assert not torch.isnan(send).any()
    torch.testing.assert_close(send, want, rtol=1e-4, atol=1e-4)
    tiles = [hi - lo for lo, hi in sched.exec_ranges()]
    assert counters.tolist() == tiles


def test_signal_at_none_counts_nothing_and_bad_values_are_refused(K):
    plan = _plan("gemm_allreduce", 50, 40, 24, 2, 16, 16, 2, 4, 3, 1)
    a, b = torch.randn(50, 24), torch.randn(24, 40)
    cfg = K.GemmConfig(16, 16, 16, 2, 2, 4, True, False)
    send, counters = _interp_or_skip(lambda: K.gemm_signal_into(a, b, None, plan, config=cfg, signal_at="none"))
    assert counters.tolist() == [0, 0, 0]
    want, _ = _expected_send(a, b, None, plan)
    torch.testing.assert_close(send, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="signal_at must be one of"):
        K.gemm_signal_into(a, b, None, plan, config=cfg, signal_at="later")


@pytest.mark.parametrize("m,n,k,bias", [(50, 40, 24, True), (33, 37, 21, False), (64, 32, 48, False)])
def test_plain_gemm(K, m, n, k, bias):
    torch.manual_seed(7)
    a, b = torch.randn(m, k), torch.randn(k, n)
    bvec = torch.randn(n) if bias else None
    cfg = K.GemmConfig(16, 32, 16, 2, 2, 4, True, False)
    c = _interp_or_skip(lambda: K.gemm(a, b, bvec, config=cfg, programs=3))
    ref = a @ b + (bvec if bias else 0)
    torch.testing.assert_close(c, ref, rtol=1e-4, atol=1e-4)


def test_half_precision_tile(K):
    """fp16 operands through the interpreter (fp32 accumulation, fp16 out). bf16 is checked on
    the GPU only: Triton 3.9's interpreter computes bf16 tl.dot wrongly (numpy has no bf16)."""
    torch.manual_seed(3)
    a, b = torch.randn(40, 32, dtype=torch.float16), torch.randn(32, 48, dtype=torch.float16)
    cfg = K.GemmConfig(16, 16, 16, 2, 2, 4, True, False)
    c = _interp_or_skip(lambda: K.gemm(a, b, config=cfg, programs=2))
    assert c.dtype == torch.float16
    ref = (a.float() @ b.float()).to(torch.float16)
    torch.testing.assert_close(c.float(), ref.float(), rtol=2e-3, atol=2e-3)


# ---- the bounded wait ---------------------------------------------------------------------------

def test_wait_consumes_full_counter(K):
    counters = torch.tensor([0, 7, 0], dtype=torch.int32)
    err = torch.zeros(5, dtype=torch.int32)
    _interp_or_skip(lambda: K.wait_counter(counters, 1, 7, timeout_ms=10, mode="spin", max_polls=5, err=err))
    assert counters.tolist() == [0, 0, 0]
    assert err.tolist() == [0, 0, 0, 0, 0]


def test_wait_reports_short_counter(K):
    counters = torch.tensor([3, 0], dtype=torch.int32)
    err = torch.zeros(5, dtype=torch.int32)
    _interp_or_skip(lambda: K.wait_counter(counters, 0, 5, timeout_ms=10, mode="spin", max_polls=5, err=err))
    assert err.tolist() == [1, 0, 3, 5, 1]  # failed, group, seen, target, ready
    assert counters.tolist() == [0, 0]     # reset so the next call starts clean


def test_available_is_false_on_cpu(K):
    if not torch.cuda.is_available():
        assert not K.available()


def test_wait_mode_choice(K):
    """auto: the spin waiter only where the GEMM leaves it an SM; stream waits need cuda-bindings."""
    assert K.choose_wait_mode("auto", 120, 132, True) == "spin"
    assert K.choose_wait_mode("auto", 132, 132, True) == "spin"  # never the unbounded waiter by default
    assert K.choose_wait_mode("auto", 132, 132, False) == "spin"
    assert K.choose_wait_mode("spin", 132, 132, True) == "spin"
    assert K.choose_wait_mode("stream", 8, 132, True) == "stream"
    with pytest.raises(RuntimeError, match="cuda-bindings"):
        K.choose_wait_mode("stream", 8, 132, False)
    with pytest.raises(ValueError, match="OVERLAP_COMPILE_SIGNAL_WAIT"):
        K.choose_wait_mode("busy", 8, 132, True)
