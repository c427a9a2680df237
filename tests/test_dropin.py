"""torch.compile(model, backend="glmc") inside an unchanged training loop."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from glmc.compiler.passmanager import Pass, PassResult
from tests.models import ATOL, CASES, RTOL, assert_state_close, eager_losses, twin


@dataclass(frozen=True)
class Recorder(Pass):
    name = "recorder"
    seen: list = field(default_factory=list, compare=False)

    def run(self, graph, ctx) -> PassResult:
        self.seen.append({graph.info(n).phase.value for n in graph.compute_nodes()})
        return PassResult(False)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_dropin_parity(backend: str) -> None:
    torch._dynamo.reset()
    (m, x, loss_fn, opt), (m2, _, _, opt2) = twin(CASES["cnn"].make)
    compiled = torch.compile(m, backend="glmc", options={"backend": backend})
    for i in range(3):
        torch.manual_seed(i)
        opt.zero_grad()
        loss = loss_fn(compiled(x[0]), x[1])
        loss.backward()
        opt.step()
        want = eager_losses(m2, x, loss_fn, opt2, 1, seed=i)[0]
        assert loss.item() == pytest.approx(want, rel=RTOL, abs=ATOL)
    assert_state_close(m, m2, opt, opt2)


def test_dropin_runs_glmc_passes_on_the_joint_graph() -> None:
    torch._dynamo.reset()
    recorder = Recorder()
    model, x, loss_fn, _ = CASES["mlp"].make()
    compiled = torch.compile(model, backend="glmc",
                             options={"backend": "eager", "passes": [recorder, ]})
    loss_fn(compiled(x[0]), x[1]).backward()
    assert recorder.seen == [{"forward", "backward"}]
