"""Does the one-GPU virtual-rank harness (tests/gpu/test_tile_fused_virtual_ranks.py) catch a broken
protocol? Runs its race with the call-start barrier removed (a fast rank may then push its next
call's tiles into a slot its peer is still reading) and prints the wrong calls and wait failures.

    python benchmarks/diagnostics/tile_fused_mutation_check.py
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))

import test_tile_fused_virtual_ranks as V  # noqa: E402
from overlap_compile.testing.virtual_ranks import patch_everywhere  # noqa: E402


def main() -> None:
    from overlap_compile.templates.tile_fused import kernels as K  # noqa: F401

    for kind, m, n, k in (("gemm_reducescatter", 4096, 4096, 1024), ("gemm_allreduce", 4096, 4096, 1024)):
        for mutation in ("none", "no call-start barrier"):
            with contextlib.ExitStack() as stack:
                if mutation != "none":
                    patch_everywhere(stack, "overlap_compile.templates.tile_fused", "barrier", lambda *a, **kw: None)
                try:
                    r = V.race(kind, m, n, k, 2, 300, torch.bfloat16)
                except Exception as e:  # a wait that timed out is a caught failure too
                    r = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
            print(f"{kind:20s} {mutation:22s} {r}", flush=True)


if __name__ == "__main__":
    main()
