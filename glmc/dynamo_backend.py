"""`torch.compile(model, backend="glmc")`: glmc's passes inside an unchanged training loop.

Dynamo captures the forward; AOTAutograd builds the joint forward+backward graph; glmc's pass
pipeline rewrites that joint graph (the same passes `glmc.optimize` runs); then Inductor (or
eager kernels, `options={"backend": "eager"}`) compiles the partitioned forward and backward.
The optimizer stays in the user's Python loop on this path.
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.fx as fx

from glmc.ir import (InputSpec, NodeInfo, OutputKind, OutputSpec, Phase, Role, TensorSpec,
                     TrainGraph)
from glmc.passmanager import PassContext, PassManager
from glmc.pipeline import parse_pipeline
from glmc.step import source_line


def joint_to_traingraph(gm: fx.GraphModule) -> TrainGraph:
    """A TrainGraph view of an AOTAutograd joint graph (placeholders primals_*/tangents_*)."""
    g = gm.graph
    inputs, backward = [], set()
    for n in g.nodes:
        if n.op == "placeholder":
            tangent = n.name.startswith("tangents")
            role = Role.GRADIENT if tangent else Role.INPUT
            inputs.append(InputSpec(role, n.name))
            n.meta["glmc"] = NodeInfo(Phase.INPUT, role, TensorSpec.of(n.meta.get("val")),
                                      target=n.name)
            if tangent:
                backward.add(n)
        elif n.op == "call_function":
            is_bwd = any(a in backward for a in n.all_input_nodes)
            if is_bwd:
                backward.add(n)
            phase = Phase.BACKWARD if is_bwd else Phase.FORWARD
            role = Role.GRADIENT if is_bwd else Role.ACTIVATION
            n.meta["glmc"] = NodeInfo(phase, role, TensorSpec.of(n.meta.get("val")),
                                      source=_short(n.meta.get("stack_trace")))
    out = next(n for n in reversed(g.nodes) if n.op == "output")
    outputs = [OutputSpec(OutputKind.GRADIENT if isinstance(v, fx.Node) and v in backward
                          else OutputKind.FORWARD, str(i))
               for i, v in enumerate(out.args[0])]
    return TrainGraph(gm, inputs, outputs)


def _short(trace: str | None) -> str | None:
    return source_line(trace)


def run_glmc_passes(gm: fx.GraphModule, passes: Any, backend: str) -> PassManager:
    """glmc's pipeline on AOTAutograd's joint graph. The default here is cleanup alone: the
    passes that re-derive a whole step (fusion, precision) need what a joint graph lacks
    (`Need.STEP`), and naming them is a PipelineError listing why."""
    from glmc.backends import get_backend
    graph = joint_to_traingraph(gm)
    manager = PassManager(parse_pipeline(passes if passes is not None else "cleanup"))
    manager.run(graph, PassContext(get_backend(backend).traits()))
    return manager


def _joint_pass(passes: Any):
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class GlmcJointPass(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            gm = graph.owning_module or fx.GraphModule(torch.nn.Module(), graph)
            run_glmc_passes(gm, passes, "inductor")

        def uuid(self) -> bytes:
            import glmc
            spelling = ",".join(p.spelling() for p in parse_pipeline(passes or "cleanup"))
            return hashlib.sha256(f"glmc-{glmc.__version__}:{spelling}".encode()).digest()

    return GlmcJointPass()


def glmc_backend(gm: fx.GraphModule, example_inputs: list, **kwargs: Any):
    """Dynamo backend. Options (torch.compile(..., options={...})): backend, passes."""
    options = dict(kwargs.get("options") or {})
    unknown = sorted(set(options) - {"backend", "passes"})
    if unknown:
        from glmc.errors import ConfigError
        raise ConfigError(f"torch.compile(backend='glmc'): unknown option(s) {unknown}; known: "
                          "backend (inductor | eager), passes (a pipeline string)")
    target = options.pop("backend", "inductor")
    passes = options.pop("passes", None)
    parse_pipeline(passes if passes is not None else "cleanup")  # bad pipelines fail here
    if target == "inductor":
        from torch._inductor.compile_fx import compile_fx

        patches = {"joint_custom_pre_pass": _joint_pass(passes),
                   "fallback_random": True}  # dropout masks equal eager's
        return compile_fx(gm, example_inputs, config_patches=patches)
    if target == "eager":
        return _eager_aot(gm, example_inputs, passes)
    from glmc.errors import ConfigError
    raise ConfigError(f"torch.compile(backend='glmc'): backend option {target!r} is unknown; "
                      "use 'inductor' or 'eager'")


def _eager_aot(gm: fx.GraphModule, example_inputs: list, passes: Any):
    from functorch.compile import default_partition, make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kw: Any):
        run_glmc_passes(joint, passes, "eager")
        joint.recompile()
        return default_partition(joint, joint_inputs, **kw)

    def compiler(module: fx.GraphModule, _inputs: Any):
        return make_boxed_func(module.forward)

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler,
                        partition_fn=partition)(gm, example_inputs)
