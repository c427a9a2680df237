"""glmc's custom ops keep their declared contracts."""
from __future__ import annotations

import pytest
import torch

from glmc import kernels  # noqa: F401  (registers the ops)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_backward_leaves_its_inputs_alone(dtype) -> None:
    """Declared `mutates_args=()`: fp32 logits were once overwritten by an in-place exp."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 17, generator=g).to(dtype)
    target = torch.randint(0, 17, (9,), generator=g)
    before = logits.clone()
    loss, lse = torch.ops.glmc.cross_entropy(logits, target, -100, 1)
    grad = torch.ops.glmc.cross_entropy_backward(torch.ones(()), logits, target, lse, -100, 1)
    assert torch.equal(logits, before)
    logits32 = before.float().requires_grad_()
    torch.autograd.backward(torch.nn.functional.cross_entropy(logits32, target))
    torch.testing.assert_close(grad.float(), logits32.grad, rtol=2e-2 if dtype != torch.float32
                               else 1e-5, atol=1e-3 if dtype != torch.float32 else 1e-7)
