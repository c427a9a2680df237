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
