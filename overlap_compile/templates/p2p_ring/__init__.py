"""p2p_ring (CommFuse): the GEMM in row chunks, each sent over a ring of peer transfers as soon as it
is done (all-gather: each shard's GEMM as soon as it arrives).

spec.py (what it supports, its configurations, the graph it emits), op.py (its ops), model.py (its
latency model), reference.py (the algorithm on any device: the oracle), kernels.py (copy engine),
kernels_nccl.py (NCCL send/recv), sum_kernel.py. The registry (templates/__init__.py) finds the
spec, ops and model by the template's name.
"""
