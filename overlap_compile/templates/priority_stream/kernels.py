"""priority_stream on NVIDIA GPUs: cuBLAS chunks on the compute stream, NCCL collectives on a
high-priority communication stream, ordered by events (the algorithm is reference.py's):

    compute stream   chunk c's GEMM (reference.compute_chunk: cuBLAS, or with a tile config the
                     persistent Triton GEMM) into its contiguous slice of the send buffer
    comm stream      waits for chunk c's event, then issues its collective (ProcessGroupNCCL
                     with async_op=False enqueues on the *current* stream, torch >= 2.7)
    join             the compute stream waits for the comm stream before the op returns

All-gather runs the other way round: the comm stream gathers every chunk back to back, an event
after each, and copies the rows into place; the compute stream waits for event c, then computes.
High priority (``comm_priority``) because the GEMM fills every SM: a normal-priority collective
would get blocks only as GEMM blocks retire. Capturable; import touches no CUDA state.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch

from . import reference as ref
from ..plans import AllGatherGemmPlan, GemmCollectivePlan

_streams: dict[tuple[int, int], Any] = {}
_lock = threading.Lock()

# functional-collective reduce op names (plan.reduce_op) -> torch.distributed.ReduceOp attribute
_REDUCE_OPS = {"sum": "SUM", "avg": "AVG", "product": "PRODUCT", "min": "MIN", "max": "MAX",
               "band": "BAND", "bor": "BOR", "bxor": "BXOR"}


# ---- where to run ----------------------------------------------------------------------------

def usable(group_name: str, device: torch.device, plan: Any = None) -> str | None:
    """Why this path cannot run here (None: it can): it needs a CUDA tensor and an NCCL backend
    for it in the group. (gloo on CUDA tensors blocks the host per call and cannot be captured:
    reference.py then.)"""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "needs CUDA tensors on an NCCL process group"
    from ...runtime.comm import resolve_group

    try:
        backend = resolve_group(group_name)._get_backend(device)
    except (RuntimeError, AttributeError) as e:
        return f"process group {group_name!r}: {e}"
    if type(backend).__name__ != "ProcessGroupNCCL":
        return "needs an NCCL process group"
    return None


def stream_priority(option: str | int) -> int:
    """The CUDA stream priority for the ``comm_priority`` option: "highest" is the greatest
    priority the device has (the numerically lowest end of the range); an integer is clamped
    into the range."""
    least, greatest = _priority_range()
    if option == "highest":
        return greatest
    return max(greatest, min(int(option), least))


def _priority_range() -> tuple[int, int]:
    """(least, greatest) priority; lower numbers are higher priorities."""
    lo, hi = torch.cuda.Stream.priority_range()
    return max(lo, hi), min(lo, hi)


def comm_stream(device: torch.device) -> torch.cuda.Stream:
    """This device's communication stream at the configured priority. One per (device, priority)
    for the whole process, so that all of this template's collectives are issued on one stream,
    in program order (the order every rank issues them in)."""
    from ... import config as oc_config

    prio = stream_priority(oc_config.current().comm_priority)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, prio)
    with _lock:
        s = _streams.get(key)
        if s is None:
            s = _streams[key] = torch.cuda.Stream(device=index, priority=prio)
        return s


def reduce_op(name: str | None) -> Any:
    import torch.distributed as dist

    key = (name or "sum").lower()
    if key not in _REDUCE_OPS:
        raise ValueError(f"{ref.TEMPLATE}: reduce op {name!r} is not supported on NCCL; allowed: {sorted(_REDUCE_OPS)}")
    return getattr(dist.ReduceOp, _REDUCE_OPS[key])


# ---- the GEMM: cuBLAS, or the persistent Triton GEMM shaped for co-residence -------------------

def tile_gemm(config: dict, device: torch.device) -> ref.MatMul | None:
    """None (cuBLAS) unless the config names a tile; then signal_reorder's persistent TMA GEMM
    with that tile, ``stages`` pipeline stages (shared memory per block: fewer leave room for
    NCCL's blocks on the same SMs) and ``programs`` persistent programs (fewer leave whole SMs
    to NCCL). This is the occupancy-shaping knob of resource-aware overlap."""
    if config.get("block_m") is None:
        return None
    from ..signal_reorder import kernels as SR

    bm, bn, stages, programs = config["block_m"], config["block_n"], config.get("stages"), config.get("programs")

    def mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
        cfg = SR.default_config(a.dtype, bm, bn)
        if stages is not None:
            cfg = dataclasses.replace(cfg, num_stages=int(stages))
        SR.gemm(a, b, bias, cfg, programs, out=out)

    return mm


# ---- GEMM -> collective ----------------------------------------------------------------------

def _collective(plan: GemmCollectivePlan, lay: ref.Layout, c: int, send_c: torch.Tensor, result: torch.Tensor,
                pg: Any, op: Any) -> None:
    """Chunk c's collective, issued on the current (comm) stream."""
    import torch.distributed as dist

    lo, hi = lay.chunks[c]
    if plan.kind == "gemm_allreduce":
        dist.all_reduce(send_c, op=op, group=pg)  # in place: send is the result
    elif plan.kind == "gemm_reducescatter":
        dist.reduce_scatter_tensor(result[lo:hi], send_c, op=op, group=pg)
    elif len(lay.chunks) == 1:
        dist.all_to_all_single(result, send_c, group=pg)  # one chunk: source-major is the result
    else:
        # Source j's rows land at result rows j*R + [lo, hi): strided, so receive into a scratch
        # buffer (allocated on this stream, so the allocator reuses it only after this stream's
        # work) and place it, still under the next chunk's GEMM.
        recv_c = torch.empty_like(send_c)
        dist.all_to_all_single(recv_c, send_c, group=pg)
        ref.place_received(result, recv_c, lay, c)


def run(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group_name: str,
        plan: GemmCollectivePlan, out: torch.Tensor | None = None) -> torch.Tensor:
    """Chunked GEMM on the compute stream, chunk c's collective on the comm stream as soon as
    chunk c is done. Returns reference.run's result (``[result_rows, n]``), in ``out`` if given."""
    from ...runtime.comm import resolve_group

    lay = ref.gemm_layout(plan)
    pg = resolve_group(group_name)
    op = reduce_op(plan.reduce_op) if plan.kind != "gemm_alltoall" else None
    compute = torch.cuda.current_stream(a.device)
    side = comm_stream(a.device)
    in_place = plan.kind == "gemm_allreduce"  # the all-reduce sums the send buffer in place
    send = out if (in_place and out is not None) else a.new_empty(plan.m, plan.n)  # chunk-major: chunk c is send[W*lo : W*hi]
    result = send if in_place else (out if out is not None else a.new_empty(plan.result_rows, plan.n))
    for c in range(len(lay.chunks)):
        send_c = send[slice(*lay.buffer_rows(c))]
        ref.compute_chunk(a, b, bias, lay, c, send_c, tile_gemm(plan.config, a.device))
        # Event on the compute stream after chunk c; the comm stream waits for it (this also
        # orders the first collective after everything the caller queued before the op, and
        # inside a CUDA graph capture it forks the comm stream into the graph).
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            _collective(plan, lay, c, send_c, result, pg, op)
    compute.wait_stream(side)  # join: the result is ready in the caller's stream order
    return result


# ---- all-gather -> GEMM ----------------------------------------------------------------------

def run_allgather(shard: torch.Tensor, bs: list[torch.Tensor], biases: list[torch.Tensor | None],
                  group_name: str, plan: AllGatherGemmPlan,
                  outs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Every chunk's all-gather on the comm stream (an event after each), chunk c's GEMMs on the
    compute stream once event c has fired. Returns ``[gathered, y_0, y_1, ...]`` (``outs`` if
    given)."""
    import torch.distributed as dist

    from ...runtime.comm import resolve_group

    lay = ref.allgather_layout(plan)
    pg = resolve_group(group_name)
    compute = torch.cuda.current_stream(shard.device)
    side = comm_stream(shard.device)
    shard = shard.contiguous()  # NCCL reads contiguous rows
    if outs is not None:
        gathered, *ys = outs
    else:
        gathered, ys = shard.new_empty(plan.m, plan.k), [shard.new_empty(plan.m, n) for n in plan.ns]
    # One chunk with outer == 1: the gather's source-major rows are the gathered matrix itself.
    direct = len(lay.chunks) == 1 and lay.stripes.outer == 1
    gath = gathered if direct else shard.new_empty(plan.m, plan.k)  # chunk-major scratch

    side.wait_stream(compute)  # the shard (and the buffers) exist before the first gather
    landed = []
    with torch.cuda.stream(side):
        for c, (lo, hi) in enumerate(lay.chunks):
            gath_c = gath[slice(*lay.buffer_rows(c))]
            dist.all_gather_into_tensor(gath_c, shard[lo:hi], group=pg)
            ev = torch.cuda.Event()
            ev.record(side)
            landed.append((ev, gath_c))
            if not direct:
                ref.place_gathered(gathered, gath_c, lay, c)  # after the event: not on the GEMM's path
    for c, (ev, gath_c) in enumerate(landed):
        compute.wait_event(ev)
        ref.gemm_gathered(gath_c, bs, biases, ys, lay, c, tile_gemm(plan.config, shard.device))
    compute.wait_stream(side)  # join: the placed gathered rows too (templates/base.py: no record_stream)
    return [gathered] + ys

