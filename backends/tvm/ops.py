"""What the TVM backend adds to torch's decompositions and TVM's PyTorch frontend for training.

* Decompositions (plain ATen, no prims): `native_layer_norm` and `var_mean`, whose torch
  decompositions use prims (`prims.var`, `broadcast_in_dim`) the frontend cannot import, and
  whose TVM converters compute only the inference output; `add` / `sub` with `alpha`, which
  the converters ignore; `index_put` on the leading dim (embedding's backward), which TVM's
  IndexPut rejects (it wants an index per dim), as a scatter; `cat` without the empty 1-d
  tensors torch skips.
* Converters (`custom_convert_map` of `from_exported_program`): `scatter_add` (max-pool's
  backward) and `amax`, which the frontend lacks, and `clamp` / `clamp_min` / `clamp_max`,
  whose converters fail on integer tensors and misread clamp_max's bound.

    layer_norm(x)  ->  mean = x.mean(-1, keepdim); var = ((x - mean)^2).mean(-1, keepdim)
                       rstd = rsqrt(var + eps); out = (x - mean) * rstd * w + b
                       returns (out, mean, rstd) as ATen does (mean/rstd in x's dtype on CPU)
"""
from __future__ import annotations

from typing import Any, Callable

import torch

aten = torch.ops.aten


def native_layer_norm(x: torch.Tensor, shape: list[int], weight: torch.Tensor | None,
                      bias: torch.Tensor | None, eps: float) -> Any:
    dims = list(range(x.dim() - len(shape), x.dim()))
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    xf = x.to(acc)
    mean = xf.mean(dim=dims, keepdim=True)
    centered = xf - mean
    rstd = torch.rsqrt((centered * centered).mean(dim=dims, keepdim=True) + eps)
    out = centered * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    stat = x.dtype if x.device.type == "cpu" else acc  # as ATen's kernels return them
    return out.to(x.dtype), mean.to(stat), rstd.to(stat)


def var_mean(x: torch.Tensor, dim: list[int] | None = None, *, correction: float | None = None,
             keepdim: bool = False) -> Any:
    dims = list(range(x.dim())) if dim is None else [d % max(x.dim(), 1) for d in dim]
    count = 1
    for d in dims:
        count *= x.shape[d]
    mean = x.mean(dim=dims, keepdim=True)
    centered = x - mean
    denom = max(count - (1 if correction is None else correction), 0)
    var = (centered * centered).sum(dim=dims, keepdim=keepdim) / denom
    return var, mean if keepdim else mean.squeeze(dims)


def _with_alpha(op: Any) -> Callable:
    """add/sub(x, y, alpha=a) as x +- (y * a): TVM's converters drop `alpha` (SGD's weight
    decay and momentum are `add(grad, param, alpha=wd)`). alpha == 1 stays as it is."""
    def decomposition(x: Any, y: Any, *, alpha: Any = 1) -> Any:
        if alpha == 1:
            return NotImplemented
        return op(x, aten.mul.Tensor(y, alpha) if isinstance(y, torch.Tensor) else y * alpha)
    return decomposition


def max_pool2d_with_indices(x: torch.Tensor, kernel: list[int], stride: list[int] | None = None,
                            padding: Any = 0, dilation: Any = 1, ceil_mode: bool = False) -> Any:
    """max_pool2d with the indices its backward reads (flat h * W + w per plane, as ATen), as
    strided slices of the padded input, one per kernel offset, and a max over them. TVM's
    converter returns zeros for the indices; torch's decomposition uses an `index.Tensor`
    TVM's converter cannot broadcast."""
    pair = (lambda v: [v, v] if isinstance(v, int) else list(v) * (2 // len(v)))
    (kh, kw), (ph, pw), (dh, dw) = pair(kernel), pair(padding), pair(dilation)
    sh, sw = pair(stride) if stride else (kh, kw)
    if ceil_mode or x.dim() != 4:
        return NotImplemented
    h, w = x.shape[-2:]
    oh, ow = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    xp = aten.constant_pad_nd.default(x, [pw, pw, ph, ph], float("-inf"))
    windows = [xp[:, :, i * dh: i * dh + sh * (oh - 1) + 1: sh,
                  j * dw: j * dw + sw * (ow - 1) + 1: sw] for i in range(kh) for j in range(kw)]
    values, k = torch.stack(windows, dim=-1).max(dim=-1)  # first maximum, as ATen
    # the flat input index of every window's element, built from aranges alone (TVM's
    # converters give Python ints int32 constants, which int64 arithmetic rejects)
    where = []
    for i in range(kh):
        r0 = (i * dh - ph) * w
        rows = torch.arange(r0, r0 + sh * w * oh, sh * w, device=x.device)[:oh].unsqueeze(1)
        for j in range(kw):
            c0 = j * dw - pw
            cols = torch.arange(c0, c0 + sw * ow, sw, device=x.device)[:ow].unsqueeze(0)
            where.append(rows + cols)
    table = torch.stack(where, dim=-1).expand(*k.shape, kh * kw)
    return values, torch.gather(table, -1, k.unsqueeze(-1)).squeeze(-1)


def index_put(x: torch.Tensor, indices: list[torch.Tensor | None], values: torch.Tensor,
              accumulate: bool = False) -> Any:
    """index_put on the leading dim only (embedding's backward: `zeros(V, D)[ids] += grad`)
    as scatter(_add) along dim 0: TVM's IndexPut wants one index tensor per dim."""
    if len(indices) != 1 or indices[0] is None or x.dim() == 1 or \
            indices[0].dtype == torch.bool:
        return NotImplemented
    idx = indices[0].reshape(-1)
    rest = list(x.shape[1:])
    vals = values.expand(*indices[0].shape, *rest).reshape(idx.shape[0], *rest)
    where = idx.reshape(-1, *[1] * len(rest)).expand(idx.shape[0], *rest)
    if accumulate:
        return aten.scatter_add.default(x, 0, where, vals)
    return aten.scatter.src(x, 0, where, vals)


def cat(tensors: list[torch.Tensor], dim: int = 0) -> Any:
    """cat without the empty 1-d tensors torch's legacy rule skips (transformers' KV cache
    starts as `tensor([])`); TVM's concat wants every input of the same rank."""
    kept = [t for t in tensors if not (t.dim() == 1 and t.numel() == 0)]
    if len(kept) == len(tensors) or not kept:
        return NotImplemented
    return aten.cat.default(kept, dim) if len(kept) > 1 else aten.clone.default(kept[0])


DECOMPOSITIONS: dict[Any, Callable] = {
    aten.cat.default: cat,
    aten.max_pool2d_with_indices.default: max_pool2d_with_indices,
    aten.index_put.default: index_put,
    aten.native_layer_norm.default: native_layer_norm,
    aten.var_mean.correction: var_mean,
    aten.add.Tensor: _with_alpha(aten.add.Tensor),
    aten.sub.Tensor: _with_alpha(aten.sub.Tensor),
}


# ---- converters ---------------------------------------------------------------------------------

def _scatter_add(node: Any, importer: Any) -> Any:
    from tvm import relax
    x, dim, index, src = (importer.env.get(a, a) if not isinstance(a, int) else a
                          for a in node.args)
    return importer.block_builder.emit(
        relax.op.scatter_elements(x, index, src, axis=dim, reduction="add"))


def _amax(node: Any, importer: Any) -> Any:
    from tvm import relax
    x = importer.env[node.args[0]]
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", [])
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    axis = list(dims) if dims else None  # amax(x, []) reduces every dim
    return importer.block_builder.emit(relax.op.max(x, axis=axis, keepdims=keepdim))


def _clamp(node: Any, importer: Any, lo_at: int | None = 1, hi_at: int | None = 2) -> Any:
    """clamp with scalar bounds as maximum/minimum against constants of x's dtype. TVM's
    converters make a missing bound +-inf, which an integer tensor (token ids) cannot take
    ("Cannot convert infinity to BigInt"), and clamp_max reads its bound from args[2]."""
    from tvm import relax
    x = importer.env[node.args[0]]
    dtype = x.ty.dtype.dtype if hasattr(x.ty, "dtype") else x.struct_info.dtype

    def bound(at: int | None, key: str) -> Any:
        if at is None:
            return None
        return node.args[at] if len(node.args) > at else node.kwargs.get(key)

    lo, hi = bound(lo_at, "min"), bound(hi_at, "max")
    if lo is not None:
        x = importer.block_builder.emit(relax.op.maximum(x, relax.const(lo, dtype)))
    if hi is not None:
        x = importer.block_builder.emit(relax.op.minimum(x, relax.const(hi, dtype)))
    return x


CONVERTERS: dict[str, Callable] = {
    "scatter_add.default": _scatter_add,
    "amax.default": _amax,
    "clamp.default": _clamp,
    "clamp_min.default": lambda node, importer: _clamp(node, importer, 1, None),
    "clamp_max.default": lambda node, importer: _clamp(node, importer, None, 1),
}
