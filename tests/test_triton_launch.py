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
