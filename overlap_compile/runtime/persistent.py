"""Long-lived device buffers (flags, error records, pointer tables) allocated outside any CUDA-graph
memory pool.

Inductor's CUDA-graph trees (``mode="reduce-overhead"``) run a graph's first calls with every
allocation *of the calling thread* routed into the graph pool, and then refuse to record when a
tensor in that pool is alive but is not a graph output ("Detected N tensor(s) in the cudagraph
pool not tracked as outputs"). A template's op creates its caches lazily on its first call, i.e.
during that warm-up, so they would land in the pool. ``allocate(fn)`` runs ``fn`` on a worker
thread, whose allocations go to the ordinary caching allocator, and waits for it.
"""
from __future__ import annotations

import concurrent.futures
import threading
from typing import Callable, TypeVar

import torch

T = TypeVar("T")
_WORKER_NAME = "overlap_compile-alloc"
_worker: concurrent.futures.ThreadPoolExecutor | None = None
_lock = threading.Lock()
_streams: dict[int, torch.cuda.Stream] = {}  # used by the worker thread only


def allocate(fn: Callable[[], T]) -> T:
    """``fn()`` with its CUDA allocations outside any graph pool, run on the worker thread's own
    stream; any kernels it queued (a zero fill, a copy) have finished when this returns. On CPU,
    or with no CUDA, simply ``fn()``."""
    global _worker
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return fn()
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("overlap_compile: a persistent buffer was first needed inside a CUDA graph capture; "
                           "run the op once before capturing")
    if threading.current_thread().name.startswith(_WORKER_NAME):  # already there: no second hop (no self-wait)
        return fn()
    with _lock:
        if _worker is None:
            _worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=_WORKER_NAME)
    device = torch.cuda.current_device()

    def run() -> T:
        torch.cuda.set_device(device)
        # a stream of its own, never the legacy default one: that one would queue behind (and
        # wait for) the kernels of every stream, including another op's bounded spin waits
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            out = fn()
        stream.synchronize()
        return out

    return _worker.submit(run).result()


def zeros_int32(n: int, device: torch.device | int | str) -> torch.Tensor:
    """``n`` int32 zeros outside any graph pool (``allocate``): flags and error records."""
    return allocate(lambda: torch.zeros(n, dtype=torch.int32, device=device))
