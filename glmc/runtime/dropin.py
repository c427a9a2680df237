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

from glmc.compiler.passmanager import PassContext, PassManager
from glmc.passes import parse_pipeline
from glmc.trace.step import joint_to_traingraph


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
            from glmc.version import __version__
            spelling = ",".join(p.spelling() for p in parse_pipeline(passes or "cleanup"))
            return hashlib.sha256(f"glmc-{__version__}:{spelling}".encode()).digest()

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
