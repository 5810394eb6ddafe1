"""tile_fused (TileLink): a persistent GEMM whose tiles are pushed to (or pulled from) the peers tile
by tile, with release/acquire signals.

spec.py (what it supports, its configurations, the graph it emits), op.py (its ops), model.py (its
latency model), reference.py (the algorithm on any device: the oracle), kernels.py (the ops' run
path on GPUs; it re-exports the next two), launch.py (the host launchers, error records, symmetric
buffers and streams), jit_kernels.py (the @triton.jit kernels), primitives.py (the Triton signal
primitives). The registry (templates/__init__.py) finds the spec, ops and model
by the template's name.
"""
