"""Capture of one pipeline stage: a module's forward, its backward and its optimizer update as
three graphs (`capture_stage`), with the values it sends and receives typed as `Boundary`
inputs and outputs (`glmc.ir.program.Stage`)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from glmc.errors import CaptureError, ConfigError
from glmc.ir.graph import (InputSpec, NodeInfo, OutputKind, OutputSpec, Phase, Role, TensorSpec,
                           TrainGraph)
from glmc.ir.program import Stage
from glmc.trace.optim import ensure_state, rule_for
from glmc.trace.step import PARAM_META, OptimizerSpec




StageArg = tuple["int | str", torch.Tensor]  #: (batch leaf index | received boundary, example)


def capture_stage(index: int, module: nn.Module, optimizer: torch.optim.Optimizer,
                  args: Sequence[StageArg], *, send: Sequence[str] = (), loss_fn: Any = None,
                  target: tuple[int, torch.Tensor] | None = None,
                  partition: Callable[[fx.GraphModule], Any] | None = None,
                  update: str = "fused",
                  rewrites: Sequence[Callable[[fx.GraphModule, list[InputSpec]], Any]] = (),
                  tp: Any = None) -> Stage:
    """Stage `index` of a pipeline: `module(*args)` then either sends its outputs under the
    names `send`, or (last stage) computes `loss_fn(output, target)` — or, without `loss_fn`,
    returns the loss itself. An arg is `(i, example)` for leaf `i` of the microbatch, or
    `(name, example)` for a value received from the stage that sends `name`; its gradient is
    sent back as `"grad:" + name`. Buffers are read-only inputs (`Role.BUFFER`; a stage that
    writes a buffer, as batch norm does, is rejected). AOTAutograd's default partition decides
    what the forward saves for the backward: every forward value the backward reads —
    `partition(joint)`, when given, rewrites AOTAutograd's joint graph first (glmc's recompute
    pass, `glmc.passes.recompute.recompute_stage`: backward copies of the values it chooses to
    recompute, so the partition saves their inputs instead). The update is the optimizer's
    glmc rule (`glmc.trace.optim`): with `update="single"` one parameter at a time, as
    torch.optim's default CPU loop computes it (bit-identical); `"foreach"`: one
    multi-tensor op per group (torch's foreach path); `"fused"` (default): ATen's fused kernel
    per group where the rule has one (AdamW/Adam on fp32: what `fused=True` runs;
    `run_inplace` runs it in place on the state), else foreach — equal to the single-tensor
    update within rounding. `rewrites`, each `rewrite(gm, inputs)` in turn:
    the stage's forward is traced to ATen ops (`gm`: parameters, buffers, batch leaves and
    received values -> its outputs; every node with glmc metadata, `inputs` its placeholders'
    specs, received values as activations) and rewritten in place (e.g. the fusion pass's
    forward patterns, `glmc.passes.fusion.fuse_stage`, then the bf16 dtype assignment,
    `glmc.passes.precision.assign_stage`); the result is differentiated again, so the
    backward follows the rewrites. `tp` (tensor parallelism inside the stage,
    `glmc.parallel.stage_tp.StageTensorParallel`): its `shard(index, joint, inputs, outputs)`
    rewrites the stage's joint graph into this rank's local program (`partition` is then not
    run), and the update is captured on the blocks' shapes (`tp.local_shapes`)."""
    if update not in ("fused", "foreach", "single"):
        raise ConfigError(f"capture_stage: update={update!r}; use 'fused', 'foreach' or "
                          "'single'")
    if (loss_fn is not None) != (target is not None) or (bool(send) and loss_fn is not None):
        raise ConfigError(f"capture_stage: stage {index} needs either send= (names of its "
                          "outputs) or, as the last stage, loss_fn= with target= (or neither: "
                          "the module returns the loss)")
    names = [n for n, _ in module.named_parameters()]
    buffers = [n for n, _ in module.named_buffers()]
    leaves = list(args) + ([target] if target is not None else [])
    n_state = len(names) + len(buffers)

    def step(*flat: torch.Tensor) -> Any:
        state = dict(zip(names + buffers, flat[:n_state]))
        out = torch.func.functional_call(module, state,
                                         tuple(flat[n_state:n_state + len(args)]))
        return loss_fn(out, flat[-1]) if loss_fn is not None else out

    examples, ins = _stage_inputs(index, module, leaves)
    fn: Callable = step
    for rewrite in rewrites:  # each traced afresh: a rewrite sees its input's values
        fn = _rewritten(fn, examples, ins, rewrite)
    if tp is not None:
        fw, bw, n_out = _sharded_graphs(fn, examples, ins, names, len(buffers), leaves, send,
                                        index, tp)
    else:
        fw, bw, n_out = _aot_graphs(fn, examples, partition, index, send, names)
    if n_out != max(len(send), 1):
        raise ConfigError(f"capture_stage: stage {index} returns {n_out} values but send= "
                          f"names {len(send)} (a stage that writes a buffer returns more)")
    n_saved = len(_output_args(fw)) - n_out
    outs = [OutputSpec(OutputKind.SEND, n) for n in send] or [OutputSpec(OutputKind.LOSS, "")]
    forward = _retype(fw, ins, [*outs, *(OutputSpec(OutputKind.SAVED, f"saved:{k}")
                                         for k in range(n_saved))], Phase.FORWARD, index)
    backward = _backward(index, bw, names, len(buffers), leaves, send, n_saved)
    shapes = tp.local_shapes(index, module) if tp is not None else None
    return Stage(index, forward, backward, _update_graph(index, module, optimizer, update,
                                                         shapes))


def _stage_inputs(index: int, module: nn.Module, leaves: list
                  ) -> tuple[list[torch.Tensor], list[InputSpec]]:
    """The stage step's example inputs and their specs: parameters (trainable: a frozen one
    is a ConfigError), buffers, then the batch leaves and received values."""
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
    if frozen:  # Whisper's positions: the stage programs would train them (KeyError before)
        raise ConfigError(f"capture_stage: stage {index} holds frozen parameters {frozen} "
                          "(requires_grad=False); glmc's pipeline does not support them yet "
                          "(a stage updates every parameter it holds): train this model "
                          "data-parallel (--zero), which does")
    examples = [p.detach().requires_grad_() for p in module.parameters()]
    examples += [b.detach() for b in module.buffers()]
    examples += [t.detach().requires_grad_(isinstance(k, str)) for k, t in leaves]
    ins = [InputSpec(Role.PARAMETER, n) for n, _ in module.named_parameters()]
    ins += [InputSpec(Role.BUFFER, n) for n, _ in module.named_buffers()]
    ins += [InputSpec(Role.BOUNDARY, k) if isinstance(k, str) else InputSpec(Role.INPUT,
            f"input:{k}") for k, _ in leaves]
    return examples, ins


def _rewritten(step: Callable, examples: list[torch.Tensor], inputs: list[InputSpec],
               rewrite: Callable[[fx.GraphModule, list[InputSpec]], Any]) -> fx.GraphModule:
    """`step` traced to ATen ops and rewritten by `rewrite` (see `capture_stage`); what
    AOTAutograd then differentiates."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def flat(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = step(*args)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    gm = make_fx(flat, tracing_mode="fake")(*(t.detach() for t in examples))
    # received values are activations to a rewrite
    specs = [InputSpec(Role.INPUT, s.target) if s.role is Role.BOUNDARY else s for s in inputs]
    spec = iter(specs)
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            s = next(spec)
            n.meta["glmc"] = NodeInfo(Phase.INPUT, s.role, TensorSpec.of(n.meta.get("val")),
                                      target=s.target)
        elif n.op == "get_attr":
            n.meta["glmc"] = NodeInfo(Phase.INPUT, Role.CONSTANT,
                                      TensorSpec.of(n.meta.get("val")))
        elif n.op == "call_function":
            n.meta["glmc"] = NodeInfo(Phase.FORWARD, Role.ACTIVATION,
                                      TensorSpec.of(n.meta.get("val")), created_by="stage")
    rewrite(gm, specs)
    gm.recompile()
    return gm


def _aot_graphs(fn: Callable, examples: list[torch.Tensor],
                partition: Callable[[fx.GraphModule], Any] | None = None, index: int = 0,
                send: Sequence[str] = (), params: Sequence[str] = ()
                ) -> tuple[fx.GraphModule, fx.GraphModule, int]:
    """AOTAutograd's forward and backward graphs of `fn` (run once on `examples`), split by
    the default partition after `partition`'s rewrite of the joint graph (`capture_stage`).
    The joint graph's first placeholders (the stage's parameters) carry their names
    `params` (`PARAM_META`): what `joint_to_traingraph` places its nodes in blocks by."""
    from functorch.compile import aot_function, make_boxed_func
    from torch._functorch.partitioners import default_partition

    got: dict[str, fx.GraphModule] = {}

    def keep(kind: str) -> Callable:
        def compiler(gm: fx.GraphModule, _: Any) -> Callable:
            got[kind] = gm
            return make_boxed_func(gm.forward)
        return compiler

    def split(joint: fx.GraphModule, joint_inputs: Any, **kw: Any) -> Any:
        if partition is not None:
            primals = (n for n in joint.graph.nodes if n.op == "placeholder")
            for name, n in zip(params, primals):
                n.meta[PARAM_META] = name
            partition(joint)
            joint.recompile()
        return default_partition(joint, joint_inputs, **kw)

    compiled = aot_function(fn, fw_compiler=keep("F"), bw_compiler=keep("B"), partition_fn=split)
    out = compiled(*examples)
    outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    _check_gradients([name for name, o in zip(send or [""], outs) if not o.requires_grad],
                     index)
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    return got["F"], got["B"], len(outs)


def _check_gradients(inert: list[str], index: int) -> None:
    if inert:
        raise CaptureError(
            f"capture_stage: stage {index} sends {inert} across the cut, which carries no "
            "gradient (computed from the batch alone, e.g. an attention mask made once and "
            "read by every block, as in T5); glmc's pipeline "
            "sends a gradient back for every value it passes on. Not supported yet: cut "
            "elsewhere (cut=), or train this model data-parallel (--zero)")


def _sharded_graphs(fn: Callable, examples: list[torch.Tensor], inputs: list[InputSpec],
                    names: list[str], n_buffers: int, leaves: list, send: Sequence[str],
                    index: int, tp: Any) -> tuple[fx.GraphModule, fx.GraphModule, int]:
    """The forward and backward graphs of `fn` as this rank of a tensor-parallel stage runs
    them: AOTAutograd's joint graph (exported, not run), rewritten by `tp.shard` into the
    local program with its collectives, then split by the default partition (which keeps
    the backward's collectives and mutations in the backward)."""
    from torch._functorch.aot_autograd import aot_export_joint_simple
    from torch._functorch.partitioners import default_partition

    def flat(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = fn(*args)
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        # a sent value that is a view (of an input or of a value made here) is copied:
        # the export takes no output that aliases another tensor
        return tuple(o.clone() if o._is_view() else o for o in outs)

    n_out = max(len(send), 1)
    joint = aot_export_joint_simple(flat, examples, trace_joint=True)
    tangents = [n for n in joint.graph.nodes if n.op == "placeholder"][len(examples):]
    if len(tangents) != n_out:  # an output without a gradient has no cotangent input
        if not send:
            raise CaptureError(f"capture_stage: the loss of stage {index} carries no "
                               "gradient (it does not depend on any parameter or received "
                               "value)")
        _check_gradients([f"one of {list(send)}"], index)
    # the joint's signature: received values are activations to the pass, then cotangents
    ins = [InputSpec(Role.INPUT, s.target) if s.role is Role.BOUNDARY else s for s in inputs]
    ins += [InputSpec(Role.GRADIENT, f"grad:{n}") for n in send] or \
        [InputSpec(Role.GRADIENT, "seed:loss")]
    outs: list[OutputSpec | None] = [OutputSpec(OutputKind.SEND, n) for n in send] or \
        [OutputSpec(OutputKind.LOSS, "")]
    local = tp.shard(index, joint, ins, outs + _gradient_outputs(names, n_buffers, leaves))
    fw, bw = default_partition(local, examples, num_fwd_outputs=n_out)
    return fw, bw, n_out


def _output_args(gm: fx.GraphModule) -> list[Any]:
    return list(next(n for n in gm.graph.nodes if n.op == "output").args[0])


def _backward(index: int, bw: fx.GraphModule, names: list[str], n_buffers: int, leaves: list,
              send: Sequence[str], n_saved: int) -> TrainGraph:
    ins = [InputSpec(Role.SAVED, f"saved:{k}") for k in range(n_saved)]
    ins += [InputSpec(Role.BOUNDARY, f"grad:{n}") for n in send] or [InputSpec(Role.GRADIENT,
                                                                               "")]
    grads = _output_args(bw)
    for n, g in zip(names, grads):
        if g is None:
            raise CaptureError(f"capture_stage: parameter {n!r} of stage {index} gets no "
                               "gradient; drop it from the stage")
    return _retype(bw, ins, _gradient_outputs(names, n_buffers, leaves), Phase.BACKWARD,
                   index)


def _gradient_outputs(names: list[str], n_buffers: int, leaves: list
                      ) -> list[OutputSpec | None]:
    """What the backward returns, one per forward input: each parameter's gradient, None
    for a buffer, the gradient of a received value sent back (None for a batch leaf)."""
    outs: list[OutputSpec | None] = [OutputSpec(OutputKind.GRADIENT, n) for n in names]
    outs += [None] * n_buffers
    outs += [OutputSpec(OutputKind.SEND, f"grad:{k}") if isinstance(k, str) else None
             for k, _ in leaves]
    return outs


def _retype(gm: fx.GraphModule, inputs: list[InputSpec], outputs: Sequence[OutputSpec | None],
            phase: Phase, stage: int) -> TrainGraph:
    """A TrainGraph over a copy of `gm`: its placeholders become `inputs`, its outputs (by
    position; None drops one) `outputs`, and every node gets `phase`'s NodeInfo."""
    role = {Phase.FORWARD: Role.ACTIVATION, Phase.BACKWARD: Role.GRADIENT,
            Phase.OPTIMIZER: Role.UPDATE}[phase]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise CaptureError(f"capture_stage: AOTAutograd's {phase.value} graph of stage {stage} "
                           f"takes {len(placeholders)} inputs, expected {len(inputs)}")
    g, env = fx.Graph(), {}
    specs = iter(inputs)
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            spec = next(specs)
            env[n] = g.placeholder(f"{spec.role.value}_{len(env)}")
            info = NodeInfo(Phase.INPUT, spec.role, target=spec.target, stage=stage)
        elif n.op == "output":
            picked = [(o, v) for o, v in zip(outputs, _output_args(gm)) if o is not None]
            g.output(tuple(env[v] for _, v in picked))
            break
        else:
            env[n] = g.node_copy(n, lambda a: env[a])
            old = n.meta.get("glmc")  # a collective keeps what it is (tensor parallelism)
            info = NodeInfo(phase, role, created_by="capture_stage", stage=stage,
                            comm=old.comm if isinstance(old, NodeInfo) else None)
        env[n].meta = {"val": n.meta.get("val"),
                       "glmc": info.replace(spec=TensorSpec.of(n.meta.get("val")))}
    graph = TrainGraph(fx.GraphModule(gm, g), list(inputs), [o for o, _ in picked],
                       meta={"stage": stage, "phase": phase.value})
    graph.verify()
    return graph


def _update_graph(index: int, module: nn.Module, optimizer: torch.optim.Optimizer,
                  update: str = "fused", shapes: dict[str, tuple[int, ...]] | None = None
                  ) -> TrainGraph:
    """(lr per group, then per parameter: param, gradient, state...) -> (param, state...);
    `update` as `capture_stage` says; `shapes`: parameters updated as blocks of these shapes
    (tensor parallelism; their gradients and same-shaped state alike)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    rule = rule_for(optimizer)
    ensure_state(optimizer)
    names = {id(p): n for n, p in module.named_parameters()}
    groups = optimizer.param_groups
    ins = [InputSpec(Role.HYPERPARAM, f"lr:{gi}") for gi in range(len(groups))]
    examples = [torch.tensor(float(g["lr"]), dtype=torch.float64) for g in groups]
    outs, keys_of = [], []
    for gi, group in enumerate(groups):
        keys = rule.state_keys(group)
        keys_of.append((len(group["params"]), keys))
        for p in group["params"]:
            if id(p) not in names:
                raise ConfigError(f"capture_stage: stage {index}'s optimizer holds a tensor "
                                  "that is not a parameter of the stage's module")
            name = names[id(p)]
            ins += [InputSpec(Role.PARAMETER, name), InputSpec(Role.GRADIENT, name)]
            ins += [InputSpec(Role.OPTIMIZER_STATE, f"{k}:{name}") for k in keys]
            block = shapes.get(name) if shapes else None
            examples += [p.detach(), torch.zeros_like(p),
                         *(optimizer.state[p][k] for k in keys)] if block is None else \
                [p.new_empty(block), p.new_empty(block),
                 *(_block_like(optimizer.state[p][k], p, block) for k in keys)]
            outs += [OutputSpec(OutputKind.PARAM, name)]
            outs += [OutputSpec(OutputKind.STATE, f"{k}:{name}") for k in keys]

    def step(*flat: torch.Tensor) -> list[torch.Tensor]:
        rest, new = list(flat[len(groups):]), []
        for gi, (count, keys) in enumerate(keys_of):
            width = 2 + len(keys)
            mine, rest = rest[:count * width], rest[count * width:]
            entries = [mine[k * width:(k + 1) * width] for k in range(count)]
            new_ps, new_ss = rule.update_group(
                [e[0] for e in entries], [e[1] for e in entries],
                [dict(zip(keys, e[2:])) for e in entries], flat[gi], groups[gi], update)
            for p, s in zip(new_ps, new_ss):
                new += [p, *(s[k] for k in keys)]
        return new

    gm = make_fx(step, tracing_mode="fake")(*examples)
    graph = _retype(gm, ins, outs, Phase.OPTIMIZER, index)
    # the optimizer as data, as a whole step records it: passes that need the update (the
    # shard pass under ZeRO-1 over pipeline replicas) see what it is
    graph.meta["optimizer"] = OptimizerSpec.of(optimizer, names)
    return graph


def _block_like(state: torch.Tensor, param: torch.Tensor, block: tuple[int, ...]
                ) -> torch.Tensor:
    """An optimizer state's example for a parameter updated as a block: the block's shape
    where the state has the parameter's (moments), as it is otherwise (a step count)."""
    return state.new_empty(block) if state.shape == param.shape else state
