"""`clip{max_norm=1.0}`: gradient clipping by global norm, inside the compiled step.

    glmc.optimize(model, batch, optimizer=opt, clip_grad_norm=1.0)
    glmc train FILE ... --clip-grad-norm 1.0

The same ops, in the same order, as `torch.nn.utils.clip_grad_norm_(params, max_norm)` on CPU
(its per-tensor path): the 2-norm of each gradient the update reads, the 2-norm of their stack,
`max_norm / (total + 1e-6)` clamped to at most 1, every gradient multiplied by it before the
update reads it. Runs after gradient accumulation's running sums (the norm of the step's
gradient, not a micro-batch's). Data parallel (after the shard pass): with ZeRO-0 every
rank's update reads the whole averaged gradients (ZeRO-1: all-reduced whole, then sliced), so
every rank computes the same norm; with ZeRO 2-3 it reads its own rows (zero-padded,
reduce-scattered), so the squared local norm is all-reduced (sum) over the data-parallel ranks
first — every rank scales by the same coefficient. Tensor parallel (after the
tensor_parallel pass): the squared norm of the sharded gradients' blocks is all-reduced over
"tp" and the replicated ones' added once. Not yet with fp16 loss scaling (the gradients are
still scaled there: the update unscales them) nor with tp and data-parallel replicas
together: typed errors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from glmc.compiler.passmanager import Effect, Need, Pass, PassContext, PassResult
from glmc.errors import ConfigError
from glmc.ir.graph import GRAD_OF, Phase, Role, TrainGraph, is_comm
from glmc.ir.plans import TP
from glmc.ir.program import (NodeBuilder, insert_collective, restore_topological_order,
                              update_gradients)

aten = torch.ops.aten


@dataclass(frozen=True)
class ClipStats:
    max_norm: float
    gradients: int  #: gradients clipped together (one global norm)


@dataclass(frozen=True)
class ClipPass(Pass):
    """Scale every gradient the update reads so that their global 2-norm is <= max_norm."""

    name = "clip"
    max_norm: float = 1.0

    def __post_init__(self) -> None:
        if not float(self.max_norm) > 0:
            raise ConfigError(f"clip: max_norm must be > 0, got {self.max_norm}")

    def needs(self) -> frozenset[Need]:
        return frozenset({Need.STEP})

    def effects(self) -> frozenset[Effect]:
        return frozenset()

    def run(self, graph: TrainGraph, ctx: PassContext) -> PassResult:
        if graph.meta.get("loss_scaling") is not None:
            raise ConfigError("clip: fp16 loss scaling is not supported yet (the gradients are "
                              "scaled until the update unscales them); use bf16 or fp32")
        plan = graph.meta.get("sharding")  # glmc.ir.plans.ShardPlan of the shard pass
        tp = graph.meta.get("tensor_parallel")  # glmc.ir.plans.TpPlan
        if tp is not None and (plan is not None or ctx.mesh is None):
            raise ConfigError("clip: clipping a tensor-parallel step with data-parallel "
                              "replicas is not supported yet (their gradient buckets mix "
                              "sharded and whole gradients); drop clip_grad_norm or the "
                              "replicas")
        if plan is None and tp is None and any(is_comm(n) for n in graph.compute_nodes()):
            raise ConfigError("clip: the step communicates but has no data-parallel shard "
                              "plan; clip runs after the shard pass")
        grads = update_gradients(graph)
        if not grads:
            raise ConfigError("clip: the step has no optimizer update whose gradients to clip")
        emit = NodeBuilder(graph, self.name)
        g = graph.graph
        last = grads[-1]  # update_gradients is in graph order
        bwd, grad = Phase.BACKWARD, Role.GRADIENT
        readers = {n: [u for u in n.users if u.op == "call_function"
                       and TrainGraph.info(u).phase is Phase.OPTIMIZER] for n in grads}
        with g.inserting_before(last.next):
            norms = [emit(aten.linalg_vector_norm.default, (n, 2.0), bwd, grad, like=n)
                     for n in grads]
            if tp is not None:
                total = _tp_norm(graph, emit, grads, norms, tp, ctx.mesh)
            else:
                total = emit(aten.linalg_vector_norm.default,
                             (emit(aten.stack.default, (norms,), bwd, grad, like=last), 2.0),
                             bwd, grad, like=last)
            if plan is not None and plan.stage >= 2:  # each rank holds its rows: sum squares
                # (stage 1 all-reduces whole gradients: the update reads them whole, then
                # slices its rows, so every rank already has the global norm)
                squared = emit(aten.mul.Tensor, (total, total), bwd, grad, like=last)
                total = emit(aten.sqrt.default, (squared,), bwd, grad, like=last)
                insert_collective(graph, squared, "all_reduce", plan.mesh, plan.dim, "sum",
                                  [total])
            coef = emit(aten.mul.Tensor, (emit(aten.reciprocal.default, (
                emit(aten.add.Tensor, (total, 1e-6), bwd, grad, like=last),), bwd, grad,
                like=last), float(self.max_norm)), bwd, grad, like=last)
            coef = emit(aten.clamp.default, (coef, None, 1.0), bwd, grad, like=last)
            for n in grads:
                clipped = emit(aten.mul.Tensor, (n, coef), bwd, grad, like=n)
                for r in readers[n]:
                    r.replace_input_with(n, clipped)
        restore_topological_order(graph)  # data parallel: early buckets' updates wait for it
        g.lint()
        graph.gm.recompile()
        return PassResult(True, ClipStats(float(self.max_norm), len(grads)))


def _tp_norm(graph: TrainGraph, emit: NodeBuilder, grads: list[fx.Node],
             norms: list[fx.Node], tp: Any, mesh: Any) -> fx.Node:
    """The global 2-norm of a tensor-parallel step's gradients: the squared norm of the
    sharded ones' blocks summed over "tp" (one all-reduce of a scalar), plus the replicated
    ones' (the same on every rank)."""
    bwd, grad = Phase.BACKWARD, Role.GRADIENT
    sharded: list[fx.Node] = []
    whole: list[fx.Node] = []
    for n, norm in zip(grads, norms):
        names = n.meta.get(GRAD_OF)
        if not names:
            raise ConfigError(f"clip: cannot tell whose gradient '{n.name}' is in the "
                              "tensor-parallel step; drop clip_grad_norm or tp")
        (sharded if any(name in tp.tiles for name in names) else whole).append(norm)
    last = grads[-1]

    def squared(norms: list[fx.Node]) -> fx.Node:
        total = emit(aten.linalg_vector_norm.default,
                     (emit(aten.stack.default, (norms,), bwd, grad, like=last), 2.0),
                     bwd, grad, like=last)
        return emit(aten.mul.Tensor, (total, total), bwd, grad, like=last)

    parts = [squared(group) for group in (sharded, whole) if group]
    total = parts[0] if len(parts) == 1 else \
        emit(aten.add.Tensor, (parts[0], parts[1]), bwd, grad, like=last)
    out = emit(aten.sqrt.default, (total,), bwd, grad, like=last)
    if sharded:  # this rank's blocks' squares, summed over the ranks first
        insert_collective(graph, parts[0], "all_reduce", mesh, TP, "sum",
                          [total if len(parts) > 1 else out])
    return out


__all__ = ["ClipPass", "ClipStats"]
