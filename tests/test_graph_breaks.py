"""Models Dynamo cannot capture as one graph: logging calls are skipped, real graph breaks fall
back to compiling the pieces (with a warning naming the line and the reason in plain words),
and strict=True keeps the hard error."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import glmc
from tests.models import train_side_by_side

log = logging.getLogger("glmc-test-model")


class Logs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        log.warning("forward called")  # as transformers' GPT-2 does (logger.warning_once)
        return self.lin(x)


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if h.sum().item() > 0:  # data-dependent control flow: a graph break
            h = h * 2
        return self.b(h)


def _train(model: nn.Module, backend: str = "eager", **options):
    torch.manual_seed(0)
    batch = (torch.randn(6, 8, generator=torch.Generator().manual_seed(1)),
             torch.randint(0, 4, (6,), generator=torch.Generator().manual_seed(2)))
    trainer, ref, _, _ = train_side_by_side(model, batch, nn.functional.cross_entropy, backend,
                                            **options)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    return trainer


def test_logging_calls_do_not_break_capture() -> None:
    trainer = _train(Logs())
    assert trainer.graph is not None  # one whole-step graph
    assert not trainer.report.compiles[0].warnings


def test_graph_break_falls_back_to_pieces_with_one_warning() -> None:
    with pytest.warns(UserWarning, match="breaks into several graphs") as caught:
        trainer = _train(Branches())
    assert len([w for w in caught if "breaks into several graphs" in str(w.message)]) == 1
    record = trainer.report.compiles[0]
    message = record.warnings[0]
    assert "test_graph_breaks.py" in message and "tensor" in message  # the user's line, why
    assert "not run: fusion" in message
    assert trainer.graph is None
    assert [r.skipped for r in record.history] == [True, False]  # fusion limited, cleanup not
    assert "breaks into several graphs" in trainer.report.summary()


def test_strict_keeps_the_hard_error() -> None:
    with pytest.raises(glmc.GraphBreakError) as e:
        _train(Branches(), strict=True)
    assert "test_graph_breaks.py" in str(e.value)
