"""runtime/persistent.py on CPU: no CUDA, so no worker thread: fn runs once, here, and its result
comes back unchanged (the CUDA path is exercised by tests/gpu/test_reduce_overhead.py)."""
import threading

import torch

from overlap_compile.runtime import persistent


def test_without_cuda_fn_runs_once_in_the_calling_thread():
    calls = []

    def fn():
        calls.append(threading.current_thread().name)
        return torch.zeros(3, dtype=torch.int32)

    out = persistent.allocate(fn)
    assert calls == [threading.current_thread().name]
    assert out.dtype == torch.int32 and out.tolist() == [0, 0, 0]
