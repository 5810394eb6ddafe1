"""signal_reorder on NVIDIA GPUs: one persistent Triton GEMM that signals per wave group, and a
high-priority communication stream that waits on those signals and runs the unchanged NCCL
collective on each group's contiguous slice (FlashOverlap, EuroSys '26). Re-exports
gemm_kernel.py and gemm_configs.py, so ``kernels.<name>`` reaches every name of the three::

    _wait_kernel          one-thread bounded spin on a group counter (the watchdog), consumes it
    run()                 what op.py calls: GEMM on the compute stream, per group wait +
                          collective on the comm stream, join; returns reference.run's buffer

Each (device, plan) owns an int32 counter per wave group, zeroed once; the GEMM adds the tile
count and the waiter consumes it (writes 0), so a CUDA-graph replay is a fresh call. Waiters
(``OVERLAP_COMPILE_SIGNAL_WAIT``): ``spin`` (default), bounded by ``plan.timeout_ms``, raising
``SignalTimeoutError``; ``stream``, ``cuStreamWaitValue32`` (no SM, no timeout, system scope).
"""
from __future__ import annotations

import os
import threading
from typing import Any

import torch

from ..plans import GemmCollectivePlan
from .reference import out_shape as reference_out_shape
from ...runtime.persistent import zeros_int32
from .gemm_configs import (  # noqa: F401  (re-exported: kernels.<name>)
    GemmConfig, _cache, _save_cache, _shape_key, cache_path, candidate_configs, choose_config, default_config,
    preferred_blocks)
from .gemm_kernel import (  # noqa: F401  (re-exported: kernels.<name>)
    SIGNAL_AT, TEMPLATE, TensorDescriptor, _HAVE_TRITON, _Layout, _Operands, _a_rows_contiguous, _compile_fallbacks,
    _dot_precision, _launch, _layout, _layouts, _num_sms, _operands, _tma_ok, available, gemm, gemm_signal_into,
    layout, tl, triton, wave_table)

if _HAVE_TRITON:
    from .gemm_kernel import (  # noqa: F401  (re-exported: kernels.<name>)
        _bulk_store_wait, _cta_barrier, _gemm_kernel, _signal_group, global_row_jit, send_slot_jit, tile_acc_jit,
        tile_coords_jit)

    # The bounded one-thread waiter lives in runtime.spin_wait (p2p_ring waits on peers' flags
    # with it too); here it runs in GEQ mode at GPU scope on the wave-group counters.
    # A fresh jit of it, so that this module loaded under TRITON_INTERPRET gets an interpreted copy.
    from ...runtime import spin_wait as _spin_wait

    _wait_kernel = _spin_wait.jit_wait_kernel()


class SignalTimeoutError(RuntimeError):
    """A wait on a wave-group counter ran past its bound (or saw an impossible count)."""


# ------------------------------------------------------------------------------------------
# Communication side: streams, waits, collectives
# ------------------------------------------------------------------------------------------

_streams: dict[tuple[int, int], torch.cuda.Stream] = {}
_errors: dict[int, torch.Tensor] = {}
_states: dict[tuple[int, str], torch.Tensor] = {}
_state_lock = threading.Lock()


def _comm_stream(device: torch.device) -> torch.cuda.Stream:
    """The communication stream of this device, at the configured (default: highest) priority:
    a normal-priority comm stream is starved by the persistent GEMM (ANCHORS.md)."""
    from ... import config as oc_config

    pr = oc_config.current().comm_priority
    prio = -1000 if pr == "highest" else int(pr)  # torch clamps to the device's highest priority
    key = (device.index, prio)
    with _state_lock:
        s = _streams.get(key)
        if s is None:
            s = _streams[key] = torch.cuda.Stream(device=device, priority=prio)
        return s


def _error_buffer(device: torch.device) -> torch.Tensor:
    """(failed, group, counter seen, target, ready) written by _wait_kernel on failure.
    Pinned host memory (mapped into the GPU's address space), so the host reads it without a
    synchronisation; device memory where a launch refuses the pinned pointer."""
    with _state_lock:
        buf = _errors.get(device.index)
        if buf is None:
            buf = _errors[device.index] = torch.zeros(5, dtype=torch.int32).pin_memory()
        return buf


def _use_device_error_buffer(device: torch.device) -> torch.Tensor:
    with _state_lock:
        buf = _errors[device.index] = zeros_int32(5, device)
        return buf


def _raise_if_failed(device: torch.device, synchronize: bool) -> None:
    buf = _errors.get(device.index)
    if buf is None:
        return
    if synchronize:
        torch.cuda.synchronize(device)
    elif buf.is_cuda:
        return  # reading device memory would synchronise; leave it to check_errors()
    vals = buf.tolist()
    if vals[4] == 0:
        return
    group, seen, target = vals[1], vals[2], vals[3]
    buf.zero_()
    what = "overshot" if seen > target else "timed out"
    raise SignalTimeoutError(
        f"{TEMPLATE}: the wait on wave group {group} {what}: its tile counter read {seen}, expected {target} "
        f"(device cuda:{device.index}). The GEMM did not signal exactly the group's tiles within the "
        f"signal_timeout_ms bound; the results of that call are invalid."
    )


def check_errors(device: torch.device | int | None = None, synchronize: bool = True) -> None:
    """Raise SignalTimeoutError if a bounded wait on ``device`` failed (after a synchronisation
    unless ``synchronize=False``)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    elif isinstance(device, int):
        device = torch.device("cuda", device)
    _raise_if_failed(device, synchronize)


WAIT_MODES = ("auto", "spin", "stream")


def choose_wait_mode(requested: str, programs: int, sms: int, have_stream_wait: bool) -> str:
    """Which waiter a call uses (``OVERLAP_COMPILE_SIGNAL_WAIT``: auto | spin | stream).

    ``auto``: always the bounded spin waiter: no wait on a GPU signal may hang forever, and
    cuStreamWaitValue32 cannot time out, so it is used only when asked for explicitly
    (``stream``, experiments). The spin waiter needs a free SM: the predictor plans
    programs < SMs (NCCL needs SMs too): with programs == SMs it makes the whole op slower than
    mm + all_reduce. ``programs``/``sms``/``have_stream_wait`` are kept in the signature for
    callers that log the choice."""
    if requested not in WAIT_MODES:
        raise ValueError(f"OVERLAP_COMPILE_SIGNAL_WAIT: got {requested!r}; allowed: {list(WAIT_MODES)}")
    if requested == "stream" and not have_stream_wait:
        raise RuntimeError(f"{TEMPLATE}: OVERLAP_COMPILE_SIGNAL_WAIT=stream needs cuda-bindings (cuda.bindings.driver)")
    if requested != "auto":
        return requested
    return "spin"


def _have_stream_wait() -> bool:
    try:
        _driver()
        return True
    except ImportError:
        return False


def _wait_mode(programs: int | None = None, device: torch.device | None = None) -> str:
    requested = os.environ.get("OVERLAP_COMPILE_SIGNAL_WAIT", "auto")
    if requested == "auto" and programs is not None and device is not None:
        return choose_wait_mode(requested, programs, _num_sms(device), _have_stream_wait())
    if requested == "auto":
        return "spin"
    return choose_wait_mode(requested, 0, 1, requested != "stream" or _have_stream_wait())


def wait_counter(counters: torch.Tensor, group: int, target: int, timeout_ms: int, mode: str | None = None,
                 max_polls: int = 1 << 30, err: torch.Tensor | None = None) -> None:
    """Enqueue on the current stream a wait until ``counters[group] == target``, which then
    resets it to 0. ``mode='spin'``: bounded (see module doc); ``'stream'``: cuStreamWaitValue32.
    ``err`` overrides the device's error buffer (tests on the interpreter pass a CPU tensor;
    off the GPU the bound is ``max_polls`` polls instead of a time)."""
    mode = mode or _wait_mode()
    if mode == "stream":
        _stream_wait(counters, group, target)
        return
    use_timer = counters.is_cuda
    args = (counters, group, target, None, _spin_wait.bound_us(timeout_ms), max_polls, group)  # tag = group
    if err is not None:
        _wait_kernel[(1,)](*args[:3], err, *args[4:], USE_TIMER=use_timer, UNTIL_EQUAL=False, SYS=False, num_warps=1)
        return
    err = _error_buffer(counters.device)
    try:
        _wait_kernel[(1,)](*args[:3], err, *args[4:], USE_TIMER=use_timer, UNTIL_EQUAL=False, SYS=False, num_warps=1)
    except Exception as e:
        if err.is_cuda or "ointer" not in str(e):
            raise
        # This Triton refused the pinned host pointer: keep the record in device memory.
        err = _use_device_error_buffer(counters.device)
        _wait_kernel[(1,)](*args[:3], err, *args[4:], USE_TIMER=use_timer, UNTIL_EQUAL=False, SYS=False, num_warps=1)


_driver_mod: Any = None


def _driver() -> Any:
    global _driver_mod
    if _driver_mod is None:
        try:
            from cuda.bindings import driver  # cuda-bindings >= 12.6
        except ImportError:  # older cuda-python
            from cuda import cuda as driver  # type: ignore
        _driver_mod = driver
    return _driver_mod


def _stream_wait(counters: torch.Tensor, group: int, target: int) -> None:
    drv = _driver()
    stream = drv.CUstream(torch.cuda.current_stream(counters.device).cuda_stream)
    addr = drv.CUdeviceptr(counters.data_ptr() + 4 * group)
    (err,) = drv.cuStreamWaitValue32(stream, addr, target, drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{TEMPLATE}: cuStreamWaitValue32 failed: {err}")
    (err,) = drv.cuStreamWriteValue32(stream, addr, 0, drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{TEMPLATE}: cuStreamWriteValue32 failed: {err}")


def _counters(device: torch.device, plan: GemmCollectivePlan) -> torch.Tensor:
    """Per (device, plan): one int32 counter per wave group, zeroed once; the waiters leave them
    at zero after every call."""
    key = (device.index, plan.to_json())
    with _state_lock:
        cnt = _states.get(key)
        if cnt is None:
            cnt = _states[key] = zeros_int32(len(plan.config["wave_groups"]), device)
        return cnt


_REDUCE_OPS = {"sum": "SUM", "avg": "AVG", "product": "PRODUCT", "prod": "PRODUCT", "min": "MIN", "max": "MAX",
               "band": "BAND", "bor": "BOR", "bxor": "BXOR"}


def _reduce_op(name: str | None) -> Any:
    import torch.distributed as dist

    key = (name or "sum").lower()
    if key not in _REDUCE_OPS:
        raise ValueError(f"{TEMPLATE}: reduce op {name!r} not supported; allowed: {sorted(_REDUCE_OPS)}")
    return getattr(dist.ReduceOp, _REDUCE_OPS[key])


def run(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group_name: str,
        plan: GemmCollectivePlan, out: torch.Tensor | None = None) -> torch.Tensor:
    """GEMM + collective, overlapped by wave group; returns reference.run's received buffer
    (``out`` when given).

    Compute stream: the signalling GEMM. Comm stream (highest priority), per group g: bounded
    wait on counter g (consumes it), then the collective on the group's contiguous send slice
    (all_reduce in place / reduce_scatter_tensor / all_to_all_single, with async_op=False so
    ProcessGroupNCCL issues it on *this* stream, torch >= 2.7). Finally the compute stream waits
    for the comm stream, so the result is ready in stream order for the caller.
    """
    import torch.distributed as dist

    from ...runtime.comm import resolve_group

    device = a.device
    capturing = torch.cuda.is_current_stream_capturing()
    if not capturing:
        _raise_if_failed(device, synchronize=False)  # report a failed wait of an earlier call
    counters = _counters(device, plan)
    lay = _layout(device, plan)
    grid, sched = lay.grid, lay.sched
    pg = resolve_group(group_name)
    compute = torch.cuda.current_stream(device)
    comm = _comm_stream(device)
    tiles = (grid.block_m, grid.block_n)
    in_place = plan.kind == "gemm_allreduce"  # the all-reduce sums the send buffer in place
    send = out if (in_place and out is not None) else torch.empty(sched.num_exec, *tiles, dtype=a.dtype, device=device)
    if out is not None and tuple(out.shape) != tuple(send.shape if in_place else reference_out_shape(plan)):
        raise ValueError(f"signal_reorder: output buffer {tuple(out.shape)} does not match the plan's "
                         f"{tuple(reference_out_shape(plan))}")
    if in_place:
        recv = send
    elif out is not None:
        recv = out
    elif plan.kind == "gemm_reducescatter":
        recv = torch.empty(grid.num_tiles, *tiles, dtype=a.dtype, device=device)
    else:
        recv = torch.empty(plan.world, grid.num_tiles, *tiles, dtype=a.dtype, device=device)
    # The comm stream may only start after everything the caller queued before this op (and,
    # inside a capture, this fork makes the comm stream part of the graph).
    comm.wait_stream(compute)
    mode = _wait_mode(plan.config["programs"], device)
    gemm_signal_into(a, b, bias, plan, send=send, counters=counters, scope="sys" if mode == "stream" else "gpu",
                     signal_at=plan.config.get("signal_at", "group_end"))
    op = _reduce_op(plan.reduce_op) if plan.kind != "gemm_alltoall" else None
    with torch.cuda.stream(comm):
        for g, ((lo, hi), (llo, lhi)) in enumerate(zip(sched.exec_ranges(), sched.local_ranges())):
            wait_counter(counters, g, hi - lo, plan.timeout_ms, mode)
            part = send[lo:hi]
            if plan.kind == "gemm_allreduce":
                dist.all_reduce(part, op=op, group=pg)
            elif plan.kind == "gemm_reducescatter":
                dist.reduce_scatter_tensor(recv[llo:lhi], part, op=op, group=pg)
            else:
                # Source j's tiles land at recv[j, llo:lhi]: a strided slice, so receive into a
                # contiguous scratch and place it (still on the comm stream, under the GEMM).
                scratch = torch.empty_like(part)
                dist.all_to_all_single(scratch, part, group=pg)
                recv[:, llo:lhi].copy_(scratch.view(plan.world, lhi - llo, *tiles))
    compute.wait_stream(comm)  # the join (templates/base.py: no record_stream)
    return recv
