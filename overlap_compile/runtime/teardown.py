"""One teardown path for what the template ops own: symmetric buffers, flags, captured op graphs,
routes, agreement records, per-plan warm-up marks, and the work still queued on the device.

    release(group_name)     forget one group's resources (None: every group's, and the graphs)
    install()               release on ``dist.destroy_process_group`` (the default group's: Inductor's
                            CUDA graphs too) and at interpreter exit
    finish(timeout_s=10)    a rank's ending: barrier, release (CUDA graphs too), destroy the default group, and
                            (rank 0, which hosts the store) wait until every rank destroyed its own

torch has no callback on a group's destruction, so ``install`` (called by the first rewritten op)
wraps ``destroy_process_group``. Releasing waits for device work up to signal_timeout_ms plus a
margin; buffers a kernel still uses past that are kept alive with a warning, never freed under it.
"""
from __future__ import annotations

import atexit
import functools
import sys
import threading
import time
import warnings
from typing import Callable

import torch

_lock = threading.Lock()
_releasers: list[Callable[[str | None], None]] = []
_kept: list = []  # buffers not freed because the device did not go idle in time
released: list[str] = []  # "group X" / "all groups" per release, for tests and the soak's log
_installed = False
MARGIN_S = 2.0


def register(fn: Callable[[str | None], None]) -> None:
    """``fn(group_name)`` forgets a module's resources of that group (None: of every group)."""
    with _lock:
        if fn not in _releasers:
            _releasers.append(fn)


def _timeout_s() -> float:
    from .. import config

    return config.current().signal_timeout_ms / 1000 + MARGIN_S


def quiesce(timeout_s: float | None = None) -> bool:
    """Whether every device this process used went idle within ``timeout_s`` (default: the
    signal timeout plus a margin). The synchronisation runs on a helper thread, so a kernel that
    never ends (a collective whose peer is gone) cannot hold the caller."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return True
    done = threading.Event()

    def sync() -> None:
        try:
            for d in range(torch.cuda.device_count()):
                torch.cuda.synchronize(d)
        except Exception:  # a device error: nothing more to wait for
            pass
        done.set()

    threading.Thread(target=sync, name="overlap_compile-quiesce", daemon=True).start()
    return done.wait(_timeout_s() if timeout_s is None else timeout_s)


def release(group_name: str | None = None, timeout_s: float | None = None) -> bool:
    """Forget ``group_name``'s resources (None: every group's, the op graphs too). Returns False
    when the device did not go idle in time: then symmetric buffers are kept, not freed."""
    idle = quiesce(timeout_s)
    if not idle:
        what = f"group {group_name!r}" if group_name is not None else "every group"
        warnings.warn(f"overlap_compile: work on the GPU did not finish within {_timeout_s() if timeout_s is None else timeout_s:.0f} s "
                      f"at the teardown of {what}; its buffers are kept (not freed under a running kernel)")
    for fn in [_release_core] + list(_releasers):
        try:
            fn(group_name, idle) if fn is _release_core else fn(group_name)
        except Exception as e:  # one module's failure must not keep the others' resources
            warnings.warn(f"overlap_compile: teardown step {getattr(fn, '__qualname__', fn)} failed: {e}")
    released.append("all groups" if group_name is None else f"group {group_name}")
    return idle


def _drop_keys(d: dict | set, match: Callable[[object], bool]) -> None:
    for k in [k for k in d if match(k)]:
        d.remove(k) if isinstance(d, set) else d.pop(k, None)


def _release_core(group_name: str | None, idle: bool) -> None:
    """The caches of this package's runtime and templates, by the module that owns each."""
    mods = sys.modules

    # group-keyed caches must go with their group: names restart at "0" after re-initialisation
    def of_group(k: object, at: int) -> bool:
        return group_name is None or (isinstance(k, tuple) and len(k) > at and k[at] == group_name)

    op_graphs = mods.get("overlap_compile.runtime.op_graphs")
    if op_graphs is not None:
        if group_name is None:
            op_graphs.clear()
        else:
            with op_graphs._lock:
                for key in [k for k in op_graphs._graphs if k[0][1:2] == (group_name,)]:
                    op_graphs._drop(key, op_graphs._graphs.pop(key))
                _drop_keys(op_graphs._seen, lambda k: k[0][1:2] == (group_name,))
                _drop_keys(op_graphs._failed, lambda k: k[1:2] == (group_name,))
    symm = mods.get("overlap_compile.runtime.symm")
    if symm is not None:
        with symm._lock:
            gone = [k for k in symm._cache if of_group(k, 0)]
            for k in gone:
                buf = symm._cache.pop(k)
                if not idle:
                    _kept.append(buf)
            _drop_keys(symm._usable, lambda k: of_group(k, 0))
            _drop_keys(symm._grown, lambda k: of_group(k, 0))
    agreement = mods.get("overlap_compile.runtime.agreement")
    if agreement is not None:
        with agreement._lock:
            _drop_keys(agreement._checked, lambda k: of_group(k, 0))
            if group_name is None:  # a new default group brings a new store: its checks count from 1
                agreement._sequence.clear()
    base = mods.get("overlap_compile.templates.base")
    if base is not None:
        _drop_keys(base._routes, lambda k: of_group(k, 2))
    launch = mods.get("overlap_compile.templates.tile_fused.launch")
    if launch is not None:
        with launch._state_lock:
            _drop_keys(launch._local, lambda k: of_group(k, 2))
            _drop_keys(launch._warmed, lambda k: of_group(k, 2))
            if group_name is None:
                if not idle:
                    _kept.extend(launch._err.values())
                launch._err.clear()
                launch._err_host.clear()


def install() -> None:
    """Release a group's resources when it is destroyed, and everything at interpreter exit."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = c10d.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(group=None):
        world = c10d.GroupMember.WORLD
        name = None if group is None or group is world else getattr(group, "group_name", None)
        release(name)
        if name is None:
            drop_cuda_graphs()
        return original(group)

    destroy_process_group.__wrapped_by_overlap_compile__ = True
    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group
    atexit.register(_at_exit)


def drop_cuda_graphs() -> None:
    """Free the CUDA graphs Inductor recorded under mode="reduce-overhead" on this thread (the
    next call of a compiled function records anew). A graph that captured NCCL kernels keeps
    its communicator busy, and destroying the default group under it may not return
    (pytorch/pytorch#115388); with that group gone those graphs cannot run again anyway."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    try:
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees
    except ImportError:
        return
    try:
        reset_cudagraph_trees()
    except Exception as e:  # the group's teardown goes on
        warnings.warn(f"overlap_compile: freeing Inductor's CUDA graphs before destroy_process_group failed: {e}")


def _at_exit() -> None:
    try:
        release(None, timeout_s=_timeout_s())
    except Exception:
        pass


def finish(timeout_s: float = 10.0, group_name: str = "default") -> float:
    """End a rank: barrier, release, destroy the default process group; rank 0 (the store's host)
    then waits until every rank reported its group destroyed, so no rank's watchdog loses the
    store mid-teardown ("Broken pipe"). Bounded by ``timeout_s`` at each step; returns the
    seconds the teardown took. Prints nothing."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    start = time.monotonic()
    if not dist.is_initialized():
        release(None)
        return time.monotonic() - start
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        store = c10d._get_default_store()
    except Exception:
        store = None
    _bounded(dist.barrier, timeout_s, "the closing barrier")
    release(None)
    drop_cuda_graphs()  # here: Inductor keeps its graphs per thread, and the destroy runs on a helper
    _bounded(dist.destroy_process_group, timeout_s, "destroy_process_group")
    if store is not None and world > 1:
        key = f"overlap_compile/finished/{group_name}"
        try:
            store.add(key, 1)
            deadline = time.monotonic() + timeout_s
            while rank == 0 and store.add(key, 0) < world and time.monotonic() < deadline:
                time.sleep(0.01)
        except Exception:  # the host went first: nothing left to wait for
            pass
    return time.monotonic() - start


def _bounded(fn: Callable[[], object], timeout_s: float, what: str) -> None:
    """``fn()`` on a helper thread; past ``timeout_s`` a RuntimeError naming ``what``."""
    errors: list[BaseException] = []
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def run() -> None:
        try:
            if device is not None:  # NCCL's barrier runs on the thread's current device
                torch.cuda.set_device(device)
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            errors.append(e)

    t = threading.Thread(target=run, name=f"overlap_compile-{what}", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise RuntimeError(f"overlap_compile: {what} did not return within {timeout_s:.0f} s")
    if errors:
        raise errors[0]
