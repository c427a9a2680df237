"""The write-back form of a step: new state copied into its inputs, in place.

`lower_writeback` is an IR-to-IR transform the runtime applies for backends that update state
in place (eager, Inductor); functional backends run the step as it is and the runtime copies
the outputs. The cost and memory models predict the form the backend will run.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from glmc.ir.graph import OutputKind, Phase, Role, TrainGraph, is_view


def lower_writeback(graph: TrainGraph, early: bool = True,
                    fused_in_place: bool = False) -> fx.GraphModule:
    """The step as `f(*inputs) -> (loss,)` that copies every new state value into its input
    (a joint graph without state keeps its outputs).

    Each copy is placed right after both the new value exists and the last read of the old
    value (through any view of it) — `early=True`, so a new parameter or optimizer-state tensor
    is freed as soon as it is written back instead of living to the end of the step; with
    `early=False` all copies go last. Inductor turns these input mutations into stores inside
    its kernels; eager runs them as `copy_`. With `fused_in_place`, ATen's fused optimizer
    calls then run in place on the state (`glmc.ir.kernels.in_place_fused_updates`), as both
    in-place backends run them: the form the cost and memory models should see. Node metadata
    is shared with `graph` (shallow).
    """
    old = graph.graph
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    order = [n for n in old.nodes if n.op != "output"]
    for n in order:
        env[n] = new.node_copy(n, lambda a: env[a])
    position = {n: i for i, n in enumerate(order)}
    phs = [n for n in order if n.op == "placeholder"]
    kept: list[fx.Node] = []  #: the loss, and a joint graph's forward/gradient outputs
    copies: list[tuple[int, fx.Node, fx.Node]] = []
    for (k, i), value in zip(_pairs(graph, kept_too=True), graph.output_values()):
        if i is None:
            kept.append(value)
            continue
        dest = phs[i]
        if value is dest or alias_root(value) is dest:
            continue
        at = len(order) - 1
        if early:
            at = max(position[value], *(position[r] for r in alias_readers(dest)))
        copies.append((at, dest, value))
    for at, dest, value in sorted(copies, key=lambda c: -c[0]):
        with new.inserting_after(env[order[at]]):
            c = new.call_function(torch.ops.aten.copy_.default, (env[dest], env[value]))
        c.meta = {"val": dest.meta.get("val"),
                  "glmc": dest.meta["glmc"].replace(phase=Phase.OPTIMIZER, role=Role.UPDATE,
                                                   created_by="writeback")}
    new.output(tuple(env[v] if isinstance(v, fx.Node) else v for v in kept))
    new.lint()
    gm = fx.GraphModule(graph.gm, new)
    if fused_in_place:
        from glmc.ir.kernels import in_place_fused_updates
        in_place_fused_updates(gm)
    return gm


STATE_KINDS = (OutputKind.PARAM, OutputKind.BUFFER, OutputKind.STATE)
#: inputs a new state value never replaces, though they may share its target name (a pipeline
#: stage's update reads each parameter's gradient under the parameter's name)
NOT_STATE = (Role.GRADIENT, Role.INPUT, Role.BOUNDARY, Role.SAVED)


def writeback_pairs(graph: TrainGraph) -> list[tuple[int, int]]:
    """(output index, input index) of every new state value and the input it replaces."""
    return [(k, i) for k, i in _pairs(graph) if i is not None]


def _pairs(graph: TrainGraph, kept_too: bool = False) -> list[tuple[int, int | None]]:
    """(output index, index of the input it replaces — None for an output that replaces
    nothing, listed with `kept_too`)."""
    slot = {spec.target: i for i, spec in enumerate(graph.inputs) if spec.role not in NOT_STATE}
    out: list[tuple[int, int | None]] = []
    for k, spec in enumerate(graph.outputs):
        if spec.kind in STATE_KINDS:
            out.append((k, slot[spec.target]))
        elif kept_too:
            out.append((k, None))
    return out


def copy_back(pairs: list[tuple[int, int]], inputs: list[torch.Tensor],
                outputs: list[torch.Tensor]) -> None:
    """Copy a functional step's new state into the tensors it was read from (the runtime
    after a functional step; glmc.runtime.cudagraph inside its recorded graph)."""
    with torch.no_grad():
        for k, i in pairs:
            if inputs[i] is not outputs[k]:
                inputs[i].copy_(outputs[k])


def copy_graph(graph: TrainGraph) -> fx.GraphModule:
    """A GraphModule over a copy of `graph`'s fx graph (node metadata shared, shallowly), for
    backends that rewrite what they compile."""
    return graph.copy().gm


def alias_root(n: fx.Node) -> fx.Node:
    while n.op == "call_function" and is_view(n) and n.args and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


def storage_key(n: fx.Node) -> tuple[fx.Node, Any]:
    """What `n`'s storage is, as (node, index): `alias_root`, except that an item of a
    non-view op's tuple result (a multi-output op's getitem) is its own storage."""
    while n.op == "call_function" and is_view(n) and n.args and isinstance(n.args[0], fx.Node):
        if n.target is operator.getitem and not is_view(n.args[0]):
            return n.args[0], n.args[1]
        n = n.args[0]
    return n, None


def alias_readers(n: fx.Node) -> list[fx.Node]:
    """Every node that reads `n`'s storage: its users, and the users of its views (the
    graph's output left out); `[n]` itself where nothing reads it."""
    out, stack = [], [n]
    while stack:
        for u in stack.pop().users:
            if u.op == "output":
                continue
            out.append(u)
            if is_view(u):
                stack.append(u)
    return out or [n]
