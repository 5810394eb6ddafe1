"""Quick single-GPU check of the Triton GEMM against cuBLAS on a few shapes, with the config and
any compile fallback printed (CUDA graph medians)."""
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from overlap_compile.templates.signal_reorder import kernels  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

warnings.simplefilter("always")
for m, n, k in [(8192, 8192, 4096), (8192, 8192, 7168), (8192, 4096, 2752)]:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    bt = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
    cfg = kernels.choose_config(a.device, m, n, k, a.dtype)
    ref = do_bench_cudagraph(lambda: a @ b)
    for name, bb in (("b row-major", b), ("b = weight.t()", bt)):
        t = do_bench_cudagraph(lambda: kernels.gemm(a, bb))
        err = ((kernels.gemm(a, bb).float() - (a @ bb).float()).norm() / (a @ bb).float().norm()).item()
        print(f"{m}x{n}x{k} {name:>15}: cublas {ref:.3f} triton {t:.3f} ratio {ref / t:.2f} err {err:.1e} cfg {cfg}")
print("fallbacks:", kernels._compile_fallbacks)
print("cache:", kernels.cache_path(), os.path.exists(kernels.cache_path()))
