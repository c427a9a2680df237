"""The main model on the main backend, in the default test set: tiny GLM on Inductor, without
and with fusion (the default pipeline), against eager PyTorch."""
from __future__ import annotations

import pytest
import torch

import glmc
from tests.models import CASES, RTOL, assert_state_close, eager_losses, glmc_losses, twin

STEPS = 3


@pytest.mark.parametrize("passes", [pytest.param("cleanup", marks=pytest.mark.slow), None],
                         ids=["cleanup", "default-fusion"])  # cleanup-only: -m slow (70 s)
def test_tiny_glm_on_inductor_matches_eager(passes: str | None) -> None:
    (m, x, loss_fn, opt), (m2, _, _, opt2) = twin(CASES["glm"].make)
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend="inductor",
                            passes=passes, measure=False)
    got = glmc_losses(trainer, x, STEPS)
    want = eager_losses(m2, x, loss_fn, opt2, STEPS)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=0)
    assert got[0] != got[-1], "training must change the loss"
    if passes is None:
        counts = trainer.report.compiles[0].history[0].stats.counts
        assert counts["attention"] > 0 and counts["norm"] > 0  # fusion really fired
    # wk.bias: exact gradient zero, Adam turns its rounding noise into lr-sized steps
    assert_state_close(m, m2, opt, opt2, zero_grad_params=("wk.bias",))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_cross_entropy_backward_reads_the_target_instead_of_summing(reduction, weighted) -> None:
    """The Inductor lowering's cross-entropy rewrite: the same gradient, the class-dim sum
    gone (float64 through ATen here; under Inductor: the next test)."""
    gm, args, grad = _cross_entropy_grad_graph(reduction, weighted, torch.float64)
    from glmc.backends.inductor.backend import _cross_entropy_backward
    want = gm(*args)
    assert _cross_entropy_backward(gm) == 1
    aten = torch.ops.aten
    assert not [n for n in gm.graph.nodes if n.target is aten._log_softmax_backward_data.default]
    got = gm(*args)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    assert (got[[2, 7]] == 0).all()  # ignored rows
    x, t, w, g = args
    xr = x.clone().requires_grad_()
    loss = torch.nn.functional.cross_entropy(xr, t, weight=w, reduction=reduction) * g
    loss.sum().backward()
    torch.testing.assert_close(got, xr.grad, rtol=1e-12, atol=1e-15)


#: compiled rewrite vs compiled original: the same IEEE operations per element, but Inductor's
#: kernels need not evaluate them on the same code path (an AVX-512 host: 3-6 of 444 elements
#: 1-2 ulp apart; bit-identical on AVX2 hosts), so a few ulp, not bit-identity
ULP4 = 4 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_cross_entropy_backward_rewrite_matches_under_inductor_to_a_few_ulp(reduction: str,
                                                                            weighted: bool
                                                                            ) -> None:
    from glmc.backends.inductor.backend import _cross_entropy_backward
    from torch._inductor.compile_fx import compile_fx
    gm, args, _ = _cross_entropy_grad_graph(reduction, weighted, torch.float32)
    want = compile_fx(gm, list(args))(*args)
    assert _cross_entropy_backward(gm) == 1
    got = compile_fx(gm, list(args))(*args)
    got = got[0] if isinstance(got, (tuple, list)) else got
    want = want[0] if isinstance(want, (tuple, list)) else want
    torch.testing.assert_close(got, want, rtol=ULP4, atol=0)
    assert (got[[2, 7]] == 0).all() and (got != 0).sum() > got.numel() // 2


def _cross_entropy_grad_graph(reduction: str, weighted: bool, dtype: torch.dtype):
    """make_fx graph of cross-entropy's input gradient (log_softmax + nll_loss, forward and
    backward as ATen ops), its inputs (two ignored rows) and the gradient's scale."""
    from torch.fx.experimental.proxy_tensor import make_fx
    aten = torch.ops.aten
    red = {"none": 0, "mean": 1, "sum": 2}[reduction]

    def grad(x, t, w, g):
        out = aten._log_softmax.default(x, 1, False)
        _, total = aten.nll_loss_forward.default(out, t, w, red, -100)
        gl = aten.nll_loss_backward.default(g, out, t, w, red, -100, total)
        return aten._log_softmax_backward_data.default(gl, out, 1, x.dtype)

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 37, generator=gen, dtype=dtype)
    t = torch.randint(0, 37, (12,), generator=gen)
    t[[2, 7]] = -100
    w = torch.rand(37, generator=gen, dtype=dtype) if weighted else None
    g = torch.rand(12, generator=gen, dtype=dtype) if red == 0 else torch.tensor(1.5, dtype=dtype)
    args = (x, t, w, g)
    return make_fx(grad)(*args), args, g


@pytest.mark.parametrize("start", [0, 1])  # logits[:, :-1] and logits[:, 1:]
def test_shifted_cross_entropy_scatters_into_the_padded_gradient(start: int,
                                                                 monkeypatch) -> None:
    """A causal LM's loss on `logits[:, :-1]`: the rewrite pads the gradient first and
    scatters the targets' values into the padded buffer, so Inductor writes one logits-sized
    buffer, not the scattered gradient and its padded copy. Equal to the rewrite without it
    (each element gets the same additions; a few ulp allowed, as above); the compiled
    gradient's peak is one unpadded gradient lower."""
    from glmc.backends.inductor import backend as inductor
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.proxy_tensor import make_fx

    from glmc.analysis.memory import measure_peak
    aten = torch.ops.aten

    def grad(logits, t):
        x = logits[:, start:start + 63].reshape(-1, logits.shape[-1])
        out = aten._log_softmax.default(x, 1, False)
        _, total = aten.nll_loss_forward.default(out, t, None, 1, -100)
        gl = aten.nll_loss_backward.default(torch.tensor(1.0), out, t, None, 1, -100, total)
        gx = aten._log_softmax_backward_data.default(gl, out, 1, x.dtype)
        end = -1 if start == 0 else 64  # as `[:, :-1]` and `[:, 1:]` record them
        return aten.slice_backward.default(gx.view(4, 63, 512), [4, 64, 512], 1, start, end,
                                           1)

    gen = torch.Generator().manual_seed(0)
    args = (torch.randn(4, 64, 512, generator=gen), torch.randint(0, 512, (252,), generator=gen))
    args[1][[5, 100]] = -100
    graphs = {}
    for pad_first in (False, True):
        gm = make_fx(grad)(*args)
        with monkeypatch.context() as m:
            if not pad_first:  # the scatter as before: into the unpadded gradient
                m.setattr(inductor, "_scatter_after_padding", lambda *a: False)
            assert inductor._cross_entropy_backward(gm) == 1
        puts = [n for n in gm.graph.nodes if n.target is aten.index_put.default]
        assert len(puts) == 1 and (puts[0].args[0].target is aten.slice_backward.default) \
            == pad_first
        graphs[pad_first] = compile_fx(gm, list(args))
    peaks, grads = {}, {}
    for pad_first, fn in graphs.items():
        fn(*args)  # warm
        out, m = measure_peak(lambda: fn(*args))
        grads[pad_first] = out[0] if isinstance(out, (tuple, list)) else out
        peaks[pad_first] = m.peak_bytes
    torch.testing.assert_close(grads[True], grads[False], rtol=ULP4, atol=0)
    assert (grads[True][:, 63 - 63 * start] == 0).all() and (grads[True] != 0).sum() > 200 * 512
    x = args[0].clone().requires_grad_()
    torch.nn.functional.cross_entropy(x[:, start:start + 63].reshape(-1, 512),
                                      args[1]).backward()
    torch.testing.assert_close(grads[True], x.grad, rtol=1e-5, atol=1e-7)
    assert peaks[False] - peaks[True] >= 252 * 512 * 4  # one unpadded gradient less
