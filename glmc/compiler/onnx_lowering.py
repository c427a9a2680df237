"""The functional step as ONNX: the lowering shared by the export (glmc.export.artifacts) and the ONNX
Runtime backend (backends/ort.py).

    graph (ATen, maybe glmc ops)  --lower_to_aten-->  plain ATen
        --make_fx(core ATen + glmc + [fused attention] decompositions)-->  core ATen
        --torch.export + dynamo ONNX exporter-->  ONNX (IR version 10: onnxruntime >= 1.19)

`onnx_offenses` answers ahead of time (on fake tensors, in seconds) which ops the exporter has
no function for, with the source lines of the step's nodes they come from.

Two backward ops have no ONNX function in torch's exporter: the fused attention's
(`_scaled_dot_product_flash_attention_for_cpu_backward`, from the fusion pass) and
`convolution_backward`. `extra_decompositions=True` decomposes them to ops it has (the
attention's: recompute softmax(q k^T) and the textbook gradients; the convolution's: two
forward convolutions), and training-mode batch norm to mean/var (onnxruntime 1.19's CPU
BatchNormalization ignores training_mode=1), so fused steps and CNNs lower and run too. It is
opt-in: the export keeps its documented behaviour (fail with the offense) until its tests are
updated; the ORT backend always lowers them.
"""
from __future__ import annotations

import functools
import math
import re
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.fx as fx

from glmc.errors import ConfigError, ExportError, GlmcError, Offense
from glmc.ir.graph import TrainGraph

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
aten = torch.ops.aten
_NO_ONNX = "no ONNX function in torch's exporter"


def require_onnx(where: str = "export") -> None:
    import importlib.util
    missing = [m for m in ("onnx", "onnxscript") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"{where}: ONNX export needs {', '.join(missing)} (pip install "
                          "'glmc[onnx]')")


# ---- decompositions ----------------------------------------------------------------------------

def _flash_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                              dropout_p: float, is_causal: bool, *,
                              attn_mask: torch.Tensor | None = None,
                              scale: float | None = None) -> Any:
    """The CPU flash attention's backward as plain ATen math, in fp32 (as the kernel
    accumulates). Recomputes the probabilities from q and k instead of reading `lse`: torch's
    own decomposition of the forward returns the probabilities in that slot, not the
    log-sum-exp, so the backward must not depend on it. Dropout has no decomposition here
    (NotImplemented: the op stays and `onnx_offenses` names it)."""
    if dropout_p != 0.0:
        return NotImplemented
    dtype = q.dtype
    g, q, k, v, out = (t.float() for t in (grad_out, q, k, v, out))
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    rep = q.shape[-3] // k.shape[-3]  # grouped-query attention: k/v heads shared by `rep`
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    s = q @ k.transpose(-2, -1) * scale
    if is_causal:
        L, S = q.shape[-2], k.shape[-2]
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else s + attn_mask.float()
    p = s.softmax(dim=-1)
    dv = p.transpose(-2, -1) @ g
    dp = g @ v.transpose(-2, -1)
    ds = p * (dp - (g * out).sum(dim=-1, keepdim=True))
    dq = ds @ k * scale
    dk = ds.transpose(-2, -1) @ q * scale
    if rep > 1:
        dk = dk.unflatten(-3, (-1, rep)).sum(dim=-3)  # (..., kv heads, rep, S, E)
        dv = dv.unflatten(-3, (-1, rep)).sum(dim=-3)
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


def _convolution_backward(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                          bias_sizes: Any, stride: list[int], padding: list[int],
                          dilation: list[int], transposed: bool, output_padding: list[int],
                          groups: int, mask: list[bool]) -> Any:
    """convolution_backward as forward convolutions (the exporter has no function for it):

        grad_x = conv_transpose(grad, w)                        (output_padding restores x's size)
        grad_w = conv(x^T, grad^T, stride=dilation, dilation=stride)^T   per group, cut to w's size
        grad_b = grad.sum(every dim but channels)
    Transposed convolutions are left alone (NotImplemented: offense names them)."""
    if transposed:
        return NotImplemented
    nd = x.dim() - 2
    ks, ins, outs = w.shape[2:], x.shape[2:], grad.shape[2:]
    gx = gw = gb = None
    if mask[0]:
        extra = [ins[i] - ((outs[i] - 1) * stride[i] - 2 * padding[i]
                           + dilation[i] * (ks[i] - 1) + 1) for i in range(nd)]
        gx = aten.convolution.default(grad, w, None, stride, padding, dilation, True, extra,
                                      groups)
    if mask[1]:
        cin, cout = x.shape[1] // groups, grad.shape[1] // groups
        parts = []
        for g in range(groups):
            xg = x[:, g * cin:(g + 1) * cin].transpose(0, 1)       # (Cin/g, N, *in)
            dg = grad[:, g * cout:(g + 1) * cout].transpose(0, 1)  # (Cout/g, N, *out)
            full = aten.convolution.default(xg, dg, None, dilation, padding, stride, False,
                                            [0] * nd, 1)           # (Cin/g, Cout/g, >= k)
            for i in range(nd):
                full = full.narrow(2 + i, 0, ks[i])
            parts.append(full.transpose(0, 1))
        # contiguous as ATen's kernel returns it (a transposed layout would make later
        # decompositions restore strides with prims.copy_strided, which does not export)
        gw = torch.cat(parts, dim=0) if groups > 1 else parts[0].contiguous()
    if mask[2]:
        gb = grad.sum(dim=[0, *range(2, grad.dim())])
    return gx, gw, gb


def _split_with_sizes(x: torch.Tensor, sizes: list[int], dim: int = 0) -> list[torch.Tensor]:
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [x.narrow(dim, start, size) for start, size in zip(starts, sizes)]


def _slice_scatter(base: torch.Tensor, src: torch.Tensor, dim: int = 0, start: int | None = None,
                   end: int | None = None, step: int = 1) -> Any:
    """`src` written into `base[start:end]` along `dim` as a Concat of `src` and the slices of
    `base` around it, not the exporter's Transpose + ScatterND + Transpose (GLM small's rotary
    backward: 124 Transposes, 9% of ONNX Runtime's step). Exact (data movement only). A step
    other than 1 keeps the exporter's form (NotImplemented: make_fx records the op)."""
    if step != 1:
        return NotImplemented
    dim = dim % base.dim()
    size = base.shape[dim]
    lo, hi, _ = slice(start, end).indices(size)
    hi = max(lo, hi)
    parts = [base.narrow(dim, 0, lo)] if lo > 0 else []
    parts.append(src)
    if hi < size:
        parts.append(base.narrow(dim, hi, size - hi))
    return torch.cat(parts, dim) if len(parts) > 1 else src.clone()


def lowering_decompositions(extra_decompositions: bool = False) -> dict[Any, Callable]:
    """core ATen + glmc's fused ops; with `extra_decompositions` also the backward ops torch's
    exporter has no function for (the fused attention's, convolution's) and training-mode
    batch norm (whose ONNX form onnxruntime runs in eval mode)."""
    from torch._decomp import core_aten_decompositions

    from glmc.ir.kernels import decompositions

    table = {**core_aten_decompositions(), **decompositions()}
    if extra_decompositions:
        table[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = \
            _flash_attention_backward
        table[aten.convolution_backward.default] = _convolution_backward
        # exported as BatchNormalization(training_mode=1), which onnxruntime 1.19's CPU kernel
        # runs with the running statistics (eval), not the batch's: decompose to mean/var
        bn = aten._native_batch_norm_legit_functional.default
        table[bn] = torch._decomp.decomposition_table[bn]
        # as Slice/Gather, not SplitToSequence + SequenceAt: sequences have no bf16 in ONNX's
        # schemas, and the bf16 fallback (backends/ort_bf16.py) casts tensors only
        table[aten.split_with_sizes.default] = _split_with_sizes
        table[aten.unbind.int] = lambda x, dim=0: [x.select(dim, i) for i in range(x.shape[dim])]
        table[aten.slice_scatter.default] = _slice_scatter
    return table


def _decompose(gm: fx.GraphModule, inputs: list[torch.Tensor], fake: bool,
               extra_decompositions: bool = False,
               table: dict[Any, Callable] | None = None) -> fx.GraphModule:
    """The step in core ATen, as `export_onnx` hands it to the exporter; `fake` traces it on
    fake tensors (nothing computed). `table` replaces the decompositions (the TVM backend
    passes `lowering_decompositions(True)` plus its own)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    if table is None:
        table = lowering_decompositions(extra_decompositions)
    rng = torch.get_rng_state()
    with torch.no_grad():
        if fake:
            # the step's own real constants (a model's empty cache tensor, say) meet the fake
            # inputs there: the mode converts them instead of refusing the mix
            from torch._subclasses.fake_tensor import FakeTensorMode
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            fakes = [mode.from_tensor(t) for t in inputs]
            with mode:
                decomposed = make_fx(gm, decomposition_table=table)(*fakes)
        else:
            decomposed = make_fx(gm, decomposition_table=table)(*inputs)
    torch.set_rng_state(rng)
    return decomposed


def lowered(graph: TrainGraph) -> TrainGraph:
    """`graph` with glmc's own ops replaced by plain ATen (kernels.lower_to_aten)."""
    from glmc.ir.kernels import lower_to_aten
    return TrainGraph(lower_to_aten(graph.gm), graph.inputs, graph.outputs, graph.meta)


def onnx_ready(graph: TrainGraph) -> TrainGraph:
    """`graph` as every ONNX consumer lowers it — the ORT backend and the step export alike:
    glmc's ops to ATen and views to reshapes (`lower_to_reshapes`); pass the result to
    `export_onnx` / `onnx_offenses` with `extra_decompositions=True` (the fused attention's and
    convolution's backward, training-mode batch norm)."""
    return TrainGraph(lower_to_reshapes(graph.gm), graph.inputs, graph.outputs, graph.meta)


def example_inputs(graph: TrainGraph) -> list[torch.Tensor]:
    """Zero tensors shaped like the step's inputs (for tracing; token ids 0 are in range)."""
    out = []
    for ph in graph.placeholders():
        val = ph.meta.get("val")
        spec = TrainGraph.info(ph).spec
        shape, dtype = (tuple(val.shape), val.dtype) if val is not None else \
            (spec.shape, spec.dtype)
        device = spec.device if spec is not None else "cpu"
        out.append(torch.zeros(shape, dtype=dtype, device=device))
    return out


# ---- export ------------------------------------------------------------------------------------

def export_onnx(graph: TrainGraph, inputs: list[torch.Tensor], path: Path, *,
                extra_decompositions: bool = False, where: str = "export",
                opset: int | None = None) -> Path:
    """The functional step as ONNX: decompose to core ATen, torch.export, dynamo ONNX exporter
    (at `opset`, default: the exporter's own)."""
    require_onnx(where)
    real = [t.detach().clone() for t in inputs]
    decomposed = _decompose(graph.gm, real, fake=False,
                            extra_decompositions=extra_decompositions)

    try:
        program = export_step_program(decomposed, real)
        onnx_program = torch.onnx.export(program, (), dynamo=True, optimize=False,
                                         verify=False, verbose=False, opset_version=opset)
    except Exception as e:
        raise ExportError(f"{where}: torch's ONNX exporter failed on the step: "
                          f"{_exporter_message(e)}") from e
    onnx_program.model.ir_version = 10  # onnxruntime 1.19 loads IR <= 10
    onnx_program.save(str(path))
    _check_outputs(graph, path, where)
    return path


def _exporter_message(e: Exception) -> str:
    """The exporter's message without its terminal colours and boilerplate."""
    text = _ANSI.sub("", str(e))
    _, found, summary = text.partition("## Exception summary")
    text = summary if found else text
    for noise in ("(Refer to the full stack trace above for more information.)", "⬆️"):
        text = text.replace(noise, "")
    return text.strip()


def _check_outputs(graph: TrainGraph, path: Path, where: str = "export") -> None:
    import onnx
    model = onnx.load(str(path), load_external_data=False)
    if len(model.graph.output) != len(graph.outputs) or \
            len(model.graph.input) != len(graph.inputs):
        raise GlmcError(f"{where}: step.onnx has {len(model.graph.input)} inputs / "
                        f"{len(model.graph.output)} outputs, the step {len(graph.inputs)} / "
                        f"{len(graph.outputs)}; the exporter dropped or merged some")


# ---- what the ONNX exporter cannot take ----------------------------------------------------------

def onnx_offenses(graph: TrainGraph, inputs: list[torch.Tensor],
                  extra_decompositions: bool = False) -> list[Offense]:
    """Every op of the ATen-lowered `graph` that torch's ONNX exporter has no function for, once
    the decompositions `export_onnx` and the exporter apply are done, with the source lines of
    the nodes it comes from. Traces on fake tensors: seconds, not the export's minutes. Empty
    when this torch has no exporter registry to ask (the export then fails or succeeds)."""
    known = _onnx_registry()
    if known is None:
        return []
    registry, exporter_decomposes = known
    try:
        decomposed = _decompose(graph.gm, inputs, fake=True,
                                extra_decompositions=extra_decompositions)
    except Exception as e:  # e.g. an op without a fake kernel: the export itself will tell
        warnings.warn(f"export: could not check the step against the ONNX exporter ahead of "
                      f"time ({type(e).__name__}: {e})", stacklevel=2)
        return []
    return missing_ops(graph, decomposed,
                       lambda t: registry.is_registered(t) or t in exporter_decomposes)


def missing_ops(graph: TrainGraph, decomposed: fx.GraphModule, supported: Callable[[Any], bool],
                missing: str = _NO_ONNX, register: str = "an ONNX function") -> list[Offense]:
    """The ops of `decomposed` (the step after `_decompose`) that `supported` rejects, as
    offenses at the source lines of the step's nodes they come from. `missing` says what the
    consumer lacks, `register` what a user could register for the op (ONNX export, TVM)."""
    found: dict[Any, set[Any]] = {}  # op of the step -> ops without a function it became
    for n in decomposed.graph.nodes:
        t = n.target
        if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or supported(t):
            continue
        found.setdefault(n.meta.get("original_aten") or t, set()).add(t)
    offenses = []
    for origin, leaves in found.items():
        offenses += _offenses_of(graph, origin, leaves, missing, register)
    return offenses


def _offenses_of(graph: TrainGraph, origin: Any, leaves: set[Any], missing: str = _NO_ONNX,
                 register: str = "an ONNX function") -> list[Offense]:
    """One offense per source line (and creating pass) of the step's nodes calling `origin`."""
    name = str(origin)
    via = "" if leaves == {origin} else \
        f" (it decomposes to {', '.join(sorted(map(str, leaves)))})"
    sites: dict[tuple[str, str], int] = {}
    for n in graph.compute_nodes():
        if n.target == origin or str(n.target) == name:  # a node's copied meta holds copies
            info = n.meta.get("glmc")
            where = (info.source or info.module) if info is not None else None
            key = (where or n.name, info.created_by if info is not None else "capture")
            sites[key] = sites.get(key, 0) + 1
    offenses = []
    for (where, created_by), count in (sites or {("<step>", "capture"): 1}).items():
        times = f" [{count} nodes]" if count > 1 else ""
        offenses.append(Offense(f"{name}: {missing}{via}{times}; "
                                f"{_fix(origin, created_by, register)}", where))
    return offenses


def _fix(origin: Any, created_by: str, register: str = "an ONNX function") -> str:
    if created_by == "capture":
        return f"the model's own op: change the model, or register {register} for it"
    why = " (glmc's op has no ATen decomposition; please file a glmc issue)" \
        if getattr(origin, "namespace", "") == "glmc" else ""
    return (f"from the '{created_by}' pass{why}: export the step without it (--disable "
            f"{created_by}, disable=('{created_by}',)), or change the model if it has the op too")


@functools.lru_cache(maxsize=1)
def _onnx_registry() -> tuple[Any, frozenset] | None:
    """torch's ONNX function registry (torchlib), and the ops the exporter decomposes itself
    before it looks functions up (`_fx_passes.decompose_with_registry`)."""
    import logging

    import torch._decomp
    try:  # private to torch; without it the exporter's own error is what the user gets
        from torch.onnx._internal.exporter._registration import ONNXRegistry
    except ImportError:
        return None
    log = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = log.level
    log.setLevel(logging.ERROR)  # "torchvision is not installed. Skipping torchvision::nms"
    try:
        registry = ONNXRegistry.from_torchlib()
    finally:
        log.setLevel(level)
    decomposes = {*torch.export.default_decompositions(), *torch._decomp.decomposition_table}
    return registry, frozenset(decomposes)


def lower_to_reshapes(gm: fx.GraphModule) -> fx.GraphModule:
    """glmc's ops to ATen, and every `view` to `reshape`: the decomposed attention backward
    returns contiguous gradients where the fused kernel returned strided ones, so a captured
    `view` may no longer apply. The step is functional (nothing writes through a view), so
    `reshape` computes the same values."""
    from glmc.ir.kernels import lower_to_aten
    gm = lower_to_aten(gm)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
    gm.recompile()
    return gm


class _Step(torch.nn.Module):
    """A step GraphModule as a module returning a tuple, as torch.export wants it."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__()
        self.step = gm

    def forward(self, *xs: torch.Tensor) -> Any:
        return tuple(self.step(*xs))


def export_step_program(gm: fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
    """`torch.export` of a (decomposed) step on `inputs`: what ONNX's and TVM's importers read."""
    return torch.export.export(_Step(gm), tuple(inputs))
