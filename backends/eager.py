"""`eager`: runs the step graph op by op with PyTorch's kernels. The numerical reference.

Guarantees: computes exactly the ATen ops of the graph in program order, so results equal eager
PyTorch training up to the optimizer's scalar rounding (see glmc.trace.optim). Needs no compiler.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from glmc.backends.base import Backend, StepFn

from glmc.ir.graph import TrainGraph


class EagerBackend(Backend):
    name = "eager"

    def _compile(self, gm: fx.GraphModule, graph: TrainGraph) -> StepFn:
        from glmc.analysis.phases import InterpreterInstrument
        holder = {"run": gm}  # the per-phase profile swaps in a timing interpreter

        def run(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
            with torch.no_grad():
                return list(holder["run"](*inputs))
        run.instrument = InterpreterInstrument(gm, holder)
        return run
