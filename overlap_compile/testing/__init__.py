"""Helpers for tests, benchmarks and CPU tools: the multi-process harness (``multiprocess.py``,
gloo on CPU, nccl on GPUs), a fake process group (``fake_group.py``), the GEMM/collective
patterns as a model writes them and the plans of single sites (``patterns.py``), and W virtual
ranks on one GPU for the peer-memory templates' protocols (``virtual_ranks.py``)."""
