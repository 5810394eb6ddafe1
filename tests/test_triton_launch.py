"""runtime/triton_launch.FastLaunch: the JIT once per key, then the compiled kernel directly, with
every argument in declaration order (a fake kernel stands in for Triton's on CPU)."""
from __future__ import annotations

import types

import pytest

from overlap_compile.runtime.triton_launch import FastLaunch, int_kind


class _Compiled:
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("direct", grid, args))


class _Kernel:
    """What FastLaunch reads of a ``@triton.jit`` function: its parameters and ``kernel[grid](...)``."""

    def __init__(self, names, consts, returns_compiled=True):
        self.arg_names = names
        self.params = [types.SimpleNamespace(name=n, is_constexpr=n in consts) for n in names]
        self.log = []
        self.returns_compiled = returns_compiled

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.log.append(("jit", grid, args, kw))
            return _Compiled(self.log) if self.returns_compiled else None
        return run


def test_the_jit_runs_once_per_key_then_the_compiled_kernel_with_constexprs_last():
    k = _Kernel(["x", "n", "A", "B"], {"A", "B"})
    launch = FastLaunch(k)
    launch(("k1",), (4,), ("t", 7), dict(A=1, B=True), num_warps=2)
    launch(("k1",), (5, 2), ("u", 8), dict(A=1, B=True), num_warps=2)
    launch(("k2",), (1,), ("v", 9), dict(A=3, B=False), num_warps=2)
    assert k.log == [("jit", (4,), ("t", 7), dict(A=1, B=True, num_warps=2)),
                     ("direct", (5, 2, 1), ("u", 8, 1, True)),
                     ("jit", (1,), ("v", 9), dict(A=3, B=False, num_warps=2))]


def test_without_a_compiled_kernel_every_launch_goes_through_the_jit():
    k = _Kernel(["x", "A"], {"A"}, returns_compiled=False)  # the interpreter returns nothing
    launch = FastLaunch(k)
    for _ in range(3):
        launch(("k",), (1,), ("t",), dict(A=1), num_warps=1)
    assert [e[0] for e in k.log] == ["jit"] * 3


def test_constexprs_before_other_parameters_are_refused():
    with pytest.raises(ValueError, match="constexpr parameters \\['A'\\] must come last"):
        FastLaunch(_Kernel(["A", "x"], {"A"}))


def test_int_kinds_follow_the_jit():
    assert [int_kind(v) for v in (0, -1, 2 ** 31 - 1, 2 ** 31, -(2 ** 31) - 1, 2 ** 63)] == [
        "i32", "i32", "i32", "i64", "i64", "u64"]


def test_the_wait_kernel_and_the_sum_kernel_fit_the_fast_path():
    from overlap_compile.runtime import spin_wait
    from overlap_compile.templates.p2p_ring import sum_kernel

    if not spin_wait.HAVE_TRITON:
        pytest.skip("no Triton")
    from triton.runtime.jit import JITFunction  # the compiled form, whatever TRITON_INTERPRET says

    assert FastLaunch(JITFunction(spin_wait.wait_kernel.fn)).const_names == ["USE_TIMER", "UNTIL_EQUAL", "SYS"]
    assert FastLaunch(JITFunction(sum_kernel._sum_kernel.fn)).const_names == ["HAS_ACC", "BLOCK"]


def test_every_bounded_wait_is_one_compiled_variant_for_every_bound():
    """A wait's bound reaches the kernels as an int32 of microseconds for every allowed bound, and
    no kernel specialises on it: a call with another bound (a test's short one, a user's
    signal_timeout_ms) never compiles and loads a second variant mid-run while peers wait."""
    pytest.importorskip("triton")
    from overlap_compile.config import MAX_SIGNAL_TIMEOUT_MS
    from overlap_compile.runtime import spin_wait
    from overlap_compile.templates.moe_fused import expert_kernel
    from overlap_compile.templates.tile_fused import jit_kernels

    bounds = [1, 50, 1000, 2147, 2148, 10000, MAX_SIGNAL_TIMEOUT_MS]
    assert {int_kind(spin_wait.bound_us(ms)) for ms in bounds} == {"i32"}
    assert spin_wait.bound_us(10000) == 10_000_000
    for bad in (0, -5, MAX_SIGNAL_TIMEOUT_MS + 1):
        with pytest.raises(ValueError, match="signal_timeout_ms"):
            spin_wait.bound_us(bad)
    kernels = [spin_wait.wait_kernel, expert_kernel._swiglu_experts_kernel] + [
        k for k in vars(jit_kernels).values() if "timeout_us" in getattr(k, "arg_names", ())]
    assert len(kernels) >= 8
    for k in kernels:
        assert "timeout_us" in k.arg_names and "timeout_ns" not in k.arg_names, k.fn.__name__
        assert {"timeout_us", "max_polls"} <= set(k.do_not_specialize), k.fn.__name__
