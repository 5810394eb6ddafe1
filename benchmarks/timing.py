"""Timing shared by the benchmarks (ops, predictor, e2e, moe, gemm, host_profile,
diagnostics/occupancy_sweep): one place for medians, CUDA events, CUDA-graph capture and host time.

``time_ms(fn)``: warm-up, then per call the ranks meet at a barrier and the call is timed with
CUDA events (the host clock on CPU dry runs); the median per rank, and the slowest rank's median
is the result (all ranks return the same number). Without a process group (one-GPU benchmarks):
this process's median. ``time_interleaved(fns)``: several callables timed side by side, one
sample each per round, the order reversed every other round; ``time_pair(fa, fb)``: two of them,
with the median of the rounds' ratios (host-launched calls whose host speed drifts). ``graphed(fn)``: fn captured in a CUDA graph
(after warm-up on a side stream), returned as its replay; ``calls`` captures that many calls in one
graph (gemm.py times kernels that way, without launch gaps). ``host_ms_per_call(fn, calls)``: the
host's own time per call of back-to-back calls (host_profile.py). ``Budget``: rank 0's clock decides
for every rank whether the next configuration still fits a time budget. ``op_graph_counts()`` /
``op_graph_calls_since(before)``: how the template ops' host-launched calls went between two
points (runtime.op_graphs; moe.py's and e2e.py's rows); ``op_graph_progress()``: whether they are
still capturing. ``on_every_rank(flag)``: the ranks' verdict, the same on all of them.
``kernel_and_host_timers(fn, rep_ms)`` and ``one_gpu()``: the one-GPU diagnostics' CUDA-graph and
host-launched timers, and their device, profile and date.
"""
from __future__ import annotations

import collections
import math
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist


# runtime.op_graphs' outcomes of the template ops' host-launched calls: "replayed" is the one
# where a call costs a single graph launch
OP_GRAPH_CALLS = ("eager", "captured", "replayed", "failed", "declined")


def op_graph_counts() -> collections.Counter:
    """runtime.op_graphs' outcome counts so far (a snapshot for op_graph_calls_since)."""
    from overlap_compile.runtime import op_graphs

    return collections.Counter(op_graphs.stats)


def op_graph_calls_since(before: collections.Counter) -> dict:
    """outcome -> host-launched template op calls since ``before`` (op_graph_counts())."""
    now = op_graph_counts()
    return {k: now[k] - before[k] for k in OP_GRAPH_CALLS}


def op_graph_progress() -> tuple[int, int]:
    """(captures, eager calls of sites not declined) of runtime.op_graphs so far: unchanged over a
    round of calls when every template op call replayed a graph or belongs to a site that captures
    no more (time_interleaved's ``settle``)."""
    c = op_graph_counts()
    return c["captured"], c["eager"] - c["declined"]


def time_ms(fn, iters: int = 20, warmup: int = 5, calls: int = 1) -> float:
    """Median ms per call of ``fn`` (module docstring); ``calls`` > 1: each sample times that many
    back-to-back calls after the barrier and divides, so the ranks' skew leaving the barrier (a
    large share of a call of a fraction of a millisecond) is spread over them."""
    if calls < 1:
        raise ValueError(f"time_ms: calls must be >= 1, got {calls}")
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    group = dist.is_initialized()  # one GPU, no process group: no barrier, this process's median
    times = [_sample_ms(fn, calls, cuda, group) for _ in range(iters)]
    if not group:
        return statistics.median(times)
    med = torch.tensor([statistics.median(times)], device="cuda" if cuda else "cpu")
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return med.item()


def _sample_ms(fn, calls: int, cuda: bool, group: bool) -> float:
    """One sample: the ranks meet at a barrier, then ``calls`` back-to-back calls are timed (CUDA
    events, else the host clock) and divided; the GPU is idle when it returns."""
    if group:
        dist.barrier()
    if cuda:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(calls):
            fn()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) * 1e3 / calls


def round_order(names: list, r: int) -> list:
    """``names`` in round ``r``: as given in even rounds, reversed in odd ones. Over two rounds
    every one sits at the same mean place, so neither a drift of the machine nor a place's own
    bias (a GPU that heats over a round) favours one; with one round the order is as given."""
    return list(names) if r % 2 == 0 else list(reversed(names))


def time_interleaved(fns: dict, iters: int = 20, warmup: int = 3, calls: int = 1,
                     settle: Callable[[], Any] | None = None, max_warmup: int = 30) -> dict[str, list[float]]:
    """Each of ``fns`` (name -> callable) timed once per round, in the round's order (as given in
    even rounds, reversed in odd ones), ``iters`` rounds after ``warmup`` calls of each: per name
    its samples in round order, each one as ``time_ms`` times a sample (barrier, ``calls``
    back-to-back calls) and the slowest rank's. Configurations timed minutes apart see a machine
    that has drifted (the host's speed; a GPU's clocks under its power cap, which follow its
    temperature); samples side by side see the same drift, so ratios taken per round do not.
    ``settle``: a state to wait for before timing (e.g. op_graphs' captures so far): warm-up rounds
    go on until one leaves it unchanged on every rank, at most ``max_warmup``. Calls side by side
    move each other's buffers, so a callable whose replays need its buffers back (runtime.op_graphs)
    takes more rounds to settle than it would alone."""
    if calls < 1 or iters < 1 or not fns:
        raise ValueError(f"time_interleaved: iters and calls must be >= 1 and fns not empty, got {iters}, {calls}, "
                         f"{len(fns)} callables")
    cuda = torch.cuda.is_available()
    group = dist.is_initialized()
    names = list(fns)
    r = 0
    while r < warmup or (settle is not None and r < max_warmup):
        before = settle() if settle is not None else None
        for name in round_order(names, r):
            fns[name]()
        r += 1
        if settle is not None and r >= warmup and on_every_rank(before == settle()):
            break
    if cuda:
        torch.cuda.synchronize()
    got: dict[str, list[float]] = {name: [] for name in names}
    for i in range(iters):
        for name in round_order(names, i):
            got[name].append(_sample_ms(fns[name], calls, cuda, group))
    if group:
        t = torch.tensor([got[name] for name in names], dtype=torch.float64, device="cuda" if cuda else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        got = dict(zip(names, t.tolist()))
    return got


def on_every_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank of the default group (this process's own without one),
    so that all ranks go on the same way."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([0 if flag else 1], device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() == 0


def time_pair(fa, fb, iters: int = 20, warmup: int = 3, calls: int = 1) -> dict:
    """``fa`` and ``fb`` timed in alternating rounds (time_interleaved: A B, then B A); the
    round's ratio is B's time over A's. Returns the medians ``a_ms``, ``b_ms`` and ``ratio`` (B / A:
    A's speedup over B) and ``rounds``. Where the host launches the calls (a call of a fraction of
    a millisecond), the host's speed drifts between configurations timed minutes apart; rounds
    side by side see the same drift, so their ratio does not."""
    got = time_interleaved({"a": fa, "b": fb}, iters, warmup, calls)
    a, b = got["a"], got["b"]
    return {"a_ms": statistics.median(a), "b_ms": statistics.median(b),
            "ratio": statistics.median(y / x for x, y in zip(a, b)), "rounds": iters}


def graphed(fn, calls: int = 1, warmup: int = 3):
    """``calls`` calls of fn captured in one CUDA graph, after ``warmup`` calls on a side stream;
    returns the graph's replay."""
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA graphs need a GPU")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g.replay


def kernel_and_host_timers(fn, rep_ms: int, calls: int = 10) -> dict[str, Callable[[], float]]:
    """Two ways of timing ``fn`` on one GPU, each a callable returning ms per call (do_bench's
    median): ``cuda_graph``, replayed from a graph of ``calls`` calls (kernel time), and ``eager``,
    host-launched. A diagnostic calls them in alternating rounds."""
    from triton.testing import do_bench

    graph = graphed(fn, calls=calls, warmup=2)
    return {"cuda_graph": lambda: do_bench(graph, warmup=10, rep=rep_ms, return_mode="median") / calls,
            "eager": lambda: do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")}


def one_gpu() -> tuple[torch.device, str, Any, str]:
    """(device, its name, its built-in profile (h200 where none matches), today's ISO date): what a
    one-GPU diagnostic runs on and names its rows by."""
    import datetime

    from overlap_compile.predictor import load_profile
    from overlap_compile.predictor.profile import builtin_for_device

    if not torch.cuda.is_available():
        raise RuntimeError("this diagnostic needs a CUDA GPU")
    dev = torch.device("cuda", 0)
    name = torch.cuda.get_device_name(dev)
    return dev, name, load_profile(builtin_for_device(name) or "h200"), datetime.date.today().isoformat()


def host_ms_per_call(fn, calls: int) -> float:
    """Wall time per call of ``calls`` back-to-back calls, on the host only: the loop is timed
    before the GPU catches up (5 warm-up calls, then a synchronisation and, under a process group,
    a barrier). For calls whose GPU work is small, this is what the host spends per call."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / calls  # the loop's own time: host-side only
    torch.cuda.synchronize()
    return host


class Budget:
    """Rank 0's clock decides for all: skip a configuration when what is left is less than the
    longest configuration so far (the next one is likely as long). Counted from the launch
    (``start``: wall clock of the launching process), so process start-up is paid from it too."""

    def __init__(self, seconds: float, device: str, start: float) -> None:
        self.seconds, self.device = seconds, device
        self.start, self.longest = start, 0.0

    def left(self) -> float:
        return self.seconds - (time.time() - self.start) if self.seconds else math.inf

    def should_skip(self) -> str | None:
        flag = torch.tensor([self.left(), self.longest], dtype=torch.float64, device=self.device)
        dist.broadcast(flag, 0)
        left, longest = flag.tolist()
        if left < longest or left <= 0:
            return f"time budget: {max(left, 0):.0f} s left of {self.seconds:.0f} s, the longest configuration took {longest:.0f} s"
        return None

    def took(self, seconds: float) -> None:
        self.longest = max(self.longest, seconds)
