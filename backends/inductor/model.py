"""Inductor's fusion, as the cost and memory models see it (a `glmc.ir.target.FusionModel`).

Inductor inlines pointwise ops into the kernels of their consumers: an inlined op writes no
buffer of its own, and the kernel it joins reads the inlined op's inputs instead. The core
analyses never import this module (it reads Inductor's decomposition and fallback tables); the
Inductor backend hands `FusionGroups` to them through its `BackendTraits`:

    traits = BackendTraits("inductor", fusion=FusionGroups, early_writeback=True)
    simulate(lowered, traits)       # glmc.analysis.memory
    estimate_time(lowered, prof, traits)   # glmc.analysis.cost

before:  b = mul(a, 2); c = exp(b); s = sum(c)   (three kernels, two buffers)
after:   mul and exp are inlined into the sum's kernel, which reads `a` alone

Kernels Inductor generates are then fused into one launch per stretch between the extern calls
(matmuls, fallbacks) they depend on: a generated kernel whose inputs are all available before
the k-th extern call shares a launch with every other such kernel (Inductor's scheduler fuses
them vertically and horizontally; tiny GLM: 23 launches modelled, 29 generated; MLP: 6 and 5).
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from glmc.analysis.cost import OpCost, is_view, kind_of, op_cost, value_bytes
from glmc.ir.graph import op_name
from glmc.ir.kernels import ELEMENTWISE

#: Inductor realizes a pointwise buffer read by this many consumers or more
_INLINE_READS = 4
#: not tagged pointwise by ATen, but lowered by Inductor as pointwise kernels
_POINTWISE_LIKE = {"_to_copy", "clone", "copy", "where", "masked_fill", "native_dropout_backward"}


class FusionGroups:
    """Which pointwise nodes a fusing backend inlines into their consumers, and which kernels
    share a launch.

    A pointwise node — multi-tensor (`_foreach_*`) ones element by element — is inlined when
    every consumer (looking through views) is itself a pointwise op, a reduction, an op
    Inductor generates code for (`_generated`) or an in-place copy of it into a step input,
    and it has fewer than `_INLINE_READS` consumers — Inductor's defaults. Everything else is
    a kernel that writes its output buffer.
    """

    def __init__(self, graph: fx.Graph) -> None:
        self._inlined: set[fx.Node] = _loss_gradients(graph)
        for n in reversed(graph.nodes):  # consumers are decided before their producers
            if n.op == "call_function" and _fusible(n) and self._consumers_fuse(n):
                self._inlined.add(n)
        self._launches = self._launch_roots(graph)

    def inlined(self, node: fx.Node) -> bool:
        """True when `node` is computed inside its consumers' kernels (no buffer of its own)."""
        return node in self._inlined

    def reads(self, node: fx.Node) -> list[fx.Node]:
        """The materialized nodes (inputs, kernel outputs) the kernel rooted at `node` reads."""
        return self._walk(node.all_input_nodes)[0]

    def kernel_cost(self, node: fx.Node, cost: OpCost) -> OpCost:
        """`cost` with the bytes read and the FLOPs of the whole kernel rooted at `node` (its
        inlined producers computed inside), launched once per fused group. glmc's elementwise
        ops are compiled from their ATen form (glmc.ir.kernels.ELEMENTWISE): one generated kernel,
        not a Python op."""
        # copy_(dest, src) writes dest and reads what src's computation reads
        start = node.all_input_nodes[1:] if _mutates(node) else node.all_input_nodes
        reads, inlined = self._walk(start)
        changes: dict[str, Any] = {
            "bytes_read": sum(value_bytes(a.meta.get("val")) for a in reads),
            "flops": cost.flops + sum(op_cost(a).flops for a in inlined)}
        if _glmc_elementwise(node):
            changes.update(calls=0, python_op=False, parts=(), workspace=0)
        if not _extern(node):
            changes["launches"] = 1 if node in self._launches else 0
        return cost.replace(**changes)

    def _walk(self, start: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
        """(materialized nodes read, inlined nodes computed) by a kernel whose operands are
        `start`."""
        seen: set[fx.Node] = set()
        out: list[fx.Node] = []
        inlined: list[fx.Node] = []
        stack = list(start)
        while stack:
            a = stack.pop()
            if a in seen:
                continue
            seen.add(a)
            if a in self._inlined:
                inlined.append(a)
                stack.extend(a.all_input_nodes)
            elif a.target is operator.getitem and a.args[0] in self._inlined:
                stack.extend(_element_inputs(a.args[0], a.args[1]))  # one list element
            elif is_view(a) and not _mutates(a) and a.target is not operator.getitem:
                stack.extend(a.all_input_nodes[:1])
            else:
                out.append(a)
        return out, inlined

    def _consumers_fuse(self, n: fx.Node) -> bool:
        groups = _element_consumers(n) if _is_list(n) else [_consumers(n)]
        for users in groups:
            if not users or len(users) >= _INLINE_READS:
                return False
            for u in users:
                if not self._fuses_into(n, u):
                    return False
        return True

    @staticmethod
    def _fuses_into(n: fx.Node, u: fx.Node) -> bool:
        if u.op != "call_function":
            return False
        if _mutates(u):  # an in-place copy of n (or of one of n's elements) into an input
            src = u.args[1] if len(u.args) > 1 else None
            return src is n or src in n.users
        return _pointwise(u) or kind_of(u) == "reduction" or _generated(u)

    def _launch_roots(self, graph: fx.Graph) -> set[fx.Node]:
        """The first generated kernel of each stretch between the extern calls it depends on
        (the others join its launch)."""
        ready: dict[fx.Node, int] = {}  # node -> externs that ran before its value exists
        first_of: dict[int, fx.Node] = {}
        externs = 0
        for n in graph.nodes:
            deps = [ready.get(a, 0) for a in n.all_input_nodes]
            if n.op != "call_function" or is_view(n) and not _mutates(n) or n in self._inlined:
                ready[n] = max(deps, default=0)
            elif _extern(n):
                externs += 1
                ready[n] = externs
            else:
                ready[n] = max((ready.get(a, 0) for a in self.reads(n)), default=0)
                first_of.setdefault(ready[n], n)
        return set(first_of.values())


def cross_entropy_grad(node: fx.Node) -> fx.Node | None:
    """The `nll_loss_backward` a `_log_softmax_backward_data` node differentiates (2-D, int64
    or int32 targets, one dtype), which the Inductor lowering rewrites (`glmc.backends.
    inductor._cross_entropy_backward`); None for any other node."""
    if node.target is not torch.ops.aten._log_softmax_backward_data.default:
        return None
    g, _, dim = node.args[:3]
    if not (isinstance(g, fx.Node) and g.target is torch.ops.aten.nll_loss_backward.default):
        return None
    val, gval, target = node.meta.get("val"), g.meta.get("val"), g.args[2]
    tval = target.meta.get("val") if isinstance(target, fx.Node) else None
    if (val is None or gval is None or gval.dim() != 2 or dim % 2 != 1
            or val.dtype != gval.dtype or tval is None
            or tval.dtype not in (torch.int64, torch.int32)):
        return None  # (uint8 indices would be read as a boolean mask by index_put)
    return g


def padded_by(node: fx.Node) -> tuple[fx.Node, fx.Node, int, int] | None:
    """(view, slice_backward, its dim, its start, both normalized) when `node`'s one reader
    views it and that view's one reader pads it back along a leading dim with step 1 (a
    causal LM's `logits[:, :-1]` in the backward); else None."""
    aten = torch.ops.aten
    view = next(iter(node.users)) if len(node.users) == 1 else None
    if view is None or view.target not in (aten.view.default, aten._unsafe_view.default,
                                           aten.reshape.default) or len(view.users) != 1:
        return None
    pad = next(iter(view.users))
    if pad.target is not aten.slice_backward.default:
        return None
    val, shaped = node.meta.get("val"), view.meta.get("val")
    sizes, dim, start, end, step = pad.args[1:6]
    if val is None or shaped is None or step != 1 or shaped.dim() != len(sizes):
        return None
    shape, sizes, dim = list(shaped.shape), [int(d) for d in sizes], dim % len(sizes)
    start = max(0, start + sizes[dim]) if start < 0 else start
    end = max(0, end + sizes[dim]) if end < 0 else end
    kept = len(range(start, min(end, sizes[dim])))
    if (dim >= len(sizes) - 1 or shape[-1] != val.shape[-1] or shape[dim] != kept
            or [d for i, d in enumerate(shape) if i != dim]
            != [d for i, d in enumerate(sizes) if i != dim]):
        return None  # the rows must land in the padded tensor as the view lays them out
    return view, pad, dim, start


def _loss_gradients(graph: fx.Graph) -> set[fx.Node]:
    """What the Inductor lowering's cross-entropy rewrite writes no buffer for: the one-hot
    `nll_loss_backward` (gone), and the `_log_softmax_backward_data` itself when its gradient
    is padded back (written into the padded buffer, `_scatter_after_padding`)."""
    out = set()
    for n in graph.nodes:
        g = cross_entropy_grad(n) if n.op == "call_function" else None
        if g is not None:
            if len(g.users) == 1:
                out.add(g)
            if padded_by(n) is not None:
                out.add(n)
    return out


def _pointwise(n: fx.Node) -> bool:
    return kind_of(n) == "pointwise" or op_name(n) in _POINTWISE_LIKE or _is_foreach(n)


def _is_foreach(n: fx.Node) -> bool:
    return n.op == "call_function" and op_name(n).startswith("_foreach_") and not _mutates(n)


def _is_list(n: fx.Node) -> bool:
    return isinstance(n.meta.get("val"), (list, tuple))


def _fusible(n: fx.Node) -> bool:
    val = n.meta.get("val")
    return _pointwise(n) and (isinstance(val, torch.Tensor) or (_is_foreach(n) and bool(val)))


def _consumers(n: fx.Node) -> list[fx.Node]:
    """The users of `n`, looking through (non-mutating) views."""
    out = []
    for u in n.users:
        if is_view(u) and not _mutates(u):
            out.extend(_consumers(u))
        else:
            out.append(u)
    return out


def _element_consumers(n: fx.Node) -> list[list[fx.Node]]:
    """The consumers of each element of a list-valued node (every use must be a getitem)."""
    if any(u.target is not operator.getitem for u in n.users):
        return [[]]
    return [_consumers(u) for u in n.users]


def _element_inputs(n: fx.Node, i: int) -> list[fx.Node]:
    """What element `i` of a multi-tensor op reads: the i-th tensor of each list argument and
    every tensor argument (a scalar shared by all elements)."""
    out: list[fx.Node] = []
    for a in list(n.args) + list(n.kwargs.values()):
        if isinstance(a, fx.Node):
            out.append(a)
        elif isinstance(a, (list, tuple)) and len(a) > i and isinstance(a[i], fx.Node):
            out.append(a[i])
    return out


def _glmc_elementwise(n: fx.Node) -> bool:
    t = n.target
    return isinstance(t, torch._ops.OpOverload) and t.namespace == "glmc" and \
        op_name(n) in ELEMENTWISE


def _generated(n: fx.Node) -> bool:
    """Inductor decomposes this op into pointwise ops and reductions, so producers fuse into it."""
    from torch._inductor.decomposition import decompositions
    from torch._inductor.lowering import fallbacks
    t = n.target
    if _glmc_elementwise(n):
        return True  # compiled from their ATen form
    return (isinstance(t, torch._ops.OpOverload) and t in decompositions and t not in fallbacks
            and kind_of(n) != "matmul")


def _extern(n: fx.Node) -> bool:
    """A call Inductor does not generate code for: matmuls and convolutions (extern BLAS /
    oneDNN kernels), attention and other fallbacks, glmc's loss kernels (Python ops)."""
    from torch._inductor.decomposition import decompositions
    from torch._inductor.lowering import fallbacks, lowerings
    t = n.target
    if not isinstance(t, torch._ops.OpOverload):
        return True
    if t.namespace == "glmc":
        return op_name(n) not in ELEMENTWISE
    if kind_of(n) == "matmul" or t in fallbacks:
        return True
    return not (t in lowerings or t.overloadpacket in lowerings or t in decompositions)


def _mutates(n: fx.Node) -> bool:
    t = n.target
    return isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable
