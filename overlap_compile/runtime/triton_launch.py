"""Small Triton kernels launched without the JIT's per-call binding.

``kernel[grid](*args, **consts)`` binds and specialises every argument on every call: tens of
microseconds of host time, which a host-launched op that queues a few small kernels per call (the
bounded flag waits, p2p_ring's sum) pays at every site of every step. ``FastLaunch`` keeps the
compiled kernel of the first launch under a key the caller derives from what the JIT specialises
on, and later launches with that key go straight to the compiled kernel's runner.

    launch = FastLaunch(kernel)                       # constexprs: the kernel's trailing parameters
    launch(key, grid, args, consts, num_warps=1)      # first time per key: the JIT; then direct

The runner takes every argument in declaration order (constexprs included, as the JIT passes them)
on the Triton versions used here; constexprs come last, so a launcher that took only the others
would get trailing extras, never misread ones. Under the interpreter, or where the JIT returns no
compiled kernel, every launch goes through the JIT.
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

_lock = threading.Lock()


def int_kind(v: int) -> str:
    """How the JIT types a Python int argument it does not specialise on."""
    return "i32" if -(2 ** 31) <= v < 2 ** 31 else ("i64" if -(2 ** 63) <= v < 2 ** 63 else "u64")


def aligned(t: Any) -> bool:
    """Whether a tensor argument's address is a multiple of 16 (the JIT specialises on it)."""
    return t.data_ptr() % 16 == 0


class FastLaunch:
    """One ``@triton.jit`` kernel's compiled variants, by the caller's key (the module doc)."""

    def __init__(self, kernel: Any) -> None:
        names = list(getattr(kernel, "arg_names", []))
        consts = [p.name for p in getattr(kernel, "params", []) if getattr(p, "is_constexpr", False)]
        if consts and names[len(names) - len(consts):] != consts:
            raise ValueError(f"FastLaunch: {getattr(kernel, '__name__', kernel)}'s constexpr parameters {consts} "
                             f"must come last (parameters {names})")
        self.kernel = kernel
        self.const_names = consts
        self._compiled: dict[tuple, Any] = {}

    def __call__(self, key: tuple, grid: tuple[int, ...], args: Sequence[Any], consts: dict[str, Any],
                 num_warps: int) -> None:
        compiled = self._compiled.get(key)
        if compiled is not None:
            compiled[tuple(grid) + (1,) * (3 - len(grid))](*args, *(consts[n] for n in self.const_names))
            return
        compiled = self.kernel[grid](*args, **consts, num_warps=num_warps)
        if hasattr(compiled, "__getitem__") and set(consts) == set(self.const_names):
            with _lock:
                self._compiled[key] = compiled

    def clear(self) -> None:
        with _lock:
            self._compiled.clear()
