"""tile_fused GEMM + reduce-scatter / all-reduce with W virtual ranks on ONE GPU: the cross-rank
protocol (barrier, tile flags, pushes into peers' receive slots, the reduce, the all-reduce's
gather) under real concurrency, call after call, on a machine with one GPU.

Each virtual rank is a host thread with its own compute and comm streams; the symmetric buffers
are W ordinary buffers on the GPU with one address table, so a rank's pushes and signals reach its
"peers" exactly as they reach other GPUs' memory through the table on a real group. What this
shows: the flag protocol pairs the right tiles and slots, no call reads a slot before it is
complete or after the next call overwrote it, and the result is right on every call with the
inputs changing from call to call. What it cannot show: ordering across an NVLink fabric (every
"peer" here shares one L2), which the 2-GPU race loops of tests/gpu/test_tile_fused.py check.
"""
from __future__ import annotations

import contextlib
import sys
import threading

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PACKAGE = "overlap_compile.templates.tile_fused"
VARIANTS = 3  # input sets cycled call after call


class _VirtualGroup:
    """What the kernels ask of a process group: this thread's rank and the size."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.local = threading.local()

    def rank(self) -> int:
        return self.local.rank

    def size(self) -> int:
        return self.world


def _patch_everywhere(stack: contextlib.ExitStack, name: str, value) -> None:
    """Replace ``name`` in every module of the tile_fused package (and runtime.comm) that holds it
    as a global, whichever file the kernels live in."""
    mods = [m for n, m in list(sys.modules.items())
            if m is not None and (n.startswith(PACKAGE + ".") or n == "overlap_compile.runtime.comm")]
    for mod in mods:
        if name in vars(mod):
            old = vars(mod)[name]
            setattr(mod, name, value)
            stack.callback(setattr, mod, name, old)


@contextlib.contextmanager
def virtual_ranks(world: int, device: torch.device):
    from overlap_compile.templates.tile_fused import kernels as K  # noqa: F401  (loads the package)

    group = _VirtualGroup(world)
    buffers: dict[tuple, tuple[list[torch.Tensor], torch.Tensor]] = {}
    lock = threading.Lock()
    _, greatest = torch.cuda.Stream.priority_range()
    comm = [torch.cuda.Stream(device, priority=greatest) for _ in range(world)]
    flags: dict[tuple, torch.Tensor] = {}

    def symm(group_name, key, shape, dtype, dev, zero=False):
        k = (key, tuple(shape), dtype)
        with lock:
            if k not in buffers:
                ts = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(world)]
                buffers[k] = (ts, torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=dev))
        ts, table = buffers[k]
        return ts[group.rank()], table

    def zeros_cached(key, n, dev):
        k = (key, group.rank())
        with lock:
            if k not in flags:
                flags[k] = torch.zeros(n, dtype=torch.int32, device=dev)
        return flags[k]

    with contextlib.ExitStack() as stack:
        torch.cuda.synchronize(device)
        _patch_everywhere(stack, "_symm", symm)
        _patch_everywhere(stack, "_comm_stream", lambda dev: comm[group.rank()])
        _patch_everywhere(stack, "_zeros_cached", zeros_cached)
        _patch_everywhere(stack, "resolve_group", lambda name: group)
        _patch_everywhere(stack, "_first_call", lambda key, pg, dev, body: None)  # warmed up below
        yield group


def _warm_up(group: _VirtualGroup, calls: list) -> None:
    """Compile and load every kernel (Triton warm-up, nothing launched) before any rank spins."""
    mods = [m for n, m in sys.modules.items() if n.startswith(PACKAGE + ".") and "_warming" in vars(m)]
    for r, call in enumerate(calls):
        group.local.rank = r
        for m in mods:
            m._warming = True
        try:
            call()
        finally:
            for m in mods:
                m._warming = False


def race(kind: str, m: int, n: int, k: int, world: int, calls: int, dtype: torch.dtype) -> dict:
    from overlap_compile.templates.plans import GemmCollectivePlan
    from overlap_compile.templates.tile_fused import kernels as K

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    cfg = {"block_m": 128, "block_n": 128, "group_m": 8, "comm_ctas": 8}
    outer, chunk = (1, m) if kind == "gemm_allreduce" else (1, m // world)
    plan = GemmCollectivePlan("tile_fused", kind, m, n, k, world, "sum", outer, chunk, False, cfg, timeout_ms=5000)
    g = torch.Generator(device=dev).manual_seed(7)
    inputs = [[(torch.randn(m, k, device=dev, dtype=dtype, generator=g) / 4,
                torch.randn(k, n, device=dev, dtype=dtype, generator=g) / 4) for _ in range(world)]
              for _ in range(VARIANTS)]
    full = [sum(a.double() @ b.double() for a, b in v) for v in inputs]  # the sum over ranks
    rows = m // world
    expected = [[f if kind == "gemm_allreduce" else f[r * rows:(r + 1) * rows] for r in range(world)] for f in full]
    errors: list[list[torch.Tensor]] = [[] for _ in range(world)]
    failures: list[BaseException] = []
    with virtual_ranks(world, dev) as group:
        _warm_up(group, [lambda r=r: K._run_rs(*inputs[0][r], None, "virtual", plan) for r in range(world)])
        compute = [torch.cuda.Stream(dev) for _ in range(world)]

        def worker(r: int) -> None:
            try:
                group.local.rank = r
                torch.cuda.set_device(dev)
                with torch.cuda.stream(compute[r]):
                    for i in range(calls):
                        a, b = inputs[i % VARIANTS][r]
                        out = K.run(a, b, None, "virtual", plan)
                        exp = expected[i % VARIANTS][r]
                        errors[r].append((out.double() - exp).norm() / exp.norm())
            except BaseException as e:  # handed to the main thread
                failures.append(e)

        threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        torch.cuda.synchronize(dev)
        if failures:
            raise failures[0]
        K.check_errors(dev)
    tol = {torch.bfloat16: 2e-2, torch.float16: 5e-3}[dtype]
    errs = torch.stack([torch.stack(e) for e in errors])
    return {"calls": calls, "wrong": int(((errs > tol) | errs.isnan()).sum()), "max_rel": float(errs.max())}


@pytest.mark.parametrize("kind,m,n,k", [("gemm_reducescatter", 2 * 1000, 1000, 520),
                                        ("gemm_reducescatter", 4096, 4096, 1024),
                                        ("gemm_allreduce", 2 * 500, 1000, 520),
                                        ("gemm_allreduce", 4096, 4096, 1024)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_call_right_with_two_virtual_ranks(kind, m, n, k, dtype):
    from overlap_compile.templates.tile_fused import kernels as K

    if not K.available():
        pytest.skip("tile_fused kernels unavailable (Triton / sm_80+)")
    r = race(kind, m, n, k, 2, 300, dtype)
    print(kind, (m, n, k), dtype, r)
    assert r["wrong"] == 0, r
