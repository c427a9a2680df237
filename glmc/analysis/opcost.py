"""What one op costs: its kind, FLOPs, bytes moved and overheads (`OpCost`), by rule.

Rules, in the order they are consulted:

* fused ops (`_RULES`, keyed by qualified op name): CPU flash attention (FLOPs from the shapes,
  `glmc.analysis.profiles.attention_flops`) and glmc's kernels (`glmc.ir.kernels`), which run as Python
  custom ops: their cost is the ATen kernels their bodies run (chunk by chunk for the losses),
  the ATen calls they make and the custom op's own dispatch;
* matmul-like ops: FLOPs from `torch.utils.flop_counter` (mm, bmm, addmm, convolution, ...);
* pointwise ops (ATen's tag; FLOPs per element from `_POINTWISE_WEIGHT`), reductions, and the
  ops of `_KNOWN` (FLOPs per element of the largest input); views move nothing;
* anything else: the generic bytes rule, kind "unknown" (counted and reported, never free).

Bytes are the inputs read and outputs written; a backend's fusion model (glmc.ir.target) corrects
them for the kernels it fuses. `glmc.analysis.cost` turns costs into time on a device profile.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.fx as fx

from glmc.analysis.profiles import ATTENTION_BACKWARD_FACTOR, attention_flops
from glmc.ir.graph import RANDOM_OPS, comm_ops, is_view, op_name
from glmc.ir.kernels import CHUNK_ELEMENTS, head_rows, mlp_rows

__all__ = ["OpCost", "op_cost", "kind_of", "is_view", "value_bytes", "selective_keeps"]

aten = torch.ops.aten

# ---- op classification ------------------------------------------------------------------------

#: FLOPs per output element of pointwise ops that are not a single add/mul (transcendentals etc.)
_POINTWISE_WEIGHT = {
    "exp": 8, "log": 8, "sqrt": 4, "rsqrt": 4, "pow": 8, "tanh": 10, "sigmoid": 10, "silu": 12,
    "silu_backward": 16, "gelu": 16, "gelu_backward": 24, "erf": 10, "div": 4, "lerp": 3,
    "addcmul": 3, "addcdiv": 4, "sin": 8, "cos": 8, "native_dropout_backward": 2,
}
#: non-pointwise, non-matmul ops with a known cost rule: name -> FLOPs per element of the
#: largest input (bytes come from inputs + outputs)
_KNOWN = {
    "_softmax": 5, "_softmax_backward_data": 3, "_log_softmax": 5, "_log_softmax_backward_data": 3,
    "nll_loss_forward": 1, "nll_loss_backward": 1, "embedding": 0, "embedding_dense_backward": 1,
    "native_layer_norm": 8, "native_layer_norm_backward": 12,
    "_native_batch_norm_legit_functional": 8,
    "native_batch_norm": 8, "native_batch_norm_backward": 12, "_native_batch_norm_legit": 8,
    "_native_batch_norm_legit_no_training": 4, "max_pool2d_with_indices": 1,
    "max_pool2d_with_indices_backward": 1, "avg_pool2d": 1, "avg_pool2d_backward": 1,
    "cat": 0, "stack": 0, "clone": 0, "_to_copy": 0, "copy": 0, "copy_": 0, "triu": 1, "tril": 1,
    "slice_backward": 0, "select_backward": 0, "slice_scatter": 0, "index_select": 0,
    "gather": 0, "scatter": 0,
    "scatter_add": 1, "index": 0, "index_put": 0, "index_add": 1, "native_dropout": 4,
    "bernoulli": 4, "rand": 4, "randn": 8, "rand_like": 4, "randn_like": 8, "where": 1,
    "zeros": 0, "ones": 0, "full": 0, "empty": 0, "zeros_like": 0, "ones_like": 0,
    "full_like": 0, "empty_like": 0, "scalar_tensor": 0, "arange": 1, "cumsum": 1,
    "_unsafe_index": 0, "constant_pad_nd": 0, "fill": 0, "masked_fill": 1, "topk": 4, "sort": 8,
    "_fused_adam": 16, "_fused_adamw": 16, "_fused_sgd": 4,
}
#: ops that allocate but never read their input's data (only its shape)
_SHAPE_ONLY = {"zeros_like", "ones_like", "full_like", "empty_like", "zeros", "ones", "full",
               "empty", "scalar_tensor", "arange", "rand", "randn", "rand_like", "randn_like"}


def kind_of(node: fx.Node) -> str:
    """'view' | 'matmul' | 'pointwise' | 'reduction' | 'known' | 'comm' | 'unknown' |
    'input'."""
    if node.op in ("placeholder", "get_attr"):
        return "input"
    if node.op != "call_function":
        return "view"
    if is_view(node):
        # in-place ops alias their input but still compute
        t = node.target
        if isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable:
            return "known"
        return "view"
    t = node.target
    if not isinstance(t, torch._ops.OpOverload):
        return "unknown"
    if t in comm_ops():
        return "comm"  # timed by the communication model (glmc.analysis.comm), not as compute
    if t._schema.name in _RULES:
        return _RULES[t._schema.name][0]
    if t.overloadpacket in _flop_registry():
        return "matmul"
    name = op_name(node)
    if torch.Tag.pointwise in t.tags:
        return "pointwise"
    if name.startswith("_foreach_"):
        return "known"  # multi-tensor pointwise: one pass over every tensor of the lists
    if torch.Tag.reduction in t.tags:
        return "reduction"
    if name in _KNOWN:
        return "known"
    return "unknown"


def selective_keeps(node: fx.Node) -> bool:
    """Whether selective recomputation keeps `node`'s value for the backward rather than
    making it again (Korthikanti et al. 2022's rule, by op kind): the outputs of matmuls and
    attention (costly to make again), of collectives (their peers would have to join in) and
    of random ops (their draws must repeat) are kept, and of any op doing more than
    `_SELECTIVE_FLOPS` per element it makes (glmc's fused kernels that run matmuls inside);
    pointwise ops, norms, softmax, reductions and copies, cheap per byte they hold, are
    recomputed from them."""
    if kind_of(node) in ("matmul", "comm", "input") or op_name(node) in RANDOM_OPS:
        return True
    return op_cost(node).flops > _SELECTIVE_FLOPS * max(1, _val_numel(node.meta.get("val")))


#: FLOPs per element made above which selective recomputation keeps a value: above every
#: pointwise op, norm and softmax (at most 16, GELU), far below a matmul's 2 x its inner size
_SELECTIVE_FLOPS = 32


def _flop_registry() -> dict:
    from torch.utils.flop_counter import flop_registry
    return flop_registry


def value_bytes(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (list, tuple)):
        return sum(value_bytes(x) for x in v)
    return 0


def _val_numel(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel()
    if isinstance(v, (list, tuple)):
        return sum(_val_numel(x) for x in v)
    return 0


def _val_dtype(v: Any) -> torch.dtype | None:
    if isinstance(v, torch.Tensor):
        return v.dtype
    if isinstance(v, (list, tuple)):
        for x in v:
            d = _val_dtype(x)
            if d is not None:
                return d
    return None


@dataclass(frozen=True)
class OpCost:
    """FLOPs and bytes of one op or kernel, and what it pays in overheads.

    `launches`: kernel launches (or dispatches) of the op itself; 0 when it runs inside a
    kernel already launched. `calls`: ATen calls its Python body makes (`python_op`: a Python
    custom op, which pays the profile's custom-op dispatch instead of a launch). `parts`: the
    inner kernels of a composite op as (cost, how many); its time is theirs, not a roofline of
    the totals. `workspace`: bytes it allocates and frees inside (its peak above its outputs);
    `workspace_cap`: the most that reaches for any number of rows (a chunked kernel holds one
    chunk), None where it grows with the rows.
    """

    kind: str
    flops: float
    bytes_read: int
    bytes_written: int
    dtype: str
    name: str = ""
    launches: int = 1
    calls: int = 0
    python_op: bool = False
    parts: tuple[tuple["OpCost", int], ...] = ()
    workspace: int = 0
    workspace_cap: int | None = None
    reused: int = 0  #: bytes of passes over data the op just touched (cache speed if it fits)
    working_set: int = 0  #: bytes those passes keep touching (picks the cache level)

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    def replace(self, **changes: Any) -> "OpCost":
        return replace(self, **changes)


def op_cost(node: fx.Node) -> OpCost:
    """FLOPs and bytes of one node computed alone (no fusion)."""
    kind = kind_of(node)
    out = node.meta.get("val")
    dtype = str(_val_dtype(out) or torch.float32).replace("torch.", "")
    if kind in ("view", "input") or node.op != "call_function":
        return OpCost(kind, 0.0, 0, 0, dtype, op_name(node))
    if kind == "comm":
        return OpCost(kind, 0.0, 0, 0, dtype, op_name(node), launches=0,
                      workspace=_comm_staging(node))
    rule = _RULES.get(node.target._schema.name) if isinstance(
        node.target, torch._ops.OpOverload) else None
    if rule is not None:
        return rule[1](node)
    ins = [a.meta.get("val") for a in node.all_input_nodes]
    name = op_name(node)
    read = 0 if name in _SHAPE_ONLY else sum(value_bytes(v) for v in ins)
    written = value_bytes(out)
    if kind == "matmul":
        flops = _matmul_flops(node)
    elif kind == "pointwise":
        flops = _val_numel(out) * _POINTWISE_WEIGHT.get(name, 1)
    elif kind == "reduction":
        flops = max((_val_numel(v) for v in ins), default=0)
    elif kind == "known":
        if node.target._schema.is_mutable and is_view(node):  # copy_: reads src, writes dest
            written = value_bytes(ins[1]) if len(ins) > 1 else written
            read = written
        flops = max((_val_numel(v) for v in ins), default=_val_numel(out)) * _KNOWN.get(name, 1)
        if name.startswith("_foreach_"):
            flops = _val_numel(out)
    else:  # unknown: generic bytes rule, one FLOP per element
        flops = max(_val_numel(out), max((_val_numel(v) for v in ins), default=0))
    return OpCost(kind, float(flops), read, written, dtype, name)


def _comm_staging(node: fx.Node) -> int:
    """Bytes a collective allocates while in flight: gloo (CPU) stages the whole buffer of a
    reduce-scatter (its input) and of an all-gather (its output) in a temporary — measured
    with the c10 allocator, torch 2.13; NCCL works in place. How long it lives:
    glmc.analysis.memory's `_staging`."""
    name = comm_ops().get(node.target)
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor) or out.device.type != "cpu":
        return 0
    if name == "reduce_scatter_tensor":
        return value_bytes(node.args[0].meta.get("val"))
    if name == "all_gather_into_tensor":
        return value_bytes(out)
    return 0


def _matmul_flops(node: fx.Node) -> float:
    """FLOPs from torch.utils.flop_counter's formulas (they take tensors or shapes)."""
    fn = _flop_registry()[node.target.overloadpacket]

    def val(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return a.meta.get("val")
        if isinstance(a, (list, tuple)):
            return type(a)(val(x) for x in a)
        return a
    return float(fn(*[val(a) for a in node.args], **{k: val(v) for k, v in node.kwargs.items()},
                    out_val=node.meta.get("val")))


# ---- rules for fused ops: flash attention and glmc's kernels ------------------------------------


def _val(a: Any) -> Any:
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def _arg(node: fx.Node, i: int, name: str, default: Any) -> Any:
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _io_bytes(node: fx.Node) -> tuple[int, int]:
    return (sum(value_bytes(a.meta.get("val")) for a in node.all_input_nodes),
            value_bytes(node.meta.get("val")))


def _attention(node: fx.Node, backward: bool) -> OpCost:
    """CPU flash attention (no S×S buffer: bytes are its inputs and outputs)."""
    first = 1 if backward else 0  # the backward takes grad_out first
    q, k, v = (_val(node.args[first + i]) for i in range(3))
    causal = bool(_arg(node, 7 if backward else 4, "is_causal", False))
    flops = attention_flops(math.prod(q.shape[:-3]), q.shape[-3], q.shape[-2], k.shape[-2],
                            q.shape[-1], v.shape[-1], causal)
    read, written = _io_bytes(node)
    return OpCost("matmul", flops * (ATTENTION_BACKWARD_FACTOR if backward else 1.0), read,
                  written, str(q.dtype).replace("torch.", ""), op_name(node))


def _python_op(node: fx.Node, flops: float, moved: float, calls: int, workspace: float,
               parts: tuple[tuple[OpCost, int], ...] = (), cap: float | None = None) -> OpCost:
    """A glmc kernel: a Python custom op whose body makes `calls` ATen calls moving `moved`
    bytes in all. Its inputs and outputs move once from memory; the rest are passes over
    data the body just touched (`reused`, at cache speed while it fits)."""
    read, written = _io_bytes(node)
    out = _val_dtype(node.meta.get("val")) or torch.float32
    return OpCost("known", float(flops), read, written, str(out).replace("torch.", ""),
                  op_name(node), calls=calls, python_op=True, parts=parts,
                  workspace=int(workspace), workspace_cap=None if cap is None else int(cap),
                  reused=max(0, int(moved) - read - written),
                  working_set=read + written + int(workspace))


def _numel_size(x: torch.Tensor) -> tuple[int, int]:
    return x.numel(), x.element_size()


#: ATen calls in the body of glmc.ir.kernels.gated_backward per activation (3 of them dtype
#: casts that copy nothing); each other call is one pass over the activation
_GATED_BACKWARD_CALLS = {"silu": 12, "gelu": 17, "gelu_tanh": 26}


def _rms_norm(node: fx.Node) -> OpCost:
    n, size = _numel_size(_val(node.args[0]))  # pow, mean, add, rsqrt, 2 mul: 7 passes
    return _python_op(node, 4 * n, 7 * n * size, 6, n * size)


def _rms_norm_backward(node: fx.Node) -> OpCost:
    n, size = _numel_size(_val(node.args[1]))  # 6 mul, mean, sub, sum, 2 casts: 19 passes
    return _python_op(node, 9 * n, 19 * n * size, 11, 3 * n * size)


def _gated(node: fx.Node) -> OpCost:
    n, size = _numel_size(_val(node.args[0]))  # act(gate) (an exp's work), · up: 5 passes
    return _python_op(node, 9 * n, 5 * n * size, 2, n * size)


def _gated_backward(node: fx.Node) -> OpCost:
    n, _ = _numel_size(_val(node.args[1]))  # in fp32 (gate.float()): 2.5 passes per call
    calls = _GATED_BACKWARD_CALLS.get(str(node.args[3]), 26)
    return _python_op(node, (calls + 4) * n, 10 * (calls - 3) * n, calls, 3 * n * 4)


def _chunks(n_rows: int, vocab: int, elements: int) -> tuple[int, int]:
    """(rows per chunk, chunks) of glmc's chunked losses (glmc.ir.kernels._rows_per_chunk)."""
    rows = min(n_rows, max(1, elements // max(1, vocab)))
    return rows, -(-n_rows // rows)


def _chunk(flops: float, cold: float, reused: float, working_set: float) -> OpCost:
    """One chunk's vector work in fp32: `cold` bytes from memory, `reused` over the chunk."""
    return OpCost("known", float(flops), int(cold), 0, "float32", reused=int(reused),
                  working_set=int(working_set))


def _cross_entropy(node: fx.Node) -> OpCost:
    """Per chunk of rows: a fp32 copy, logsumexp (max, exp, sum: 11 FLOPs and 4 passes per
    logit), gather; 8 + 12 calls per chunk."""
    logits = _val(node.args[0])
    (n, v), size = logits.shape, logits.element_size()
    rows, chunks = _chunks(n, v, CHUNK_ELEMENTS)
    part = _chunk(11 * rows * v, rows * v * size, rows * v * 16, rows * v * 8)
    return _python_op(node, 11 * n * v, chunks * (part.bytes + part.reused), 8 + 12 * chunks,
                      rows * v * 8, ((part, chunks),),
                      _chunks(1 << 62, v, CHUNK_ELEMENTS)[0] * v * 8)


def _cross_entropy_backward(node: fx.Node) -> OpCost:
    """Per chunk: softmax from the saved lse in place (sub, exp, scale: 11 FLOPs and 7 fp32
    passes per logit), cast back; 4 + 21 calls per chunk."""
    logits = _val(node.args[1])
    (n, v), size = logits.shape, logits.element_size()
    rows, chunks = _chunks(n, v, CHUNK_ELEMENTS)
    part = _chunk(11 * rows * v, 2 * rows * v * size, rows * v * 28, rows * v * 4)
    return _python_op(node, 11 * n * v, chunks * (part.bytes + part.reused), 4 + 21 * chunks,
                      rows * v * 4, ((part, chunks),),
                      _chunks(1 << 62, v, CHUNK_ELEMENTS)[0] * v * 4)


def _linear_cross_entropy(node: fx.Node) -> OpCost:
    """Per chunk of rows: three matmuls (logits, grad x, grad w) at the chunk's size, the loss
    and softmax over the fp32 logits chunk (log_softmax, exp: 23 FLOPs and 8 passes per
    logit); in fp32 grad x and grad w are written/accumulated by the matmuls, otherwise grad w
    gets a (V, D) product added per chunk; 10 + 27 calls per chunk. Holds a logits chunk and
    its softmax temporaries (and the product)."""
    x, w = _val(node.args[0]), _val(node.args[1])
    (n, d), v = x.shape, w.shape[0]
    asked = int(_arg(node, 6, "rows", 0))
    rows = head_rows(n, v) if asked <= 0 else min(n, asked)
    most = head_rows(1 << 62, v) if asked <= 0 else asked  # rows of a chunk at any size
    chunks = -(-n // rows)
    fp32 = _arg(node, 5, "fp32", True)
    dtype = "float32" if fp32 else str(x.dtype).replace("torch.", "")
    mm = OpCost("matmul", 2.0 * rows * d * v, (rows * d + v * d + rows * v) * 4, 0, dtype)
    soft = _chunk(23 * rows * v, 0, rows * v * 32, rows * v * 8)
    parts: tuple = ((mm, 3 * chunks), (soft, chunks))
    if not fp32:
        parts += ((_chunk(v * d, 3 * v * d * 4, 0, 0), chunks),)
    flops = sum(p.flops * k for p, k in parts)
    moved = sum((p.bytes + p.reused) * k for p, k in parts)
    extra = 0 if fp32 else v * d * 4
    return _python_op(node, flops, moved, 10 + 27 * chunks, rows * v * 8 + extra, parts,
                      most * v * 8 + extra)


def _gated_mlp(node: fx.Node, backward: bool) -> OpCost:
    """Per chunk of rows: the gate/up and down matmuls (3; the backward makes gate/up again
    and adds grad w_down, grad h, grad x and grad w_gate/w_up: 8), act(gate) * up (and the
    backward's closed-form derivative, `_gated_backward`'s passes); holds one chunk's
    projections, activation and their gradients."""
    first = 1 if backward else 0
    x, wd = _val(node.args[first]), _val(node.args[first + 3])
    (n, d), inter, size = x.shape, wd.shape[1], x.element_size()
    asked = int(_arg(node, first + 5, "rows", 0))
    rows = mlp_rows(n, inter, asked)
    most = mlp_rows(1 << 62, inter, asked)  # rows of a chunk at any size
    chunks = -(-n // rows)
    dtype = str(x.dtype).replace("torch.", "")
    mm = OpCost("matmul", 2.0 * rows * d * inter, (rows * d + inter * d + rows * inter) * size,
                0, dtype)
    act = _chunk(9 * rows * inter, 0, 5 * rows * inter * size, 3 * rows * inter * size)
    parts: tuple = ((mm, (8 if backward else 3) * chunks), (act, chunks))
    calls, workspace = 6, 3 * rows * inter * size
    if backward:
        k = _GATED_BACKWARD_CALLS.get(str(_arg(node, first + 4, "act", "silu")), 26)
        parts += ((_chunk((k + 4) * rows * inter, 0, 10 * (k - 3) * rows * inter,
                          3 * rows * inter * 4), chunks),)
        calls, workspace = 12 + k, rows * inter * (6 * size + 12)
    flops = sum(p.flops * c for p, c in parts)
    moved = sum((p.bytes + p.reused) * c for p, c in parts)
    return _python_op(node, flops, moved, 2 + calls * chunks, workspace, parts,
                      workspace * most // rows)


#: qualified op name -> (kind, rule giving its OpCost); consulted before every other rule
_RULES: dict[str, tuple[str, Callable[[fx.Node], OpCost]]] = {
    "aten::_scaled_dot_product_flash_attention_for_cpu":
        ("matmul", lambda n: _attention(n, backward=False)),
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward":
        ("matmul", lambda n: _attention(n, backward=True)),
    "glmc::rms_norm": ("known", _rms_norm),
    "glmc::rms_norm_backward": ("known", _rms_norm_backward),
    "glmc::gated": ("known", _gated),
    "glmc::gated_backward": ("known", _gated_backward),
    "glmc::cross_entropy": ("known", _cross_entropy),
    "glmc::cross_entropy_backward": ("known", _cross_entropy_backward),
    "glmc::linear_cross_entropy": ("known", _linear_cross_entropy),
    "glmc::gated_mlp": ("known", lambda n: _gated_mlp(n, backward=False)),
    "glmc::gated_mlp_backward": ("known", lambda n: _gated_mlp(n, backward=True)),
}
