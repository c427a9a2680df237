"""Fused kernels glmc's passes substitute into the step (registered as torch custom ops, so every
backend and AOTAutograd see one op with a known backward).

`glmc::cross_entropy(logits, target, ignore_index, reduction)`: mean/sum negative log-likelihood
of `log_softmax(logits.float())`, computed in fp32 in row chunks from logits of any float dtype.
It never materialises fp32 copies of the logits or their log-probabilities: the backward keeps
only the logits (in their own dtype) and one fp32 log-sum-exp per row, and returns the gradient
in the logits' dtype. With low-precision logits this is exactly `nll_loss(log_softmax(
logits.float()))` up to fp32 summation order, at a fraction of the memory.
"""
from __future__ import annotations

import contextlib
import operator

import torch
from torch import Tensor

CHUNK_ELEMENTS = 1 << 18  #: fp32 elements per chunk (1 MiB)

_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def _rows_per_chunk(logits: Tensor) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, logits.shape[-1]))


@torch.library.custom_op("glmc::cross_entropy", mutates_args=())
def cross_entropy(logits: Tensor, target: Tensor, ignore_index: int,
                  reduction: int) -> tuple[Tensor, Tensor]:
    """(loss, lse): loss reduced as ATen's nll_loss `reduction` (1 mean, 2 sum); lse per row."""
    rows = _rows_per_chunk(logits)
    lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    picked = torch.empty_like(lse)
    for s in range(0, logits.shape[0], rows):
        chunk = logits[s:s + rows].float()
        lse[s:s + rows] = torch.logsumexp(chunk, dim=-1)
        t = target[s:s + rows].clamp(min=0)
        picked[s:s + rows] = chunk.gather(1, t.unsqueeze(1)).squeeze(1)
    valid = target != ignore_index
    nll = torch.where(valid, lse - picked, torch.zeros_like(lse))
    if reduction == 2:
        loss = nll.sum()
    else:
        loss = nll.sum() / valid.sum().to(torch.float32)
    return loss, lse


@cross_entropy.register_fake
def _(logits: Tensor, target: Tensor, ignore_index: int, reduction: int) -> tuple[Tensor, Tensor]:
    loss = logits.new_empty((), dtype=torch.float32)
    return loss, logits.new_empty(logits.shape[0], dtype=torch.float32)


@torch.library.custom_op("glmc::cross_entropy_backward", mutates_args=())
def cross_entropy_backward(grad: Tensor, logits: Tensor, target: Tensor, lse: Tensor,
                           ignore_index: int, reduction: int) -> Tensor:
    rows = _rows_per_chunk(logits)
    valid = target != ignore_index
    scale = grad.float()
    if reduction != 2:
        scale = scale / valid.sum().to(torch.float32)
    out = torch.empty_like(logits)
    for s in range(0, logits.shape[0], rows):
        p = logits[s:s + rows].float().sub_(lse[s:s + rows, None]).exp_()
        t = target[s:s + rows]
        ok = valid[s:s + rows]
        p.scatter_add_(1, t.clamp(min=0).unsqueeze(1), -ok.to(p.dtype).unsqueeze(1))
        p *= (scale * ok.to(p.dtype)).unsqueeze(1)
        out[s:s + rows] = p.to(logits.dtype)
    return out


@cross_entropy_backward.register_fake
def _(grad: Tensor, logits: Tensor, target: Tensor, lse: Tensor, ignore_index: int,
      reduction: int) -> Tensor:
    return torch.empty_like(logits)


def _setup(ctx, inputs, output) -> None:  # noqa: ANN001 (torch.library's signature)
    logits, target, ignore_index, reduction = inputs
    ctx.save_for_backward(logits, target, output[1])
    ctx.ignore_index, ctx.reduction = ignore_index, reduction


def _backward(ctx, grad_loss, grad_lse):  # noqa: ANN001
    logits, target, lse = ctx.saved_tensors
    g = cross_entropy_backward(grad_loss, logits, target, lse, ctx.ignore_index, ctx.reduction)
    return g, None, None, None


cross_entropy.register_autograd(_backward, setup_context=_setup)


# ---- LM head + cross-entropy, chunked ---------------------------------------------------------

def _head_logits(xc: Tensor, w: Tensor, fp32: bool) -> Tensor:
    """fp32 logits of one row chunk: an fp32 matmul (`fp32`; `w` already fp32), or a matmul in
    x's dtype (`w` already in it) whose output is then widened (autocast's numerics)."""
    if fp32:
        return xc.float() @ w.t()
    return (xc @ w.t()).float()


def _head_weight(weight: Tensor, x: Tensor, fp32: bool) -> Tensor:
    return weight.float() if fp32 else weight.to(x.dtype)


@torch.library.custom_op("glmc::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(x: Tensor, weight: Tensor, target: Tensor, ignore_index: int,
                         reduction: int, fp32: bool) -> tuple[Tensor, Tensor]:
    """`cross_entropy(x @ weight.T, target)` without ever holding the (N, V) logits: row chunks
    of logits are made, reduced to their log-sum-exp and target logit, and dropped; the
    backward makes them again. Returns (loss, lse)."""
    rows = _rows_per_chunk_n(weight.shape[0])
    lse = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    picked = torch.empty_like(lse)
    w = _head_weight(weight, x, fp32)
    for s in range(0, x.shape[0], rows):
        logits = _head_logits(x[s:s + rows], w, fp32)
        lse[s:s + rows] = torch.logsumexp(logits, dim=-1)
        t = target[s:s + rows].clamp(min=0)
        picked[s:s + rows] = logits.gather(1, t.unsqueeze(1)).squeeze(1)
    valid = target != ignore_index
    nll = torch.where(valid, lse - picked, torch.zeros_like(lse))
    loss = nll.sum() if reduction == 2 else nll.sum() / valid.sum().to(torch.float32)
    return loss, lse


@linear_cross_entropy.register_fake
def _(x: Tensor, weight: Tensor, target: Tensor, ignore_index: int, reduction: int,
      fp32: bool) -> tuple[Tensor, Tensor]:
    return x.new_empty((), dtype=torch.float32), x.new_empty(x.shape[0], dtype=torch.float32)


@torch.library.custom_op("glmc::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(grad: Tensor, x: Tensor, weight: Tensor, target: Tensor,
                                  lse: Tensor, ignore_index: int, reduction: int,
                                  fp32: bool) -> tuple[Tensor, Tensor]:
    rows = _rows_per_chunk_n(weight.shape[0])
    valid = target != ignore_index
    scale = grad.float()
    if reduction != 2:
        scale = scale / valid.sum().to(torch.float32)
    grad_x = torch.empty_like(x)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    w = _head_weight(weight, x, fp32)
    for s in range(0, x.shape[0], rows):
        xc = x[s:s + rows]
        p = _head_logits(xc, w, fp32).sub_(lse[s:s + rows, None]).exp_()
        ok = valid[s:s + rows]
        p.scatter_add_(1, target[s:s + rows].clamp(min=0).unsqueeze(1),
                       -ok.to(p.dtype).unsqueeze(1))
        p *= (scale * ok.to(p.dtype)).unsqueeze(1)
        if fp32:
            grad_x[s:s + rows] = (p @ w).to(x.dtype)
            grad_w += p.t() @ xc.float()
        else:
            pl = p.to(x.dtype)
            grad_x[s:s + rows] = pl @ w
            grad_w += (pl.t() @ xc).float()
    return grad_x, grad_w.to(weight.dtype)


@linear_cross_entropy_backward.register_fake
def _(grad: Tensor, x: Tensor, weight: Tensor, target: Tensor, lse: Tensor, ignore_index: int,
      reduction: int, fp32: bool) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(weight)


def _lce_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    x, weight, target, ignore_index, reduction, fp32 = inputs
    ctx.save_for_backward(x, weight, target, output[1])
    ctx.args = (ignore_index, reduction, fp32)


def _lce_backward(ctx, grad_loss, grad_lse):  # noqa: ANN001
    x, weight, target, lse = ctx.saved_tensors
    gx, gw = linear_cross_entropy_backward(grad_loss, x, weight, target, lse, *ctx.args)
    return gx, gw, None, None, None, None


linear_cross_entropy.register_autograd(_lce_backward, setup_context=_lce_setup)


def _rows_per_chunk_n(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, vocab))


def cross_entropy_reference(logits: Tensor, target: Tensor, ignore_index: int,
                            reduction: int) -> tuple[Tensor, Tensor]:
    """The same result with plain ATen ops, unchunked (for ONNX export and tests)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    loss = torch.nn.functional.nll_loss(logp, target, ignore_index=ignore_index,
                                        reduction=_REDUCTIONS[reduction])
    return loss, torch.logsumexp(logits.float(), dim=-1)


def cross_entropy_backward_reference(grad: Tensor, logits: Tensor, target: Tensor, lse: Tensor,
                                     ignore_index: int, reduction: int) -> Tensor:
    valid = target != ignore_index
    scale = grad.float()
    if reduction != 2:
        scale = scale / valid.sum().to(torch.float32)
    p = torch.exp(logits.float() - lse.unsqueeze(1))
    onehot = torch.nn.functional.one_hot(target.clamp(min=0), logits.shape[-1]).to(p.dtype)
    p = (p - onehot) * (scale * valid.to(p.dtype)).unsqueeze(1)
    return p.to(logits.dtype)


def linear_cross_entropy_reference(x: Tensor, weight: Tensor, target: Tensor, ignore_index: int,
                                   reduction: int, fp32: bool) -> tuple[Tensor, Tensor]:
    logits = _head_logits(x, _head_weight(weight, x, fp32), fp32)
    return cross_entropy_reference(logits, target, ignore_index, reduction)


def linear_cross_entropy_backward_reference(grad: Tensor, x: Tensor, weight: Tensor,
                                            target: Tensor, lse: Tensor, ignore_index: int,
                                            reduction: int, fp32: bool) -> tuple[Tensor, Tensor]:
    logits = _head_logits(x, _head_weight(weight, x, fp32), fp32)
    p = cross_entropy_backward_reference(grad, logits, target, lse, ignore_index, reduction)
    if fp32:
        return (p @ weight.float()).to(x.dtype), (p.t() @ x.float()).to(weight.dtype)
    pl = p.to(x.dtype)
    return pl @ weight.to(x.dtype), (pl.t() @ x).to(weight.dtype)


def decompositions() -> dict:
    """glmc's ops as plain ATen, for exporters that only know ATen (ONNX)."""
    return {torch.ops.glmc.cross_entropy.default: cross_entropy_reference,
            torch.ops.glmc.cross_entropy_backward.default: cross_entropy_backward_reference,
            torch.ops.glmc.linear_cross_entropy.default: linear_cross_entropy_reference,
            torch.ops.glmc.linear_cross_entropy_backward.default:
                linear_cross_entropy_backward_reference}


def lower_to_aten(gm: "torch.fx.GraphModule") -> "torch.fx.GraphModule":
    """A copy of `gm` with every glmc op replaced by its plain-ATen decomposition, for consumers
    that run without glmc (the exported step.py, ONNX). Unchunked: it holds full fp32 logits."""
    import copy

    import torch.fx as fx
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    table = decompositions()
    graph = copy.deepcopy(gm.graph)
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target not in table:
            continue
        fn = table[n.target]
        tensors = [a for a in n.args if isinstance(a, fx.Node)]
        consts = {i: a for i, a in enumerate(n.args) if not isinstance(a, fx.Node)}

        def call(*ts, fn=fn, consts=consts, count=len(n.args)):
            it = iter(ts)
            return fn(*[consts[i] if i in consts else next(it) for i in range(count)])

        vals = [a.meta["val"] for a in tensors]
        with detect_fake_mode(vals) or contextlib.nullcontext():
            sub = make_fx(call)(*vals)
        env: dict = {}
        placeholders = iter(tensors)
        with graph.inserting_before(n):
            for s in sub.graph.nodes:
                if s.op == "placeholder":
                    env[s] = next(placeholders)
                elif s.op == "output":
                    result = fx.map_arg(s.args[0], lambda a: env[a])
                else:
                    env[s] = graph.node_copy(s, lambda a: env[a])
                    env[s].meta = {**n.meta, "val": s.meta.get("val")}
        if isinstance(result, (tuple, list)):
            for u in list(n.users):
                if u.target is operator.getitem:
                    u.replace_all_uses_with(result[u.args[1]])
                    graph.erase_node(u)
        else:
            n.replace_all_uses_with(result)
        graph.erase_node(n)
    graph.eliminate_dead_code()
    return fx.GraphModule(gm, graph)
