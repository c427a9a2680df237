"""Per-op fp32 fallback for bf16 ONNX models on ONNX Runtime's CPU kernels.

ONNX Runtime's CPU execution provider registers few bf16 kernels. The session tells which node
type it cannot place ("Could not find an implementation for MatMul(13) node with name ...");
`run_in_fp32` rewrites every node of that type that touches bf16 to compute in fp32:

    y:bf16 = MatMul(a:bf16, b:bf16)
      ->  a32 = Cast<FLOAT>(a); b32 = Cast<FLOAT>(b); y32 = MatMul(a32, b32); y = Cast<BF16>(y32)

The values between ops stay bf16, so rounding happens where eager's bf16 kernels round (at op
outputs); only the arithmetic inside the op is fp32 (which ATen's bf16 CPU kernels mostly do
as well).
"""
from __future__ import annotations

import re
from typing import Any

#: "no kernel for this type" (NOT_IMPLEMENTED) and "the op's schema has no such type"
#: (INVALID_GRAPH, e.g. SplitToSequence on bf16)
_MISSING = (re.compile(r"Could not find an implementation for (\w+)\(\d+\) node"),
            re.compile(r"Type 'tensor\(bfloat16\)' of \w+ parameter \(.*?\) of operator "
                       r"\((\w+)\)"))


def missing_kernel(message: str) -> str | None:
    """The node type onnxruntime's session creation rejected for its types, or None for other
    errors."""
    for pattern in _MISSING:
        m = pattern.search(message)
        if m:
            return m.group(1)
    return None


def _types(model: Any) -> dict[str, int]:
    import onnx
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type
             for v in [*g.value_info, *g.input, *g.output] if v.type.HasField("tensor_type")}
    types.update({t.name: t.data_type for t in g.initializer})
    return types


def run_in_fp32(model: Any, op_type: str) -> bool:
    """Rewrite (in place) every `op_type` node of `model`'s main graph with a bf16 input or
    output to compute in fp32. False when there was none (the failure is not about bf16).
    Model-local functions are inlined first, so their nodes are in the main graph too."""
    import onnx
    from onnx import TensorProto, helper

    if model.functions:
        inlined = onnx.inliner.inline_local_functions(model)
        model.CopyFrom(inlined)

    bf16, f32 = TensorProto.BFLOAT16, TensorProto.FLOAT
    types = _types(model)
    graph = model.graph
    nodes, changed = [], False
    for k, node in enumerate(graph.node):
        touches = [n for n in [*node.input, *node.output] if types.get(n) == bf16]
        if node.op_type != op_type or not touches:
            nodes.append(node)
            continue
        changed = True
        for j, name in enumerate(node.input):
            if types.get(name) == bf16:
                cast = f"{name}__glmc_f32_{k}"
                nodes.append(helper.make_node("Cast", [name], [cast], to=f32,
                                              name=f"{node.name}__in{j}_f32"))
                node.input[j] = cast
        after = []
        for j, name in enumerate(node.output):
            if types.get(name) == bf16:
                wide = f"{name}__glmc_f32"
                node.output[j] = wide
                after.append(helper.make_node("Cast", [wide], [name], to=bf16,
                                              name=f"{node.name}__out{j}_bf16"))
        nodes += [node, *after]
    if changed:
        del graph.node[:]
        graph.node.extend(nodes)
    return changed


def function_ops_in_fp32(model: Any) -> list[str]:
    """The node types that touch bf16 and whose ONNX schema is a function (Softmax,
    LogSoftmax, ...), rewritten to fp32: onnxruntime expands such an op into its body when it
    has no kernel for the type, and then names the body's op (a nameless `ReduceMax`), not
    the op of the model. Empty when there is none."""
    import onnx

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 18)
    types = _types(model)
    candidates = set()
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx") or not any(
                types.get(n) == onnx.TensorProto.BFLOAT16 for n in [*node.input, *node.output]):
            continue
        try:
            schema = onnx.defs.get_schema(node.op_type, opset)
        except onnx.defs.SchemaError:
            continue
        if schema.has_function or schema.has_context_dependent_function:
            candidates.add(node.op_type)
    return sorted(op for op in candidates if run_in_fp32(model, op))
