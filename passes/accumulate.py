"""`accumulate`: gradient accumulation over micro-batches on one process.

    glmc compile FILE --accumulate 4          # the batch in 4 micro-batches, one update
    glmc.optimize(model, batch, parallel=ParallelPlan(accumulate=4))

The step takes a running sum per gradient and one for the loss, and 1/k, as inputs
(`Role.ACCUMULATOR`); each gradient the update reads becomes (gradient + its sum) · 1/k, the loss
(loss + its sum) · 1/k. The Trainer runs the first k - 1 micro-batches through the step's micro
program — forward and backward, the sums out, no update (`glmc.runtime.strategy.Accumulating`) —
and the last through the whole step. Because 1/k is an input, k may change between steps without
a recompile. With a mean loss this is the step of the whole batch, as PyTorch's accumulation loop
(`(loss / k).backward()` per micro-batch, then `optimizer.step()`) computes it, within fp32
rounding (the sums are added in another order); buffers (BatchNorm statistics) are updated per
micro-batch, as that loop does. Data-parallel steps accumulate in the shard pass instead
(running sums per gradient bucket, one collective per bucket per step); a tensor-parallel step
without data-parallel replicas accumulates here, each rank its gradient blocks (its
forward's and backward's collectives run on every micro-batch).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from glmc.compiler.passmanager import Effect, Need, Pass, PassContext, PassResult
from glmc.errors import ConfigError
from glmc.ir.graph import ACCUMULATES, GRAD_OF, OutputKind, Phase, Role, TrainGraph, is_comm
from glmc.ir.program import NodeBuilder, update_gradients

aten = torch.ops.aten


@dataclass(frozen=True)
class AccumulateStats:
    gradients: int  #: running sums added for gradients
    accumulators: list  #: every running-sum input, by target


@dataclass(frozen=True)
class AccumulatePass(Pass):
    """Running sums for gradient accumulation over micro-batches on one process."""

    name = "accumulate"

    def needs(self) -> frozenset[Need]:
        return frozenset({Need.STEP})

    def effects(self) -> frozenset[Effect]:
        return frozenset({Effect.ADDS_STATE})

    def run(self, graph: TrainGraph, ctx: PassContext) -> PassResult:
        tp_alone = "tensor_parallel" in graph.meta and "sharding" not in graph.meta
        if not tp_alone and any(is_comm(n) for n in graph.compute_nodes()):
            raise ConfigError("accumulate: the step communicates; a data-parallel step "
                              "accumulates in the shard pass (parallel={'accumulate': k})")
        if "accumulators" in graph.meta:
            return PassResult(False, AccumulateStats(0, sorted(graph.meta["accumulators"])))
        emit = NodeBuilder(graph, self.name)
        grads = update_gradients(graph)
        if not grads:
            raise ConfigError("accumulate: the step has no optimizer update to accumulate for")
        device = grads[0].meta["val"].device
        scale = emit.input("acc:scale", Role.ACCUMULATOR, (), torch.float32, device)
        accumulators = {"acc:scale": scale}
        g = graph.graph
        for grad in grads:
            target = "acc:grad:" + ",".join(grad.meta.get(GRAD_OF, (grad.name,)))
            readers = [u for u in grad.users if u.op == "call_function"
                       and TrainGraph.info(u).phase is Phase.OPTIMIZER]
            with g.inserting_before(grad.next):
                scaled = _accumulate(emit, grad, target, scale, Phase.BACKWARD, accumulators)
            for r in readers:
                r.replace_input_with(grad, scaled)
        outs = graph.output_values()
        k = next((i for i, s in enumerate(graph.outputs) if s.kind is OutputKind.LOSS), None)
        if k is not None:
            loss = outs[k]
            with g.inserting_before(graph.output_node()):
                mean = _accumulate(emit, loss, "acc:loss", scale, Phase.FORWARD, accumulators)
            graph.output_node().replace_input_with(loss, mean)
        graph.meta["accumulators"] = {t: TrainGraph.info(n).spec
                                      for t, n in accumulators.items()}
        g.lint()
        graph.gm.recompile()
        return PassResult(True, AccumulateStats(len(grads), sorted(accumulators)))


def _accumulate(emit: NodeBuilder, value: fx.Node, target: str, scale: fx.Node, phase: Phase,
                accumulators: dict[str, fx.Node]) -> fx.Node:
    """(value + running sum) · scale; the sum, marked `ACCUMULATES`, is what a micro-batch's
    program outputs."""
    val = value.meta["val"]
    acc = emit.input(target, Role.ACCUMULATOR, val.shape, val.dtype, val.device)
    accumulators[target] = acc
    role = TrainGraph.info(value).role
    total = emit(aten.add.Tensor, (value, acc), phase, role, like=value)
    total.meta[ACCUMULATES] = target
    return emit(aten.mul.Tensor, (total, scale), phase, role, like=value)


__all__ = ["AccumulatePass", "AccumulateStats"]
