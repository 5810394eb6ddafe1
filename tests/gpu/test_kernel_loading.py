"""A spinning kernel must never wait for a kernel the GPU has not loaded yet.

Under CUDA's lazy loading a kernel is loaded at its first launch, and loading may wait for the
context to go idle: a kernel that spins until a not-yet-loaded kernel signals it then waits for
that kernel while the kernel's loading waits for the spin to end (a deadlock until the spin's
bound runs out). tile_fused's GEMM + reduce-scatter had exactly that shape: its push kernel spins
on the GEMM's tiles and was launched first, on the first call of a plan. ``tile_fused.kernels.
_loaded`` loads each kernel when its first call compiles it. Each case here runs in a fresh
process (nothing loaded yet): a bounded wait on one stream, then the first launch of the kernel
that releases it on another.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

SCRIPT = r"""
import json, sys, time
import torch
from overlap_compile.runtime.spin_wait import bound_us
from overlap_compile.templates.tile_fused import kernels as K

preload = sys.argv[1] == "1"
dev = torch.device("cuda", 0)
flags = torch.zeros(1, dtype=torch.int32, device=dev)
err = K._err_buf(dev)
asm = True
try:
    waiter = K._wait_kernel.warmup(flags, 0, 1, err, bound_us(3000), 3_000_000, USE_ASM=asm, USE_TIMER=asm,
                                   grid=(1,), num_warps=1)
    K._loaded(waiter)
except Exception:
    asm = False  # a Triton that rejects the inline asm: the tl.atomic signals
    waiter = K._wait_kernel.warmup(flags, 0, 1, err, bound_us(3000), 3_000_000, USE_ASM=asm, USE_TIMER=asm,
                                   grid=(1,), num_warps=1)
    K._loaded(waiter)
notifier = K._notify_kernel.warmup(flags, 0, USE_ASM=asm, grid=(1,), num_warps=1)
if preload:
    K._loaded(notifier)
torch.cuda.synchronize()
spin, other = torch.cuda.Stream(), torch.cuda.Stream()
t0 = time.perf_counter()
with torch.cuda.stream(spin):
    K._wait_kernel[(1,)](flags, 0, 1, err, bound_us(3000), 3_000_000, USE_ASM=asm, USE_TIMER=asm, num_warps=1)
with torch.cuda.stream(other):
    K._notify_kernel[(1,)](flags, 0, USE_ASM=asm, num_warps=1)
torch.cuda.synchronize()
print(json.dumps({"preload": preload, "asm": asm, "timed_out": int(err[0].item()),
                  "seconds": time.perf_counter() - t0,
                  "module_loading": __import__("os").environ.get("CUDA_MODULE_LOADING")}))
"""


def _run(preload: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}
    out = subprocess.run([sys.executable, "-c", SCRIPT, "1" if preload else "0"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_preloaded_kernel_releases_a_spinning_one():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from overlap_compile.templates.tile_fused import kernels as K

    if not K.available():
        pytest.skip("tile_fused kernels unavailable (Triton / sm_80+)")
    loaded = _run(preload=True)
    lazy = _run(preload=False)  # what the first GEMM+RS call did before _loaded: reported, not asserted
    print(f"preloaded: {loaded}\nloaded at first launch: {lazy}")
    assert loaded["timed_out"] == 0 and loaded["seconds"] < 1.0, loaded
