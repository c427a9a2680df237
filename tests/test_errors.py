from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import glmc
from glmc.errors import CaptureError, ConfigError, GlmcError, InputError
from tests.models import CASES


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > 0:  # data-dependent branch
            y = y * 2
        n = int(y.abs().max().item())  # data-dependent Python value
        return y.sum() + n


def test_untraceable_model_lists_every_location() -> None:
    with pytest.raises(CaptureError) as info:  # strict: no fallback to compiling the pieces
        glmc.optimize(DataDependent(), (torch.randn(2, 4),), backend="eager", strict=True)
    err = info.value
    assert len(err.offenses) >= 2
    lines = {o.location for o in err.offenses}
    assert all("test_errors.py" in loc for loc in lines)
    assert len(lines) >= 2, lines
    assert "torch/_dynamo" not in str(err)


def test_wrong_batch_shape() -> None:
    model, x, loss_fn, opt = CASES["mlp"].make()
    trainer = glmc.optimize(model, x, loss_fn=loss_fn, optimizer=opt, backend="eager")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(InputError, match=r"cannot run on the batch.*\[16, 7\] X \[32, 64\]"):
        trainer.step(torch.randn(16, 7), x[1])
    with pytest.raises(InputError, match="same rank and dtype"):
        trainer.step(torch.randn(16), x[1])
    with pytest.raises(InputError, match="got 1 batch elements"):
        trainer.step(x[0])
    for k, v in model.state_dict().items():  # user state untouched by failed steps
        assert torch.equal(v, before[k])


def test_unsupported_options_are_typed_errors() -> None:
    model, x, loss_fn, _ = CASES["mlp"].make()
    with pytest.raises(ConfigError, match="no glmc rule for RMSprop"):
        glmc.optimize(model, x, loss_fn=loss_fn, optimizer=torch.optim.RMSprop(model.parameters()))
    with pytest.raises(ConfigError, match="backend 'tvmx' is unknown"):
        glmc.optimize(model, x, loss_fn=loss_fn, backend="tvmx")
    with pytest.raises(ConfigError, match="is not a fraction"):
        glmc.optimize(model, x, loss_fn=loss_fn, memory_budget="lots", backend="eager")
    with pytest.raises(ConfigError, match="unknown option"):
        glmc.optimize(model, x, loss_fn=loss_fn, memroy_budget=0.5)
    with pytest.raises(GlmcError):
        glmc.optimize(model, [1, 2], loss_fn=loss_fn)


def test_non_scalar_loss() -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(CaptureError, match="scalar"):
        glmc.optimize(model, (torch.randn(2, 4),), backend="eager")


def test_strict_backend_lists_unsupported_ops(monkeypatch) -> None:
    from glmc.backends.eager import EagerBackend

    from glmc.errors import UnsupportedOpError

    monkeypatch.setattr(EagerBackend, "supports",
                        lambda self, n: "test says no" if "gelu" in str(n.target) else None)
    model, x, loss_fn, opt = CASES["mlp"].make()
    with pytest.raises(UnsupportedOpError) as info:
        glmc.optimize(model, x, loss_fn=loss_fn, optimizer=opt, backend="eager", strict=True)
    assert len(info.value.offenses) == 2  # gelu forward and gelu_backward
    trainer = glmc.optimize(model, x, loss_fn=loss_fn, optimizer=opt, backend="eager")
    assert len(trainer.report.compiles[0].fallbacks) == 2


def test_wrong_feature_size_says_what_was_expected_and_what_came() -> None:
    import glmc
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    labels = torch.randint(0, 4, (4,))
    trainer = glmc.optimize(model, (torch.randn(4, 8), labels),
                            loss_fn=torch.nn.functional.cross_entropy, optimizer=opt,
                            backend="eager", measure=False)
    with pytest.raises(glmc.InputError, match=r"\[4, 9\] X \[8, 16\]") as e:
        trainer.step(torch.randn(4, 9), labels)
    assert "(4, 9)" in str(e.value) and "capture.py" not in str(e.value)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(glmc.InputError, match="out of bounds.*labels within"):
        trainer.step(torch.randn(4, 8), torch.tensor([0, 1, 2, 9]))
    for a, b in zip(before, model.parameters()):  # a failed step leaves the state as it was
        assert torch.equal(a, b)


def test_a_backend_compile_failure_is_a_typed_error(monkeypatch) -> None:
    from glmc.backends.eager import EagerBackend

    from glmc.errors import BackendError

    def broken(self, gm, graph):
        raise ValueError("Cannot view a tensor with shape [2, 4] as (8,)")

    monkeypatch.setattr(EagerBackend, "_compile", broken)
    model, x, loss_fn, opt = CASES["mlp"].make()
    with pytest.raises(BackendError, match="backend 'eager'.*ValueError: Cannot view"):
        glmc.optimize(model, x, loss_fn=loss_fn, optimizer=opt, backend="eager", measure=False)
