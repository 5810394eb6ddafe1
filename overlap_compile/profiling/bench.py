"""Timing for the profile command: ``Bench`` (CUDA events and graphs on GPU, the CPU clock
elsewhere), ``Progress`` (the bar on rank 0) and ``agree`` (one number for every rank)."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable


class Progress:
    """tqdm when importable (rank 0 only), else a line per step."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.enabled, self.total, self.n, self.t0 = enabled, total, 0, time.time()
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def step(self, what: str) -> None:
        self.n += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_description(what[:40])
            self.bar.update(1)
        elif self.n == self.total or self.n % max(1, self.total // 40) == 0:
            print(f"[{self.n}/{self.total} {time.time() - self.t0:6.1f}s] {what}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Bench:
    """Timing on the group's device: CUDA events and graphs on GPU, perf_counter on CPU."""

    def __init__(self, device: str, iters: int = 5, warmup: int = 2) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.cuda = device.startswith("cuda")
        self.iters, self.warmup = iters, warmup

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def time(self, fn: Callable[[], Any], calls: int = 1) -> float:
        """Median ms per call of ``calls`` back-to-back calls of fn."""
        for _ in range(self.warmup):
            fn()
        self.sync()
        out = []
        for _ in range(self.iters):
            if self.cuda:
                s, e = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(calls):
                    fn()
                e.record()
                e.synchronize()
                out.append(s.elapsed_time(e) / calls)
            else:
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                out.append((time.perf_counter() - t0) * 1e3 / calls)
        return statistics.median(out)

    def capture(self, fn: Callable[[], Any], calls: int) -> Any:
        """A CUDA graph of ``calls`` calls of fn (run once eagerly first), or None when capture fails.
        Collective callers must agree on success across ranks before replaying it."""
        if not self.cuda:
            return None
        torch = self.torch
        try:
            fn()
            self.sync()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(calls):
                    fn()
            return g
        except Exception:
            _clear_last_cuda_error()
            self.sync()
            return None


def _clear_last_cuda_error() -> None:
    """A failed capture leaves its error as the runtime's "last error"; the next eager launch would
    report it as its own (seen on 4x H200: a peer copy's capture failing, then the eager copy
    "failing" with the same cudaErrorInvalidValue). Reading it clears it."""
    try:
        from cuda.bindings import runtime as cudart

        cudart.cudaGetLastError()
    except ImportError:
        pass


def agree(values: list[float], group: Any, device: str, op: str = "max") -> list[float]:
    """``values`` reduced over ``group`` (MAX, or MIN with ``op="min"``): the same on every rank."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN, group=group)
    return [float(v) for v in t.cpu()]
