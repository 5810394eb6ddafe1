"""Run a function on W processes with an initialised process group (gloo on CPU, nccl on GPUs).

    results = run_distributed(my_module.check, world_size=2, args=(...,), timeout_s=300)

The function must be importable by qualified name (a module-level function). Each rank's return
value comes back in rank order; an exception on any rank is re-raised here with that rank's
traceback; a rank that does not finish within ``timeout_s`` fails the run (no hang).

A rank reports its result after a barrier and *before* tearing its process group down: with NCCL
collectives captured in a CUDA graph (mode="reduce-overhead"), ``destroy_process_group`` can hang
(pytorch/pytorch#115388, seen here after the last case of a test and at the end of an e2e run), so
the results are in hand and a rank still stuck in teardown a few seconds later is killed.
"""
from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import socket
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
                    backend: str = "gloo", timeout_s: float = 300, env: dict | None = None) -> list[Any]:
    target = fn if isinstance(fn, str) else f"{fn.__module__}.{fn.__qualname__}"
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
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DistributedFailure(
                    f"{target}: ranks {sorted(set(range(world_size)) - set(results) - set(errors))} did not finish "
                    f"within {timeout_s:.0f}s" + (f"; errors so far: {errors}" if errors else "")
                )
            try:
                rank, ok, payload = queue.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results and i not in errors]
                if dead:
                    errors.update({i: f"process exited with code {procs[i].exitcode}" for i in dead})
                continue
            (results if ok else errors)[rank] = payload
            if errors:
                break  # other ranks may now hang in a collective: stop them
    finally:
        for p in procs:
            p.join(timeout=TEARDOWN_S if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        first = min(errors)
        raise DistributedFailure(f"{target} failed on rank {first}:\n{errors[first]}")
    return [results[r] for r in range(world_size)]


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
