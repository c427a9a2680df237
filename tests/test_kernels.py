"""glmc's custom ops keep their declared contracts."""
from __future__ import annotations

import pytest
import torch

from glmc.ir import kernels  # noqa: F401  (registers the ops)


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


def test_fused_adam_takes_a_gradient_in_another_layout_than_its_parameter() -> None:
    """Inductor may return a convolution weight's gradient channels-last for a contiguous
    weight (ConvNeXt); ATen's fused kernel walks both element by element in memory, so the
    in-place update copies such a gradient into the parameter's layout first (without it
    ConvNeXt's loss after one AdamW step on Inductor was 2.197 instead of 2.080)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 4, 3, 3, generator=gen)
    grad = torch.randn(8, 4, 3, 3, generator=gen).contiguous(memory_format=torch.channels_last)
    assert grad.stride() != weight.stride()
    ref = weight.clone().requires_grad_()
    ref.grad = grad.contiguous()
    opt = torch.optim.AdamW([ref], lr=0.1)
    opt.step()
    p, m, v = weight.clone(), torch.zeros_like(weight), torch.zeros_like(weight)
    torch.ops.glmc.fused_adam_([p], [grad], [m], [v], [], [torch.tensor(1.0)],  # step 1
                               torch.tensor(0.1), 0.9, 0.999, 0.01, 1e-8, False, False, True, [])
    torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, opt.state[ref]["exp_avg"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("merged", [True, False], ids=["merged", "separate"])
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_gated_mlp_equals_the_unfused_mlp_and_its_autograd(merged, act) -> None:
    """`glmc::gated_mlp` over chunks of 64 rows (300 rows: the last chunk shorter) equals the
    unfused MLP and its autograd gradients in fp64 to rounding; its plain-ATen references
    (what ONNX and step.py get) agree too."""
    g = torch.Generator().manual_seed(0)
    rows, d, inter = 300, 24, 40
    x = torch.randn(rows, d, generator=g, dtype=torch.float64, requires_grad=True)
    w_gate = torch.randn(2 * inter if merged else inter, d, generator=g, dtype=torch.float64,
                         requires_grad=True)
    w_up = None if merged else torch.randn(inter, d, generator=g, dtype=torch.float64,
                                           requires_grad=True)
    w_down = torch.randn(d, inter, generator=g, dtype=torch.float64, requires_grad=True)
    leaves = [x, w_gate, w_down] + ([] if merged else [w_up])
    out = torch.ops.glmc.gated_mlp(x, w_gate, w_up, w_down, act, 64)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, leaves, grad)
    gate, up = (x @ w_gate.t()).chunk(2, -1) if merged else (x @ w_gate.t(), x @ w_up.t())
    ref = (kernels._ACTS[act](gate) * up) @ w_down.t()
    want = torch.autograd.grad(ref, leaves, grad)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(kernels.gated_mlp_reference(x, w_gate, w_up, w_down, act), ref,
                               rtol=1e-12, atol=1e-12)
    gx, gg, gu, gd = kernels.gated_mlp_backward_reference(grad, x, w_gate, w_up, w_down, act)
    for a, b in zip([gx, gg, gd] + ([] if merged else [gu]), want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_gated_mlp_rows_spread_evenly() -> None:
    """Chunks of about the asked rows, the last no sliver; never more rows than there are."""
    assert kernels.mlp_rows(1024, 640, 256) == 256
    assert kernels.mlp_rows(1000, 640, 256) == 250  # 4 chunks, not 3 x 256 + 232
    assert kernels.mlp_rows(10, 640, 256) == 10
    assert kernels.mlp_rows(1024, 640) == 171  # <= 1 MiB of fp32 gate/up per chunk: 6 chunks
    assert kernels.mlp_rows(4096, 13696) == 128  # at least MLP_MIN_ROWS


def test_gated_mlp_in_bf16_sums_its_chunks_in_fp32() -> None:
    """bf16 operands over 4 chunks: outputs and gradients within bf16 rounding of the fp64
    computation; the weight gradients, summed over the chunks in fp32, no further off than
    one unchunked bf16 matmul's."""
    g = torch.Generator().manual_seed(0)
    x, w_gate, w_down = (torch.randn(*shape, generator=g, dtype=torch.float64) / 4
                         for shape in ((256, 32), (96, 32), (32, 48)))
    grad = torch.randn(256, 32, generator=g, dtype=torch.float64)
    want = kernels.gated_mlp_backward_reference(grad, x, w_gate, None, w_down, "silu")
    low = [t.bfloat16() for t in (grad, x, w_gate, w_down)]
    got = torch.ops.glmc.gated_mlp_backward(low[0], low[1], low[2], None, low[3], "silu", 64)
    whole = kernels.gated_mlp_backward_reference(low[0], low[1], low[2], None, low[3], "silu")
    for i in (0, 1, 3):
        err = (got[i].double() - want[i]).abs().max()
        assert err <= 1.5 * (whole[i].double() - want[i]).abs().max() + 1e-3, (i, err)
    out = torch.ops.glmc.gated_mlp(low[1], low[2], None, low[3], "silu", 64)
    torch.testing.assert_close(out.double(), kernels.gated_mlp_reference(
        x, w_gate, None, w_down, "silu"), rtol=2e-2, atol=2e-2)
