"""tile_fused's host side below the ops: whether the GPU path can run, the bounded waits' error
records (``check_errors`` raises TileWaitTimeout), symmetric buffers and streams, and the
launchers of jit_kernels.py's kernels: a variant this Triton rejects falls back to a simpler one
(warned once, remembered), and a plan's first call compiles and loads every kernel before any of
them spins (``_first_call``, ``_loaded``). kernels.py runs the ops with them.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import warnings
from typing import Any

import torch

from . import primitives as P
from ...runtime.persistent import allocate, zeros_int32
from ...runtime.spin_wait import bound_us
from .jit_kernels import MODE_AG, MODE_RS, SR, _HAVE_TRITON, triton

if _HAVE_TRITON:
    from .jit_kernels import _barrier_kernel, _notify_kernel, _tile_gemm_kernel

TEMPLATE = "tile_fused"


class TileWaitTimeout(RuntimeError):
    """A bounded tile / rank wait of tile_fused ran past plan.timeout_ms."""


# ------------------------------------------------------------------------------------------
# Availability, errors
# ------------------------------------------------------------------------------------------

def available() -> bool:
    return _HAVE_TRITON and SR is not None and SR.available()


def usable(group_name: str, device: torch.device, plan: Any = None) -> str | None:
    """Why the GPU path cannot run here (None: it can). It needs the Triton kernels, an NCCL group
    and symmetric memory with peer access."""
    if not available():
        return "the tile_fused kernels need Triton"
    if device.type != "cuda":
        return f"needs CUDA tensors, got a {device.type} tensor"
    import torch.distributed as dist

    from ...runtime.comm import resolve_group

    pg = resolve_group(group_name)
    if dist.get_backend(pg) != "nccl":
        return "needs an NCCL process group"
    if not _symm_ok(group_name, device):
        return "symmetric memory cannot serve this group (every rank on this node, with peer access)"
    return None


_state_lock = threading.RLock()
_err: dict[int, torch.Tensor] = {}
_err_host: dict[int, tuple[torch.Tensor, Any, str]] = {}
_use_asm: dict[str, bool] = {}


def _err_buf(device: torch.device) -> torch.Tensor:
    with _state_lock:
        buf = _err.get(device.index)
        if buf is None:
            buf = _err[device.index] = zeros_int32(P.ERR_WORDS, device)
        return buf


def _format_error(vals: list[int], what: str) -> str:
    code, index, seen, target = vals[1:5]
    name = P.WAIT_NAMES.get(code, f"code {code}")
    return (f"{TEMPLATE} {what}: the wait on {name} {index} timed out: its flag read {seen}, expected >= {target}. "
            f"A producer or peer did not signal within signal_timeout_ms (a peer not running the same plan, or "
            f"a kernel that failed); the results of that call are invalid.")


def check_errors(device: torch.device | int | None = None, synchronize: bool = True) -> None:
    """Raise TileWaitTimeout if a bounded wait on ``device`` failed (after a synchronisation unless
    ``synchronize=False``, which only reads the copy the last eager call left in pinned memory)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    elif isinstance(device, int):
        device = torch.device("cuda", device)
    with _state_lock:
        pending = _err_host.pop(device.index, None)
        buf = _err.get(device.index)
    if synchronize and buf is not None:
        torch.cuda.synchronize(device)
        vals = buf.tolist()
        if vals[0]:
            buf.zero_()
            raise TileWaitTimeout(_format_error(vals, pending[2] if pending else "op"))
        return
    if pending is not None:
        host, event, what = pending
        if not event.query():
            with _state_lock:
                _err_host.setdefault(device.index, pending)
            return
        vals = host.tolist()
        if vals[0]:
            _err_buf(device).zero_()
            raise TileWaitTimeout(_format_error(vals, what))


def _after_call(device: torch.device, what: str) -> None:
    """Eager calls: copy the error record to pinned memory behind the call (read next time)."""
    if torch.cuda.is_current_stream_capturing():
        return
    with _state_lock:
        prev = _err_host.get(device.index)
        host = prev[0] if prev else torch.zeros(P.ERR_WORDS, dtype=torch.int32).pin_memory()
        host.copy_(_err_buf(device), non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        _err_host[device.index] = (host, ev, what)


def _timeouts(plan: Any) -> tuple[int, int]:
    """(the bound in us for %globaltimer, spin_wait.bound_us; max polls where no timer is used:
    ~1 us per poll)."""
    us = bound_us(plan.timeout_ms)
    return us, us


# ------------------------------------------------------------------------------------------
# Symmetric memory (runtime.symm) and streams
# ------------------------------------------------------------------------------------------

def _symm_ok(group_name: str, device: torch.device) -> bool:
    """Symmetric memory can serve this group: every rank on this node with peer access."""
    try:
        return bool(_symm_api().available(group_name, device))
    except Exception as e:  # no peer access, no symmetric memory: the reference runs instead
        warnings.warn(f"{TEMPLATE}: symmetric memory unusable on group {group_name!r} ({e}); using the reference")
        return False


def _symm(group_name: str, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
          zero: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(local symmetric tensor, int64 device table of every rank's address of it); cached per
    (group, key, shape, dtype); ``zero``: zeroed on every rank before any peer can signal into it."""
    return _symm_api().tensor_and_ptrs(group_name, f"{TEMPLATE}/{key}", shape, dtype, device, zero=zero)


def _grown(group_name: str, key: str, numel: int, dtype: torch.dtype, device: torch.device,
           zero: bool = False) -> Any:
    """A symmetric buffer of at least ``numel`` elements shared by every call of ``key`` whatever
    its M (runtime.symm.grown_buffer): a symbolic site's lengths do not each add one. ``zero``:
    zeroed when made (flags)."""
    return _symm_api().grown_buffer(group_name, f"{TEMPLATE}/{key}", (), numel, dtype, device, zero)


def _symm_api() -> Any:
    from ...runtime import symm

    return symm


_streams: dict[int, torch.cuda.Stream] = {}
_local: dict[tuple, torch.Tensor] = {}


def _comm_stream(device: torch.device) -> torch.cuda.Stream:
    with _state_lock:
        s = _streams.get(device.index)
        if s is None:
            s = _streams[device.index] = torch.cuda.Stream(device=device, priority=-1000)
        return s


def _zeros_cached(key: tuple, n: int, device: torch.device) -> torch.Tensor:
    """Local int32 flags, zeroed once; the protocol leaves them at zero after every call."""
    with _state_lock:
        t = _local.get(key)
        if t is None:
            t = _local[key] = zeros_int32(n, device)
        return t


# ------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------

_fallbacks: dict[tuple, tuple] = {}
# First call of a plan: every kernel is compiled (Triton ``warmup``: no launch) and the ranks meet
# at a host barrier before any bounded wait starts. Without it a rank still compiling (several
# seconds per variant, more when a variant is rejected) makes its peers' waits time out.
_warming = False
_warmed: set = set()


def _first_call(key: tuple, pg: Any, device: torch.device, body) -> None:
    global _warming
    if key in _warmed or torch.cuda.is_current_stream_capturing():
        return
    _warming = True
    try:
        body()
    finally:
        _warming = False
    torch.cuda.synchronize(device)
    import torch.distributed as dist

    # On the persistent worker: NCCL's barrier allocates a one-element tensor on the calling
    # thread and keeps it until its watchdog retires the work, so under CUDA-graph trees it was
    # the "1 tensor(s) in the cudagraph pool not tracked as outputs" of the first call.
    allocate(lambda: dist.barrier(group=pg))
    torch.cuda.synchronize(device)
    _warmed.add(key)


def _loaded(compiled: Any) -> Any:
    """Load a kernel Triton compiled (``warmup``) onto the GPU now, not at its first launch.

    Triton loads a compiled kernel's module at its first launch, and under CUDA's lazy loading
    (the default) loading can wait for the context to go idle. A first GEMM+RS call thus
    deadlocked until the bound ran out: the push kernel spun waiting for the GEMM's tiles while
    the GEMM, launched after it, waited to be loaded until the push kernel finished. NVIDIA's
    lazy-loading guide names this hazard and the cure: load every kernel before any of them spins.
    ``_init_handles`` loads the module and queries the function's attributes, which loads it."""
    init = getattr(compiled, "_init_handles", None)
    if init is not None:
        init()
    return compiled


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch_gemm(mode: int, a, b, bias, c, flags, rows, n, k, tiles, world, rank, chunk, programs, cfg,
                 a_contig_rows: bool, c_tma_ok: bool, c_view, plan) -> None:
    """_tile_gemm_kernel with signal_reorder's operand setup; if this Triton rejects a variant
    (inline asm, loop flattening, TMA, stages), retry simpler ones, warn once, remember."""
    ops = SR._operands(a, b, cfg, a_contig_rows)
    c_desc = None
    if c_tma_ok and SR._tma_ok(c_view):
        c_desc = SR.TensorDescriptor.from_tensor(c_view, [cfg.block_m, cfg.block_n])
    err = _err_buf(a.device)
    tus, polls = _timeouts(plan)
    key = (mode, cfg, ops.a_desc is not None, ops.b_desc is not None, ops.b_kmajor, c_desc is not None, a.dtype,
           bias is not None)
    tries = [_fallbacks[key]] if key in _fallbacks else [
        (True, cfg.flatten, True, cfg.num_stages), (True, False, True, cfg.num_stages),
        (False, cfg.flatten, True, cfg.num_stages), (False, False, True, cfg.num_stages),
        (False, False, True, max(2, cfg.num_stages - 1)), (False, False, False, max(2, cfg.num_stages - 1))]
    errors = []
    for use_asm, flatten, tma, stages in tries:
        ad, bd, km, cd = (ops.a_desc, ops.b_desc, ops.b_kmajor, c_desc) if tma else (None, None, False, None)
        if mode == MODE_RS and not use_asm:
            cd = None  # no bulk-store wait without asm: plain stores, ordered by the CTA barrier
        try:
            _loaded((_tile_gemm_kernel.warmup if _warming else _tile_gemm_kernel[(programs,)])(
                ops.a, ad, ops.b, bd, bias if bias is not None else c, c, cd, flags, err,
                rows, n, k, ops.a.stride(0), ops.a.stride(1), ops.b.stride(0), ops.b.stride(1),
                c.stride(0) if mode == MODE_AG else 0,
                tiles, world, rank, chunk, programs, tus, polls,
                MODE=mode, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                A_TMA=ad is not None, B_TMA=bd is not None, B_KMAJOR=km, C_TMA=cd is not None,
                HAS_BIAS=bias is not None, FLATTEN=flatten, DOT_PRECISION=SR._dot_precision(a.dtype),
                USE_ASM=use_asm, USE_TIMER=use_asm, num_warps=cfg.num_warps, num_stages=stages,
                **({"grid": (programs,)} if _warming else {}),
            ))
        except Exception as e:
            if torch.cuda.is_current_stream_capturing():
                raise
            errors.append(f"{type(e).__name__}: {str(e)[:300]}")
            continue
        if key not in _fallbacks:
            _fallbacks[key] = (use_asm, flatten, tma, stages)
            if errors:
                warnings.warn(f"{TEMPLATE}: GEMM variant fell back to asm={use_asm} flatten={flatten} tma={tma} "
                              f"stages={stages} after: {errors}")
        return
    raise RuntimeError(f"{TEMPLATE}: no variant of the tile GEMM ran on Triton {triton.__version__}: {errors}")


def _launch_small(name: str, kernel, grid, *args, **meta) -> None:
    """Comm kernels: inline-asm signals, else (remembered, warned) tl.atomic_* signals."""
    use = _use_asm.get(name)
    for use_asm in ([use] if use is not None else [True, False]):
        try:
            extra = {"USE_TIMER": use_asm} if name not in ("notify",) else {}
            if _warming:
                _loaded(kernel.warmup(*args, **meta, USE_ASM=use_asm, **extra, grid=grid))
            else:
                kernel[grid](*args, **meta, USE_ASM=use_asm, **extra)
        except Exception as e:
            if use is not None or not use_asm or torch.cuda.is_current_stream_capturing():
                raise
            warnings.warn(f"{TEMPLATE}: {name} kernel without inline asm (tl.atomic signals) after: "
                          f"{type(e).__name__}: {str(e)[:300]}")
            continue
        _use_asm[name] = use_asm
        return


def barrier(group_name: str, device: torch.device, world: int, rank: int, timeout_ms: int) -> None:
    """Device-side barrier of the group on the current stream (bounded)."""
    flags, tbl = _symm(group_name, "barrier", (world,), torch.int32, device, zero=True)
    tus, polls = _timeouts(_T(timeout_ms))
    _launch_small("barrier", _barrier_kernel, (1,), tbl, flags, _err_buf(device), world, rank, tus, polls,
                  NOTIFY=True, WAIT=True, num_warps=1)


@dataclasses.dataclass(frozen=True)
class _T:
    timeout_ms: int


_driver_checked: list = []


def stream_notify(flags: torch.Tensor, index: int) -> None:
    """flags[index] = 1 behind the work already on the current stream (the flag is 0 before: one
    notify per flag per call), by ``notify_path()``: "torch", torch's ``symm_mem.stream_write_value32_``
    (the cuStreamWriteValue32 p2p_ring writes its flags with, also under CUDA-graph capture);
    "driver", the same call through cuda-bindings; "kernel", a one-thread Triton kernel
    (rank_notify), compiled and loaded during the first-call warm-up like every other kernel."""
    path = notify_path()
    if path == "kernel":
        _launch_small("notify", _notify_kernel, (1,), flags, index, num_warps=1)
        return
    if _warming:
        return
    if path == "torch":
        torch.ops.symm_mem.stream_write_value32_(flags.view(torch.uint32), index, 1)
        return
    drv = _stream_driver()
    stream = drv.CUstream(torch.cuda.current_stream(flags.device).cuda_stream)
    addr = drv.CUdeviceptr(flags.data_ptr() + 4 * index)
    (err,) = drv.cuStreamWriteValue32(stream, addr, 1, drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{TEMPLATE}: cuStreamWriteValue32 failed: {err}")


_notify_path: list = []


def notify_path() -> str:
    """How stream_notify writes a flag here: "torch", "driver" or "kernel" (the first available;
    OVERLAP_COMPILE_TILE_FUSED_NOTIFY=torch|driver|kernel asks for one)."""
    if _notify_path:
        return _notify_path[0]
    asked = os.environ.get("OVERLAP_COMPILE_TILE_FUSED_NOTIFY", "auto")
    if asked not in ("auto", "torch", "driver", "kernel"):
        raise ValueError(f"OVERLAP_COMPILE_TILE_FUSED_NOTIFY={asked!r}: expected auto, torch, driver or kernel")
    have_torch = hasattr(getattr(torch.ops, "symm_mem", None), "stream_write_value32_") and hasattr(torch, "uint32")
    order = [asked] if asked != "auto" else ["torch", "driver", "kernel"]
    for path in order:
        if path == "torch" and have_torch or path == "driver" and _stream_driver() is not None or path == "kernel":
            _notify_path.append(path)
            return path
    raise RuntimeError(f"{TEMPLATE}: OVERLAP_COMPILE_TILE_FUSED_NOTIFY={asked} is not available here")


def _stream_driver() -> Any:
    """cuda-bindings' driver module (None without it, or when the notify is asked to be a kernel)."""
    if os.environ.get("OVERLAP_COMPILE_TILE_FUSED_NOTIFY", "auto") == "kernel":
        return None
    if not _driver_checked:
        try:
            _driver_checked.append(SR._driver())
        except ImportError:
            _driver_checked.append(None)
    return _driver_checked[0]


def _gemm_cfg(device, m, n, k, dtype, plan) -> Any:
    c = plan.config
    cfg = SR.choose_config(device, m, n, k, dtype, c["block_m"], c["block_n"], c.get("group_m", 8))
    return dataclasses.replace(cfg, block_m=c["block_m"], block_n=c["block_n"], group_m=c.get("group_m", 8),
                               warp_specialize=False)
