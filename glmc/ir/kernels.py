"""Fused kernels glmc's passes substitute into the step, registered as torch custom ops so that
AOTAutograd, every backend and the cost model see one op with a known backward.

* `glmc::cross_entropy(logits, target, ignore_index, reduction)` — mean/sum NLL of
  `log_softmax(logits.float())` in fp32, row chunk by row chunk, from logits of any float dtype:
  no fp32 copy of the logits or log-probabilities; the backward keeps the logits (their own
  dtype) and one log-sum-exp per row.
* `glmc::linear_cross_entropy(x, weight, target, ...)` — the LM head and that loss in one: the
  (tokens × vocab) logits exist one chunk at a time; the gradients for x and the weight are
  accumulated in the forward (the backward scales them by the upstream gradient).
* `glmc::rms_norm(x, weight, eps)` — RMSNorm whose backward keeps x and the per-row rstd.
* `glmc::gated(gate, up, act)` — act(gate) * up (SwiGLU/GeGLU) whose backward keeps gate and
  up and recomputes act(gate).
* `glmc::gated_mlp(x, w_gate, w_up, w_down, act)` — the whole gated MLP row chunk by row
  chunk; its backward keeps x only and makes each chunk's projections again (memory budgets).
* `glmc::fused_adam_(params, grads, exp_avgs, ...)` — ATen's fused Adam/AdamW kernel updating
  the state in place; not in glmc's IR (which stays functional: `aten._fused_adamw`), but what
  the Inductor backend lowers that op and its write-back copies to (`in_place_fused_updates`).

`decompositions()` gives each as plain ATen (unchunked), for consumers without glmc (exported
`step.py`, ONNX) and, for `ELEMENTWISE`, for Inductor to fuse.
"""
from __future__ import annotations

import contextlib
import operator

import torch
from torch import Tensor

from glmc.ir.graph import EARLY_UPDATE, replace_uses

CHUNK_ELEMENTS = 1 << 18  #: fp32 elements per chunk of the loss alone (1 MiB)
#: fp32 logits per chunk of the fused head (8 MiB): its matmuls need rows to be efficient
#: (GLM small, 1016 x 384 x 8192: 32-row chunks 2.3x slower than unfused, 256 rows on par)
HEAD_CHUNK_ELEMENTS = 1 << 21
HEAD_MIN_ROWS = 256

_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def _rows_per_chunk(vocab: int, elements: int | None = None) -> int:
    return max(1, (elements or CHUNK_ELEMENTS) // max(1, vocab))


def head_rows(n_rows: int, vocab: int) -> int:
    """Rows per chunk of the fused LM head: `HEAD_CHUNK_ELEMENTS` logits, but never fewer than
    `HEAD_MIN_ROWS` (the grad-w matmul's inner size; with 65-row chunks a 32000-word vocab ran
    1.8x slower than 256-row ones, 1024 x 512 tokens x width on 2 AMD EPYC cores)."""
    return min(n_rows, max(HEAD_MIN_ROWS, HEAD_CHUNK_ELEMENTS // max(1, vocab)))


@torch.library.custom_op("glmc::cross_entropy", mutates_args=())
def cross_entropy(logits: Tensor, target: Tensor, ignore_index: int,
                  reduction: int) -> tuple[Tensor, Tensor]:
    """(loss, lse): loss reduced as ATen's nll_loss `reduction` (1 mean, 2 sum); lse per row."""
    rows = _rows_per_chunk(logits.shape[-1])
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
    rows = _rows_per_chunk(logits.shape[-1])
    valid = target != ignore_index
    scale = grad.float()
    if reduction != 2:
        scale = scale / valid.sum().to(torch.float32)
    out = torch.empty_like(logits)
    for s in range(0, logits.shape[0], rows):
        # out of place: .float() of fp32 logits is the input itself (declared not mutated)
        p = logits[s:s + rows].float().sub(lse[s:s + rows, None]).exp_()
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
                         reduction: int, fp32: bool, rows: int = 0
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """`cross_entropy(x @ weight.T, target)` without ever holding the (N, V) logits.

    Returns (loss, grad_x, grad_w): the loss is a scalar, so its gradient with respect to x and
    the weight is the upstream gradient times fixed tensors; they are computed here, chunk by
    chunk of rows, while each chunk of logits exists (no second matmul to make the logits again
    in the backward), and the backward only scales them. Costs the three matmuls the unfused
    step does; holds grad_w (the weight's size, fp32) from here to the backward. `rows`: rows
    per chunk (0: `head_rows`); a memory budget may ask for fewer (`passes.recompute`), which
    sums grad_w in another order (within fp32 rounding)."""
    rows = head_rows(x.shape[0], weight.shape[0]) if rows <= 0 else min(x.shape[0], rows)
    valid = target != ignore_index
    count = valid.sum().to(torch.float32)
    scale = torch.ones((), dtype=torch.float32, device=x.device) if reduction == 2 else 1 / count
    w = _head_weight(weight, x, fp32)
    grad_x = torch.empty_like(x)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    for s in range(0, x.shape[0], rows):
        xc = x[s:s + rows]
        t = target[s:s + rows].clamp(min=0).unsqueeze(1)
        ok = valid[s:s + rows].to(torch.float32)
        logp = torch.log_softmax(_head_logits(xc, w, fp32), dim=-1)
        total = total - (logp.gather(1, t).squeeze(1) * ok).sum()
        p = logp.exp_()  # softmax, in place of the log-probabilities
        p.scatter_add_(1, t, -ok.unsqueeze(1))
        p *= (scale * ok).unsqueeze(1)
        if fp32:  # products written / accumulated by the matmuls themselves
            torch.mm(p, w, out=grad_x[s:s + rows])
            grad_w.addmm_(p.t(), xc.float())
        else:
            pl = p.to(x.dtype)
            grad_x[s:s + rows] = pl @ w
            grad_w += (pl.t() @ xc).float()
            del pl
        # free this chunk's probabilities before the next chunk's logits exist: otherwise
        # the loop holds three chunks (old probabilities, new logits, new log-probabilities)
        del logp, p
    return total * scale, grad_x, grad_w.to(weight.dtype)


@linear_cross_entropy.register_fake
def _(x: Tensor, weight: Tensor, target: Tensor, ignore_index: int, reduction: int,
      fp32: bool, rows: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    return x.new_empty((), dtype=torch.float32), torch.empty_like(x), torch.empty_like(weight)


def _lce_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    ctx.save_for_backward(output[1], output[2])


def _lce_backward(ctx, grad_loss, grad_gx, grad_gw):  # noqa: ANN001
    gx, gw = ctx.saved_tensors
    return gx * grad_loss.to(gx.dtype), gw * grad_loss.to(gw.dtype), None, None, None, None, None


linear_cross_entropy.register_autograd(_lce_backward, setup_context=_lce_setup)

#: outputs (by index) of glmc ops that do not grow with the batch: a weight's gradient made in
#: the forward is the weight's size for any number of rows (what a planner pricing one
#: sequence must not scale by the micro-batch)
BATCH_FIXED_OUTPUTS: dict[str, tuple[int, ...]] = {"glmc::linear_cross_entropy": (2,)}


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
                                   reduction: int, fp32: bool, rows: int = 0
                                   ) -> tuple[Tensor, Tensor, Tensor]:
    logits = _head_logits(x, _head_weight(weight, x, fp32), fp32)
    loss, lse = cross_entropy_reference(logits, target, ignore_index, reduction)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    p = cross_entropy_backward_reference(one, logits, target, lse, ignore_index, reduction)
    if fp32:
        return loss, (p @ weight.float()).to(x.dtype), (p.t() @ x.float()).to(weight.dtype)
    pl = p.to(x.dtype)
    return loss, pl @ weight.to(x.dtype), (pl.t() @ x).to(weight.dtype)


def _gated_backward_reference(grad: Tensor, gate: Tensor, up: Tensor,
                              act: str) -> tuple[Tensor, Tensor]:
    """Closed forms (no autograd inside, so tracers see plain ops), in fp32 at least."""
    gf = gate.to(torch.promote_types(gate.dtype, torch.float32))
    if act == "silu":
        sig = torch.sigmoid(gf)
        a, da = gf * sig, sig * (1 + gf * (1 - sig))
    elif act == "gelu":
        cdf = 0.5 * (1 + torch.erf(gf * 0.7071067811865476))
        a, da = gf * cdf, cdf + gf * torch.exp(-0.5 * gf * gf) * 0.3989422804014327
    else:
        k = 0.7978845608028654
        inner = k * (gf + 0.044715 * gf ** 3)
        th = torch.tanh(inner)
        a = 0.5 * gf * (1 + th)
        da = 0.5 * (1 + th) + 0.5 * gf * (1 - th * th) * k * (1 + 3 * 0.044715 * gf * gf)
    return (grad * up * da).to(gate.dtype), (grad * a).to(up.dtype)


def _rms_reference(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * rstd * weight, rstd


def _rms_backward_reference(grad: Tensor, x: Tensor, weight: Tensor,
                            rstd: Tensor) -> tuple[Tensor, Tensor]:
    normed = x * rstd
    gw = grad * weight
    grad_x = rstd * (gw - normed * (gw * normed).mean(-1, keepdim=True))
    grad_w = (grad * normed).sum(dim=tuple(range(grad.dim() - weight.dim())))
    return grad_x.to(x.dtype), grad_w.to(weight.dtype)


def decompositions() -> dict:
    """glmc's ops as plain ATen, for exporters that only know ATen (ONNX) and for Inductor
    (the elementwise ones, `ELEMENTWISE`)."""
    return {torch.ops.glmc.rms_norm.default: lambda x, w, eps: _rms_reference(x, w, eps),
            torch.ops.glmc.rms_norm_backward.default: _rms_backward_reference,
            torch.ops.glmc.gated.default: lambda g, u, act: _ACTS[act](g) * u,
            torch.ops.glmc.gated_backward.default: _gated_backward_reference,
            torch.ops.glmc.cross_entropy.default: cross_entropy_reference,
            torch.ops.glmc.cross_entropy_backward.default: cross_entropy_backward_reference,
            torch.ops.glmc.linear_cross_entropy.default: linear_cross_entropy_reference,
            torch.ops.glmc.gated_mlp.default: gated_mlp_reference,
            torch.ops.glmc.gated_mlp_backward.default: gated_mlp_backward_reference}


def lower_to_aten(gm: "torch.fx.GraphModule",
                  only: tuple[str, ...] | None = None) -> "torch.fx.GraphModule":
    """A copy of `gm` with every glmc op (or those named in `only`) replaced by its plain-ATen
    decomposition, for consumers that run without glmc (the exported step.py, ONNX) or that
    fuse ATen themselves (Inductor, `ELEMENTWISE`). The loss ops lowered are unchunked."""
    import copy

    import torch.fx as fx
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    table = decompositions()
    graph = copy.deepcopy(gm.graph)
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target not in table or \
                (only is not None and n.target._schema.name.split("::")[-1] not in only):
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
                    replace_uses(u, result[u.args[1]])
                    graph.erase_node(u)
        else:
            replace_uses(n, result)
        graph.erase_node(n)
    graph.eliminate_dead_code()
    return fx.GraphModule(gm, graph)


# ---- RMSNorm ----------------------------------------------------------------------------------

@torch.library.custom_op("glmc::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x * rsqrt(mean(x^2, -1) + eps) * weight, rstd). The backward keeps x and the per-row
    rstd only — not the normalised x the elementwise spelling saves for the weight gradient."""
    return _rms_reference(x, weight, eps)


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    out = torch.empty(torch.broadcast_shapes(x.shape, weight.shape),
                      dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    return out, x.new_empty((*x.shape[:-1], 1))


@torch.library.custom_op("glmc::rms_norm_backward", mutates_args=())
def rms_norm_backward(grad: Tensor, x: Tensor, weight: Tensor,
                      rstd: Tensor) -> tuple[Tensor, Tensor]:
    return _rms_backward_reference(grad, x, weight, rstd)


@rms_norm_backward.register_fake
def _(grad: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(weight)


def _rms_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_backward(ctx, grad, grad_rstd):  # noqa: ANN001
    x, weight, rstd = ctx.saved_tensors
    gx, gw = rms_norm_backward(grad, x, weight, rstd)
    return gx, gw, None


rms_norm.register_autograd(_rms_backward, setup_context=_rms_setup)


# ---- gated MLP activations (SwiGLU, GeGLU) -----------------------------------------------------

_ACTS = {"silu": torch.nn.functional.silu,
         "gelu": torch.nn.functional.gelu,
         "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}


@torch.library.custom_op("glmc::gated", mutates_args=())
def gated(gate: Tensor, up: Tensor, act: str) -> Tensor:
    """act(gate) * up. The backward keeps gate and up only and recomputes act(gate), instead of
    also storing act(gate) as the elementwise spelling does."""
    return _ACTS[act](gate) * up


@gated.register_fake
def _(gate: Tensor, up: Tensor, act: str) -> Tensor:
    return torch.empty(torch.broadcast_shapes(gate.shape, up.shape),
                       dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)


@torch.library.custom_op("glmc::gated_backward", mutates_args=())
def gated_backward(grad: Tensor, gate: Tensor, up: Tensor, act: str) -> tuple[Tensor, Tensor]:
    return _gated_backward_reference(grad, gate, up, act)


@gated_backward.register_fake
def _(grad: Tensor, gate: Tensor, up: Tensor, act: str) -> tuple[Tensor, Tensor]:
    return torch.empty_like(gate), torch.empty_like(up)


def _gated_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    gate, up, act = inputs
    ctx.save_for_backward(gate, up)
    ctx.act = act


def _gated_backward(ctx, grad):  # noqa: ANN001
    gate, up = ctx.saved_tensors
    dg, du = gated_backward(grad, gate, up, ctx.act)
    return dg, du, None


gated.register_autograd(_gated_backward, setup_context=_gated_setup)

# ---- the whole gated MLP, row chunk by row chunk ----------------------------------------------

#: elements of one chunk's gate/up projection (fp32: 1 MiB); at least `MLP_MIN_ROWS` rows
MLP_CHUNK_ELEMENTS = 1 << 18
MLP_MIN_ROWS = 128


def mlp_rows(n_rows: int, inter: int, asked: int = 0) -> int:
    """Rows per chunk of `glmc::gated_mlp` (`asked` > 0: that many), spread evenly over the
    chunks so that the last one is not a sliver."""
    rows = asked if asked > 0 else max(MLP_MIN_ROWS, MLP_CHUNK_ELEMENTS // max(1, 2 * inter))
    chunks = -(-n_rows // max(1, min(n_rows, rows)))
    return max(1, -(-n_rows // chunks))


def _gate_up(xc: Tensor, w_gate: Tensor, w_up: Tensor | None, inter: int
             ) -> tuple[Tensor, Tensor]:
    """(gate, up) projections of one row chunk; `w_up` None: `w_gate` is the merged
    (2 * inter, d) weight, gate rows first (one matmul)."""
    if w_up is None:
        both = xc @ w_gate.to(xc.dtype).t()
        return both[:, :inter], both[:, inter:]
    return xc @ w_gate.to(xc.dtype).t(), xc @ w_up.to(xc.dtype).t()


def _pieces(w_gate: Tensor, w_up: Tensor | None, inter: int) -> tuple[Tensor, Tensor]:
    return (w_gate[:inter], w_gate[inter:]) if w_up is None else (w_gate, w_up)


@torch.library.custom_op("glmc::gated_mlp", mutates_args=())
def gated_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor | None, w_down: Tensor, act: str,
              rows: int = 0) -> Tensor:
    """`(act(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T` for 2-D x, computed `rows` rows at a
    time (0: `mlp_rows`), so the (rows x inter) projections exist one chunk at a time. With
    `w_up` None, `w_gate` is the merged gate/up weight (GLM's `gate_up_proj`). The backward
    keeps x only and makes each chunk's projections again (one more gate/up matmul than the
    unfused backward): the whole MLP's memory is one chunk's, at a memory budget's price."""
    inter = w_down.shape[1]
    rows = mlp_rows(x.shape[0], inter, rows)
    out = x.new_empty((x.shape[0], w_down.shape[0]))
    wd = w_down.to(x.dtype).t()
    for s in range(0, x.shape[0], rows):
        gate, up = _gate_up(x[s:s + rows], w_gate, w_up, inter)
        h = _ACTS[act](gate) * up
        del gate, up
        torch.mm(h, wd, out=out[s:s + rows])
        del h
    return out


@gated_mlp.register_fake
def _(x: Tensor, w_gate: Tensor, w_up: Tensor | None, w_down: Tensor, act: str,
      rows: int = 0) -> Tensor:
    return x.new_empty((x.shape[0], w_down.shape[0]))


def _accumulate(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b in acc's dtype (fp32 or wider): a low-precision chunk's product is not
    rounded to its dtype before it is summed."""
    acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


@torch.library.custom_op("glmc::gated_mlp_backward", mutates_args=())
def gated_mlp_backward(grad: Tensor, x: Tensor, w_gate: Tensor, w_up: Tensor | None,
                       w_down: Tensor, act: str, rows: int = 0
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad x, grad w_gate, grad w_up, grad w_down) of `gated_mlp`, chunk by chunk of rows:
    each chunk's projections are made again from x, and the weight gradients are summed over
    the chunks by fp32 (or wider) matmuls, in another order than one matmul over all rows
    (fp32 rounding). With the merged weight, grad w_up is empty (its rows are in grad
    w_gate)."""
    inter = w_down.shape[1]
    rows = mlp_rows(x.shape[0], inter, rows)
    wg, wu = (w.to(x.dtype) for w in _pieces(w_gate, w_up, inter))
    wd = w_down.to(x.dtype)
    gx = torch.empty_like(x)
    acc = torch.promote_types(x.dtype, torch.float32)
    g_gate = torch.zeros(w_gate.shape, dtype=acc, device=x.device)
    g_up = torch.zeros(w_up.shape if w_up is not None else (0,), dtype=acc, device=x.device)
    gg, gu = _pieces(g_gate, g_up if w_up is not None else None, inter)
    g_down = torch.zeros(w_down.shape, dtype=acc, device=x.device)
    for s in range(0, x.shape[0], rows):
        xc, gc = x[s:s + rows], grad[s:s + rows].to(x.dtype)
        gate, up = _gate_up(xc, w_gate, w_up, inter)
        h = _ACTS[act](gate) * up
        _accumulate(g_down, gc.t(), h)
        del h
        d_gate, d_up = _gated_backward_reference(gc @ wd, gate, up, act)
        del gate, up
        torch.mm(d_gate, wg, out=gx[s:s + rows])
        gx[s:s + rows].addmm_(d_up, wu)
        _accumulate(gg, d_gate.t(), xc)
        _accumulate(gu, d_up.t(), xc)
        del d_gate, d_up
    return (gx, g_gate.to(w_gate.dtype),
            g_up.to(w_up.dtype) if w_up is not None else g_up.to(w_gate.dtype),
            g_down.to(w_down.dtype))


@gated_mlp_backward.register_fake
def _(grad: Tensor, x: Tensor, w_gate: Tensor, w_up: Tensor | None, w_down: Tensor, act: str,
      rows: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return (torch.empty_like(x), torch.empty_like(w_gate),
            torch.empty_like(w_up) if w_up is not None else w_gate.new_empty((0,)),
            torch.empty_like(w_down))


def _mlp_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    x, w_gate, w_up, w_down, act, rows = inputs
    ctx.merged = w_up is None
    ctx.save_for_backward(x, w_gate, w_down, *([] if w_up is None else [w_up]))
    ctx.act, ctx.rows = act, rows


def _mlp_backward(ctx, grad):  # noqa: ANN001
    x, w_gate, w_down, *up = ctx.saved_tensors
    gx, gg, gu, gd = gated_mlp_backward(grad, x, w_gate, up[0] if up else None, w_down,
                                        ctx.act, ctx.rows)
    return gx, gg, None if ctx.merged else gu, gd, None, None


gated_mlp.register_autograd(_mlp_backward, setup_context=_mlp_setup)


def gated_mlp_reference(x: Tensor, w_gate: Tensor, w_up: Tensor | None, w_down: Tensor,
                        act: str, rows: int = 0) -> Tensor:
    """`gated_mlp` with plain ATen ops, unchunked."""
    gate, up = _gate_up(x, w_gate, w_up, w_down.shape[1])
    return (_ACTS[act](gate) * up) @ w_down.to(x.dtype).t()


def gated_mlp_backward_reference(grad: Tensor, x: Tensor, w_gate: Tensor, w_up: Tensor | None,
                                 w_down: Tensor, act: str, rows: int = 0
                                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    inter = w_down.shape[1]
    grad = grad.to(x.dtype)
    gate, up = _gate_up(x, w_gate, w_up, inter)
    h = _ACTS[act](gate) * up
    d_gate, d_up = _gated_backward_reference(grad @ w_down.to(x.dtype), gate, up, act)
    wg, wu = _pieces(w_gate, w_up, inter)
    gx = d_gate @ wg.to(x.dtype) + d_up @ wu.to(x.dtype)
    gg, gu = (d_gate.t() @ x).to(w_gate.dtype), (d_up.t() @ x).to(w_gate.dtype)
    if w_up is None:
        gg, gu = torch.cat([gg, gu]), w_gate.new_empty((0,))
    return gx, gg, gu, (grad.t() @ h).to(w_down.dtype)


#: glmc ops whose plain-ATen form a fusing backend (Inductor) should compile instead: the
#: memory saving is in what their autograd saves, which is fixed before the backend runs
ELEMENTWISE = ("rms_norm", "rms_norm_backward", "gated", "gated_backward")
#: glmc ops computed element by element (each output element from the inputs' elements at its
#: index): a sharded program runs them on each rank's block as they are
POINTWISE = ("gated", "gated_backward")


# Defined through torch.library.Library rather than `custom_op`: this op runs every step inside
# the compiled step, and custom_op's Python autograd / version-counter / default-filling layers
# cost ~0.5 ms per call there (cProfile, CNN example: 2% of its 26-ms step); here those are
# the dispatcher's C++ fallbacks, and only the kernel itself is Python.
_LIB = torch.library.Library("glmc", "FRAGMENT")
_LIB.define("fused_adam_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
            "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] max_exp_avg_sqs, Tensor[] steps, "
            "Tensor lr, float beta1, float beta2, float weight_decay, float eps, bool amsgrad, "
            "bool maximize, bool decoupled, Tensor[] after) -> ()")


def fused_adam_(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                exp_avg_sqs: list[Tensor], max_exp_avg_sqs: list[Tensor], steps: list[Tensor],
                lr: Tensor, beta1: float, beta2: float, weight_decay: float, eps: float,
                amsgrad: bool, maximize: bool, decoupled: bool, after: list[Tensor]) -> None:
    """`torch._fused_adam(w)_` on the step's own state tensors. The gradients are only read
    (ATen's kernel writes them back only when unscaling by a `grad_scale`, not passed here;
    checked for every maximize/amsgrad/weight-decay combination). `after` (the step's outputs)
    is not read: depending on it makes a compiler schedule every output's computation — which
    may read the old parameters — before this update overwrites them."""
    op = torch._fused_adamw_ if decoupled else torch._fused_adam_
    # ATen's kernel walks a parameter and its gradient element by element in memory: a
    # gradient in another layout (a channels-last convolution weight gradient Inductor made
    # for a contiguous weight: ConvNeXt) is copied into the parameter's, as AccumulateGrad lays
    # out `.grad`
    grads = [g if g.stride() == p.stride() else torch.empty_like(p).copy_(g)
             for p, g in zip(params, grads)]
    op(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr=lr, beta1=beta1,
       beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize)


_LIB.impl("fused_adam_", fused_adam_, "CompositeExplicitAutograd")


@torch.library.register_fake("glmc::fused_adam_")
def _(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2,  # noqa: ANN001
      weight_decay, eps, amsgrad, maximize, decoupled, after) -> None:
    return None


def in_place_fused_updates(gm: "torch.fx.GraphModule") -> int:
    """Each functional `aten._fused_adam(w)` whose new parameters and state are only copied
    back into the step's inputs (the write-back form, glmc.ir.writeback) -> one in-place
    `glmc::fused_adam_` on those inputs, after every copy it replaces; the copies go. New
    parameters that are read on (a sharded update gathers them) qualify too when computed
    from private views of inputs (`_private_view`): the update then runs in place on those
    views where the functional op ran, and their readers read the views.
    Returns how many were rewritten; any other shape of use is left functional (correct,
    with the functional op's copies)."""
    aten = torch.ops.aten
    kinds = {aten._fused_adamw.tensor_lr: True, aten._fused_adam.tensor_lr: False}
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    outputs = [a for a in graph.output_node().args[0] if isinstance(a, torch.fx.Node)]
    done = 0
    for node in [n for n in graph.nodes if n.target in kinds]:
        found = _in_place_uses(node, order)
        if found is None:
            continue
        dead, moved = found
        # new parameters read on (a sharded update's gather): the update runs where the
        # functional op ran, on the parameters' private views, and its readers read those;
        # else after every copy it replaces and every output it must follow (`after`: a
        # collective's wait the scheduler placed late, such as the loss's all-reduce)
        early = bool(node.meta.get(EARLY_UPDATE)) and not moved
        if early:  # inside the backward (glmc.planning.updates): after the outputs before it
            last = max(dead, key=order.__getitem__)
            after = [o for o in outputs if order[o] < order[last]]
        else:
            last = node if moved else max([*dead, *outputs], key=order.__getitem__)
            after = [] if moved else outputs
        a, k = node.args, node.kwargs
        with graph.inserting_after(last):
            new = graph.call_function(torch.ops.glmc.fused_adam_.default, (
                list(a[0]), list(a[1]), list(a[2]), list(a[3]), list(a[4]), list(a[5]),
                k["lr"], k["beta1"], k["beta2"], k["weight_decay"], k["eps"], k["amsgrad"],
                k["maximize"], kinds[node.target], after))
        new.meta = {"val": None, "glmc": node.meta.get("glmc")}
        for item, src in moved.items():  # readers after `node` in order: after the update
            item.replace_all_uses_with(src)
        for n in sorted(dead, key=order.__getitem__, reverse=True):
            graph.erase_node(n)
        done += 1
    if done:
        graph.eliminate_dead_code()
        graph.lint()
        gm.recompile()
    return done


def _in_place_uses(node: "torch.fx.Node", order: "dict[torch.fx.Node, int]"
                   ) -> "tuple[list[torch.fx.Node], dict[torch.fx.Node, torch.fx.Node]] | None":
    """(dead, moved) if `node` can run in place: every new state tensor, and every new
    parameter either, is copied into exactly the input it was computed from (and nothing else
    reads it) — those getitems and copies are `dead` — or (`moved`: new parameter -> the view
    it was computed from) a new parameter read on is computed from a private view of a step
    input that is only overwritten later (`_private_view`: a sharded update's rows of a
    parameter, gathered after the update). None otherwise."""
    dead: list[torch.fx.Node] = []
    moved: dict[torch.fx.Node, torch.fx.Node] = {}
    for lst in node.users:  # output list i is the new value of input list i
        if lst.target is not operator.getitem or lst.args[1] not in range(5):
            return None
        dead.append(lst)
        for item in lst.users:
            if item.target is not operator.getitem:
                return None
            dead.append(item)
            users = list(item.users)
            if lst.args[1] == 1:  # the grads' new values: must be unused
                if users:
                    return None
                continue
            src = node.args[lst.args[1]][item.args[1]]
            if len(users) == 1 and users[0].target is torch.ops.aten.copy_.default and \
                    users[0].args[0] is src and users[0].args[1] is item and \
                    src.op == "placeholder":
                dead.append(users[0])
            elif lst.args[1] == 0 and _private_view(src, node, order):
                moved[item] = src
            else:
                return None
    if moved:  # run at `node`: every input it overwrites must be read by nobody until then
        copied = [n.args[0] for n in dead if n.target is torch.ops.aten.copy_.default]
        if not all(_no_reader_until_overwritten(src, node, order) for src in copied):
            return None
    return [*dead, node], moved


def _private_view(src: "torch.fx.Node", node: "torch.fx.Node",
                  order: "dict[torch.fx.Node, int]") -> bool:
    """`src` is read only by `node`, and is a chain of views (`glmc.analysis.opcost.is_view`: alias
    annotations, `_unsafe_view`, `wait_tensor`), each read only by the next, of either a fresh
    tensor or a step input whose other readers only overwrite it later (a `copy_` into it
    after `node`: the write-back of its new value; at least one) — so updating `src` in place
    changes nothing anyone reads before that overwrite."""
    from glmc.ir.graph import is_view

    x, reader = src, node
    while True:
        if x.op == "placeholder":
            others = [u for u in x.users if u is not reader]
            return bool(others) and all(
                u.target is torch.ops.aten.copy_.default and u.args[0] is x
                and order.get(u, -1) > order[node] for u in others)
        if any(u is not reader for u in x.users) or x.op != "call_function":
            return False
        if not is_view(x):
            schema = getattr(x.target, "_schema", None)  # fresh: an op that allocates
            return schema is not None and not schema.is_mutable
        if not x.args or not isinstance(x.args[0], torch.fx.Node):
            return False
        x, reader = x.args[0], x


def _no_reader_until_overwritten(src: "torch.fx.Node", node: "torch.fx.Node",
                                 order: "dict[torch.fx.Node, int]") -> bool:
    """Nothing but `node` and the `copy_` overwriting it reads input `src` after `node`: the
    in-place update may run at `node` instead of at that copy."""
    return all(u is node or order.get(u, len(order)) < order[node]
               or (u.target is torch.ops.aten.copy_.default and u.args[0] is src)
               for u in src.users)


def _register_flops() -> None:
    """FLOPs of the fused head for torch.utils.flop_counter (and so glmc's cost model)."""
    from torch.utils.flop_counter import register_flop_formula

    @register_flop_formula(torch.ops.glmc.linear_cross_entropy)
    def _fwd(x_shape, w_shape, *args, **kwargs) -> int:  # noqa: ANN001
        return 6 * x_shape[0] * x_shape[1] * w_shape[0]  # logits, grad x, grad w

    @register_flop_formula(torch.ops.glmc.gated_mlp)
    def _mlp(x_shape, gate_shape, up_shape, down_shape, *args, **kwargs) -> int:  # noqa: ANN001
        return 6 * x_shape[0] * x_shape[1] * down_shape[1]  # gate, up, down

    @register_flop_formula(torch.ops.glmc.gated_mlp_backward)
    def _mlp_bwd(grad_shape, x_shape, gate_shape, up_shape, down_shape, *args,  # noqa: ANN001
                 **kwargs) -> int:
        # gate/up again, grad w_down, grad h, grad x (two), grad w_gate/w_up (two)
        return 16 * x_shape[0] * x_shape[1] * down_shape[1]


_register_flops()
