"""`inductor`: compiles the whole step with TorchInductor (C++/OpenMP on CPU, Triton on CUDA).

Guarantees: the same ATen program as `eager`, fused by Inductor; parameters, buffers and
optimizer state are updated in place inside the generated kernels. Ops without an Inductor
lowering run as ATen fallback kernels inside the compiled step and are listed as fallbacks.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from glmc.backends.base import Backend, StepFn
from glmc.ir import REMAT, TrainGraph, comm_ops
from glmc.target import BackendTraits


class InductorBackend(Backend):
    name = "inductor"

    def traits(self) -> BackendTraits:
        from glmc.backends.inductor_model import FusionGroups
        return BackendTraits(self.name, fusion=FusionGroups, early_writeback=True)

    def supports(self, node: fx.Node) -> str | None:
        from torch._decomp import core_aten_decompositions
        from torch._inductor.decomposition import decompositions
        from torch._inductor.lowering import lowerings

        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            return None
        if target.namespace == "glmc":
            from glmc.kernels import ELEMENTWISE
            if target._schema.name.split("::")[-1] in ELEMENTWISE:
                return None  # lowered to ATen before compiling
            return "glmc fused op: runs as its own (chunked) kernel inside the step"
        if target in lowerings or target in decompositions or target in core_aten_decompositions():
            return None
        if target.overloadpacket in lowerings:
            return None
        return "no Inductor lowering; runs as an ATen fallback kernel"

    def _compile(self, gm: fx.GraphModule, graph: TrainGraph) -> StepFn:
        from torch._inductor.compile_fx import compile_fx

        from glmc.kernels import ELEMENTWISE, lower_to_aten
        # glmc's elementwise fused ops become ATen again so Inductor fuses them with their
        # neighbours; what their backward saves was fixed when the step was derived
        gm = lower_to_aten(gm, only=ELEMENTWISE)
        _split_alpha(gm)
        _views_as_reshapes(gm)
        example = [ph.meta["val"] for ph in gm.graph.nodes if ph.op == "placeholder"]
        # fallback_random: draw dropout masks with ATen's generator, exactly as eager does
        with torch.no_grad():
            compiled = compile_fx(gm, example, config_patches=_patches(graph))

        def run(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
            with torch.no_grad():
                return list(compiled(*inputs))
        return run


def _patches(graph: TrainGraph) -> dict[str, object]:
    patches: dict[str, object] = {"fallback_random": True}
    if any(TrainGraph.info(n).created_by == "recompute" or n.meta.get(REMAT)
           for n in graph.compute_nodes()):
        # Inductor's locality reordering moves producers next to their consumers; it drags
        # forward values that feed recomputation into the backward and undoes the plan
        # (GLM small, budget 0.5: 368 MiB measured with it, 298 MiB without; 310 predicted)
        patches["reorder_for_locality"] = False
    if any(n.target in comm_ops() for n in graph.compute_nodes()):
        # Inductor's scheduler otherwise puts every wait right after its collective (checked
        # in the output code: the gradient buckets' reduce-scatters then block the backward);
        # its own passes restore glmc's placement: waits as late, collectives as early as
        # dependencies allow
        patches["reorder_for_compute_comm_overlap"] = True
        patches["reorder_for_compute_comm_overlap_passes"] = ["sink_waits", "raise_comms"]
    return patches


def _views_as_reshapes(gm: fx.GraphModule) -> None:
    """aten.view -> aten.reshape (the same values; a view wherever the strides allow).

    The captured `view`s were valid for ATen's layouts, but Inductor may lay a value out
    differently: its cat decomposition turns `cat([empty(0), k])` (transformers' KV cache,
    built in training too) into `k.clone()`, which keeps k's transposed strides where ATen's
    cat is contiguous, and the `view` of that then fails (GPT-2, T5). The step is functional
    — nothing writes through these views — so reshape is exact and costs nothing where a view
    works.
    """
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
    gm.recompile()


def _split_alpha(gm: fx.GraphModule) -> None:
    """add/sub(a, b, alpha=k) -> add/sub(a, mul(b, k)).

    Inductor 2.13's CPU pattern matcher folds `add(mm(x, y), b, alpha=k)` into
    `addmm(b, x, y)` and drops `alpha` (silently wrong: SGD weight decay on a Linear weight
    showed it). Spelling the scale out keeps its rewrite correct.
    """
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        alpha = node.kwargs.get("alpha", 1)
        if node.target not in (aten.add.Tensor, aten.sub.Tensor) or alpha == 1:
            continue
        with gm.graph.inserting_before(node):
            scaled = gm.graph.call_function(aten.mul.Tensor, (node.args[1], alpha))
        scaled.meta = dict(node.args[1].meta) if isinstance(node.args[1], fx.Node) else {}
        node.args = (node.args[0], scaled)
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "alpha"}
    gm.graph.lint()
    gm.recompile()
