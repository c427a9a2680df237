"""Where the optimizer update runs: at the end of the step, or each parameter's as soon as its
gradient is complete (optimizer-in-backward).

The step builder appends the update after the whole backward, so every gradient lives until
it runs — with ATen's fused Adam(W) kernel one call per param group updates all parameters at
once at the very end. Under a memory budget that is the wrong place: a parameter's gradient is
complete long before the backward ends (the LM head's right at its start), and updating the
parameter then frees the gradient (torch's `register_post_accumulate_grad_hook` recipe does
the same in eager PyTorch). This module gives the planner that second placement:

* `split_fused_updates`: each `aten._fused_adam(w)` over a group -> one call per parameter
  (bit-identical: the kernel updates each tensor on its own);
* `place_updates_early`: every optimizer node moved to right after the last of its inputs and
  the last read of the old parameter and state values it overwrites (so the write-back can copy
  into them at once, `glmc.ir.writeback`), marked `EARLY_UPDATE` so the in-place form keeps it
  there (`glmc.ir.kernels.in_place_fused_updates`);
* `early_update_blocker`: why a step cannot take it (loss scaling decides on every gradient at
  once; collectives would change the order ranks issue them in);
* `split_overhead_s`: what the extra kernel calls cost, for the cost model's choice
  (`passes.recompute`).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from glmc.ir.graph import EARLY_UPDATE, Phase, Role, TrainGraph, is_comm
from glmc.ir.writeback import alias_root

_FUSED = (torch.ops.aten._fused_adamw.tensor_lr, torch.ops.aten._fused_adam.tensor_lr)
_STATE_ROLES = (Role.PARAMETER, Role.OPTIMIZER_STATE)


def early_update_blocker(graph: TrainGraph) -> str | None:
    """Why the update of `graph` must stay at the end of the step, or None."""
    if not any(_phase(n) is Phase.OPTIMIZER for n in graph.compute_nodes()):
        return "the step has no optimizer update"
    if graph.meta.get("loss_scaling") is not None:
        return "loss scaling skips or applies the whole update on every gradient's overflow check"
    if any(is_comm(n) for n in graph.compute_nodes()):
        return "a sharded update's collectives would be issued in another order"
    return None


def split_fused_updates(graph: TrainGraph) -> int:
    """Each fused Adam(W) call over several parameters -> one call per parameter, in the same
    place. Returns how many calls were added."""
    g = graph.graph
    added = 0
    for node in [n for n in g.nodes if n.target in _FUSED]:
        lists = node.args[:6]
        count = len(lists[0])
        if count < 2 or any(not isinstance(u.args[1], int) or u.target is not operator.getitem
                            for u in node.users):
            continue
        singles = []
        with g.inserting_before(node):
            for i in range(count):
                args = tuple([lst[i]] if lst else [] for lst in lists)
                one = g.call_function(node.target, args, dict(node.kwargs))
                one.meta = {**node.meta, "val": tuple(
                    [v[i]] if v else [] for v in node.meta["val"])}
                singles.append(one)
        for lst in list(node.users):  # getitem(node, k) -> its items getitem(lst, i)
            k = lst.args[1]
            for item in list(lst.users):
                i = item.args[1]
                with g.inserting_before(item):
                    part = g.call_function(operator.getitem, (singles[i], k))
                    part.meta = {**lst.meta, "val": [lst.meta["val"][i]]}
                    new = g.call_function(operator.getitem, (part, 0))
                new.meta = dict(item.meta)
                item.replace_all_uses_with(new)
                g.erase_node(item)
            g.erase_node(lst)
        g.erase_node(node)
        added += count - 1
    if added:
        g.lint()
        graph.gm.recompile()
    return added


def place_updates_early(graph: TrainGraph) -> int:
    """Move every optimizer node to right after the last of its inputs and of the non-update
    reads of the parameters and state it updates; mark the moved ones `EARLY_UPDATE`. Nodes
    keep their relative order; returns how many moved."""
    g = graph.graph
    nodes = list(g.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    roles = dict(zip(graph.placeholders(), (s.role for s in graph.inputs)))
    readers: dict[fx.Node, int] = {}  # state placeholder -> last non-update read

    def last_read(ph: fx.Node) -> int:
        if ph not in readers:
            found, stack = order[ph], [ph]
            while stack:
                for u in stack.pop().users:
                    if _phase(u) is Phase.OPTIMIZER or u.op == "output":
                        continue
                    found = max(found, order[u])
                    if _is_alias(u):
                        stack.append(u)
            readers[ph] = found
        return readers[ph]

    base: dict[fx.Node, int] = {}
    for n in nodes:
        if _phase(n) is not Phase.OPTIMIZER:
            continue
        at = 0
        for a in n.all_input_nodes:
            at = max(at, base.get(a, order[a]))
            root = alias_root(a)
            if root.op == "placeholder" and roles.get(root) in _STATE_ROLES:
                at = max(at, last_read(root))
        base[n] = at
    key = {n: (base[n], 1, order[n]) if n in base else (order[n], 0, order[n]) for n in nodes}
    placed = sorted(nodes, key=key.__getitem__)
    if all(a is b for a, b in zip(placed, nodes)):
        return 0
    output = g.output_node()
    for n in placed:
        if n is not output:
            output.prepend(n)
    moved, later = 0, False  # walking back: is a forward/backward node after this one?
    for n in reversed(placed):
        if n in base:
            if later:
                moved += 1
                if n.target in _FUSED:
                    n.meta[EARLY_UPDATE] = True
        elif n.op == "call_function":
            later = True
    g.lint()
    graph.gm.recompile()
    return moved


def split_overhead_s(graph: TrainGraph, per_call_s: float) -> float:
    """Seconds the per-parameter fused calls add over one call per group."""
    extra = 0
    for n in graph.compute_nodes():
        if n.target in _FUSED:
            extra += max(0, len(n.args[0]) - 1)
    return extra * per_call_s


def _phase(n: fx.Node) -> Phase | None:
    info = n.meta.get("glmc")
    return info.phase if info is not None else None


def _is_alias(n: fx.Node) -> bool:
    from glmc.ir.graph import is_view
    return n.op == "call_function" and is_view(n)


__all__ = ["early_update_blocker", "split_fused_updates", "place_updates_early",
           "split_overhead_s"]
