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


def decompositions() -> dict:
    """glmc's ops as plain ATen, for exporters that only know ATen (ONNX)."""
    return {torch.ops.glmc.cross_entropy.default: cross_entropy_reference,
            torch.ops.glmc.cross_entropy_backward.default: cross_entropy_backward_reference}


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
