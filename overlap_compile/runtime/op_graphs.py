"""Host-launched template ops replayed from CUDA graphs, one graph per (call site, buffers).

A template op queues many small pieces (stream forks, events, flag writes, wait kernels, GEMM
slices), all capturable, so a call is captured once and later calls with the same key replay it.
The key: the plan and every input's address, shape, strides and dtype, plus the output buffers,
which the op allocates from the caching allocator *before* the lookup (a fresh tensor per call,
the same addresses in a steady state). State living between calls (symmetric buffers, flags)
returns to its initial values each call, so a replay is a fresh call. A key runs as usual the
first time, is captured the second, replayed after; temporaries share one graph pool per device.
Inside another capture the op runs as written; a failed capture warns and runs it as written.

Where the addresses do not settle (a training step's activations land elsewhere every step: the
caching allocator's free lists differ between steps) graphs are captured and never replayed, host
time and pool memory for nothing. A graph is stale when its site (static key) made more calls since
its capture than the site has graphs, plus ``STALE_AFTER``, without replaying it (a model whose L
layers share a site replays each layer's graph L calls later). A site with ``STALE_GRAPHS`` stale
graphs is "declined": its graphs never replayed are dropped, and its calls run as written until one
call's buffers come back ``SETTLED_SIGHTINGS`` times. Then that call is captured as before: the
same site in an inference graph after training (its plan is the training forward's), whose
buffers do settle, still gets its graph, while a training step's buffers seldom come back that often.
"""
from __future__ import annotations

import collections
import contextlib
import threading
import warnings
from typing import Callable, Iterator, Sequence

import torch

from . import cublas_workspaces, failed_capture

CAPTURE_ON_SIGHT = 2  # the n-th call with the same key is captured (1: the first one runs as usual)
MAX_GRAPHS = 256  # per process; the least recently replayed graph is dropped past this
MAX_SEEN = 4096  # keys seen once and not (yet) captured; forgotten all at once past this
STALE_AFTER = 4  # calls past a site's graph count after which a graph never replayed is stale
STALE_GRAPHS = 2  # stale graphs that make a site declined
SETTLED_SIGHTINGS = 4  # sightings of one call's buffers after which a declined site captures it

_lock = threading.Lock()
_graphs: "collections.OrderedDict[tuple, torch.cuda.CUDAGraph]" = collections.OrderedDict()
_seen: dict[tuple, int] = {}
_failed: dict[tuple, str] = {}  # static key -> why its capture failed (run as written from then on)
_pools: dict[int, tuple] = {}
_live = collections.Counter()  # device index -> graphs alive in its pool
_side: dict[int, torch.cuda.Stream] = {}
_calls = collections.Counter()  # static key -> its calls so far
_born: dict[tuple, int] = {}  # key -> its static key's call count when it was captured
_replays = collections.Counter()  # key -> replays of its graph
_declined: dict[tuple, str] = {}  # static key -> why it is captured no more
# "eager", "captured", "replayed", "failed"; "declined": eager calls of declined sites
stats = collections.Counter()
_scope = threading.local()  # .token: the namespace of this thread's calls inside apart()


def tensor_key(t: torch.Tensor | None) -> tuple | None:
    """What a graph assumes about an input: where it is and how it is laid out."""
    if t is None:
        return None
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def run(static_key: tuple, device: torch.device, inputs: Sequence[torch.Tensor | None],
        outputs: Sequence[torch.Tensor], call: Callable[[], None],
        check_errors: Callable[[], None] | None = None) -> None:
    """Do ``call()`` (the op's stream work, writing into ``outputs``) now, replayed from a graph
    when this exact call was captured before. ``static_key`` names the site (template, plan,
    group); ``check_errors`` raises a failure an earlier call recorded on the device (a captured
    call does not run the op's Python, so its own check would not run on a replay)."""
    if torch.cuda.is_current_stream_capturing():
        call()
        return
    scope = getattr(_scope, "token", None)
    if scope is not None:
        static_key = (scope, static_key)
    key = (static_key, device.index, tuple(tensor_key(t) for t in inputs), tuple(o.data_ptr() for o in outputs))
    _calls[static_key] += 1
    graph = _graphs.get(key)
    if graph is not None:
        if check_errors is not None:
            check_errors()
        with _lock:
            if key in _graphs:
                _graphs.move_to_end(key)
            _replays[key] += 1
        graph.replay()
        stats["replayed"] += 1
        return
    if static_key not in _failed:
        needed = SETTLED_SIGHTINGS if static_key in _declined else CAPTURE_ON_SIGHT
        seen = _seen.get(key, 0) + 1
        if len(_seen) >= MAX_SEEN:
            _seen.clear()  # a model whose addresses never repeat: nothing here will be captured anyway
        _seen[key] = seen
        if seen >= needed and _unsettled(static_key):
            _seen.pop(key, None)
            seen = 0
        graph = _capture(static_key, device, call) if seen >= needed else None
        if graph is not None:
            with _lock:
                _seen.pop(key, None)
                _graphs[key] = graph
                _born[key] = _calls[static_key]
                _live[device.index] += 1
                while len(_graphs) > MAX_GRAPHS:
                    _drop(*_graphs.popitem(last=False))
            if check_errors is not None:
                check_errors()
            graph.replay()
            stats["captured"] += 1
            return
    if static_key in _declined:
        stats["declined"] += 1
    call()  # as written: a first sighting, a failed capture, or a site whose capture failed before
    stats["eager"] += 1


def _unsettled(static_key: tuple) -> bool:
    """Whether ``static_key`` has STALE_GRAPHS stale graphs (the module doc); if so it is declined
    from now on and its graphs never replayed are dropped."""
    with _lock:
        site = [k for k in _graphs if k[0] == static_key]
        now = _calls[static_key]
        stale = [k for k in site if not _replays[k] and now - _born[k] > len(site) + STALE_AFTER]
        if len(stale) < STALE_GRAPHS:
            return False
        _declined[static_key] = (f"{len(stale)} of its {len(site)} graphs were not replayed within "
                                 f"{len(site) + STALE_AFTER} calls: its buffers move between calls")
        for k in site:
            if not _replays[k]:
                _drop(k, _graphs.pop(k))
        return True


def declined() -> dict[tuple, str]:
    """The sites (static keys) captured no more, and why."""
    return dict(_declined)


def _drop(key: tuple, graph: torch.cuda.CUDAGraph) -> None:
    """Forget one graph; with the last graph of a device its memory pool goes too (torch frees a
    pool when no graph uses it, and its handle must not be used again)."""
    device = key[1]
    _replays.pop(key, None)
    _born.pop(key, None)
    graph.reset()
    _live[device] -= 1
    if _live[device] == 0:
        _pools.pop(device, None)


def clear() -> None:
    """Drop every graph (their pool memory goes back once no graph holds it)."""
    with _lock:
        while _graphs:
            _drop(*_graphs.popitem(last=False))
        _seen.clear()
        _failed.clear()
        _declined.clear()
        _calls.clear()
        stats.clear()


@contextlib.contextmanager
def apart(device: torch.device | str | None = None) -> Iterator[None]:
    """The calls this thread makes inside the block are kept apart from the process's: keyed in a
    namespace of their own, so a site the model's steps declined (or whose capture failed) is
    captured and replayed here as in a fresh process, and nothing here counts toward the model's
    sites. At the end, once ``device`` is idle, the block's graphs and records go. For settle's
    timing (predictor/exhaustive.py): its buffers go with it (runtime.symm.dropped_after), and a
    graph keeps the addresses it was captured with; a later call landing there would replay it
    into memory that is no longer there. And a site timed after the model ran (an inference graph
    compiled after training) is timed as it runs once its buffers settle, not as a declined one."""
    token = object()
    outer = getattr(_scope, "token", None)
    _scope.token = token
    try:
        yield
    finally:
        _scope.token = outer
        with _lock:
            made = [k for k in _graphs if _in_scope(k, token)]
        if made and device is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize(device)  # no replay of them still running
        with _lock:
            for k in made:
                if k in _graphs:
                    _drop(k, _graphs.pop(k))
            for table in (_seen, _calls, _failed, _declined):
                for k in [k for k in table if _in_scope(k, token)]:
                    del table[k]


def _in_scope(key: tuple, token: object) -> bool:
    """Whether ``key`` (a static key, or a call's key whose first item is one) is ``token``'s."""
    head = key[0]
    return head is token or (isinstance(head, tuple) and len(head) > 0 and head[0] is token)


def failures() -> dict[tuple, str]:
    return dict(_failed)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream captures run on (never the caller's: it may be the legacy default stream,
    which cannot be captured). Made once per device, with a small GEMM run on it so that the
    cuBLAS state of that stream exists before its first capture."""
    s = _side.get(device.index)
    if s is None:
        s = torch.cuda.Stream(device)
        s.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(s):
            x = torch.ones(16, 16, device=device, dtype=torch.bfloat16)
            torch.mm(x, x)
        torch.cuda.current_stream(device).wait_stream(s)
        _side[device.index] = s
    return s


def pool_bytes(device: torch.device | int) -> int:
    """Bytes the graphs' pool on ``device`` holds (reserved: its blocks serve replays only, and
    ``torch.cuda.max_memory_allocated`` does not count them once captured); 0 where none."""
    index = device.index if isinstance(device, torch.device) else device
    ours = _pools.get(index)
    if ours is None:
        return 0
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if seg.get("device", index) == index and tuple(seg.get("segment_pool_id", (0, 0))) == tuple(ours))


def _pool(device: torch.device) -> tuple:
    p = _pools.get(device.index)
    if p is None:
        p = _pools[device.index] = torch.cuda.graph_pool_handle()
    return p


def _capture(static_key: tuple, device: torch.device, call: Callable[[], None]) -> torch.cuda.CUDAGraph | None:
    """The op's stream work recorded on the side stream (nothing runs), or None after a failed
    capture (remembered: that site runs as written from then on)."""
    caller, side = torch.cuda.current_stream(device), _side_stream(device)
    side.wait_stream(caller)
    graph = torch.cuda.CUDAGraph()
    error: BaseException | None = None
    # the side stream's cuBLAS workspace: allocated in the graphs' pool during the capture, none
    # left outside it (runtime/cublas_workspaces.py)
    with cublas_workspaces.released(), torch.cuda.stream(side):
        # thread-local: another thread's CUDA calls (a compile worker) cannot spoil this capture
        graph.capture_begin(pool=_pool(device), capture_error_mode="thread_local")
        try:
            call()
        except BaseException as e:  # noqa: BLE001 - reported below, the call then runs as written
            error = e
        finally:
            try:
                graph.capture_end()
            except BaseException as e:  # noqa: BLE001
                error = error or e
    caller.wait_stream(side)
    if error is None:
        return graph
    why = f"{type(error).__name__}: {error}"
    _failed[static_key] = why
    del graph
    failed_capture.recover(device, side)  # the generator out of capture mode, as before the attempt
    if _live[device.index] == 0:
        _pools.pop(device.index, None)  # the failed capture was the pool's only user: it is gone
    stats["failed"] += 1
    warnings.warn(f"overlap_compile: {static_key[0]} could not be captured into a CUDA graph for host-launched "
                  f"replay ({why}); this site runs as written (per-call host launches) from now on")
    return None
