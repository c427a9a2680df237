"""Tied (shared) parameters are one input of the step: one gradient summed over every use, one
optimizer state, whatever name the shared tensor is reached by first."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from glmc.ir.graph import Role
from tests.models import assert_state_close, train_side_by_side


class Tied(nn.Module):
    """An embedding whose weight is also the LM head's (as GPT-2, T5, Qwen2-tied do)."""

    def __init__(self, head_first: bool) -> None:
        super().__init__()
        if head_first:  # the shared tensor's first name is the head's
            self.head = nn.Linear(16, 50, bias=False)
            self.embed = nn.Embedding(50, 16)
            self.embed.weight = self.head.weight
        else:
            self.embed = nn.Embedding(50, 16)
            self.head = nn.Linear(16, 50, bias=False)
            self.head.weight = self.embed.weight
        self.mid = nn.Linear(16, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.embed(ids)))).flatten(0, 1)


@pytest.mark.parametrize("backend,head_first", [("eager", False), ("eager", True),
                                                ("inductor", True)])
def test_tied_weights_train_like_eager(backend: str, head_first: bool) -> None:
    torch.manual_seed(0)
    model = Tied(head_first)
    ids = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(1))
    trainer, ref, opt, opt_ref = train_side_by_side(model, (ids, ids.flatten()),
                                                    nn.functional.cross_entropy, backend)
    shared = [s.target for s in trainer.graph.inputs if s.role is Role.PARAMETER]
    assert len(shared) == 3  # embed/head weight once, mid.weight, mid.bias
    assert model.head.weight is model.embed.weight  # still tied, updated in place
    assert_state_close(model, ref, opt, opt_ref)
