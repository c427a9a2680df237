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

from glmc.compiler.passmanager import PassContext, PassManager, StageForm, StageUnit
from glmc.passes import parse_pipeline
from glmc.trace.step import joint_to_traingraph


def run_glmc_passes(gm: fx.GraphModule, passes: Any, backend: str) -> PassManager:
    """glmc's pipeline on AOTAutograd's joint graph, before its partition. When every pass of
    the pipeline rewrites joint graphs (`StageForm.JOINT`: cleanup, recompute — as on a
    pipeline stage) they run as on a stage (`PassManager.run_stage`); otherwise the pipeline
    runs on the joint graph as a TrainGraph, where passes that need a whole step (fusion and
    precision rewrite the forward before it is differentiated; shard, compress, partition) are
    one PipelineError saying why. The default here is cleanup alone."""
    from glmc.backends import get_backend
    pipeline = parse_pipeline(passes if passes is not None else "cleanup")
    manager = PassManager(pipeline)
    ctx = PassContext(get_backend(backend).traits())
    if all(StageForm.JOINT in p.stage_forms() for p in pipeline):
        manager.run_stage(StageUnit(0, StageForm.JOINT, gm), ctx)
    else:
        manager.run(joint_to_traingraph(gm), ctx)
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
    pipeline = parse_pipeline(passes if passes is not None else "cleanup")  # bad ones fail here
    if target == "inductor" and any(p.name == "recompute" for p in pipeline):
        from glmc.errors import PipelineError
        raise PipelineError(
            "torch.compile(backend='glmc'): recompute has no effect on the Inductor drop-in: "
            "Inductor's min-cut partitioner chooses what the forward saves after glmc's "
            "passes (measured: the same saved bytes with and without it). Use "
            "options={'backend': 'eager'} (the default partition keeps glmc's plan), "
            "glmc.optimize(..., memory_budget=...) for the whole step, or torch's own "
            "torch._functorch.config.activation_memory_budget")
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
