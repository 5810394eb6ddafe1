"""p2p_ring's one-pass reduce-scatter tail, ``out = (acc + own + arrived) * scale``, against the
sum in float64: the torch path (CPU tensors) and the Triton kernel through Triton's interpreter
(in a subprocess, so TRITON_INTERPRET=1 leaks into no other test), odd sizes, in place."""
from __future__ import annotations

import pytest
import torch

from tests.interpreter import run_interpreted

from overlap_compile.templates.p2p_ring.sum_kernel import sum_into

CASES = [((1, 1), torch.float32, False, 1.0), ((37, 129), torch.float16, True, 0.25), ((5, 2049), torch.float32, True, 1.0),
         ((3, 4101), torch.float16, False, 0.5)]


def check(shape, dtype, with_acc: bool, scale: float, in_place: bool) -> None:
    g = torch.Generator().manual_seed(shape[1])
    own, arrived = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    acc = torch.randn(shape, generator=g) if with_acc else None
    want = (own.double() + arrived.double() + (acc.double() if with_acc else 0)) * scale
    want_own = own.clone()
    out = sum_into(own if in_place else torch.empty_like(own), own, arrived, acc, scale)
    assert out.dtype == dtype and out.shape == own.shape
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    if not in_place:
        assert torch.equal(own, want_own)


@pytest.mark.parametrize("shape,dtype,with_acc,scale", CASES)
@pytest.mark.parametrize("in_place", [False, True])
def test_torch_path(shape, dtype, with_acc, scale, in_place):
    check(shape, dtype, with_acc, scale, in_place)


def test_bad_inputs_are_named():
    x = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="shapes differ"):
        sum_into(x, x, torch.zeros(4, 5))
    with pytest.raises(ValueError, match="contiguous"):
        sum_into(x, x, torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="acc must be float32"):
        sum_into(x, x, x, torch.zeros(4, 4, dtype=torch.float16))


def test_triton_kernel_under_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed")
    code = ("import tests.test_p2p_ring_sum_kernel as t\n"
            "from overlap_compile.templates.p2p_ring import sum_kernel as k\n"
            "import torch\n"
            "assert k._use_triton(torch.zeros(1)), 'the interpreter path is not taken'\n"
            "for c in t.CASES:\n    t.check(*c, in_place=True); t.check(*c, in_place=False)\n"
            "print('ALL OK')\n")
    run_interpreted(code)
