"""Splitting a graph into sub-graphs by what each output needs: the backward into I (input
gradients) and W (parameter gradients) for zero-bubble schedules (`split_backward`), a step into
its gradient part and its optimizer update (`split_update`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch.fx as fx

from glmc.ir.graph import InputSpec, NodeInfo, OutputKind, OutputSpec, Phase, Role, TrainGraph
from glmc.ir.program import Stage




def split_backward(stage: Stage) -> Stage:
    """`stage` with its backward also split in two graphs, for zero-bubble schedules:

    I  saved, cotangents -> sent input gradients, stash   (what the previous stage waits for)
    W  saved, stash      -> parameter gradients           (can run later, filling bubbles)

    I holds every node the input gradients need; W the rest of what the parameter gradients
    need; `stash` is the I values W reads (outputs `SAVED "stash:k"`). I + W compute exactly
    the backward's nodes, so the gradients are bit-identical to B's."""
    bw = stage.backward
    outs = list(zip(bw.outputs, bw.output_values()))
    sends = [(o, v) for o, v in outs if o.kind is OutputKind.SEND]
    grads = [(o, v) for o, v in outs if o.kind is not OutputKind.SEND]
    in_i = _ancestors([v for _, v in sends])
    w_all = _ancestors([v for _, v in grads])
    in_w = w_all - in_i
    stash = []
    for n in bw.graph.nodes:
        if n in in_i and n.op != "placeholder" and (any(u in in_w for u in n.users)
                                                    or any(v is n for _, v in grads)):
            # a node of several outputs (a fused op's backward) is stashed as the items W
            # reads: a graph output must be a tensor
            tuple_valued = isinstance(n.meta.get("val"), (tuple, list))
            stash += [u for u in n.users if u in in_w] if tuple_valued else [n]
    phs = dict(zip(bw.placeholders(), bw.inputs))
    stash_specs = [InputSpec(Role.SAVED, f"stash:{k}") for k in range(len(stash))]
    i_graph = _subgraph(bw, [(phs[p], p) for p in bw.placeholders() if p in in_i],
                        sends + [(OutputSpec(OutputKind.SAVED, s.target), n)
                                 for s, n in zip(stash_specs, stash)], "I")
    w_inputs = [(phs[p], p) for p in bw.placeholders() if p in w_all]
    w_inputs += list(zip(stash_specs, stash))
    w_graph = _subgraph(bw, w_inputs, grads, "W")
    return dataclasses.replace(stage, split=(i_graph, w_graph))


@dataclass
class UpdateSplit:
    """A step cut in two before its optimizer update (`split_update`): `front` computes the
    forward and the backward, `update` the new parameters and optimizer state. Wiring, by
    index: `front_inputs[j]` is the step input front's input j is; `update_inputs[j]` is
    ("input", i) for step input i or ("front", k) for front's output k (a gradient); each step
    output is `outputs[k]` = ("front" | "update", index into that part's outputs)."""

    front: TrainGraph
    update: TrainGraph
    front_inputs: list[int]
    update_inputs: list[tuple[str, int]]
    outputs: list[tuple[str, int]]


def split_update(graph: TrainGraph) -> UpdateSplit | None:
    """`graph` cut before its optimizer-phase nodes, for a backend that runs the forward and
    backward itself and leaves the update to torch's kernels (ONNX Runtime: ATen's fused
    Adam in place). What the update reads from the rest crosses as front outputs `SAVED
    "update:k"` (gradients, the loss scaler's overflow flag). None when the step has no update
    or a forward/backward node reads an update value (nothing to cut)."""
    update = {n for n in graph.compute_nodes() if TrainGraph.info(n).phase is Phase.OPTIMIZER}
    if not update or any(u in update for n in graph.compute_nodes() if n not in update
                         for u in n.all_input_nodes):
        return None
    outs = list(zip(graph.outputs, graph.output_values()))
    phs = graph.placeholders()
    slot = {ph: i for i, ph in enumerate(phs)}
    crossing = [n for n in graph.compute_nodes() if n not in update
                and any(u in update for u in n.users)]
    if any(isinstance(n.meta.get("val"), (tuple, list)) for n in crossing):
        return None  # a tuple-valued node read whole by the update: not a graph output
    front_outs = [(s, v) for s, v in outs if v not in update]
    front_outs += [(OutputSpec(OutputKind.SAVED, f"update:{k}"), n)
                   for k, n in enumerate(crossing)]
    front_phs = sorted((n for n in _ancestors([v for _, v in front_outs]) if n in slot),
                       key=slot.__getitem__)
    front = _subgraph(graph, [(graph.inputs[slot[p]], p) for p in front_phs], front_outs,
                      "front")
    states = {s.target for s, v in outs if v in update}  # its state inputs, read or not
    update_phs = [p for p in phs if any(u in update for u in p.users)
                  or graph.inputs[slot[p]].target in states]
    inputs = [(graph.inputs[slot[p]], p) for p in update_phs]
    inputs += [(InputSpec(Role.SAVED, f"update:{k}"), n) for k, n in enumerate(crossing)]
    back = _subgraph(graph, inputs, [(s, v) for s, v in outs if v in update], "update")
    n_front = len(front_outs) - len(crossing)
    wires = [("input", slot[p]) for p in update_phs]
    wires += [("front", n_front + k) for k in range(len(crossing))]
    where, kf, ku = [], 0, 0
    for _, v in outs:
        if v in update:
            where.append(("update", ku))
            ku += 1
        else:
            where.append(("front", kf))
            kf += 1
    return UpdateSplit(front, back, [slot[p] for p in front_phs], wires, where)


def _ancestors(values: Sequence[Any], stop: Iterable[fx.Node] = ()) -> set[fx.Node]:
    """`values` and what they read, not looking past `stop`."""
    seen: set[fx.Node] = set()
    stop = set(stop)
    todo = [v for v in values if isinstance(v, fx.Node)]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += [] if n in stop else n.all_input_nodes
    return seen


def _subgraph(graph: TrainGraph, inputs: list[tuple[InputSpec, fx.Node]],
              outputs: list[tuple[OutputSpec, Any]], part: str) -> TrainGraph:
    """A TrainGraph computing `outputs` of `graph` from `inputs` (any nodes of it)."""
    g, env = fx.Graph(), {}
    for spec, n in inputs:
        env[n] = g.placeholder(f"{spec.role.value}_{len(env)}")
        info = TrainGraph.info(n)
        env[n].meta = {"val": n.meta.get("val"),
                       "glmc": NodeInfo(Phase.INPUT, spec.role, info.spec, target=spec.target,
                                        stage=info.stage)}
    need = _ancestors([v for _, v in outputs], stop=[n for _, n in inputs])
    for n in graph.graph.nodes:
        if n in need and n not in env and n.op in ("call_function", "get_attr"):
            env[n] = g.node_copy(n, lambda a: env[a])
            env[n].meta = dict(n.meta)
    g.output(tuple(env[v] for _, v in outputs))
    out = TrainGraph(fx.GraphModule(graph.gm, g), [s for s, _ in inputs],
                     [s for s, _ in outputs], meta={**graph.meta, "part": part})
    out.verify()
    return out
