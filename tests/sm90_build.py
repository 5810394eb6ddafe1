"""Build the project's Triton kernels for Hopper (sm_90) on a machine without a GPU.

Triton's compiler runs on the CPU: given a kernel's signature and constexprs it goes through
TTIR, TTGIR, LLVM IR and PTX to a cubin with the ptxas bundled in its wheel. ``building()``
swaps the launch step of ``JITFunction.run`` for that build, so calling a launcher on CPU
tensors builds exactly the variant the launcher would start on an H100/H200 (constexprs,
argument types, 16-byte alignment specialisation), with the GPU-only switches the launchers
derive from the device (inline PTX, %globaltimer, hardware barriers) turned on, and launches
nothing. What a GPU run would reject at build time fails here too: a name bound to two shapes
in the branches of a runtime ``if`` (which the interpreter accepts), a shared-memory or TMA
box limit, malformed inline PTX. Timing and the memory model still need the GPU.

Each build is recorded (kernel name, constexprs, compiled kernel); an exception is recorded
and re-raised, so a launcher's fallback chain (which catches build errors and retries a
simpler variant) cannot hide a failed first choice: tests assert ``failures`` is empty.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

# switches the launchers set from the device: on for the Hopper build
GPU_SWITCHES = {"USE_ASM": True, "USE_TIMER": True, "HW_BARRIER": True}


@dataclasses.dataclass
class Build:
    kernel: str
    constexprs: dict
    compiled: Any = None
    error: str | None = None


@dataclasses.dataclass
class Builds:
    done: list[Build] = dataclasses.field(default_factory=list)

    @property
    def failures(self) -> list[Build]:
        return [b for b in self.done if b.error is not None]

    def of(self, kernel: str) -> list[Build]:
        return [b for b in self.done if b.kernel == kernel and b.error is None]


@contextlib.contextmanager
def building(arch: int = 90) -> Iterator[Builds]:
    """Within the block, every ``kernel[grid](...)`` builds for ``sm_<arch>`` instead of launching."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as build, make_backend
    from triton.runtime import jit

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    builds = Builds()
    original = jit.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        for name, value in GPU_SWITCHES.items():
            if name in kwargs:
                kwargs[name] = value
        constexprs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
        record = Build(self.fn.__name__, constexprs)
        builds.done.append(record)
        try:
            binder = jit.create_function_from_signature(self.signature, self.params, backend)
            bound, specialization, options = binder(*args, **kwargs)
            options, signature, consts, attrs = self._pack_args(backend, kwargs, bound, specialization, options)
            record.compiled = build(ASTSource(self, signature, consts, attrs), target=target,
                                    options=options.__dict__)
        except Exception as e:
            record.error = f"{type(e).__name__}: {str(e)[:2000]}"
            raise
        return record  # not the compiled kernel: a launcher that loads what it launched loads nothing

    jit.JITFunction.run = run
    try:
        yield builds
    finally:
        jit.JITFunction.run = original
