"""tile_fused (TileLink): a persistent GEMM whose tiles are pushed to (or pulled from) the peers tile
by tile, with release/acquire signals.

spec.py (what it supports, its configurations, the graph it emits), op.py (its ops), model.py (its
latency model), reference.py (the algorithm on any device: the oracle), kernels.py, primitives.py
(the Triton signal primitives). The registry (templates/__init__.py) finds the spec, ops and model
by the template's name.
"""
