"""The ``profile`` command (``python -m overlap_compile profile``): measures this machine and writes
its HardwareProfile JSON (the format: predictor/profile.py). It sits above the predictor and the
pass: it times cuBLAS, the templates' Triton GEMMs and the collectives, and, for the host overhead
of each template's op, rewrites a small site with the pass.

* ``command.py``: the command line and the order of the measurements (``main``, ``measure``)
* ``build.py``: what to measure (GEMM shapes, world sizes), the GPU's facts, and the profile dict
  the measurements become (pure, tested on CPU)
* ``bench.py``: timing (CUDA events and graphs, or the CPU clock), the progress bar, the ranks'
  agreement on a number
* ``gemms.py``: the GEMM table: cuBLAS and signal_reorder's Triton kernels
* ``collectives.py``: the collective curves, their launch cost and the GEMM/collective contention
* ``op_overhead.py``: the host overhead of each template's op
"""
