"""`cleanup`: dead code, common subexpressions, and no-op views / detaches / clones.

Guarantees: the step computes the same values with fewer nodes. Random ops are never removed
or merged (that would shift the RNG stream and change dropout masks); ops with side effects
are never touched.

    before:  a = detach(x); b = mm(a, w); c = mm(x, w); d = view(c, c.shape); return b + d
    after:   b = mm(x, w); return b + b
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from glmc.ir import RANDOM_OPS, REMAT, TrainGraph, op_name
from glmc.passmanager import Pass, PassContext, PassResult

aten = torch.ops.aten

_IDENTITY = {aten.detach.default, aten.alias.default, aten.lift_fresh_copy.default}
_SAME_SHAPE_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                     aten.expand.default}


@dataclass(frozen=True)
class CleanupStats:
    noops: int = 0
    cse: int = 0
    dead: int = 0


@dataclass(frozen=True)
class CleanupPass(Pass):
    """Removes dead code, merges identical pure nodes, drops no-op views/detach/clone."""

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


def is_impure(node: fx.Node) -> bool:
    if node.op in ("placeholder", "output"):
        return True
    if op_name(node) in RANDOM_OPS:
        return True  # removing an unused draw would shift every later dropout mask
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.is_mutable
    return node.is_impure()


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _is_noop(node: fx.Node) -> bool:
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
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


def _remove_noops(g: fx.Graph) -> int:
    count = 0
    for node in list(g.nodes):
        if _is_noop(node):
            node.replace_all_uses_with(node.args[0])
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
    return node.target, freeze(node.args), freeze(node.kwargs)


def _cse(g: fx.Graph) -> int:
    seen: dict[Any, fx.Node] = {}
    merged = 0
    for node in list(g.nodes):
        if node.op != "call_function" or is_impure(node) or node.meta.get(REMAT):
            continue
        key = _key(node)
        if key in seen:
            node.replace_all_uses_with(seen[key])
            g.erase_node(node)
            merged += 1
        else:
            seen[key] = node
    return merged
