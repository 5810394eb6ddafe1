"""moe_fused's one-pass SwiGLU elementwise steps (templates/moe_fused/swiglu_kernels.py) against
eager autograd's formulas in float64: the torch path (CPU tensors) and the Triton kernels through
Triton's interpreter (a subprocess, so TRITON_INTERPRET=1 leaks into no other test); odd shapes,
2-D and 3-D, operands that are column blocks of a wider saved layout (strided rows and batches),
float32 and bfloat16; the backward with gate and up read through a row index (-1: zeros)."""
from __future__ import annotations

import pytest
import torch

from tests.interpreter import run_interpreted

from overlap_compile.templates.moe_fused.swiglu_kernels import silu_mul, silu_mul_backward

# (shape, dtype, strided): strided operands are the middle column block [:, n:2n] of a [B, 3n, F] tensor
CASES = [((1, 1), torch.float32, False), ((37, 300), torch.float32, False), ((3, 17, 257), torch.bfloat16, True),
         ((2, 5, 1000), torch.float32, True), ((4, 33, 31), torch.bfloat16, False)]


def _operand(shape, dtype, strided: bool, g: torch.Generator) -> torch.Tensor:
    if not strided:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    b, n, f = shape
    return (torch.randn(b, 3 * n, f, generator=g) * 3).to(dtype)[:, n:2 * n]


def reference(d_act, gate, up):
    """Eager autograd's gradient of silu(gate) * up, float64."""
    g, u = gate.double().requires_grad_(), up.double().requires_grad_()
    act = torch.nn.functional.silu(g) * u
    act.backward(d_act.double())
    return act.detach(), g.grad, u.grad


def check(shape, dtype, strided: bool) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    gate, up, d_act = (_operand(shape, dtype, strided, g) for _ in range(3))
    act_want, dg_want, du_want = reference(d_act, gate, up)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    out = _operand(shape, dtype, strided, g)
    assert silu_mul(gate, up, out=out) is out
    torch.testing.assert_close(out.double(), act_want, rtol=tol, atol=tol)
    torch.testing.assert_close(silu_mul(gate, up).double(), act_want, rtol=tol, atol=tol)
    d_gate, d_up = _operand(shape, dtype, strided, g), _operand(shape, dtype, strided, g)
    silu_mul_backward(d_act, gate, up, d_gate, d_up)
    torch.testing.assert_close(d_gate.double(), dg_want, rtol=tol, atol=tol)
    torch.testing.assert_close(d_up.double(), du_want, rtol=tol, atol=tol)


def check_gather() -> None:
    """gate and up as the [3, 5, 40] middle column block of a [3, 15, 40] layout, read through 7
    rows (two of them -1); d_act, d_gate, d_up [7, 40]: equal to the same step on gathered copies."""
    g = torch.Generator().manual_seed(9)
    gate_full, up_full = torch.randn(3, 15, 40, generator=g) * 3, torch.randn(3, 15, 40, generator=g)
    gate, up = gate_full[:, 5:10], up_full[:, 5:10]
    rows = torch.tensor([14, -1, 0, 7, 3, -1, 9])
    flat_g, flat_u = gate.reshape(-1, 40), up.reshape(-1, 40)
    pick = [(flat_g[i], flat_u[i]) if i >= 0 else (torch.zeros(40), torch.zeros(40)) for i in rows.tolist()]
    g_rows, u_rows = torch.stack([p[0] for p in pick]), torch.stack([p[1] for p in pick])
    d_act = torch.randn(7, 40, generator=g)
    _, dg_want, du_want = reference(d_act, g_rows, u_rows)
    d_gate, d_up = torch.full((7, 40), float("nan")), torch.full((7, 40), float("nan"))
    silu_mul_backward(d_act, gate, up, d_gate, d_up, rows=rows)
    torch.testing.assert_close(d_gate.double(), dg_want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d_up.double(), du_want, rtol=1e-5, atol=1e-5)
    assert d_gate[1].abs().sum() == 0 and d_up[5].abs().sum() == 0


@pytest.mark.parametrize("shape,dtype,strided", CASES)
def test_torch_path(shape, dtype, strided):
    check(shape, dtype, strided)


def test_gathered_gate_and_up_torch_path():
    check_gather()
    with pytest.raises(ValueError, match="len\\(rows\\)"):
        silu_mul_backward(torch.zeros(3, 4), torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(3, 4),
                          rows=torch.tensor([0, 1]))


def test_written_block_only():
    """Writing a column block of the saved layout leaves the other blocks as they were."""
    g = torch.Generator().manual_seed(0)
    full = torch.randn(2, 30, 64, generator=g)
    before = full.clone()
    gate, up = torch.randn(2, 10, 64, generator=g), torch.randn(2, 10, 64, generator=g)
    silu_mul(gate, up, out=full[:, 10:20])
    assert torch.equal(full[:, :10], before[:, :10]) and torch.equal(full[:, 20:], before[:, 20:])
    assert not torch.equal(full[:, 10:20], before[:, 10:20])


def test_bad_inputs_are_named():
    x = torch.zeros(4, 6)
    with pytest.raises(ValueError, match="share one"):
        silu_mul(x, torch.zeros(4, 5))
    with pytest.raises(ValueError, match="unit column stride"):
        silu_mul(x, torch.zeros(6, 4).t())
    with pytest.raises(ValueError, match="share one"):
        silu_mul_backward(x, x, x, x, torch.zeros(2, 4, 6))


def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed")
    code = ("import tests.test_moe_swiglu_kernels as t\n"
            "from overlap_compile.templates.moe_fused import swiglu_kernels as k\n"
            "import torch\n"
            "assert k._use_triton(torch.zeros(1)), 'the interpreter path is not taken'\n"
            "for c in t.CASES:\n    t.check(*c)\n"
            "t.test_written_block_only()\n"
            "t.check_gather()\n"
            "print('ALL OK')\n")
    run_interpreted(code)
