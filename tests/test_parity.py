"""Loss at every step and all parameters / optimizer state after 3 steps equal eager PyTorch."""
from __future__ import annotations

import pytest
import torch

import glmc
from tests.models import CASES, RTOL, ATOL, assert_state_close, eager_losses, glmc_losses, twin

STEPS = 3

PARAMS = [
    pytest.param("mlp", "eager"), pytest.param("cnn", "eager"), pytest.param("glm", "eager"),
    pytest.param("mlp", "inductor"), pytest.param("cnn", "inductor"),
    pytest.param("glm", "inductor", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("case,backend", PARAMS)
def test_parity(case: str, backend: str) -> None:
    (m, x, loss_fn, opt), (m2, _, _, opt2) = twin(CASES[case].make)
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend=backend)
    got = glmc_losses(trainer, x, STEPS)
    want = eager_losses(m2, x, loss_fn, opt2, STEPS)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
    assert got[0] != got[-1], "training must change the loss"
    assert_state_close(m, m2, opt, opt2)


@pytest.mark.parametrize("opt_cls,kwargs", [
    (torch.optim.SGD, dict(lr=0.1)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2)),
    (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=1e-2)),
    (torch.optim.Adam, dict(lr=1e-2, maximize=True)),
    (torch.optim.AdamW, dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)),
])
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_optimizers(opt_cls, kwargs, backend) -> None:
    def make():
        model, x, loss_fn, _ = CASES["mlp"].make()
        return model, x, loss_fn, opt_cls(model.parameters(), **kwargs)
    (m, x, loss_fn, opt), (m2, _, _, opt2) = twin(make)
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend=backend)
    got, want = glmc_losses(trainer, x, STEPS), eager_losses(m2, x, loss_fn, opt2, STEPS)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
    assert_state_close(m, m2, opt, opt2)


def test_lr_scheduler_changes_lr_without_recompile() -> None:
    (m, x, loss_fn, opt), (m2, _, _, opt2) = twin(CASES["mlp"].make)
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend="eager")
    s1 = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    s2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    for i in range(3):
        torch.manual_seed(i)
        trainer.step(*x)
        s1.step()
        eager_losses(m2, x, loss_fn, opt2, 1, seed=i)
        s2.step()
    assert_state_close(m, m2, opt, opt2)
    assert len(trainer.report.compiles) == 1


def test_state_dict_roundtrip_and_resume(tmp_path) -> None:
    (m, x, loss_fn, opt), (m2, _, _, opt2) = twin(CASES["mlp"].make)
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend="eager")
    glmc_losses(trainer, x, 2)
    torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt")
    m2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    got = glmc_losses(trainer, x, 2, seed=10)
    want = eager_losses(m2, x, loss_fn, opt2, 2, seed=10)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
    assert_state_close(m, m2, opt, opt2)


def test_dropout_masks_equal_eager() -> None:
    """The CNN has dropout: identical losses under the same seed prove identical masks."""
    (m, x, loss_fn, opt), (m2, _, _, opt2) = twin(CASES["cnn"].make)
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend="eager")
    rng_nodes = [n for n in trainer.graph.compute_nodes() if trainer.graph.info(n).rng]
    assert [trainer.graph.info(n).rng.ordinal for n in rng_nodes] == [0]
    assert glmc_losses(trainer, x, 2) == eager_losses(m2, x, loss_fn, opt2, 2)


def test_changed_batch_size_recompiles() -> None:
    (m, x, loss_fn, opt), (m2, _, _, opt2) = twin(CASES["mlp"].make)
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend="eager")
    small = (x[0][:5], x[1][:5])
    for batch in (x, small, x):
        torch.manual_seed(0)
        got = trainer.step(*batch).item()
        want = eager_losses(m2, batch, loss_fn, opt2, 1)[0]
        assert got == pytest.approx(want, rel=RTOL, abs=ATOL)
    assert len(trainer.report.compiles) == 2
    assert_state_close(m, m2, opt, opt2)
