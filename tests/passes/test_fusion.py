"""fusion: each pattern fires on the spellings of the examples and transformers' GLM, does not
fire when an intermediate has another reader, and keeps loss and parameters at fp32 parity."""
from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import glmc
from glmc.backends import get_backend
from glmc.compiler.passmanager import PassContext
from glmc.errors import ConfigError, PipelineError
from glmc.ir.graph import Phase, TrainGraph, op_name
from glmc.passes.fusion import FusionPass
from glmc.trace.capture import capture
from tests.models import CASES, RTOL, assert_state_close, glmc_losses, twin


class Tol(NamedTuple):
    """(rtol, atol) of fused vs unfused, fp32: `values` for losses and parameters, `grads` for
    the summed gradients (SGD's momentum buffers)."""

    values: tuple[float, float]
    grads: tuple[float, float]


#: Per pattern, what it needs and no more: about 10x the largest difference measured on the
#: tests' models over 3 SGD steps (in brackets, absolute), so a pattern that starts rounding
#: worse than its kind of fusion explains fails its test.
#: - attention: the flash kernel sums its blocked softmax in another order than bmm + softmax
#:   (params 2.6e-6; gradients 5.3e-5, whatever the rtol: single elements near zero)
#: - norm: RMSNorm is bit-identical; LayerNorm's kernel computes mean and variance in another
#:   order (params 1.2e-7, gradients 5.4e-8)
#: - mlp: glmc::gated differs only in its backward's rounding (params 1.5e-8, gradients 1.9e-9)
#: - loss: the fused cross-entropy's log-sum-exp (losses 1.2e-7 relative, params 1.5e-8,
#:   gradients 6e-8)
#: - optimizer: op for op the same formula: bit-identical
PATTERN_TOLERANCES = {
    "attention": Tol(values=(1e-4, 1e-5), grads=(1e-3, 1e-4)),
    "norm": Tol(values=(1e-5, 1e-6), grads=(1e-5, 1e-6)),
    "mlp": Tol(values=(1e-5, 1e-7), grads=(1e-5, 1e-8)),
    "loss": Tol(values=(1e-5, 1e-7), grads=(1e-5, 1e-8)),
    "optimizer": Tol(values=(0.0, 0.0), grads=(0.0, 0.0)),
}


def _tolerance(patterns: str) -> Tol:
    """The loosest tolerance of the `+`-joined patterns."""
    tols = [PATTERN_TOLERANCES[p] for p in patterns.split("+")]
    return Tol(*(tuple(max(t[i][j] for t in tols) for j in range(2)) for i in range(2)))


def _fuse(model: nn.Module, x, loss_fn=None, **opts):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = capture(model, x, loss_fn, opt)
    return g, FusionPass(**opts).run(g, PassContext()).stats


def test_attention_auto_times_both_forms_on_a_fusing_backend():
    """`attention=None` on Inductor: each attention shape is timed fused and unfused and the
    faster kept; a region kept unfused is listed with both measured times."""
    model, x, lf, opt = CASES["glm"].make()
    g = capture(model, x, lf, opt)
    stats = FusionPass(attention=None).run(g, PassContext(get_backend("inductor").traits())).stats
    layers = model.cfg.layers
    kept = [r for r in stats.regions if r["pattern"] == "attention" and r.get("kept")]
    assert stats.counts["attention"] + len(kept) == layers
    assert all("measured bmm+softmax" in r["op"] and "ms" in r["op"] for r in kept)
    ops = _ops(g)
    assert ("_softmax" in ops) == bool(kept)


def _ops(g: TrainGraph, phase: Phase | None = None) -> set[str]:
    return {op_name(n) for n in g.compute_nodes()
            if phase is None or TrainGraph.info(n).phase is phase}


def test_all_patterns_fire_on_glm_and_the_attention_matrix_is_gone():
    model, x, lf, opt = CASES["glm"].make()
    cfg = model.cfg
    g = capture(model, x, lf, opt)
    stats = FusionPass(attention=True, loss=True).run(
        g, PassContext(get_backend("inductor").traits())).stats
    assert stats.counts == {"attention": cfg.layers, "norm": 2 * cfg.layers + 1,
                            "mlp": cfg.layers, "loss": 1, "optimizer": 1}
    assert FusionPass().selected(get_backend("eager").traits()) == [
        "attention", "norm", "mlp", "loss"]
    # on a fusing backend `auto` leaves the LM head + loss to the compiler (faster there)
    assert FusionPass().selected(get_backend("inductor").traits()) == [
        "attention", "norm", "mlp", "optimizer"]
    assert FusionPass(attention=False, loss=True).selected(
        get_backend("inductor").traits()) == ["norm", "mlp", "loss", "optimizer"]
    assert all(r["source"] and "glm.py" in r["source"] for r in stats.regions
               if r["pattern"] != "optimizer")
    ops = _ops(g)
    assert "_softmax" not in ops and "_log_softmax" not in ops
    assert "_scaled_dot_product_flash_attention_for_cpu" in ops
    assert {"rms_norm", "gated", "linear_cross_entropy"} <= ops
    # no value of the step has the (batch, heads, seq, seq) shape of the attention matrix,
    # and grouped-query k/v are not repeated (enable_gqa)
    b, s = x[0].shape
    for n in g.compute_nodes():
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            assert v.dim() != 4 or tuple(v.shape[-2:]) != (s, s), n.format_node()
    assert not any(op_name(n) == "expand" and len(n.meta["val"].shape) == 5
                   for n in g.compute_nodes()), "k/v were repeated for grouped-query attention"


class Attn(nn.Module):
    """Spellings: mul-scale or div-scale, bool mask or additive mask, probabilities reused."""

    def __init__(self, scale_by: str = "div", mask: str = "causal", reuse: str = "") -> None:
        super().__init__()
        self.proj = nn.Linear(16, 48)
        self.scale_by, self.mask, self.reuse = scale_by, mask, reuse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.proj(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1)
        scores = scores / math.sqrt(8) if self.scale_by == "div" else scores * 8 ** -0.5
        if self.mask == "causal":
            scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf)
        elif self.mask == "band":  # a non-causal boolean mask
            band = torch.ones(s, s, dtype=torch.bool).triu(3)
            scores = scores.masked_fill(band, -math.inf)
        elif self.mask == "additive":
            scores = scores + torch.zeros(s, s).masked_fill(
                torch.ones(s, s, dtype=torch.bool).triu(1), -1e9)
        p = scores.softmax(-1)
        out = (p @ v).sum()
        return out + (p.pow(2).sum() if self.reuse == "probs" else 0)


@pytest.mark.parametrize("scale_by,mask", [("div", "causal"), ("mul", "band"),
                                           ("div", "additive"), ("mul", "none")])
def test_attention_spellings_fire_with_parity(scale_by, mask):
    torch.manual_seed(0)
    model = Attn(scale_by, mask)
    x = torch.randn(2, 6, 16)
    g, stats = _fuse(model, (x,))
    assert stats.counts["attention"] == 1
    _parity(lambda: Attn(scale_by, mask), (x,), "attention")


def test_attention_does_not_fire_when_probabilities_are_read_elsewhere():
    torch.manual_seed(0)
    _, stats = _fuse(Attn(reuse="probs"), (torch.randn(2, 6, 16),))
    assert stats.counts["attention"] == 0


class NormMLP(nn.Module):
    def __init__(self, reuse: str = "", act: str = "silu") -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(16) + 0.1 * torch.randn(16))
        self.gate_up = nn.Linear(16, 64)
        self.down = nn.Linear(32, 16)
        self.reuse, self.act = reuse, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = normed * self.w
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        a = {"silu": F.silu, "gelu": F.gelu,
             "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[self.act](gate)
        out = self.down(a * up).pow(2).mean()
        if self.reuse == "normed":
            out = out + normed.mean()
        if self.reuse == "act":
            out = out + a.mean()
        return out


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_norm_and_gated_mlp_fire_with_parity(act):
    torch.manual_seed(0)
    x = torch.randn(4, 5, 16)
    _, stats = _fuse(NormMLP(act=act), (x,))
    assert stats.counts["norm"] == 1 and stats.counts["mlp"] == 1
    assert any(r["op"] == f"glmc::gated({act})" for r in stats.regions)
    _parity(lambda: NormMLP(act=act), (x,), "norm+mlp")


@pytest.mark.parametrize("reuse,pattern", [("normed", "norm"), ("act", "mlp")])
def test_norm_and_mlp_do_not_fire_when_intermediates_are_reused(reuse, pattern):
    torch.manual_seed(0)
    _, stats = _fuse(NormMLP(reuse=reuse), (torch.randn(4, 5, 16),))
    assert stats.counts[pattern] == 0


class WholeMLP(nn.Module):
    """Bias-free gated MLPs: GLM's merged gate/up weight or Llama's two, 3-D activations."""

    def __init__(self, merged: bool, bias: bool = False, reuse: bool = False) -> None:
        super().__init__()
        self.merged, self.reuse = merged, reuse
        if merged:
            self.gate_up = nn.Linear(16, 48, bias=bias)
        else:
            self.gate, self.up = nn.Linear(16, 24, bias=bias), nn.Linear(16, 24, bias=bias)
        self.down = nn.Linear(24, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1) if self.merged else (self.gate(x), self.up(x))
        out = self.down(F.silu(gate) * up)
        return (out + x).pow(2).mean() + (gate.mean() if self.reuse else 0)


@pytest.mark.parametrize("merged", [True, False], ids=["merged", "separate"])
def test_whole_gated_mlp_chunked_fires_with_parity(merged):
    """`mlp=chunked`: the whole MLP is one glmc::gated_mlp whose backward keeps only x: no
    (tokens x inter) value crosses from the forward to the backward; 3 SGD steps over 5 row
    chunks (320 rows, 64 per chunk) equal the unfused step to fp32 rounding (its weight
    gradients sum over the chunks)."""
    torch.manual_seed(0)
    x = torch.randn(4, 80, 16)
    g, stats = _fuse(WholeMLP(merged), (x,), patterns="mlp", mlp="chunked", mlp_rows=64)
    assert stats.counts["mlp"] == 1
    assert [r["op"] for r in stats.regions] == ["glmc::gated_mlp(silu, chunked)"]
    assert {"gated_mlp", "gated_mlp_backward"} <= _ops(g) and "mm" not in _ops(g, Phase.FORWARD)
    crossing = [n for n in g.compute_nodes() if TrainGraph.info(n).phase is Phase.FORWARD
                and any(TrainGraph.info(u).phase is Phase.BACKWARD for u in n.users)]
    assert all(n.meta["val"].dim() == 0 or n.meta["val"].shape[-1] != 24 for n in crossing), \
        [n.name for n in crossing]
    _parity(lambda: WholeMLP(merged), (x,), "mlp", options=",mlp=chunked,mlp_rows=64")


@pytest.mark.parametrize("variant", ["bias", "reuse"])
def test_whole_gated_mlp_needs_bias_free_projections_read_by_it_alone(variant):
    """A biased projection, or a gate read elsewhere, keeps the act-only glmc::gated."""
    torch.manual_seed(0)
    model = WholeMLP(True, bias=variant == "bias", reuse=variant == "reuse")
    g, stats = _fuse(model, (torch.randn(4, 80, 16),), patterns="mlp", mlp="chunked")
    assert "gated_mlp" not in _ops(g) and "gated" in _ops(g)
    assert [r["op"] for r in stats.regions] == ["glmc::gated(silu)"]


@pytest.mark.parametrize("bias,op", [(True, "cross_entropy"), (False, "linear_cross_entropy")])
def test_loss_fires_with_parity(bias, op):
    """A biased head fuses the loss only; a bias-free one fuses head and loss."""
    def make():
        return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 50, bias=bias))
    torch.manual_seed(0)
    x, y = torch.randn(12, 16), torch.randint(0, 50, (12,))
    g, stats = _fuse(make(), (x, y), F.cross_entropy)
    assert stats.counts["loss"] == 1
    assert {"cross_entropy", "linear_cross_entropy"} & _ops(g) == {op}
    _parity(make, (x, y), "loss", F.cross_entropy)


def _parity(make, x, patterns: str, loss_fn=None, steps: int = 3, options: str = "") -> None:
    """`fusion{patterns=...}` (and `options`) against no fusion, within the patterns'
    PATTERN_TOLERANCES."""
    tol = _tolerance(patterns)
    torch.manual_seed(0)
    m1 = make()
    m2 = make()
    m2.load_state_dict(m1.state_dict())
    # SGD: Adam would turn the key bias's rounding-noise gradient (its exact gradient is zero:
    # softmax ignores it) into lr-sized steps that differ between any two implementations
    o1 = torch.optim.SGD(m1.parameters(), lr=0.05, momentum=0.9)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.05, momentum=0.9)
    a = glmc.optimize(m1, x, loss_fn=loss_fn, optimizer=o1, backend="eager", passes="cleanup")
    b = glmc.optimize(m2, x, loss_fn=loss_fn, optimizer=o2, backend="eager",
                      passes=f"fusion{{patterns={patterns}{options}}},cleanup")
    assert all(b.report.history[0].stats.counts[p] for p in patterns.split("+"))  # it fired
    la, lb = glmc_losses(a, x, steps), glmc_losses(b, x, steps)
    rtol, atol = tol.values
    torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), rtol=rtol, atol=atol)
    for (name, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(p2, p1, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    rtol, atol = tol.grads
    for (name, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(o2.state[p2]["momentum_buffer"], o1.state[p1]["momentum_buffer"],
                                   rtol=rtol, atol=atol, msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("case,backend", [("mlp", "eager"), ("cnn", "eager"), ("glm", "eager"),
                                          pytest.param("glm", "inductor",
                                                       marks=pytest.mark.slow)])
def test_examples_parity_with_and_without_fusion(case, backend):
    (m, x, lf, opt), (m2, _, _, opt2) = twin(CASES[case].make)
    a = glmc.optimize(m, x, loss_fn=lf, optimizer=opt, backend=backend, passes="cleanup")
    b = glmc.optimize(m2, x, loss_fn=lf, optimizer=opt2, backend=backend,
                      passes="fusion,cleanup")
    la, lb = glmc_losses(a, x, 3), glmc_losses(b, x, 3)
    torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), rtol=RTOL, atol=1e-5)
    # the key bias's exact gradient is zero: its Adam steps are rounding noise (tests/models.py)
    assert_state_close(m, m2, opt, opt2, zero_grad_params=("wk.bias",) if case == "glm" else ())


def test_options_and_ordering():
    with pytest.raises(ConfigError, match="unknown pattern"):
        FusionPass(patterns="attention+softmax")
    from glmc.passes import parse_pipeline
    with pytest.raises(PipelineError, match="would undo 'precision'.*put 'fusion' first"):
        parse_pipeline("precision,fusion")
    assert [p.name for p in parse_pipeline("fusion,precision{policy=bf16},cleanup")] == [
        "fusion", "precision", "cleanup"]
    assert [p.name for p in parse_pipeline(None, precision="bf16", fusion=True)] == [
        "fusion", "precision", "cleanup"]


def test_report_lists_fused_regions(tmp_path):
    import json
    model, x, lf, opt = CASES["glm"].make()
    trainer = glmc.optimize(model, x, optimizer=opt, backend="eager", passes="fusion,cleanup")
    glmc_losses(trainer, x, 3)
    json_path, html_path = trainer.write_report(str(tmp_path))
    rec = json.loads(open(json_path).read())["compiles"][0]["passes"][0]
    assert rec["name"] == "fusion" and rec["stats"]["counts"]["attention"] == model.cfg.layers
    html = open(html_path).read()
    assert "<h3>Fusion</h3>" in html and "scaled_dot_product_attention" in html
    assert "glm.py" in html  # source lines of the fused regions


class ManualLayerNorm(nn.Module):
    """Two spellings of LayerNorm written out; `reuse` reads the mean elsewhere."""

    def __init__(self, reuse: bool = False) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(16) + 0.1 * torch.randn(16))
        self.b = nn.Parameter(0.1 * torch.randn(16))
        self.lin = nn.Linear(16, 16)
        self.reuse = reuse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        y = (x - mu) / torch.sqrt(var + 1e-5) * self.w + self.b
        h = self.lin(y)
        v2 = h.var(-1, keepdim=True, unbiased=False)
        z = (h - h.mean(-1, keepdim=True)) * torch.rsqrt(v2 + 1e-5)
        out = z.pow(2).mean() + y.mean()
        return out + (mu.sum() if self.reuse else 0)


def test_layer_norm_spellings_fire_with_parity():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16)
    g, stats = _fuse(ManualLayerNorm(), (x,))
    assert stats.counts["norm"] == 2
    assert sum(op_name(n) == "native_layer_norm" for n in g.compute_nodes()) == 2
    _parity(ManualLayerNorm, (x,), "norm")
    _, stats = _fuse(ManualLayerNorm(reuse=True), (x,))
    assert stats.counts["norm"] == 1  # the first one's mean is read elsewhere


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.01, amsgrad=True),
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    lambda p: torch.optim.SGD([{"params": p[:2], "lr": 0.1}, {"params": p[2:], "lr": 0.01}]),
], ids=["adamw", "adam-amsgrad", "sgd-nesterov", "sgd-two-groups"])
def test_foreach_update_is_bit_identical(make_opt):
    """patterns=optimizer: one multi-tensor update per param group, same values exactly."""
    torch.manual_seed(0)
    x = torch.randn(4, 5, 16)
    results = []
    for passes in ("cleanup", "fusion{patterns=optimizer},cleanup"):
        torch.manual_seed(0)
        model = NormMLP()
        opt = make_opt(list(model.parameters()))
        t = glmc.optimize(model, (x,), optimizer=opt, backend="eager", passes=passes)
        losses = glmc_losses(t, (x,), 3)
        results.append((losses, [p.detach().clone() for p in model.parameters()],
                        {op_name(n) for n in t.graph.compute_nodes()}))
    (la, pa, ops_a), (lb, pb, ops_b) = results
    assert not any(o.startswith("_foreach_") for o in ops_a)
    assert any(o.startswith("_foreach_") for o in ops_b)
    assert la == lb
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))


def test_fused_step_exports_to_python_and_reproduces_losses(tmp_path):
    """glmc's fused ops are lowered to plain ATen in step.py (it runs without glmc)."""
    from tests.test_report_export import _run_export
    model, x, lf, opt = CASES["glm"].make()
    trainer = glmc.optimize(model, x, optimizer=opt, backend="eager", fusion=True,
                            predict=False, measure=False)
    glmc_losses(trainer, x, 2)
    trainer.export(str(tmp_path))
    assert "torch.ops.glmc" not in (tmp_path / "step.py").read_text()
    want = glmc_losses(trainer, x, 3, seed=100)
    got = _run_export(tmp_path, "--steps", "3", "--seed", "100")
    # the exported loss is unchunked: fp32 summation order differs
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=1e-5)
