"""The fallback when a model breaks into several graphs: compile the pieces.

glmc's whole-step compile needs one graph. When Dynamo cannot give one (a graph break the user
has not removed), the Trainer does not stop — unless `strict=True` — but runs what
`torch.compile` users get: the model + loss compiled piecewise through glmc's drop-in backend
(cleanup on each piece's joint graph), `loss.backward()` in eager autograd, and the optimizer
update compiled on its own (Inductor; eager backend: torch.optim as it is). Passes that need a
whole step (fusion, precision, recompute) do not run; the report says which and why.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from glmc.errors import GraphBreakError
from glmc.trace.capture import Batch, LossModule

#: what a whole-step pass loses when the step is compiled in pieces
WHY_LIMITED = "needs the whole step in one graph"


class PieceStep:
    """One training step of a model that breaks into several graphs (see the module doc)."""

    def __init__(self, model: nn.Module, loss_fn: Any, optimizer: torch.optim.Optimizer,
                 backend: str) -> None:
        from glmc.runtime.dropin import glmc_backend

        self.optimizer = optimizer
        self.module = LossModule(model, loss_fn)
        self.compiled = torch.compile(self.module, backend=glmc_backend, dynamic=False,
                                      options={"backend": backend, "passes": "cleanup"})
        self.update = optimizer.step
        if backend == "inductor":
            self.update = torch.compile(optimizer.step, dynamic=False)

    def __call__(self, batch: Batch) -> torch.Tensor:
        args, kwargs = batch
        self.optimizer.zero_grad(set_to_none=True)
        (loss,) = self.compiled(*args, **dict(kwargs))
        loss.backward()
        self.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def fallback_warning(error: GraphBreakError, limited: list[str]) -> str:
    """One line for the user: where the model breaks, why, and what glmc does instead."""
    first = error.offenses[0] if error.offenses else None
    where = f" at {first.location}: {first.reason}" if first else ""
    more = f" (+{len(error.offenses) - 1} more)" if len(error.offenses) > 1 else ""
    passes = f"; not run: {', '.join(limited)} ({WHY_LIMITED})" if limited else ""
    return (f"the model breaks into several graphs{where}{more}; glmc compiles the pieces and "
            f"the optimizer update separately{passes}; strict=True makes this an error")
