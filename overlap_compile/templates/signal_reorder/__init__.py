"""signal_reorder (FlashOverlap): one persistent GEMM whose wave groups signal the collective as their
tiles are done, the received tiles put back in order by graph glue.

spec.py (what it supports, its configurations, the graph it emits), op.py (its ops), model.py (its
latency model), reference.py (the algorithm on any device: the oracle), kernels.py (the op's run
path on GPUs: waits and collectives per wave group; it re-exports the next two), gemm_kernel.py
(the persistent Triton GEMM and its signalling epilogue), gemm_configs.py (its tile configurations
and tuning cache). The registry (templates/__init__.py) finds the spec, ops and model by
the template's name.
"""
