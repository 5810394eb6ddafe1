"""Run a function on W processes with an initialised process group (gloo on CPU, nccl on GPUs).

    results = run_distributed(my_module.check, world_size=2, args=(...,), timeout_s=300)

The function must be importable by qualified name (a module-level function). Each rank's return
value comes back in rank order; an exception on any rank is re-raised here with that rank's
traceback; a rank that does not finish within ``timeout_s`` fails the run (no hang).

A rank reports its result after a barrier and *before* tearing its process group down: with NCCL
collectives captured in a CUDA graph (mode="reduce-overhead"), ``destroy_process_group`` can hang
(pytorch/pytorch#115388, seen here after the last case of a test and at the end of an e2e run), so
the results are in hand and a rank still stuck in teardown a few seconds later is killed.

A test suite pays process start-up (Python, importing torch and the library: seconds per rank) on
every run. ``keep_ranks_between_runs()`` (tests/conftest.py) keeps W gloo ranks alive between runs
instead, which import once and fork a child per run: each run still has a process, a group and a
store of its own and the library's state as imported, but not the imports' cost. A run that fails
or times out stops the kept ranks, and the next run starts fresh ones. Runs with ``env``, over
NCCL, off Linux or with ``reuse=False`` start their own processes.
"""
from __future__ import annotations

import atexit
import importlib
import multiprocessing as mp
import os
import queue as queue_mod
import socket
import sys
import time
import traceback
from typing import Any, Callable


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TEARDOWN_S = 10  # seconds a rank that reported gets to tear its process group down and exit


class DistributedFailure(RuntimeError):
    pass


def _worker(rank: int, world: int, port: int, backend: str, target: str, args: tuple, kwargs: dict,
            queue: Any, env: dict) -> None:
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    try:
        import torch
        import torch.distributed as dist

        if backend == "nccl":
            torch.cuda.set_device(rank)
        torch.set_num_threads(1)
        dist.init_process_group(backend, rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank) if backend == "nccl" else None)
        module, name = target.rsplit(".", 1)
        fn = getattr(importlib.import_module(module), name)
        result = fn(*args, **kwargs)
        if dist.is_initialized():  # a function may end with its own teardown (tests of it)
            dist.barrier()
        queue.put((rank, True, result))
    except BaseException:
        # Report at once and leave the process group alone: the other ranks may be blocked in a
        # collective this rank will never join, so a barrier or teardown here would hang until
        # the backend's timeout (seen: a benchmark rank failing, the run hanging for minutes).
        # run_distributed stops the other ranks when it reads this.
        queue.put((rank, False, traceback.format_exc()))
        return
    from ..runtime import teardown

    try:  # barrier, release, destroy; rank 0 (the store's host) leaves last
        teardown.finish(timeout_s=TEARDOWN_S / 2)
    except Exception:
        pass  # may hang or fail (see the module docstring): the parent kills a rank still here


def run_distributed(fn: Callable | str, world_size: int = 2, args: tuple = (), kwargs: dict | None = None,
                    backend: str = "gloo", timeout_s: float = 300, env: dict | None = None,
                    reuse: bool | None = None) -> list[Any]:
    """``fn(*args, **kwargs)`` on every rank; the ranks' return values in rank order. ``reuse``:
    run on ranks kept between runs (None: as ``keep_ranks_between_runs`` set it; never with
    ``env``, over NCCL or off Linux)."""
    target = fn if isinstance(fn, str) else f"{fn.__module__}.{fn.__qualname__}"
    if (_keep_ranks if reuse is None else reuse) and not env and backend == "gloo" and sys.platform == "linux":
        return _kept_ranks(world_size).run(target, args, kwargs or {}, timeout_s)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, backend, target, args, kwargs or {}, queue, env or {}),
                    daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        _collect(target, procs, queue, timeout_s, results, errors)
    finally:
        for p in procs:
            p.join(timeout=TEARDOWN_S if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    return _returned(target, results, errors)


ERROR_GRACE_S = 2.0  # after a rank's failure, how long the others' reports are still read
DIED = "process exited"  # how a rank whose process died without reporting is reported


def _collect(target: str, procs: list, queue: Any, timeout_s: float, results: dict, errors: dict) -> None:
    """Fill ``results`` / ``errors`` (rank -> payload) from ``queue`` until every rank reported, or
    ERROR_GRACE_S after the first failure (the others may now wait in a collective it will never
    join). The grace lets a failure's cause arrive beside its echoes: a rank that died is reported
    by its parent a moment after its peers report the connection it closed. A rank whose process
    died is an error; past ``timeout_s`` with no failure raises DistributedFailure naming the ranks
    still out."""
    world_size = len(procs)
    deadline = time.monotonic() + timeout_s
    grace = False
    while len(results) + len(errors) < world_size:
        if errors and not grace:
            grace, deadline = True, min(deadline, time.monotonic() + ERROR_GRACE_S)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if errors:
                return
            raise DistributedFailure(
                f"{target}: ranks {sorted(set(range(world_size)) - set(results))} did not finish "
                f"within {timeout_s:.0f}s"
            )
        try:
            rank, ok, payload = queue.get(timeout=min(remaining, 1.0))
        except queue_mod.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results and i not in errors]
            if dead:
                errors.update({i: f"{DIED} with code {procs[i].exitcode}" for i in dead})
            continue
        (results if ok else errors)[rank] = payload


def _returned(target: str, results: dict, errors: dict) -> list[Any]:
    """The ranks' results in rank order, or DistributedFailure with the failure that caused the
    others: a rank whose process died (its peers' errors are the connection it closed), else the
    first reported (``errors`` keeps the order they came in)."""
    if errors:
        died = [r for r, e in errors.items() if e.startswith(DIED)]
        first = died[0] if died else next(iter(errors))
        others = sorted(set(errors) - {first})
        also = f"\n(ranks {others} failed too)" if others else ""
        raise DistributedFailure(f"{target} failed on rank {first}:\n{errors[first]}{also}")
    return [results[r] for r in range(len(results))]


# ---- ranks kept between runs (test suites) ------------------------------------------------------

_keep_ranks = False
_kept: dict[int, "_KeptRanks"] = {}


def keep_ranks_between_runs(on: bool = True) -> None:
    """Gloo runs without ``env`` reuse W processes per world size from now on (``on``), or start
    their own again (the kept ones are stopped)."""
    global _keep_ranks
    _keep_ranks = on
    if not on:
        stop_kept_ranks()


def stop_kept_ranks() -> None:
    for ranks in list(_kept.values()):
        ranks.stop()


def _kept_ranks(world_size: int) -> "_KeptRanks":
    ranks = _kept.get(world_size)
    if ranks is None:
        ranks = _kept[world_size] = _KeptRanks(world_size)
    return ranks


def _kept_worker(rank: int, world: int, tasks: Any, queue: Any) -> None:
    """A kept rank: imports once what every run imports, then forks one child per task that runs
    it as ``_worker`` does in a process of its own (its own group and store, the library's state
    as imported, its teardown), and waits for it. A child that dies before reporting is reported
    here. Runs on Linux (fork, and the child dies with this process: PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    import torch  # imported once, here, for every child
    import overlap_compile  # noqa: F401
    if torch.version.cuda is None:
        # and, on a CPU build, the compiler's modules a child's first torch.compile imports (about
        # 1 s each time). Imports only: a warm-up compile here was tried and dropped (one run hung,
        # and the runs were slower). Not on a CUDA build: importing Inductor's benchmarking module
        # calls torch.cuda.is_available(), which registers torch's fork handler there, and every
        # child forked after it refuses to initialise CUDA.
        import torch._functorch.aot_autograd  # noqa: F401
        import torch._inductor.codegen.cpp  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401
        import torch._inductor.fx_passes.post_grad  # noqa: F401
        import torch._inductor.scheduler  # noqa: F401

    libc = ctypes.CDLL(None, use_errno=True)
    while True:
        task = tasks.get()
        if task is None:
            return
        port, target, args, kwargs = task
        if torch.cuda.is_initialized():  # a forked child could not use CUDA
            queue.put((rank, False, "a kept rank initialised CUDA before forking its run; run this one with "
                                    "reuse=False"))
            return
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: stopping the kept rank stops its run
                _worker(rank, world, port, "gloo", target, args, kwargs, queue, {})
                queue.close()
                queue.join_thread()  # the report is written before the child leaves
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if status:
            queue.put((rank, False, f"{DIED} with status {status} before it reported"))


class _KeptRanks:
    """W spawned ranks that run one target after another (``run``), each run in forked children."""

    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.queue = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.procs = [ctx.Process(target=_kept_worker, args=(r, world_size, self.tasks[r], self.queue),
                                  daemon=False) for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, target: str, args: tuple, kwargs: dict, timeout_s: float) -> list[Any]:
        port = free_port()
        for t in self.tasks:
            t.put((port, target, args, kwargs))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        try:
            _collect(target, self.procs, self.queue, timeout_s, results, errors)
        except BaseException:
            self.stop(kill=True)
            raise
        if errors:
            self.stop(kill=True)
        return _returned(target, results, errors)

    def stop(self, kill: bool = False) -> None:
        """Ask the ranks to leave (``kill``: at once) and forget them; one still there after
        TEARDOWN_S is killed."""
        if _kept.get(len(self.procs)) is self:
            del _kept[len(self.procs)]
        if not kill:
            for p, t in zip(self.procs, self.tasks):
                if p.is_alive():
                    t.put(None)
        for p in self.procs:
            p.join(timeout=TEARDOWN_S if not kill else 0.5)
            if p.is_alive():
                p.kill()
                p.join()


atexit.register(stop_kept_ranks)


def assert_no_gpu_failures(fn: Callable | str, world_size: int, args: tuple = (), timeout_s: float = 600,
                           shown: int = 30) -> None:
    """The GPU tests' common ending: skip (pytest) with fewer than ``world_size`` GPUs, else run
    ``fn`` on every rank over NCCL; each rank returns a list of failure lines, and any line fails
    the test (the first ``shown`` of them in the message)."""
    import pytest
    import torch

    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs, found {torch.cuda.device_count()}")
    fails = [f for per_rank in run_distributed(fn, world_size=world_size, args=args, backend="nccl",
                                               timeout_s=timeout_s) for f in per_rank]
    assert not fails, "\n".join(fails[:shown])
