"""``search="exhaustive"``: measure the baseline and every predicted candidate of a site, once.

It runs inside the decision (while the first call compiles its graph), on every rank of the
site's group at the same point, so the collectives pair up: each rank times the baseline and each
candidate's op on random operands of the site's shapes (``WARMUP``, then ``ROUNDS`` x
``PER_ROUND`` calls interleaved over the items, the median per item; CUDA-graph replays where
Inductor captures the graph); the group all-reduces the times with MAX; candidates are re-ranked
by measured time and rank 0's best is checked on every rank (``DecisionMismatchError``, never a
hang later). ``predicted_ms`` becomes the measured time and ``note`` says "measured X ms
(predicted Y ms)"; results are cached with the decision. Groups on neither NCCL nor gloo are not
measured (the note says so). Tests replace the timing with ``set_measure(fn)``.
"""
from __future__ import annotations

import hashlib
import statistics
import time
from typing import Any, Callable

WARMUP = 2
ROUNDS = 3  # interleaved rounds over the items (_time_all) ...
PER_ROUND = 3  # ... of this many timed calls each
MAX_MEASURED = 32  # per template: the best predicted ones if a template offers more
FAILED_MS = 1e9  # a candidate that failed to run on some rank (kept comparable across ranks)
# what a queued timing runs ahead of each call: ~5 ms at Hopper clocks (1.6-2.0 GHz), past the host
# time of any op call (0.03-0.9 ms, benchmarks/host_profile.py)
HOST_AHEAD_CYCLES = 10_000_000

_measure_hook: Callable[..., float] | None = None


def _failed() -> None:
    """The call of an item that could not be built: fails its warm-up, so it counts as failed."""
    raise RuntimeError("this item could not be built")


def set_measure(fn: Callable[..., float] | None) -> None:
    """Replace the timing function (tests); None restores the real one."""
    global _measure_hook
    _measure_hook = fn


def measure_source() -> Callable[..., float] | None:
    """What times the sites now (the hook, None for the real timing): part of any cache key of
    measured times, so times from one source are never served under another."""
    return _measure_hook


def _group(match: Any) -> Any:
    from ..runtime.comm import resolve_group

    return resolve_group(match.group_name)


def _device_of(pg: Any) -> str | None:
    import torch
    import torch.distributed as dist

    backend = str(dist.get_backend(pg)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    if backend == "gloo":
        return "cpu"
    return None


def _agree_max(values: list[float], pg: Any, device: str) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
    return [float(v) for v in t.cpu()]


def _broadcast_choice(index: int, pg: Any, device: str, what: str) -> None:
    import torch
    import torch.distributed as dist

    from ..runtime.agreement import DecisionMismatchError

    t = torch.tensor([index], dtype=torch.int64, device=device)
    src = dist.get_global_rank(pg, 0) if hasattr(dist, "get_global_rank") else 0
    dist.broadcast(t, src=src, group=pg)
    if int(t.item()) != index:
        raise DecisionMismatchError(
            f"overlap_compile: search='exhaustive' chose candidate {index} of {what} on rank "
            f"{dist.get_rank(pg)} but rank 0 chose {int(t.item())}; use the same options and profile everywhere")


def _time(fn: Callable[[], Any], device: str, queued: bool = False) -> float:
    """Median ms of ``fn`` launched from the host (CUDA events on GPU), each call from an idle GPU,
    so the host's launch time counts; ``queued``: each call is issued while the GPU is still busy
    with a sleep kernel queued before the start event, so only the GPU's time counts, as for a
    call issued while the GPU works through earlier kernels of its graph."""
    return _time_all([fn], device, queued=queued)[0]


def _time_graphed(fn: Callable[[], Any], pg: Any, device: str) -> float:
    """Median ms of ``fn`` captured once into a CUDA graph and replayed: what a graph that
    Inductor captures (mode="reduce-overhead") runs (see ``_time_all``)."""
    return _time_all([fn], device, pg, graphed=True)[0]


def _time_all(fns: list[Callable[[], Any]], device: str, pg: Any = None, graphed: bool = False,
              queued: bool = False) -> list[float]:
    """Median ms of each of ``fns`` (``FAILED_MS`` where it failed), their samples taken in
    ``ROUNDS`` interleaved rounds of ``PER_ROUND`` calls, so that a drift of the GPU's clocks or of
    the peer's timing over the measurement falls on every item alike rather than on whichever
    ran last (two measurements of one 5 ms site taken one after the other differed by 8%).

    ``graphed``: each fn is captured once into a CUDA graph and replayed. Every rank captures
    (capturing runs nothing, so a rank whose capture fails leaves no collective unpaired), then
    the group agrees that all captured before any replays; if one rank could not, the item
    counts as failed on every rank. Else launched from the host (``_time``), each round's timed
    calls of an item after calls that are not timed: a template op replays its CUDA graph per
    (inputs, output) addresses (runtime/op_graphs), and the output an op allocates can land
    elsewhere after the other items ran (with many free blocks in the caching allocator, as once a
    model has run), so its first calls at a new address, run as written and captured, stay out of
    the samples."""
    from ..runtime.op_graphs import CAPTURE_ON_SIGHT  # an op's calls at new addresses before it replays

    runs = [_prepare(fn, device, pg, graphed) for fn in fns]
    untimed = 0 if graphed else CAPTURE_ON_SIGHT
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(ROUNDS):
        for run, got in zip(runs, samples):
            if run is not None:
                for _ in range(untimed):
                    run()
                got.extend(_sample(run, device, queued) for _ in range(PER_ROUND))
    return [statistics.median(got) if got else FAILED_MS for got in samples]


def _prepare(fn: Callable[[], Any], device: str, pg: Any, graphed: bool) -> Callable[[], Any] | None:
    """``fn`` warmed up, as the call to time (a graph's replay where ``graphed``), or None where it
    failed (graphed: on some rank of the group)."""
    import torch

    from ..runtime import cublas_workspaces, failed_capture

    if not graphed:
        try:
            for _ in range(WARMUP):
                fn()
        except Exception:
            return None
        return fn
    graph = None
    try:
        for _ in range(WARMUP):
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with cublas_workspaces.released(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
            fn()
    except Exception:
        if graph is not None:  # the capture began: the generator out of capture mode again
            failed_capture.recover(torch.device(device), torch.cuda.Stream(device))
        graph = None
    if max(_agree_max([0.0 if graph is not None else 1.0], pg, device)) > 0:
        return None
    graph.replay()
    torch.cuda.synchronize()
    return graph.replay


def _sample(run: Callable[[], Any], device: str, queued: bool) -> float:
    """ms of one call of ``run``: CUDA events on GPU (after a sleep kernel where ``queued``), the
    host's clock on CPU."""
    import torch

    if not device.startswith("cuda"):
        t0 = time.perf_counter()
        run()
        return (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if queued:
        torch.cuda._sleep(HOST_AHEAD_CYCLES)
    s.record()
    run()
    e.record()
    e.synchronize()
    return s.elapsed_time(e)


class _Operands:
    """Random operands shared by the items of one site: the k-th tensor an item asks for is the
    k-th any item asked for when the shape matches (every item of a site asks for the same ones),
    so the items time the same data and the GPU holds one set of operands, not one per item."""

    def __init__(self, device: str, dtype: Any):
        import torch

        self.device, self.dtype, self.made, self.next = device, dtype, [], 0
        self.gen = torch.Generator(device=device).manual_seed(0)

    def item(self) -> "_Operands":
        self.next = 0
        return self

    def __call__(self, *shape: int) -> Any:
        import torch

        k, self.next = self.next, self.next + 1
        if k < len(self.made) and tuple(self.made[k].shape) == shape:
            return self.made[k]
        # drawn in place in the site's dtype: the first call's compile times sites beside the live
        # activations, and an fp32 draw cast and scaled would hold three copies at the peak
        t = torch.empty(*shape, device=self.device, dtype=self.dtype).normal_(0.0, 0.1, generator=self.gen)
        self.made[k:k + 1] = [t]
        return t


def _site_call(template: str, match: Any, config: dict | None, options: Any, device: str,
               rnd: Callable[..., Any] | None = None, profile: Any = None) -> Callable[[], Any]:
    """The site as written ("baseline") or ``template``'s op with ``config``, on random operands of
    the site's shapes (``rnd(*shape)``, by default a fresh ``_Operands``), as a call to time. Build
    and call it with fake tensors off and grad off. ``profile``: what the latency model expects of
    data the operands stand in for (an MoE section's fill)."""
    import torch

    from .. import templates
    from ..runtime import comm

    c10d = torch.ops._c10d_functional
    g, W = match.group_name, match.world_size
    rnd = rnd or _Operands(device, match.dtype)

    if match.kind == "moe":
        from ..templates.moe_fused.model import routed_fill

        return _moe_call(template, match, config, options, rnd, routed_fill(profile))
    if match.kind == "allgather_gemm":
        shard = rnd(match.m // W, match.k)
        bs = [rnd(match.k, c.n) for c in match.consumers]
        biases = [rnd(c.n) if c.bias_node is not None else None for c in match.consumers]
        if template == "baseline":
            def fn() -> Any:
                full = comm.wait(comm.start_all_gather(shard, W, g))
                return [full @ b if bias is None else torch.addmm(bias, full, b) for b, bias in zip(bs, biases)]
            return fn
        plan = templates.get_spec(template).plan(match, config, options.signal_timeout_ms).to_json()
        op = getattr(torch.ops.overlap_compile, f"{template}_allgather_gemm").default
        return lambda: op(shard, bs, biases, g, plan)
    a, b = rnd(match.m, match.k), rnd(match.k, match.n)
    bias = rnd(match.n) if match.bias_node is not None else None
    if template == "baseline":
        def fn() -> Any:
            y = a @ b if bias is None else torch.addmm(bias, a, b)
            if match.kind == "gemm_allreduce":
                return comm.wait(c10d.all_reduce.default(y, match.reduce_op, g))
            if match.kind == "gemm_reducescatter":
                return comm.wait(comm.start_reduce_scatter(y, match.reduce_op, W, g))
            return comm.wait(comm.start_all_to_all(y, W, g))
        return fn
    plan = templates.get_spec(template).plan(match, config, options.signal_timeout_ms).to_json()
    op = getattr(torch.ops.overlap_compile, f"{template}_gemm_collective").default
    return lambda: op(a, b, bias, g, plan)


def _moe_call(template: str, match: Any, config: dict | None, options: Any, rnd: Callable,
              fill: float) -> Callable[[], Any]:
    """An expert-parallel section as written (all-to-all, SwiGLU experts, all-to-all) or as the
    moe_fused op of ``config`` (which also returns what a training section saves). Its slots are
    zero past ``fill``, the routed share the latency model expects (model.routed_fill: 80% at
    capacity factor 1.25), as the layer's are past its routed rows: dense random slots would time
    a path that skips the padding (``"experts": "packed"``) on work the layer never gives it."""
    import torch

    from .. import templates
    from ..templates.moe_fused import reference
    from ..templates.plans import MoePlan

    if getattr(match, "direction", "forward") == "backward":  # a training step's backward section
        from ..templates.moe_fused import backward_op

        plan = None if template == "baseline" else templates.get_spec(template).plan(match, config,
                                                                                   options.signal_timeout_ms)
        return backward_op.measured_call(match, plan, rnd, fill)
    w, e, c, h, f, g = match.world_size, match.e_local, match.capacity, match.hidden, match.ffn, match.group_name
    buf, w1, w3, w2 = rnd(w * e * c, h), rnd(e, h, f), rnd(e, h, f), rnd(e, f, h)
    reference.zero_past_fill(buf, 0, c, fill)
    if template == "baseline":  # one piece: all-to-all, the experts, all-to-all, as written
        as_written = MoePlan("moe_fused", w, e, c, h, f, {"pieces": 1})
        return lambda: reference.run(buf, w1, w3, w2, g, as_written)
    plan = templates.get_spec(template).plan(match, config, options.signal_timeout_ms).to_json()
    op = torch.ops.overlap_compile.moe_fused.default
    return lambda: op(buf, w1, w3, w2, g, plan)


def _measure_all(items: list[tuple[str, dict | None]], match: Any, options: Any,
                 gpu_only: bool = False, queued: bool = False, profile: Any = None) -> list[float] | str:
    """Measured ms per (template, config), agreed across the group; or the reason it was not
    measured. In the CUDA-graph launch mode (mode="reduce-overhead") GPU groups time CUDA-graph
    replays, else host launches (``queued``: issued while the GPU is busy, see ``_time``).
    ``gpu_only``: groups on CPU (gloo) are not measured either."""
    if _measure_hook is not None:
        return [float(_measure_hook(t, match, c, options)) for t, c in items]
    try:
        pg = _group(match)
    except Exception as e:
        return f"not measured: {e}"
    device = _device_of(pg)
    if device is None:
        import torch.distributed as dist

        return f"not measured: process-group backend {dist.get_backend(pg)!r} (measuring needs nccl or gloo)"
    if gpu_only and not device.startswith("cuda"):
        return "not measured: the group is on CPU (sites are settled by measuring on GPUs only)"
    from ..runtime import agreement
    from .launch import launch_mode

    graphed = device.startswith("cuda") and launch_mode() == "cuda_graph"  # read on the compiling thread
    tag = hashlib.sha1(repr((match.signature(), items, graphed, queued)).encode()).hexdigest()[:20]
    if not agreement.all_present(pg, tag):
        return (f"not measured: not every rank of the group compiled this site within "
                f"{agreement.PRESENCE_TIMEOUT_S:.0f} s "
                "(a rank that loaded the graph from a compile cache never comes); the predictions stand")

    def measure() -> list[float]:
        import torch
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        from ..runtime import op_graphs, symm

        # the symmetric buffers of the templates timed here go when the timing ends: most will
        # not be chosen, and the chosen one makes its own at its first call. The op graphs
        # captured here address them, so they go first (a later timing of the site, its operands
        # back at the same addresses, would otherwise replay one into freed memory), and the
        # timing's calls are kept apart from the model's: a site its training steps declined is
        # timed as it runs once its buffers settle (an inference graph compiled after training)
        cuda = device if device.startswith("cuda") else None
        with symm.dropped_after(cuda), op_graphs.apart(cuda):
            with unset_fake_temporarily(), torch.no_grad():
                calls, operands = [], _Operands(device, match.dtype)
                for t, c in items:
                    try:
                        calls.append(_site_call(t, match, c, options, device, operands.item(), profile))
                    except Exception:  # e.g. a plan this site cannot take: the item fails, the others run
                        calls.append(_failed)
                local = _time_all(calls, device, pg, graphed, queued)
                del calls
            return _agree_max(local, pg, device)

    return on_fresh_thread(measure)


def on_fresh_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a new thread (same CUDA device), its result or its exception. The measurements
    run while Inductor compiles, and on that thread several outstanding functional collectives
    over gloo were seen to hang both ranks (torch 2.13 CPU: four all_reduces started, then
    waited, inside a post-grad pass; the same calls on a fresh thread complete)."""
    import threading

    import torch

    from ..runtime import cublas_workspaces

    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            box["value"] = fn()
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e
        finally:  # this thread's cuBLAS handle kept a workspace per stream it ran GEMMs on
            cublas_workspaces.release()

    worker = threading.Thread(target=run, name="overlap_compile-exhaustive")
    worker.start()
    worker.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def measure_items(items: list[tuple[str, dict | None]], match: Any, options: Any,
                  gpu_only: bool = False, queued: bool = False, profile: Any = None) -> list[float] | str:
    """Measured ms of each (template, config) of ``match`` ("baseline": the site as written),
    agreed across the group (``FAILED_MS`` where it failed on some rank), or why not measured.
    ``profile``: the decision's (what its model expects of the data, _site_call)."""
    return _measure_all(items, match, options, gpu_only, queued, profile)


def measure_baseline(match: Any, options: Any, profile: Any = None) -> float | str:
    res = _measure_all([("baseline", None)], match, options, profile=profile)
    return res if isinstance(res, str) else res[0]


def measure_candidates(spec: Any, match: Any, ranked: list, options: Any, profile: Any = None) -> list:
    """Re-rank ``ranked`` (predicted, best first) by measured time; see the module docstring."""
    todo, rest = ranked[:MAX_MEASURED], ranked[MAX_MEASURED:]
    res = _measure_all([(c.template, c.config) for c in todo], match, options, profile=profile)
    if isinstance(res, str):
        for c in todo:
            c.note = f"{res}; predicted. {c.note}".strip()
        return todo + rest
    out = []
    for c, ms in zip(todo, res):
        pred = c.predicted_ms
        if ms >= FAILED_MS:
            c.note = f"failed to run when measured on some rank (predicted {pred:.4f} ms). {c.note}".strip()
            c.predicted_ms = None
        else:
            c.note = f"measured {ms:.4f} ms (predicted {pred:.4f} ms). {c.note}".strip()
            c.predicted_ms = ms
        out.append(c)
    order = sorted(range(len(out)), key=lambda i: (out[i].predicted_ms is None, out[i].predicted_ms or 0.0, i))
    if _measure_hook is None:
        pg = _group(match)
        device = _device_of(pg)
        if device is not None:
            on_fresh_thread(lambda: _broadcast_choice(order[0], pg, device, f"{spec.name} at {match.signature()}"))
    return [out[i] for i in order] + rest
