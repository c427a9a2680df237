"""Backend interface and the lowering every backend shares: state write-back.

A backend has a `name`, `supports(node)` (None when it takes the node, else the reason) and
`compile(graph) -> CompiledStep`. The compiled step takes the flat input list of the graph's
signature, updates parameters, buffers and optimizer state in place, and returns the loss.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx

from glmc.errors import Offense, UnsupportedOpError
from glmc.cost import is_view
from glmc.ir import OutputKind, Phase, Role, TrainGraph, op_name

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
    fuses: bool = False  #: fuses pointwise ops into kernels (the cost/memory model follows)
    early_writeback: bool = True  #: write new state back as soon as possible (lower_writeback)

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
        fn = self._compile(lower_writeback(graph, self.early_writeback), graph)
        return CompiledStep(fn, self.name, fallbacks, time.perf_counter() - start)

    @abc.abstractmethod
    def _compile(self, gm: fx.GraphModule, graph: TrainGraph) -> StepFn:
        """Compile the write-back form of the step (see `lower_writeback`)."""


def lower_writeback(graph: TrainGraph, early: bool = True) -> fx.GraphModule:
    """The step as `f(*inputs) -> (loss,)` that copies every new state value into its input.

    Each copy is placed right after both the new value exists and the last read of the old
    value (through any view of it) — `early=True`, so a new parameter or optimizer-state tensor
    is freed as soon as it is written back instead of living to the end of the step; with
    `early=False` all copies go last. Inductor turns these input mutations into stores inside
    its kernels; eager runs them as `copy_`. Node metadata is shared with `graph` (shallow).
    """
    old = graph.graph
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    order = [n for n in old.nodes if n.op != "output"]
    for n in order:
        env[n] = new.node_copy(n, lambda a: env[a])
    position = {n: i for i, n in enumerate(order)}
    placeholders = {ph.meta["glmc"].target: ph for ph in order if ph.op == "placeholder"}
    loss = None
    copies: list[tuple[int, fx.Node, fx.Node]] = []
    for spec, value in zip(graph.outputs, graph.output_values()):
        if spec.kind is OutputKind.LOSS:
            loss = value
            continue
        dest = placeholders[spec.target]
        if value is dest or _alias_root(value) is dest:
            continue
        at = len(order) - 1
        if early:
            at = max(position[value], *(position[r] for r in _alias_readers(dest)))
        copies.append((at, dest, value))
    for at, dest, value in sorted(copies, key=lambda c: -c[0]):
        with new.inserting_after(env[order[at]]):
            c = new.call_function(torch.ops.aten.copy_.default, (env[dest], env[value]))
        c.meta = {"val": dest.meta.get("val"),
                  "glmc": dest.meta["glmc"].replace(phase=Phase.OPTIMIZER, role=Role.UPDATE,
                                                   created_by="writeback")}
    new.output(((env[loss] if loss is not None else None),))
    new.lint()
    return fx.GraphModule(graph.gm, new)


def _alias_root(n: fx.Node) -> fx.Node:
    while n.op == "call_function" and is_view(n) and n.args and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


def _alias_readers(n: fx.Node) -> list[fx.Node]:
    """Every node that reads `n`'s storage: its users, and the users of its views."""
    out, stack = [], [n]
    while stack:
        for u in stack.pop().users:
            if u.op == "output":
                continue
            out.append(u)
            if is_view(u):
                stack.append(u)
    return out or [n]
