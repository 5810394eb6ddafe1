"""The profile's collective curves and contention: a call of each collective (and of the peer
transports) moving a given number of bytes, timed back to back in a CUDA graph where every rank
can capture it; and a GEMM beside a looping all-reduce, with and without SMs left to NCCL."""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

from ..predictor.profile import KiB, MiB
from .bench import Bench, agree
from .build import DEFAULT_NCCL_SMS


def collective_fns(coll: str, nbytes: int, group: Any, device: str, dtype: Any) -> Callable[[], Any] | None:
    """A call of ``coll`` moving ``nbytes`` (curve convention) on ``group``; None if not possible."""
    import torch
    import torch.distributed as dist

    w, rank = group.size(), group.rank()
    item = torch.empty((), dtype=dtype).element_size()
    numel = max(w, nbytes // item // w * w)
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    if coll == "all_reduce":
        buf = torch.randn(numel, dtype=dtype, device=device)
        return lambda: dist.all_reduce(buf, group=group)
    if coll == "reduce_scatter":
        src, dst = torch.randn(numel, dtype=dtype, device=device), torch.empty(numel // w, dtype=dtype, device=device)
        return lambda: rs(dst, src, group=group)
    if coll == "all_gather":
        src, dst = torch.randn(numel // w, dtype=dtype, device=device), torch.empty(numel, dtype=dtype, device=device)
        return lambda: ag(dst, src, group=group)
    if coll == "all_to_all":
        src, dst = torch.randn(numel, dtype=dtype, device=device), torch.empty(numel, dtype=dtype, device=device)
        return lambda: dist.all_to_all_single(dst, src, group=group)
    if w < 2:
        return None  # point-to-point transports need a peer
    peers = dist.get_process_group_ranks(group)
    nxt, prv = peers[(rank + 1) % w], peers[(rank - 1) % w]
    n1 = max(1, nbytes // item)
    if coll == "p2p":
        src, dst = torch.randn(n1, dtype=dtype, device=device), torch.empty(n1, dtype=dtype, device=device)

        def p2p() -> None:
            ops = [dist.P2POp(dist.isend, src, nxt, group), dist.P2POp(dist.irecv, dst, prv, group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return p2p
    if coll == "copy_engine":
        if not device.startswith("cuda"):
            return None
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(n1, dtype=dtype, device=device)
        hdl = symm_mem.rendezvous(buf, group.group_name)
        peer = hdl.get_buffer((rank + 1) % w, (n1,), dtype)
        src = torch.randn(n1, dtype=dtype, device=device)
        # Try it once here: a copy the driver refuses (seen: "invalid argument" on 4x H200) must
        # become "not measured" on every rank, not a crash of the whole profile run.
        peer.copy_(src)
        torch.cuda.synchronize(device)

        def copy(keep=(buf, hdl)) -> None:
            # ``keep`` holds the local buffer and its handle alive with the closure: once they are
            # collected the peers' mappings go too, and the copy fails with "invalid argument"
            # (what the 4x H200 profile runs hit after the probe above had succeeded).
            peer.copy_(src)

        return copy
    raise ValueError(coll)


last_graph_ok = [True]


def time_collective(bench: Bench, coll: str, size: int, group: Any, device: str, dtype: Any, use_graph: bool,
                     notes: list[str], w: int) -> float:
    """ms per call (MAX over the group's ranks), or -1 when the call cannot be built on some rank.
    Every rank of ``group`` takes the same branches (each decision is agreed first): no hang."""
    fn, err = None, None
    try:
        fn = collective_fns(coll, size, group, device, dtype)
    except Exception as e:
        err = e
    if agree([0.0 if fn is None else 1.0], group, device, op="min")[0] == 0:
        if coll == "copy_engine" and not any(n.startswith(f"copy_engine not measured at w={w}") for n in notes):
            notes.append(f"copy_engine not measured at w={w} ({type(err).__name__ if err else 'unsupported'}: {err})")
        return -1.0
    calls = 4 if size >= 64 * MiB else 16
    # Peer copies are timed eagerly: a copy-engine transfer has no kernel launch to amortise, and
    # keeping them out of capture means a refused capture can never turn later collectives eager.
    g = bench.capture(fn, calls) if use_graph and coll != "copy_engine" else None
    # always agreed (a rank that gave up on graphs earlier votes 0), so all ranks branch alike
    ok = agree([0.0 if g is None else 1.0], group, device, op="min")[0] > 0
    # only a refused capture of a collective makes later collectives eager (copies never try)
    last_graph_ok[0] = ok or not bench.cuda or coll == "copy_engine"
    t = bench.time(g.replay, 1) / calls if ok else bench.time(fn, calls)
    return agree([t], group, device)[0]


def measure_contention(bench: Bench, group: Any, device: str, dtype: Any, notes: list[str]) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    size = 2048 if device.startswith("cuda") else 64
    a = torch.randn(2 * size, size, device=device, dtype=dtype)
    b = torch.randn(size, 2 * size, device=device, dtype=dtype)
    buf = torch.zeros((128 * MiB if device.startswith("cuda") else 64 * KiB) // 2, dtype=dtype, device=device)
    reps = 8
    gemm_alone = bench.time(lambda: torch.mm(a, b), reps)
    ar_alone = bench.time(lambda: dist.all_reduce(buf, group=group), 1)

    def together(carveout: int | None) -> tuple[float, float]:
        side = torch.cuda.Stream(priority=-1) if bench.cuda else None
        setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
        if carveout is not None and setter is not None and bench.cuda:
            setter(carveout)
        try:
            g_times, c_times = [], []
            for _ in range(bench.iters):
                n_ar = max(1, int(math.ceil(gemm_alone * reps / max(ar_alone, 1e-6))))
                t0 = time.perf_counter()
                if bench.cuda:
                    bench.sync()
                    cs, ce = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    gs, ge = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    with torch.cuda.stream(side):
                        cs.record(side)
                        works = [dist.all_reduce(buf, group=group, async_op=True) for _ in range(n_ar)]
                        for wk in works:
                            wk.wait()
                        ce.record(side)
                    gs.record()
                    for _ in range(reps):
                        torch.mm(a, b)
                    ge.record()
                    bench.sync()
                    g_times.append(gs.elapsed_time(ge) / reps)
                    c_times.append(cs.elapsed_time(ce) / n_ar)
                else:
                    works = [dist.all_reduce(buf, group=group, async_op=True) for _ in range(n_ar)]
                    for _ in range(reps):
                        torch.mm(a, b)
                    for wk in works:
                        wk.wait()
                    dt = (time.perf_counter() - t0) * 1e3
                    g_times.append(dt / reps)
                    c_times.append(dt / n_ar)
            return statistics.median(g_times), statistics.median(c_times)
        finally:
            if carveout is not None and setter is not None and bench.cuda:
                setter(0)

    g_full, c_full = together(None)
    gemm_slow = max(1.0, g_full / gemm_alone)
    comm_slow = max(1.0, c_full / ar_alone)
    reserved = None
    if bench.cuda and getattr(torch._C, "_set_sm_carveout_experimental", None) is not None:
        try:
            carve = DEFAULT_NCCL_SMS["all_reduce"]
            torch._C._set_sm_carveout_experimental(carve)
            alone_c = bench.time(lambda: torch.mm(a, b), reps)
            torch._C._set_sm_carveout_experimental(0)
            g_res, _ = together(carve)
            reserved = max(1.0, g_res / alone_c)
        except Exception as e:
            notes.append(f"gemm_slowdown_reserved not measured ({type(e).__name__}: {e})")
    if reserved is None:
        reserved = 1.0 + (gemm_slow - 1.0) * 0.3
        notes.append("gemm_slowdown_reserved estimated as 30% of gemm_slowdown's excess")
    vals = agree([gemm_slow, reserved, comm_slow], group, device)
    return {"gemm_slowdown": vals[0], "gemm_slowdown_reserved": min(vals[1], vals[0]), "comm_slowdown": vals[2]}
