"""Loss fusions shared by the fusion and precision passes (forward-program rewrites).

* `fuse_loss`: `nll_loss(log_softmax(logits))` -> `glmc::cross_entropy(logits)` (fp32, chunked);
* `fuse_head`: `glmc::cross_entropy(mm(x, t(w)))` -> `glmc::linear_cross_entropy(x, w)`
  (logits made chunk by chunk, never stored).
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from glmc.analysis.cost import is_view
from glmc.ir import kernels  # noqa: F401  (registers glmc's fused ops)
from glmc.ir.graph import is_impure, op_name, replace_uses
from glmc.trace.rederive import ForwardProgram

aten = torch.ops.aten


def is_plain_view(n: fx.Node) -> bool:
    """A view op of one tensor whose other arguments are not graph values (t, view, slice...)."""
    return (is_view(n) and n.target is not operator.getitem and bool(n.args)
            and isinstance(n.args[0], fx.Node) and len(n.all_input_nodes) == 1
            and isinstance(n.target, torch._ops.OpOverload) and not n.target._schema.is_mutable)


def fuse_loss(program: ForwardProgram, require_cast: bool = True) -> int:
    """`nll_loss(log_softmax(cast_fp32(logits_low)))` -> `glmc::cross_entropy(logits_low)`: the
    same fp32 loss without fp32 copies of the logits and log-probabilities (glmc.ir.kernels).
    With `require_cast=False` (the fusion pass) fp32 logits qualify too."""
    g = program.graph
    fused = 0
    for nll in [n for n in g.nodes if op_name(n) == "nll_loss_forward"]:
        logp, target, weight, reduction, ignore = nll.args[:5]
        if weight is not None or reduction not in (1, 2) or op_name(logp) != "_log_softmax":
            continue
        if len(logp.users) != 1 or logp.meta["val"].dim() != 2 or logp.args[1] not in (1, -1):
            continue
        users = list(nll.users)
        if any(u.target is not operator.getitem or (u.args[1] != 0 and u.users)
               for u in users):
            continue  # total_weight is read elsewhere (a dead getitem of it goes)
        views, x = [], logp.args[0]
        while is_plain_view(x) and len(x.users) == 1 and op_name(x) != "slice":
            views.append(x)  # a slice stops the walk: a shifted-LM one is absorbed below
            x = x.args[0]
        if op_name(x) == "_to_copy" and len(x.users) == 1 and \
                x.args[0].meta["val"].dtype in (torch.bfloat16, torch.float16):
            low = x.args[0]
        elif not require_cast and x.meta["val"].dtype == torch.float32:
            low = x
        else:
            continue
        with g.inserting_before(nll):
            absorbed = _absorb_row_slice(g, low, target, ignore, nll.meta)
            if absorbed is not None:
                value, target = absorbed
            else:
                value = low
                for v in reversed(views):
                    value = g.call_function(v.target, (value, *v.args[1:]), dict(v.kwargs))
                    value.meta = dict(v.meta)
            ce = g.call_function(torch.ops.glmc.cross_entropy.default,
                                 (value, target, ignore, reduction))
            ce.meta = dict(nll.meta)
            loss = g.call_function(operator.getitem, (ce, 0))
            loss.meta = dict(users[0].meta) if users else dict(nll.meta)
        for u in users:
            replace_uses(u, loss)
            g.erase_node(u)
        for dead in (nll, logp, *views, x):
            if not dead.users:
                g.erase_node(dead)
        fused += 1
    g.eliminate_dead_code(is_impure_node=is_impure)
    program.gm.recompile()
    return fused


def fuse_head(program: ForwardProgram, fp32: bool) -> int:
    """`glmc::cross_entropy(mm(x, t(w)))` -> `glmc::linear_cross_entropy(x, w)`: the logits are
    made chunk by chunk inside the loss and never stored; with `fp32` they are fp32 matmuls of
    the uncast activations and weight (the loss sees no low-precision rounding of the logits,
    its largest error source), else matmuls in the low dtype as autocast does."""
    g = program.graph
    fused = 0
    for ce in [n for n in g.nodes if n.target is torch.ops.glmc.cross_entropy.default]:
        logits, target, ignore, reduction = ce.args
        chain, v = [], logits
        while op_name(v) in ("view", "_unsafe_view", "reshape") and len(v.users) == 1:
            chain.append(v)
            v = v.args[0]
        if op_name(v) != "mm" or len(v.users) != 1:
            continue
        x, wt = v.args
        val = logits.meta.get("val")
        shape = list(val.shape) if val is not None else list(logits.args[1])
        if op_name(wt) != "t" or len(wt.users) != 1 or len(shape) != 2 or \
                shape[-1] != v.meta["val"].shape[-1]:
            continue  # same row count: a 2-D view of the (N, V) product with the same V
        w = wt.args[0]
        with g.inserting_before(ce):
            x_in = _uncast(g, x) if fp32 else x
            new = g.call_function(torch.ops.glmc.linear_cross_entropy.default,
                                  (x_in, _uncast(g, w), target, ignore, reduction, fp32))
        new.meta = dict(ce.meta)
        replace_uses(ce, new)
        g.erase_node(ce)
        for dead in (*chain, v, wt, w, x):
            if dead.op == "call_function" and not dead.users:
                g.erase_node(dead)
        fused += 1
    program.gm.recompile()
    return fused


def _uncast(g: fx.Graph, v: fx.Node) -> fx.Node:
    """The value `v` was cast from (through views of the cast, replayed on the source)."""
    views = []
    while is_plain_view(v):
        views.append(v)
        v = v.args[0]
    if op_name(v) != "_to_copy":
        return views[0] if views else v
    v = v.args[0]
    for view in reversed(views):
        nv = g.call_function(view.target, (v, *view.args[1:]), dict(view.kwargs))
        nv.meta = {k: x for k, x in view.meta.items() if k != "val"}
        v = nv
    return v


def _absorb_row_slice(g: fx.Graph, low: fx.Node, target: Any, ignore: int,
                      meta: dict) -> tuple[fx.Node, fx.Node] | None:
    """Shifted-LM losses read `logits[:, :-1].reshape(-1, V)`: a copy of nearly all logits,
    and a zero-filled full-size gradient in the backward. Instead, feed the whole logits and
    mark the sliced-off rows' targets `ignore_index` — the same loss and gradient, exactly."""
    node = low
    if op_name(node) == "clone":
        node = node.args[0]
    if op_name(node) != "slice" or not isinstance(target, fx.Node):
        return None
    base, dim, start, end = (list(node.args) + [0, None])[:4]
    step = node.args[4] if len(node.args) > 4 else 1
    bval, sval = base.meta.get("val"), node.meta.get("val")
    if bval is None or sval is None or step != 1 or not bval.is_contiguous():
        return None
    dim = dim % bval.dim()
    if dim == bval.dim() - 1 or target.meta["val"].numel() != sval.shape[:-1].numel():
        return None
    tval = target.meta["val"]

    def call(op: Any, *args: Any, **kwargs: Any) -> fx.Node:
        n = g.call_function(op, args, kwargs)
        n.meta = {k: v for k, v in meta.items() if k != "val"}
        return n

    rows = call(aten.view.default, target, list(sval.shape[:-1]))
    full = call(aten.full.default, list(bval.shape[:-1]), ignore, dtype=tval.dtype,
                device=tval.device)
    end = bval.shape[dim] if end is None else end
    placed = call(aten.slice_scatter.default, full, rows, dim, start, end)
    flat_target = call(aten.view.default, placed, [-1])
    flat_logits = call(aten.view.default, base, [-1, bval.shape[-1]])
    return flat_logits, flat_target


