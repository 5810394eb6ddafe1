"""moe_fused's dispatch-buffer scatter (templates/moe_fused/scatter.py): ``zeros(rows, width)``
with ``src[i]`` added into row ``index[i]``, against the graph's own op (index_put with
accumulate on zeros, in float64): the torch path on CPU tensors, the Triton kernels through
Triton's interpreter (in a subprocess, so TRITON_INTERPRET=1 leaks into no other test), odd
sizes, slots with one writer, several writers, none, negative and out-of-range indices; the op's
errors name what is wrong."""
from __future__ import annotations

import pytest
import torch

from tests.interpreter import run_interpreted

from overlap_compile.templates.moe_fused import scatter

# (choices n, width, rows, dtype, index kind)
CASES = [(1, 1, 1, torch.float32, "unique"), (37, 129, 53, torch.float32, "unique"),
         (40, 300, 40, torch.float16, "permutation"), (64, 257, 20, torch.float32, "duplicates"),
         (33, 17, 50, torch.float32, "clamped"), (12, 9, 25, torch.float32, "negative"), (0, 8, 5, torch.float32, "unique")]


def operands(n: int, width: int, rows: int, dtype, kind: str, index_dtype=torch.int64):
    g = torch.Generator().manual_seed(n * 1000 + width)
    src = torch.randn(n, width, generator=g).to(dtype)
    if kind == "unique":  # n distinct slots of rows (rows >= n)
        index = torch.randperm(rows, generator=g)[:n]
    elif kind == "permutation":
        index = torch.randperm(n, generator=g)
    elif kind == "duplicates":  # several nonzero writers per slot: the sum in any order
        index = torch.randint(0, rows, (n,), generator=g)
    elif kind == "clamped":  # the layer's capacity overflow: dropped choices (zero rows) onto a kept slot
        index = torch.randperm(rows, generator=g)[:n]
        dropped = torch.arange(n) % 4 == 3
        index[dropped] = index[0]
        src[dropped] = 0
    elif kind == "negative":  # index_put's meaning; one out of range (writes nothing)
        index = torch.randperm(rows, generator=g)[:n] - rows
        index[-1] = rows + 3
    else:
        raise ValueError(kind)
    return index.to(index_dtype), src


def check(n, width, rows, dtype, kind, index_dtype=torch.int64, device="cpu") -> None:
    index, src = operands(n, width, rows, dtype, kind, index_dtype)
    inside = (index >= -rows) & (index < rows)
    want = torch.zeros(rows, width, dtype=torch.float64).index_put_((index[inside].long(),), src[inside].double(),
                                                                    accumulate=True)
    index, src = index.to(device), src.to(device)
    got = torch.ops.overlap_compile.moe_scatter_rows(index, src, rows)
    assert got.dtype == dtype and tuple(got.shape) == (rows, width) and got.device == src.device
    want, got = want.to(got.device), got.double()
    if kind in ("duplicates",):  # several nonzero writers: rounded once per add, in any order
        tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    else:  # one nonzero writer per slot: exact
        assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}-{c[2]}rows-{c[4]}" for c in CASES])
def test_torch_path(case):
    if case[4] == "negative":  # ATen's index_put raises on the out-of-range index; the kernels skip it
        index, src = operands(*case)
        index, src, rows = index[:-1], src[:-1], case[2]
        torch.testing.assert_close(scatter.reference(index, src, rows),
                                   torch.zeros(rows, case[1]).index_add_(0, index % rows, src))
        return
    check(*case)


def test_bad_operands_are_named():
    op = torch.ops.overlap_compile.moe_scatter_rows
    with pytest.raises(ValueError, match="index must be 1-D int64 or int32"):
        op(torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 3), 4)
    with pytest.raises(ValueError, match=r"src must be \[len\(index\), width\] = \[3, \*\]"):
        op(torch.zeros(3, dtype=torch.int64), torch.zeros(2, 3), 4)
    with pytest.raises(ValueError, match="rows must be >= 1"):
        op(torch.zeros(2, dtype=torch.int64), torch.zeros(2, 3), 0)


def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed")
    code = ("import tests.test_moe_scatter as t\n"
            "from overlap_compile.templates.moe_fused import scatter as s\n"
            "import torch\n"
            "assert s._use_triton(torch.zeros(1)), 'the interpreter path is not taken'\n"
            "for c in t.CASES:\n    t.check(*c)\n"
            "t.check(37, 129, 53, torch.float32, 'unique', torch.int32)\n"
            "x = torch.randn(6, 10)[:, ::2]\n"  # a strided src (row stride 10, column stride 2)
            "got = s.scatter_add_rows(torch.tensor([4, 0, 2, 1, 3, 5]), x, 6)\n"
            "assert torch.equal(got, torch.zeros(6, 5).index_add_(0, torch.tensor([4, 0, 2, 1, 3, 5]), x))\n"
            "print('ALL OK')\n")
    run_interpreted(code)
