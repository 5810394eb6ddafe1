"""moe_fused's dispatch-buffer scatter (templates/moe_fused/scatter.py) on a GPU: the Triton
kernels against the graph's own op (index_put with accumulate into zeros, float64) for every
case of tests/test_moe_scatter.py in float32, float16 and bfloat16 (bf16 atomic adds), int64 and
int32 indices, and a layer-sized bf16 case (MoE-3's 40,960 choices of 2,048 columns into 51,200
slots, with the capacity overflow's clamped rows)."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernels_equal_index_put(dtype):
    from tests import test_moe_scatter as t

    for n, width, rows, _, kind in t.CASES:
        t.check(n, width, rows, dtype, kind, device="cuda")
    t.check(37, 129, 53, dtype, "unique", torch.int32, device="cuda")


def test_layer_sized_bf16():
    from tests import test_moe_scatter as t

    t.check(40960, 2048, 51200, torch.bfloat16, "clamped", device="cuda")
    t.check(40960, 2048, 51200, torch.bfloat16, "unique", device="cuda")
