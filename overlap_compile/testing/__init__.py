"""Helpers for tests, benchmarks and CPU tools: the multi-process harness (``multiprocess.py``,
gloo on CPU, nccl on GPUs), a fake process group (``fake_group.py``) and the GEMM/collective
patterns as a model writes them (``patterns.py``)."""
