"""The Triton code Inductor generates for signal_reorder's reorder fused into a residual +
RMSNorm consumer, per shape (one GPU): how many kernels, and whether the untile stays a view
inside the norm's kernel or is copied out first.

    TORCH_LOGS=output_code python benchmarks/reorder_codegen.py 4096x8192 8192x8192 2> code.txt
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from reorder_consumer import BLOCK, make_reorder, tiles_of  # noqa: E402
from overlap_compile.tiling import TileGrid  # noqa: E402


def main() -> None:
    for spec in sys.argv[1:]:
        m, n = map(int, spec.split("x"))
        grid = TileGrid(m, n, *BLOCK)
        y = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn_like(y)
        w = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
        print(f"===== shape {m}x{n}", file=sys.stderr, flush=True)
        torch._dynamo.reset()
        torch.compile(make_reorder(grid))(tiles_of(y, grid), residual, w)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
