"""``python -m overlap_compile demo``, the main job, and the models it runs.

* ``run.py``: the entry point: 2+ GPUs -> gpu.py, else CPU processes over gloo; the checks against
  eager
* ``gpu.py``: the demo on GPUs over NCCL, with measured step times
* ``common.py``: what both share: the reference and compiled blocks, the error measure
* ``models.py``: small Llama-style blocks and their TP+SP parallelisation
* ``moe.py``: the expert-parallel MoE layer
"""
