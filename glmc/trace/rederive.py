"""Forward programs and re-derivation of the backward.

Passes that change what the forward computes in a way the backward must follow (precision
assignment: a cast changes the dtype every gradient flows in) do not patch the backward by hand.
They take the step's forward as a program of its own (`forward_program`), rewrite it, and call
`rederive`, which differentiates the rewritten forward again with AOTAutograd — the same
machinery capture uses — and appends the optimizer update (optionally with in-graph loss
scaling). Source lines and module paths survive because the forward nodes keep their metadata.

Any pass that rewrites the backward directly (recompute) must therefore run after these.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from glmc.errors import ConfigError, PassError
from glmc.ir.graph import InputSpec, OutputKind, Phase, Role, TrainGraph
from glmc.trace.scaler import LossScaling
from glmc.trace.step import OptimizerSpec, StepSpec, build_step, fake_of, joint_export

_FORWARD_ROLES = (Role.PARAMETER, Role.BUFFER, Role.INPUT)


@dataclass
class ForwardProgram:
    """The forward of a step: `gm(*inputs) -> (loss, *new_buffers)`.

    `inputs` are the step inputs it reads (parameters, buffers, batch tensors), in the order of
    `gm`'s placeholders; `buffers` names the buffers whose new values follow the loss.
    """

    gm: fx.GraphModule
    inputs: list[InputSpec]
    buffers: list[str]

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph


def forward_program(graph: TrainGraph) -> ForwardProgram:
    """The forward nodes of `graph` (and the inputs they read) as a program of their own."""
    outputs = dict(zip(graph.outputs, graph.output_values()))
    loss = next(v for s, v in outputs.items() if s.kind is OutputKind.LOSS)
    buffer_outs = [(s.target, v) for s, v in outputs.items() if s.kind is OutputKind.BUFFER]
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    specs: list[InputSpec] = []
    for ph, spec in zip(graph.placeholders(), graph.inputs):
        if spec.role in _FORWARD_ROLES and ph.users:
            env[ph] = new.node_copy(ph)
            specs.append(spec)
    for n in graph.graph.nodes:
        if n.op == "get_attr":
            env[n] = new.node_copy(n)
        elif n.op == "call_function" and TrainGraph.info(n).phase is Phase.FORWARD:
            try:
                env[n] = new.node_copy(n, lambda a: env[a])
            except KeyError as e:
                raise PassError(f"forward: node '{n.name}' reads a non-forward value "
                                f"{e.args[0]}; the forward cannot be separated") from e
    new.output((env[loss], *(env[v] for _, v in buffer_outs)))
    new.eliminate_dead_code()
    # placeholders are never dead-code eliminated, so `specs` still matches them one to one
    return ForwardProgram(fx.GraphModule(graph.gm, new), specs, [t for t, _ in buffer_outs])


def owner_of(root: nn.Module, target: str) -> tuple[nn.Module, str]:
    """The submodule of `root` that holds the dotted name `target` (empty modules made on the
    way) and the attribute name within it: where to register a parameter or buffer so that
    `root`'s named_parameters() calls it `target`."""
    module = root
    *path, leaf = target.split(".")
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    return module, leaf


class _Replay(nn.Module):
    """Parameters and buffers named as in the step — fake tensors built from the IR's specs —
    whose forward runs a (rewritten) forward program; what AOTAutograd differentiates."""

    def __init__(self, graph: TrainGraph, program: ForwardProgram, mode: Any) -> None:
        super().__init__()
        object.__setattr__(self, "program", program)  # not a submodule: no extra parameters
        updated = {s.target for s in graph.outputs if s.kind is OutputKind.PARAM}
        for ph, spec in zip(graph.placeholders(), graph.inputs):
            if spec.role not in (Role.PARAMETER, Role.BUFFER):
                continue
            # under "model.", as capture's LossModule holds the user's model: the step
            # builder strips that prefix, and the model's own names may start with "model."
            owner, leaf = owner_of(self, f"model.{spec.target}")
            value = fake_of(TrainGraph.info(ph).spec, mode)
            if spec.role is Role.PARAMETER:
                owner.register_parameter(leaf, nn.Parameter(value, spec.target in updated))
            else:
                owner.register_buffer(leaf, value)

    def forward(self, *leaves: torch.Tensor) -> tuple[torch.Tensor]:
        program: ForwardProgram = self.program  # type: ignore[assignment]
        params = {k[len("model."):]: v for k, v in self.named_parameters()}
        buffers = {k[len("model."):]: v for k, v in self.named_buffers()}
        args = []
        mutated = set(program.buffers)
        for spec in program.inputs:
            if spec.role is Role.PARAMETER:
                args.append(params[spec.target])
            elif spec.role is Role.BUFFER:
                # a buffer the step updates (BatchNorm running stats) is read through a copy:
                # the write-back below must not bump the version of a tensor autograd saved
                b = buffers[spec.target]
                args.append(b.clone() if spec.target in mutated else b)
            else:
                args.append(leaves[int(spec.target.split(":")[1])])
        out = fx.Interpreter(program.gm).run(*args)
        loss, new_buffers = out[0], out[1:]
        for name, value in zip(program.buffers, new_buffers):
            buffers[name].copy_(value)
        return (loss,)


def rederive(graph: TrainGraph, program: ForwardProgram,
             scaling: LossScaling | None = None, foreach: bool | None = None,
             fused: bool | None = None) -> None:
    """Replace `graph` in place by the step of `program`: its backward derived by AOTAutograd,
    the optimizer update appended (with in-graph loss scaling if `scaling`; as multi-tensor
    ops if `foreach`, as ATen's fused kernels where they apply if `fused` too; by default as
    `graph`'s update was). Works from the IR alone: the
    parameters, state and batch are fake tensors made from the recorded specs."""
    if foreach is None:
        foreach = bool(graph.meta.get("foreach_update"))
    if fused is None:
        fused = bool(graph.meta.get("fused_update"))
    optimizer = graph.meta.get("optimizer")
    if not isinstance(optimizer, OptimizerSpec):
        raise ConfigError("rederive: the step records no optimizer (a torch.compile drop-in "
                          "joint graph has none); run this pass through glmc.optimize")
    program.gm.recompile()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    specs = {s.target: TrainGraph.info(ph).spec for ph, s in zip(graph.placeholders(), graph.inputs)}
    batch = sorted((int(t.split(":")[1]), s) for t, s in specs.items() if t.startswith("input:"))
    leaves = tuple(fake_of(s, mode) for _, s in batch)
    state = {s.target: specs[s.target] for s in graph.inputs if s.role is Role.OPTIMIZER_STATE}
    replay = _Replay(graph, program, mode)
    with contextlib.ExitStack() as stack, fx_traceback.preserve_node_meta():
        joint = joint_export(stack, replay, leaves, {})
        new = build_step(joint.graph_module, StepSpec(optimizer, state, scaling, foreach,
                                                              fused=foreach and fused))
    _conform(new, graph)
    graph.gm, graph.inputs, graph.outputs = new.gm, new.inputs, new.outputs
    graph.meta.update(new.meta)
    for key, on in (("loss_scaling", scaling is not None), ("foreach_update", foreach),
                    ("fused_update", foreach and fused)):
        if not on:
            graph.meta.pop(key, None)


def _conform(new: TrainGraph, old: TrainGraph) -> None:
    """Order the new step's inputs and outputs as the old step's, new ones (scaler) last."""
    rank_in = {spec: i for i, spec in enumerate(old.inputs)}
    placeholders = new.placeholders()
    order = sorted(range(len(new.inputs)), key=lambda i: rank_in.get(new.inputs[i], 1 << 30))
    missing = set(old.inputs) - set(new.inputs)
    if missing:
        raise PassError(f"rederive: the re-derived step lost inputs {sorted(map(str, missing))}")
    new.inputs = [new.inputs[i] for i in order]
    anchor = next(iter(new.graph.nodes))
    if anchor is not placeholders[order[0]]:
        anchor.prepend(placeholders[order[0]])
    anchor = placeholders[order[0]]
    for i in order[1:]:
        anchor.append(placeholders[i])
        anchor = placeholders[i]
    rank_out = {spec: i for i, spec in enumerate(old.outputs)}
    values = new.output_values()
    out_order = sorted(range(len(new.outputs)), key=lambda i: rank_out.get(new.outputs[i], 1 << 30))
    new.output_node().args = (tuple(values[i] for i in out_order),)
    new.outputs = [new.outputs[i] for i in out_order]
    new.gm.recompile()
    new.verify()
