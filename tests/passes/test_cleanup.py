"""cleanup: golden structure, must-not-fire cases, and numeric parity."""
from __future__ import annotations

import torch
import torch.nn as nn

import glmc
from glmc.capture import capture
from glmc.ir import op_name
from glmc.passes.cleanup import CleanupPass, CleanupStats
from glmc.passmanager import PassContext, PassManager


class Dup(nn.Module):
    """Computes the same matmul twice and routes it through no-op ops."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x.detach() @ self.w
        b = x @ self.w
        c = b.view(b.shape).clone()
        return (a + c).sum()


class UnusedDropout(nn.Module):
    """Draws a dropout mask whose result is never used: the draw must stay (RNG order)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _ = torch.nn.functional.dropout(x, 0.5, training=True)
        y = torch.nn.functional.dropout(self.lin(x), 0.5, training=True)
        return y.sum()


def _run(graph):
    manager = PassManager([CleanupPass()])
    manager.run(graph, PassContext())
    return manager.history[0]


def test_golden_merges_duplicate_matmul_and_drops_noops() -> None:
    x = torch.randn(4, 8)
    graph = capture(Dup(), (x,), optimizer=None)
    fwd_mm = lambda g: sum(1 for n in g.compute_nodes()  # noqa: E731
                           if op_name(n) == "mm" and g.info(n).phase is glmc.Phase.FORWARD)
    assert fwd_mm(graph) == 2
    record = _run(graph)
    assert record.changed
    assert isinstance(record.stats, CleanupStats)
    assert record.stats.cse >= 1 and record.stats.noops >= 2
    assert fwd_mm(graph) == 1
    assert not any(op_name(n) in ("detach", "clone") for n in graph.compute_nodes())


def test_must_not_fire_on_random_ops() -> None:
    graph = capture(UnusedDropout(), (torch.randn(4, 8),))
    drops_before = [n for n in graph.compute_nodes() if op_name(n) == "native_dropout"]
    _run(graph)
    drops_after = [n for n in graph.compute_nodes() if op_name(n) == "native_dropout"]
    assert len(drops_before) == len(drops_after) == 2
    assert [graph.info(n).rng.ordinal for n in drops_after] == [0, 1]


def test_must_not_fire_on_clean_graph() -> None:
    graph = capture(Dup(), (torch.randn(4, 8),))
    _run(graph)
    second = _run(graph)
    assert not second.changed
    assert second.stats == CleanupStats(0, 0, 0)


def test_cleanup_keeps_numerics() -> None:
    from tests.models import eager_losses, twin

    def make():
        model = UnusedDropout()
        return model, (torch.randn(4, 8),), None, torch.optim.AdamW(model.parameters())
    (m, x, _, opt), (m2, _, _, opt2) = twin(make)
    with_cleanup = glmc.optimize(m, x, optimizer=opt, backend="eager", passes="cleanup")
    got = []
    for i in range(3):
        torch.manual_seed(i)
        got.append(with_cleanup.step(*x).item())
    assert got == eager_losses(m2, x, None, opt2, 3)
