"""Backend interface and the lowering every backend shares: state write-back.

A backend has a `name`, `supports(node)` (None when it takes the node, else the reason) and
`compile(graph) -> CompiledStep`. The compiled step takes the flat input list of the graph's
signature, updates parameters, buffers and optimizer state in place, and returns the loss.
"""
from __future__ import annotations

import abc
import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx

from glmc.errors import Offense, UnsupportedOpError
from glmc.ir import OutputKind, TrainGraph, op_name

StepFn = Callable[[list[torch.Tensor]], torch.Tensor]


@dataclass
class CompiledStep:
    """What a backend returns: the callable plus what the report needs to know about it."""

    fn: StepFn
    backend: str
    fallbacks: list[Offense] = field(default_factory=list)
    compile_seconds: float = 0.0

    def __call__(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        return self.fn(inputs)


class Backend(abc.ABC):
    name: str = "abstract"

    def supports(self, node: fx.Node) -> str | None:
        """None if this backend compiles `node`; otherwise why it falls back to eager."""
        return None

    def unsupported(self, graph: TrainGraph) -> list[Offense]:
        offenses = []
        for n in graph.compute_nodes():
            reason = self.supports(n)
            if reason is not None:
                where = TrainGraph.info(n).source or TrainGraph.info(n).module or n.name
                offenses.append(Offense(f"{op_name(n)}: {reason}", where))
        return offenses

    def compile(self, graph: TrainGraph, strict: bool = False) -> CompiledStep:
        fallbacks = self.unsupported(graph)
        if strict and fallbacks:
            raise UnsupportedOpError(self.name, fallbacks)
        import time
        start = time.perf_counter()
        fn = self._compile(lower_writeback(graph), graph)
        return CompiledStep(fn, self.name, fallbacks, time.perf_counter() - start)

    @abc.abstractmethod
    def _compile(self, gm: fx.GraphModule, graph: TrainGraph) -> StepFn:
        """Compile the write-back form of the step (see `lower_writeback`)."""


def lower_writeback(graph: TrainGraph) -> fx.GraphModule:
    """The step as `f(*inputs) -> (loss,)` that copies every new state value into its input.

    Copies go last, after every read of the old values, so in-place update is safe; Inductor
    keeps these input mutations in its kernels (the update is written straight into the
    parameter), and eager runs them as `copy_`.
    """
    gm = fx.GraphModule(graph.gm, copy.deepcopy(graph.gm.graph))
    g = gm.graph
    placeholders = {ph.meta["glmc"].target: ph for ph in g.nodes if ph.op == "placeholder"}
    out = next(n for n in reversed(g.nodes) if n.op == "output")
    values = list(out.args[0])
    loss = None
    with g.inserting_before(out):
        for spec, value in zip(graph.outputs, values):
            if spec.kind is OutputKind.LOSS:
                loss = value
                continue
            dest = placeholders[spec.target]
            if value is not dest:
                g.call_function(torch.ops.aten.copy_.default, (dest, value))
    out.args = ((loss,),)
    g.lint()
    gm.recompile()
    return gm
