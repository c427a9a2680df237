"""transformers' GLM trains through glmc.optimize and torch.compile(backend="glmc")."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import glmc  # noqa: E402
from tests.models import ATOL, RTOL, _example, assert_state_close, eager_losses, glmc_losses, twin  # noqa: E402

make = _example("hf_glm.py")


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_hf_glm_optimize_parity(backend: str) -> None:
    (m, x, _, opt), (m2, _, _, opt2) = twin(make)
    trainer = glmc.optimize(m, x, optimizer=opt, backend=backend)
    got, want = glmc_losses(trainer, x, 3), eager_losses(m2, x, None, opt2, 3)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
    assert_state_close(m, m2, opt, opt2, zero_grad_params=("k_proj.bias",))
    # the memory model on a real transformers model: measured on the second step
    rec = trainer.report.compiles[-1].to_dict()
    assert abs(rec["errors"]["peak_memory"]) <= 0.15, rec["errors"]


@pytest.mark.slow
def test_hf_glm_dropin_parity() -> None:
    torch._dynamo.reset()
    (m, x, _, opt), (m2, _, _, opt2) = twin(make)
    compiled = torch.compile(m, backend="glmc")
    for i in range(3):
        torch.manual_seed(i)
        opt.zero_grad()
        loss = compiled(**x).loss
        loss.backward()
        opt.step()
        assert loss.item() == pytest.approx(eager_losses(m2, x, None, opt2, 1, seed=i)[0],
                                            rel=RTOL, abs=ATOL)
    assert_state_close(m, m2, opt, opt2, zero_grad_params=("k_proj.bias",))


def test_hf_glm_recompute_parity() -> None:
    (m, x, _, opt), (m2, _, _, opt2) = twin(make)
    trainer = glmc.optimize(m, x, optimizer=opt, backend="eager", memory_budget="min")
    got, want = glmc_losses(trainer, x, 3), eager_losses(m2, x, None, opt2, 3)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
    assert_state_close(m, m2, opt, opt2, zero_grad_params=("k_proj.bias",))
    (rec,) = [p for p in trainer.report.compiles[-1].history if p.name == "recompute"]
    assert rec.stats.recomputed > 0 and rec.stats.predicted_peak < rec.stats.baseline_peak
