"""The bucketed ops' baseline path (the bucket's choice "baseline") moves no more memory than the
site as written: no copy at all where the row stripes are one block per rank (outer == 1: a
[seq, batch, hidden] gather on dim 0, or a [batch, seq, hidden] one with batch 1), and exactly one
copy of the gathered matrix / GEMM output where the stripes interleave (outer > 1), the one the
graph's own chunk + cat makes. Run on a fake process group of 2 ranks (no communication); the ops' kernels are called
directly, so that the dispatch mode sees the aten ops inside them."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from overlap_compile.templates.bucketed import BucketTable, run_allgather_gemm, run_gemm_collective
from overlap_compile.testing.fake_group import fake_process_group

BASELINE = ({"max_m": None, "template": "baseline", "config": None},)
COPIES = {"clone", "copy_", "cat", "_reshape_copy", "contiguous", "_to_copy"}
W, K, N = 2, 64, 48


class CountCopies(TorchDispatchMode):
    """Counts the aten ops below the bucketed op that copy a tensor, with the bytes they write."""

    def __init__(self):
        super().__init__()
        self.copies: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in COPIES:
            self.copies.append((name, out.numel() * out.element_size()))
        return out


@pytest.mark.parametrize("outer,expected", [(1, 0), (2, 1)])
def test_allgather_baseline_copies(outer, expected):
    m = 16
    t = BucketTable(kind="allgather_gemm", world=W, k=K, ns=(N, N), has_bias=(False, False), outer=outer,
                    buckets=BASELINE, gathered=False)
    shard = torch.randn(m // W, K)
    bs = [torch.randn(N, K).t(), torch.randn(N, K).t()]
    with fake_process_group(W) as group, CountCopies() as mode:
        outs = run_allgather_gemm(shard, bs, [None, None], group, t.to_json())
    assert [tuple(o.shape) for o in outs] == [(m, K), (m, N), (m, N)]
    assert len(mode.copies) == expected, mode.copies
    assert sum(b for _, b in mode.copies) == expected * m * K * 4  # the gathered matrix, once


@pytest.mark.parametrize("outer,expected", [(1, 0), (2, 1)])
def test_reducescatter_baseline_copies(outer, expected):
    m = 16
    t = BucketTable(kind="gemm_reducescatter", world=W, k=K, n=N, reduce_op="sum", outer=outer, buckets=BASELINE)
    a, b = torch.randn(m, K), torch.randn(N, K).t()
    with fake_process_group(W) as group, CountCopies() as mode:
        out = run_gemm_collective(a, b, None, group, t.to_json())
    assert tuple(out.shape) == (m // W, N)
    assert len(mode.copies) == expected, mode.copies
    assert sum(b for _, b in mode.copies) == expected * m * N * 4  # the GEMM output, once
