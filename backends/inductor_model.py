"""Inductor's fusion, as the cost and memory models see it (a `glmc.target.FusionModel`).

Inductor inlines pointwise ops into the kernels of their consumers: an inlined op writes no
buffer of its own, and the kernel it joins reads the inlined op's inputs instead. The core
analyses never import this module (it reads Inductor's decomposition and fallback tables); the
Inductor backend hands `FusionGroups` to them through its `BackendTraits`:

    traits = BackendTraits("inductor", fusion=FusionGroups, early_writeback=True)
    simulate(lowered, traits)       # glmc.memory
    estimate_time(lowered, prof, traits)   # glmc.cost

before:  b = mul(a, 2); c = exp(b); s = sum(c)   (three kernels, two buffers)
after:   mul and exp are inlined into the sum's kernel, which reads `a` alone
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from glmc.cost import OpCost, is_view, kind_of, value_bytes
from glmc.ir import op_name

#: Inductor realizes a pointwise buffer read by this many consumers or more
_INLINE_READS = 4
#: not tagged pointwise by ATen, but lowered by Inductor as pointwise kernels
_POINTWISE_LIKE = {"_to_copy", "clone", "copy", "where", "masked_fill", "native_dropout_backward"}


class FusionGroups:
    """Which pointwise nodes a fusing backend inlines into their consumers.

    A pointwise node is inlined when every consumer (looking through views) is itself a
    pointwise op, a reduction, an op Inductor generates code for (`_generated`) or an in-place
    copy of it into a step input, and it has fewer than `_INLINE_READS` consumers —
    Inductor's defaults. Everything else is a kernel that writes its output buffer.
    """

    def __init__(self, graph: fx.Graph) -> None:
        self._inlined: set[fx.Node] = set()
        for n in reversed(graph.nodes):  # consumers are decided before their producers
            if n.op == "call_function" and _fusible(n) and self._consumers_fuse(n):
                self._inlined.add(n)

    def inlined(self, node: fx.Node) -> bool:
        """True when `node` is computed inside its consumers' kernels (no buffer of its own)."""
        return node in self._inlined

    def reads(self, node: fx.Node) -> list[fx.Node]:
        """The materialized nodes (inputs, kernel outputs) the kernel rooted at `node` reads."""
        seen: set[fx.Node] = set()
        out: list[fx.Node] = []
        stack = list(node.all_input_nodes)
        while stack:
            a = stack.pop()
            if a in seen:
                continue
            seen.add(a)
            if a in self._inlined:
                stack.extend(a.all_input_nodes)
            elif is_view(a) and not _mutates(a) and a.target is not operator.getitem:
                stack.extend(a.all_input_nodes[:1])
            else:
                out.append(a)
        return out

    def kernel_cost(self, node: fx.Node, cost: OpCost) -> OpCost:
        """`cost` with the bytes read by the whole kernel rooted at `node`."""
        read = sum(value_bytes(a.meta.get("val")) for a in self.reads(node))
        return OpCost(cost.kind, cost.flops, read, cost.bytes_written, cost.dtype, cost.name)

    def _consumers_fuse(self, n: fx.Node) -> bool:
        users = _consumers(n)
        if not users or len(users) >= _INLINE_READS:
            return False
        for u in users:
            if u.op != "call_function":
                return False
            if _mutates(u):
                if u.args[1] is not n and u.args[1] not in n.users:
                    return False
                continue
            if not (_pointwise(u) or kind_of(u) == "reduction" or _generated(u)):
                return False
        return True


def _pointwise(n: fx.Node) -> bool:
    return kind_of(n) == "pointwise" or op_name(n) in _POINTWISE_LIKE


def _fusible(n: fx.Node) -> bool:
    return _pointwise(n) and isinstance(n.meta.get("val"), torch.Tensor)


def _consumers(n: fx.Node) -> list[fx.Node]:
    """The users of `n`, looking through (non-mutating) views."""
    out = []
    for u in n.users:
        if is_view(u) and not _mutates(u):
            out.extend(_consumers(u))
        else:
            out.append(u)
    return out


def _generated(n: fx.Node) -> bool:
    """Inductor decomposes this op into pointwise ops and reductions, so producers fuse into it."""
    from torch._inductor.decomposition import decompositions
    from torch._inductor.lowering import fallbacks
    t = n.target
    return (isinstance(t, torch._ops.OpOverload) and t in decompositions and t not in fallbacks
            and kind_of(n) != "matmul")


def _mutates(n: fx.Node) -> bool:
    t = n.target
    return isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable
