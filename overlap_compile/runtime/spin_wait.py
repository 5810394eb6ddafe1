"""The bounded wait on a GPU flag: one thread spins on an int32 until it holds the value asked
for, gives up after a time bound, records what it saw, and never hangs the stream.

    wait_value(flags, index, target, timeout_ms, tag, until_equal=True, sys_scope=True)
        enqueue on the current stream: wait until flags[index] == target (or, until_equal=False,
        >= target), then consume it (write 0 back); bounded by timeout_ms.
    failure(device) -> (tag, seen, target) | None      read the record without synchronising
    clear(device)                                       forget a record (after raising it)

On a timeout or overshoot, ``wait_kernel`` writes (failed, tag, seen, target, ready) to pinned host
memory and lets the stream go on; the host raises at the next call or in ``check_errors``. Not
``cuStreamWaitValue32``: it cannot time out, so a silent peer would hang the process.
"""
from __future__ import annotations

import threading

import torch

from ..config import MAX_SIGNAL_TIMEOUT_MS
from .persistent import zeros_int32
from .triton_launch import FastLaunch, aligned, int_kind

try:  # Triton is optional on CPU-only installs
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the installation
    triton = None
    tl = None
    HAVE_TRITON = False

RECORD = ("failed", "tag", "seen", "target", "ready")  # the error record's fields, in order

if HAVE_TRITON:

    @triton.jit
    def globaltimer(dep):
        # %globaltimer: nanoseconds; ``dep`` only orders the read after the preceding poll.
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep], dtype=tl.int64,
                                         is_pure=False, pack=1)

    @triton.jit
    def nap(dep):
        # Back off between polls: the poller shares an SM with a GEMM CTA (and the counter's L2
        # line with the GEMM's atomics); a group takes tens of microseconds, so 0.5 us of
        # extra latency is nothing.
        return tl.inline_asm_elementwise("nanosleep.u32 500;\nmov.u32 $0, $1;", "=r,r", [dep],
                                         dtype=tl.int32, is_pure=False, pack=1)

    # Not specialised on the values that change from wait to wait (one compiled kernel for all).
    @triton.jit(do_not_specialize=["index", "target", "timeout_us", "max_polls", "tag"])
    def wait_kernel(counter_ptr, index, target, err_ptr, timeout_us, max_polls, tag,
                    USE_TIMER: tl.constexpr, UNTIL_EQUAL: tl.constexpr, SYS: tl.constexpr):
        """Wait until ``counter[index]`` reaches ``target`` (bounded), then consume it (write 0).

        GEQ mode (``UNTIL_EQUAL`` False) stops at ``>= target`` (wrap-safe) and calls anything but
        ``== target`` an overshoot; ``UNTIL_EQUAL`` stops only at ``== target`` (a flag that goes
        back to 0). On a timeout or an overshoot it records (failed, tag, seen, target, ready)
        in ``err_ptr`` and returns, so the stream never hangs. Only plain stores touch
        ``err_ptr``: it is pinned host memory, where atomics are not guaranteed (no PCIe atomics
        in a VM). Waiters run one after another per stream, so records rarely interleave.
        """
        ptr = counter_ptr + index
        # Poll with relaxed (volatile) loads and acquire once at the end: an acquire load per
        # poll invalidates the SM's L1 each time, which slows the GEMM CTA sharing the SM.
        seen = tl.load(ptr, volatile=True)
        expired = seen * 0
        polls = seen * 0
        if USE_TIMER:
            start = globaltimer(seen)
            timeout_ns = timeout_us.to(tl.int64) * 1000
        if UNTIL_EQUAL:
            pending = (seen != target).to(tl.int32)
        else:
            pending = ((seen - target) < 0).to(tl.int32)  # wrap-safe "seen < target" on int32
        while (pending != 0) & (expired == 0):
            if USE_TIMER:
                dep = nap(seen)
                expired = (globaltimer(dep) - start > timeout_ns).to(tl.int32)
            else:
                polls += 1
                expired = (polls >= max_polls).to(tl.int32)
            seen = tl.load(ptr, volatile=True)
            if UNTIL_EQUAL:
                pending = (seen != target).to(tl.int32)
            else:
                pending = ((seen - target) < 0).to(tl.int32)
        # Synchronises with the signaller's release: what it published is visible from here, and
        # (stream order) to everything launched after this kernel.
        if SYS:
            seen = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
        else:
            seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
        if seen != target:
            tl.store(err_ptr, 1)
            tl.store(err_ptr + 1, tag)
            tl.store(err_ptr + 2, seen)
            tl.store(err_ptr + 3, target)
            tl.debug_barrier()
            tl.store(err_ptr + 4, 1)
        if SYS:
            tl.atomic_xchg(ptr, 0, sem="relaxed", scope="sys")
        else:
            tl.atomic_xchg(ptr, 0, sem="relaxed", scope="gpu")


_launch = FastLaunch(wait_kernel) if HAVE_TRITON else None  # the compiled kernel reused (triton_launch.py)


def bound_us(timeout_ms: int) -> int:
    """A wait's bound as every bounded-wait kernel takes it: microseconds, an int32 for any bound
    up to config.MAX_SIGNAL_TIMEOUT_MS, so one compiled variant serves every bound. (The JIT types
    an int by its value: in nanoseconds a bound past 2.1 s is an int64 and a shorter one an int32,
    and a run that met the other kind compiled and loaded a second variant mid-run, its peers
    already waiting.)"""
    ms = int(timeout_ms)
    if not 0 < ms <= MAX_SIGNAL_TIMEOUT_MS:
        raise ValueError(f"a wait's bound must be 1 to {MAX_SIGNAL_TIMEOUT_MS} ms (signal_timeout_ms), "
                         f"got {timeout_ms!r}")
    return ms * 1000


def jit_wait_kernel():
    """A fresh ``@triton.jit`` of ``wait_kernel``. Decorators read TRITON_INTERPRET when they
    run, so a module loaded under the interpreter (tests on CPU) gets an interpreted copy even
    when this module was imported before without it. On CPU the timer branch is never taken
    (USE_TIMER is False), so the helpers it calls need no interpreted copies."""
    return triton.jit(wait_kernel.fn)


_records: dict[tuple[str, int], torch.Tensor] = {}
_lock = threading.Lock()


def record_buffer(device: torch.device) -> torch.Tensor:
    """This device's error record (see RECORD): pinned host memory, mapped into the GPU's address
    space, so the host reads it without a synchronisation; device memory where the launch
    refuses the pinned pointer (then it is read only after a synchronisation)."""
    key = (device.type, device.index if device.index is not None else 0)
    with _lock:
        buf = _records.get(key)
        if buf is None:
            buf = torch.zeros(len(RECORD), dtype=torch.int32)
            if device.type == "cuda":
                buf = buf.pin_memory()
            _records[key] = buf
        return buf


def _use_device_record(device: torch.device) -> torch.Tensor:
    key = (device.type, device.index if device.index is not None else 0)
    with _lock:
        buf = _records[key] = zeros_int32(len(RECORD), device)
        return buf


def wait_value(flags: torch.Tensor, index: int, target: int, timeout_ms: int, tag: int, *,
               until_equal: bool = True, sys_scope: bool = True, max_polls: int = 1 << 30) -> None:
    """Enqueue the bounded wait on ``flags[index]`` (int32 or uint32, 1-D) on the current stream.
    Off the GPU (Triton's interpreter, tests) the bound is ``max_polls`` polls instead of a time.
    Host-launched ops call this at every site: after a key's first launch the compiled kernel is
    launched directly (runtime/triton_launch.py)."""
    if not HAVE_TRITON:
        raise RuntimeError("the bounded GPU wait needs Triton")
    if flags.dtype not in (torch.int32, torch.uint32) or flags.dim() != 1:
        raise ValueError(f"wait_value: flags must be a 1-D int32/uint32 tensor, got {flags.dtype} {tuple(flags.shape)}")
    if not 0 <= index < flags.numel():
        raise ValueError(f"wait_value: index {index} outside flags of {flags.numel()} entries")
    counters = flags if flags.dtype == torch.int32 else flags.view(torch.int32)
    use_timer = counters.is_cuda
    err = record_buffer(counters.device)
    args = (counters, index, int(target), err, bound_us(timeout_ms), max_polls, int(tag))
    # SYS: the final acquire at system scope, for flags another GPU writes
    consts = dict(USE_TIMER=use_timer, UNTIL_EQUAL=bool(until_equal), SYS=bool(sys_scope))
    key = (counters.device.index, use_timer, bool(until_equal), bool(sys_scope), aligned(counters), aligned(err),
           err.is_cuda, int_kind(index), int_kind(args[2]), int_kind(args[4]), int_kind(max_polls),
           int_kind(args[6]))
    try:
        _launch(key, (1,), args, consts, num_warps=1)
    except Exception as e:
        if not err.is_pinned() or "ointer" not in str(e):
            raise
        # This Triton refused the pinned host pointer: keep the record in device memory.
        err = _use_device_record(counters.device)
        _launch(key[:5] + (aligned(err), True) + key[7:], (1,), (*args[:3], err, *args[4:]), consts, num_warps=1)


def failure(device: torch.device, synchronize: bool = False) -> tuple[int, int, int] | None:
    """(tag, seen, target) of a failed wait on ``device`` since the last ``clear``, else None.
    Without ``synchronize`` a record kept in device memory is not read (that would sync)."""
    key = (device.type, device.index if device.index is not None else 0)
    buf = _records.get(key)
    if buf is None:
        return None
    if synchronize and device.type == "cuda":
        torch.cuda.synchronize(device)
    elif buf.is_cuda:
        return None
    vals = buf.tolist()
    if vals[4] == 0:
        return None
    return vals[1], vals[2], vals[3]


def clear(device: torch.device) -> None:
    key = (device.type, device.index if device.index is not None else 0)
    buf = _records.get(key)
    if buf is not None:
        buf.zero_()
