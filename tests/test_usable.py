"""Every GPU path answers ``usable(group_name, device, plan=None)`` alike: None when it can run
here, else the reason (a string). templates/base.py and the op files route on ``is None``."""
from __future__ import annotations

import importlib
import inspect

import pytest
import torch

PATHS = [
    "overlap_compile.runtime.symm",
    "overlap_compile.templates.priority_stream.kernels",
    "overlap_compile.templates.tile_fused.kernels",
    "overlap_compile.templates.p2p_ring.kernels",
    "overlap_compile.templates.p2p_ring.kernels_nccl",
    "overlap_compile.templates.moe_fused.kernels",
    "overlap_compile.templates.moe_fused.kernels_nccl",
]


@pytest.mark.parametrize("module", PATHS)
def test_one_signature_and_a_reason_on_cpu(module):
    usable = importlib.import_module(module).usable
    params = list(inspect.signature(usable).parameters.values())
    assert [p.name for p in params] == ["group_name", "device", "plan"]
    assert params[2].default is None
    why = usable("0", torch.device("cpu"))
    assert isinstance(why, str) and why
