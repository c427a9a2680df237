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
"tp" and the replicated ones' added once. With both (dp x tp) the update reads the shard
pass's flat buckets, which mix tp blocks and whole gradients: each bucket is split as the
update splits it, the tp blocks' squares summed over "tp", and under ZeRO 2-3 (each replica
its rows) both kinds' over "dp". Not yet with fp16 loss scaling (the gradients are still
scaled there: the update unscales them): a typed error.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from glmc.compiler.passmanager import Effect, Need, Pass, PassContext, PassResult
from glmc.errors import ConfigError
from glmc.ir.graph import GRAD_BUCKET, GRAD_OF, Phase, Role, TrainGraph, is_comm
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
        if tp is not None and ctx.mesh is None:
            raise ConfigError("clip: a tensor-parallel step needs its device mesh")
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
            norms = [] if tp is not None and plan is not None else \
                [emit(aten.linalg_vector_norm.default, (n, 2.0), bwd, grad, like=n)
                 for n in grads]
            if tp is not None and plan is not None:
                total = _tp_dp_norm(graph, emit, grads, tp, plan)
            elif tp is not None:
                total = _tp_norm(graph, emit, grads, norms, tp, ctx.mesh)
            else:
                total = emit(aten.linalg_vector_norm.default,
                             (emit(aten.stack.default, (norms,), bwd, grad, like=last), 2.0),
                             bwd, grad, like=last)
            if plan is not None and plan.stage >= 2 and tp is None:  # each rank holds its
                # rows: sum the squares
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


def _tp_dp_norm(graph: TrainGraph, emit: NodeBuilder, waits: list[fx.Node], tp: Any,
                plan: Any) -> fx.Node:
    """The global 2-norm of a step with tensor-parallel groups and data-parallel replicas
    (dp x tp): the update reads the shard pass's buckets, each one flat buffer of several
    parameters' gradients, some sharded over "tp" and some whole. Each bucket is split as the
    update splits it and its pieces' norms are summed by kind: the tp blocks' squares over
    "tp", and, where ZeRO 2-3 leave each replica its rows, both kinds' over "dp" too."""
    bwd, grad = Phase.BACKWARD, Role.GRADIENT
    last = waits[-1]
    kinds: dict[bool, list[fx.Node]] = {True: [], False: []}  # sharded over "tp"?
    for w in waits:
        coll = _collective_of(w)
        bucket = coll.meta.get(GRAD_BUCKET) if coll is not None else None
        splits = [u for u in w.users if u.target is aten.split_with_sizes.default]
        if bucket is None or len(splits) != 1:
            raise ConfigError(f"clip: cannot tell whose gradients '{w.name}' holds in the "
                              "data- and tensor-parallel step; drop clip_grad_norm")
        names, sizes = plan.grad_buckets[bucket].params, list(splits[0].args[1])
        split = emit(aten.split_with_sizes.default, (w, sizes), bwd, grad, like=w)
        for k, name in enumerate(names):
            piece = emit(operator.getitem, (split, k), bwd, grad, like=w)
            norm = emit(aten.linalg_vector_norm.default, (piece, 2.0), bwd, grad, like=last)
            kinds[name in tp.tiles].append(norm)
    squares = []
    for sharded, norms in kinds.items():
        if not norms:
            continue
        total = emit(aten.linalg_vector_norm.default,
                     (emit(aten.stack.default, (norms,), bwd, grad, like=last), 2.0),
                     bwd, grad, like=last)
        sq = emit(aten.mul.Tensor, (total, total), bwd, grad, like=last)
        over = ((TP,) if sharded else ()) + ((plan.dim,) if plan.stage >= 2 else ())
        _partial(sq, plan.mesh, over)
        for dim in over:
            sq = _summed(graph, sq, plan.mesh, dim)
        squares.append(sq)
    total = squares[0] if len(squares) == 1 else \
        emit(aten.add.Tensor, (squares[0], squares[1]), bwd, grad, like=last)
    return emit(aten.sqrt.default, (total,), bwd, grad, like=last)


def _partial(value: fx.Node, mesh: Any, dims: tuple[str, ...]) -> None:
    """Mark `value` a partial sum over the mesh dims `dims` (each rank its own part),
    replicated over the others."""
    from torch.distributed.tensor import Partial, Replicate
    info = TrainGraph.info(value)
    placements = tuple(Partial("sum") if d in dims else Replicate() for d in mesh.dim_names)
    value.meta["glmc"] = info.replace(spec=dataclasses.replace(info.spec,
                                                               placements=placements))


def _summed(graph: TrainGraph, value: fx.Node, mesh: Any, dim: str) -> fx.Node:
    """`value` summed over mesh dim `dim`: the all-reduce's wait."""
    return insert_collective(graph, value, "all_reduce", mesh, dim, "sum", readers=[])


def _collective_of(wait: fx.Node) -> fx.Node | None:
    """The collective a `wait_tensor` waits for."""
    arg = wait.args[0] if wait.args else None
    return arg if isinstance(arg, fx.Node) else None


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
