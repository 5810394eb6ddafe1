"""priority_stream: the GEMM in row chunks on the compute stream, each chunk's collective on a
high-priority stream as soon as the chunk is done.

spec.py (what it supports, its configurations, the graph it emits), op.py (its ops), model.py (its
latency model), reference.py (the algorithm on any device: the oracle), kernels.py. The registry
(templates/__init__.py) finds the spec, ops and model by the template's name.
"""
