"""`cleanup`: dead code, common subexpressions, and no-op views / detaches / clones.

Guarantees: the step computes the same values with fewer nodes. Random ops are never removed
or merged (that would shift the RNG stream and change dropout masks); ops with side effects
are never touched. Collectives and their `wait_tensor`s are never merged, dropped or moved,
and nothing is rewired to read a collective's result before its wait. Copies a pass made on
purpose survive: nodes of different phases are never merged (a backward node equal to a
forward one is a recomputation; merging it back would keep the forward value alive into the
backward, a memory decision that belongs to `recompute`), and neither are nodes marked `REMAT`.

    before:  a = detach(x); b = mm(a, w); c = mm(x, w); d = view(c, c.shape); return b + d
    after:   b = mm(x, w); return b + b
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from glmc.analysis.cost import is_view
from glmc.compiler.passmanager import Pass, PassContext, PassResult, StageForm, StageUnit
from glmc.ir.graph import REMAT, Phase, TrainGraph, is_collective, is_impure, replace_uses

aten = torch.ops.aten

_IDENTITY = {aten.detach.default, aten.alias.default, aten.lift_fresh_copy.default}
_SAME_SHAPE_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                     aten.expand.default}
_COPIES = {aten.clone.default, aten._to_copy.default}  #: own their storage, unlike views

__all__ = ["CleanupPass", "CleanupStats", "is_impure"]  # is_impure: kept here for old imports


@dataclass(frozen=True)
class CleanupStats:
    noops: int = 0
    cse: int = 0
    dead: int = 0


@dataclass(frozen=True)
class CleanupPass(Pass):
    """Removes dead code, merges identical pure nodes of one phase, drops no-op views/detach/
    clone. Leaves communication, random ops, mutations and marked (`REMAT`) copies alone."""

    name = "cleanup"
    cse: bool = True

    def run(self, graph: TrainGraph, ctx: PassContext) -> PassResult:
        g = graph.graph
        noops = _remove_noops(g)
        merged = _cse(g) if self.cse else 0
        before = len(g.nodes)
        g.eliminate_dead_code(is_impure_node=is_impure)
        stats = CleanupStats(noops, merged, before - len(g.nodes))
        return PassResult(any((stats.noops, stats.cse, stats.dead)), stats)

    def stage_forms(self) -> frozenset[StageForm]:
        return frozenset({StageForm.JOINT})

    def run_stage(self, unit: StageUnit, ctx: PassContext) -> PassResult:
        """The pass on a pipeline stage's joint graph (AOTAutograd's, functional,
        differentiated already) before it is split into forward and backward. A copy whose
        removal would let a graph output alias an input stays (AOTAutograd planned the
        outputs' aliasing before this rewrite)."""
        g = unit.graph
        noops = _remove_noops(g, keep=_copies_an_input_out)
        merged = _cse(g) if self.cse else 0
        before = len(g.nodes)
        g.eliminate_dead_code(is_impure_node=is_impure)
        stats = CleanupStats(noops, merged, before - len(g.nodes))
        return PassResult(any((stats.noops, stats.cse, stats.dead)), stats)


def _copies_an_input_out(node: fx.Node) -> bool:
    """Does `node` copy (a view of) an input, and reach an output through views?"""
    src = node.args[0]
    while isinstance(src, fx.Node) and src.op == "call_function" and src.args \
            and isinstance(src.args[0], fx.Node) and (is_view(src) or _is_noop(src)):
        src = src.args[0]
    if not (isinstance(src, fx.Node) and src.op == "placeholder"):
        return False
    stack = [node]
    while stack:
        for u in stack.pop().users:
            if u.op == "output":
                return True
            if is_view(u) or _is_noop(u):
                stack.append(u)
    return False


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _phase(node: fx.Node) -> Any:
    info = node.meta.get("glmc")
    return info.phase if info is not None else None


def _foldable(node: fx.Node) -> bool:
    """May `node` be replaced by its first argument, were it a no-op?"""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    src = node.args[0]
    if is_collective(src):
        return False  # its readers would read the collective's result before the wait
    if node.target in _COPIES:  # a marked or cross-phase copy lets its source die early
        return not node.meta.get(REMAT) and _phase(src) in (_phase(node), Phase.INPUT)
    return True


def _is_noop(node: fx.Node) -> bool:
    if not _foldable(node):
        return False
    src, out = _val(node.args[0]), _val(node)
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    if node.target in _IDENTITY:
        return True
    same = (src.shape == out.shape and src.dtype == out.dtype and src.device == out.device
            and src.stride() == out.stride())
    if node.target in _SAME_SHAPE_VIEWS:
        return same
    if node.target is aten.clone.default:
        return same and node.kwargs.get("memory_format") in (None, torch.preserve_format)
    if node.target is aten._to_copy.default:
        return same and set(node.kwargs) <= {"dtype", "device", "layout"}
    return False


def _remove_noops(g: fx.Graph, keep: Any = None) -> int:
    count = 0
    for node in list(g.nodes):
        if _is_noop(node) and not (keep is not None and keep(node)):
            replace_uses(node, node.args[0])
            g.erase_node(node)
            count += 1
    return count


def _key(node: fx.Node) -> Any:
    def freeze(a: Any) -> Any:
        if isinstance(a, (list, tuple)):
            return tuple(freeze(x) for x in a)
        if isinstance(a, dict):
            return tuple(sorted((k, freeze(v)) for k, v in a.items()))
        if isinstance(a, fx.Node):
            return ("node", a)
        return (type(a).__name__, repr(a))
    return _phase(node), node.target, freeze(node.args), freeze(node.kwargs)


def _cse(g: fx.Graph) -> int:
    seen: dict[Any, fx.Node] = {}
    merged = 0
    for node in list(g.nodes):
        if node.op != "call_function" or is_impure(node) or node.meta.get(REMAT):
            continue
        key = _key(node)
        if key in seen:
            replace_uses(node, seen[key])
            g.erase_node(node)
            merged += 1
        else:
            seen[key] = node
    return merged
