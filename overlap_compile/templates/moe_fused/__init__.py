"""moe_fused: an expert-parallel MoE section (all-to-all, SwiGLU experts, all-to-all) as a pipeline of
pieces, over NCCL or the copy engine.

spec.py (what it supports, its configurations, the graph it emits), op.py (its ops), model.py (its
latency model), reference.py (the algorithm on any device: the oracle), kernels.py (copy engine),
kernels_nccl.py (NCCL), expert_kernel.py (the persistent SwiGLU kernel). The backward section of
a training step: backward_spec.py (its configuration and plan), backward_op.py (the op
moe_fused_backward, registered by op.py), backward_reference.py (its pipeline on any device),
backward_nccl.py (NCCL). The registry
(templates/__init__.py) finds the spec, ops and model by the template's name.
"""
