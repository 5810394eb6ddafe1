"""cuBLAS workspaces the library would otherwise leave behind.

torch keeps one cuBLAS workspace per (handle, stream) for the life of the process: each thread
has its own handle, and the first GEMM on a (handle, stream) pair allocates a workspace from the
caching allocator (32 MiB on Hopper by default). The library runs GEMMs where the model runs none:
on the thread that times sites while Inductor compiles (predictor/exhaustive.py) and on the side
stream runtime/op_graphs captures on. Each such pair would hold its workspace, memory the model
never gets back. ``released()`` clears every workspace around that work, as Inductor's CUDA-graph
trees do around a recording (torch._inductor.cudagraph_trees.clear_cublas_manager): a workspace a
capture needs is allocated in that graph's pool and goes with it, and the model's own are
allocated again by its next GEMM.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def release() -> None:
    """Free every cuBLAS workspace torch holds (no-op without CUDA or outside a CUDA build)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        clear()


@contextlib.contextmanager
def released() -> Iterator[None]:
    """Workspaces released on entry and on exit: none made inside outlives the block outside a
    graph's pool."""
    release()
    try:
        yield
    finally:
        release()
