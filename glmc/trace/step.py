"""Build a step graph from an AOTAutograd joint graph and an optimizer description.

Capture (from the user's model) and re-derivation (from the IR alone, `glmc.trace.rederive`) both end
here: the joint forward+backward graph is copied into a fresh graph with the step signature

    step(params, buffers, optimizer_state, lr, [scaler], batch)
        -> (loss, new_buffers, new_params and states, [scaler])

and the optimizer update — described by an `OptimizerSpec`, never by a live optimizer — is
traced on fake tensors and appended. Nothing here touches a user's module or optimizer.
"""
from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from glmc.errors import CaptureError, ConfigError, Offense
from glmc.ir.blocks import block_names
from glmc.ir.graph import (GRAD_OF, RANDOM_OPS, InputSpec, NodeInfo, OutputKind, OutputSpec, Phase,
                           RngSite, Role, TensorSpec, TrainGraph, op_name)
from glmc.trace import scaler as amp
from glmc.trace.optim import RULES, OptimizerRule
from glmc.trace.scaler import SCALE, TRACKER, LossScaling

# ---- the optimizer as data -------------------------------------------------------------------

@dataclass(frozen=True)
class GroupSpec:
    """One param group: its parameters (by name) and every hyperparameter but `lr` (an input)."""

    params: tuple[str, ...]
    hyper: tuple[tuple[str, Any], ...]

    def options(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) and k == "betas" else v for k, v in self.hyper}


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer of a step as data: its class name and param groups.

    `kind` names a `glmc.trace.optim.RULES` entry ("SGD", "Adam", "AdamW"); the update rule and the
    state keys follow from it and the group options. Saved with the graph, so a step re-derives
    and reloads without the user's optimizer.
    """

    kind: str
    groups: tuple[GroupSpec, ...]

    @staticmethod
    def of(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> "OptimizerSpec":
        """From a live optimizer; `names` maps id(parameter) -> its name in the model."""
        rule_of(type(optimizer).__name__)
        groups = []
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                if not p.requires_grad:
                    continue  # frozen: torch.optim never steps it nor makes state for it
                if id(p) not in names:
                    raise ConfigError("optimizer: it holds a tensor that is not a parameter of "
                                      "the model; build it from model.parameters()")
                params.append(names[id(p)])
            hyper = tuple(sorted((k, _freeze(v)) for k, v in group.items()
                                 if k not in ("params", "lr", "initial_lr") and _plain(v)))
            groups.append(GroupSpec(tuple(params), hyper))
        return OptimizerSpec(type(optimizer).__name__, tuple(groups))

    @property
    def rule(self) -> OptimizerRule:
        return rule_of(self.kind)

    def state_keys(self, group: GroupSpec) -> list[str]:
        return self.rule.state_keys(group.options())


def rule_of(kind: str) -> OptimizerRule:
    by_name = {cls.__name__: rule for cls, rule in RULES.items()}
    if kind not in by_name:
        raise ConfigError(f"optimizer: no glmc rule for {kind}; known optimizers: "
                          f"{', '.join(sorted(by_name))}")
    return by_name[kind]


def _freeze(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def _plain(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str, tuple, list))


# ---- fake values -----------------------------------------------------------------------------

def fake_of(spec: TensorSpec, mode: Any) -> torch.Tensor:
    """A fake tensor of `spec` in fake mode `mode` (contiguous; allocates nothing)."""
    with mode:
        return torch.empty(spec.shape, dtype=spec.dtype, device=spec.device)


# ---- AOTAutograd -----------------------------------------------------------------------------

def joint_export(stack: contextlib.ExitStack, module: torch.nn.Module, args: tuple,
                 kwargs: dict) -> Any:
    """AOTAutograd's joint forward+backward export of `module` (parameters are its inputs)."""
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

    try:
        return aot_export_joint_with_descriptors(stack, module, args, kwargs)
    except Exception as e:  # AOTAutograd raises many internal types; all become one error
        raise CaptureError("capture: the forward graph could not be differentiated or "
                           "functionalized", [Offense(first_line(e), user_frame(e))]) from e


def first_line(e: Any) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def user_frame(e: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if "/torch/" not in f.filename and "/glmc/" not in f.filename]
    if not frames:
        return "<inside torch>"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}"


# ---- building the step graph -----------------------------------------------------------------

@dataclass(frozen=True)
class StepSpec:
    """Everything besides the joint graph that a step needs: the optimizer, the values of its
    state inputs (real or fake tensors, by input target "key:param"), loss scaling, and whether
    the update is one multi-tensor op per group."""

    optimizer: OptimizerSpec
    state: dict[str, Any]
    scaling: LossScaling | None = None
    foreach: bool = False
    #: with `foreach`: each group's update as one of ATen's fused kernels where the rule has
    #: one (`OptimizerRule.update_fused`)
    fused: bool = False
    #: tied weights: every other name of a shared parameter or buffer -> its first name (the
    #: one `named_parameters()` and the optimizer use); all names become one step input
    aliases: dict[str, str] = field(default_factory=dict)


def _strip(target: str) -> str:
    return target[len("model."):] if target.startswith("model.") else target


class _StepBuilder:
    """Copies the joint graph into a fresh graph with the step signature, then adds the update."""

    def __init__(self, joint: fx.GraphModule, spec: StepSpec):
        self.joint, self.spec = joint, spec
        self.scaler_nodes: dict[str, fx.Node] = {}
        self.graph = fx.Graph()
        self.inputs: list[InputSpec] = []
        self.env: dict[fx.Node, fx.Node] = {}
        self.param_nodes: dict[str, fx.Node] = {}
        self.fake_mode = next(n.meta["val"].fake_mode for n in joint.graph.nodes
                              if n.op == "placeholder" and hasattr(n.meta.get("val"), "fake_mode"))

    def placeholder(self, role: Role, target: str, val: Any) -> fx.Node:
        node = self.graph.placeholder(f"{role.value}_{len(self.inputs)}")
        node.meta["val"] = val
        node.meta["glmc"] = NodeInfo(Phase.INPUT, role, TensorSpec.of(val), target=target)
        self.inputs.append(InputSpec(role, target))
        return node

    def _name(self, target: str) -> str:
        name = _strip(target)
        return self.spec.aliases.get(name, name)

    def _fake(self, value: Any) -> Any:
        if getattr(value, "fake_mode", None) is self.fake_mode:
            return value
        spec = value if isinstance(value, TensorSpec) else TensorSpec.of(value)
        return fake_of(spec, self.fake_mode)

    def build(self) -> TrainGraph:
        by_desc: dict[str, list[fx.Node]] = {}
        for n in self.joint.graph.nodes:
            if n.op == "placeholder":
                by_desc.setdefault(type(n.meta["desc"]).__name__, []).append(n)
        for n in by_desc.get("ParamAOTInput", []):
            name = self._name(n.meta["desc"].target)
            if name not in self.param_nodes:
                self.param_nodes[name] = self.placeholder(Role.PARAMETER, name, n.meta["val"])
            self.env[n] = self.param_nodes[name]
        buffers: dict[str, fx.Node] = {}
        for n in by_desc.get("BufferAOTInput", []):
            name = self._name(n.meta["desc"].target)
            if name not in buffers:
                buffers[name] = self.placeholder(Role.BUFFER, name, n.meta["val"])
            self.env[n] = buffers[name]
        updates = self._state_placeholders()
        if self.spec.scaling is not None:
            for key, value in self.spec.scaling.initial_state().items():
                self.scaler_nodes[key] = self.placeholder(Role.SCALER, key,
                                                          self.fake_mode.from_tensor(value))
        for n in by_desc.get("PlainAOTInput", []):
            self.env[n] = self.placeholder(Role.INPUT, f"input:{n.meta['desc'].idx}",
                                           n.meta["val"])
        loss, buffers, grads = self._copy_joint(by_desc.get("TangentAOTInput", []))
        outputs = [(OutputSpec(OutputKind.LOSS, ""), loss)]
        outputs += [(OutputSpec(OutputKind.BUFFER, t), v) for t, v in buffers]
        outputs += self._append_update(updates, grads)
        self.graph.output(tuple(v for _, v in outputs))
        gm = fx.GraphModule(self.joint, self.graph)  # keeps the constants get_attr reads
        meta: dict[str, Any] = {"optimizer": self.spec.optimizer}
        if self.spec.scaling is not None:
            meta["loss_scaling"] = self.spec.scaling
        if self.spec.foreach:
            meta["foreach_update"] = True
            if self.spec.fused and self.spec.optimizer.rule.update_fused is not None:
                meta["fused_update"] = True
        return TrainGraph(gm, self.inputs, [s for s, _ in outputs], meta=meta)

    def _state_placeholders(self) -> list[tuple[str, dict, dict[str, fx.Node], fx.Node]]:
        """(param name, group options, {state key: placeholder}, lr placeholder) per param."""
        opt = self.spec.optimizer
        lr_val = self.fake_mode.from_tensor(torch.tensor(0.0, dtype=torch.float64))
        lr_nodes = [self.placeholder(Role.HYPERPARAM, f"lr:{gi}", lr_val)
                    for gi in range(len(opt.groups))]
        result = []
        for gi, group in enumerate(opt.groups):
            options = group.options()
            for name in group.params:
                nodes = {}
                for key in opt.state_keys(group):
                    target = f"{key}:{name}"
                    if target not in self.spec.state:
                        raise CaptureError(f"capture: optimizer state '{target}' is missing")
                    nodes[key] = self.placeholder(Role.OPTIMIZER_STATE, target,
                                                  self._fake(self.spec.state[target]))
                result.append((name, options, nodes, lr_nodes[gi]))
        return result

    def _copy_joint(self, tangents: list[fx.Node]):
        out = next(n for n in self.joint.graph.nodes if n.op == "output")
        descs, values = out.meta["desc"], out.args[0]
        loss_joint = next(v for v, d in zip(values, descs) if type(d).__name__ == "PlainAOTOutput")
        if tangents and len(tangents) != 1:
            raise CaptureError("capture: the model must return exactly one loss tensor")
        seq_source: dict[int, tuple[str | None, str | None]] = {}
        for n in self.joint.graph.nodes:
            if n.op == "get_attr":  # a constant tensor of the model, e.g. a mask
                self.env[n] = self.graph.node_copy(n, lambda a: self.env[a])
                self.env[n].meta["glmc"] = NodeInfo(Phase.INPUT, Role.CONSTANT,
                                                    TensorSpec.of(n.meta.get("val")))
                continue
            if n.op != "call_function":
                continue
            if tangents and loss_joint in self.env and tangents[0] not in self.env:
                self._bind_tangent(tangents[0], loss_joint)
            self.env[n] = self.graph.node_copy(n, lambda a: self.env[a])
            _annotate_joint(self.env[n], n, seq_source)
        if tangents and tangents[0] not in self.env:
            self._bind_tangent(tangents[0], loss_joint)
        loss = self.env[loss_joint]
        spec = TrainGraph.info(loss).spec
        if spec is None or spec.shape != ():
            raise CaptureError("capture: the loss must be a scalar tensor; reduce it (e.g. "
                               f".mean()) before returning it (got shape {spec and spec.shape})")
        return (loss, *self._joint_outputs(values, descs))

    def _joint_outputs(self, values: Any, descs: Any) -> tuple[list, dict[str, fx.Node]]:
        buffers, grads = [], {}
        for v, d in zip(values, descs):
            kind = type(d).__name__
            if kind == "InputMutationAOTOutput":
                target = d.mutated_input
                if type(target).__name__ != "BufferAOTInput":
                    raise CaptureError("capture: the model mutates a parameter or an input in "
                                       f"place ({target}); only buffers may be mutated")
                buffers.append((self._name(target.target), self.env[v]))
            elif kind == "GradAOTOutput" and v is not None:
                name = self._name(d.grad_of.target)
                grads[name] = self._sum(grads[name], self.env[v]) if name in grads \
                    else self.env[v]
        return buffers, grads

    def _sum(self, a: fx.Node, b: fx.Node) -> fx.Node:
        """Two gradients of one shared parameter (its uses under two names) added."""
        total = self.graph.call_function(torch.ops.aten.add.Tensor, (a, b))
        total.meta["val"] = a.meta["val"]
        total.meta["glmc"] = TrainGraph.info(a).replace(source=None)
        return total

    def _bind_tangent(self, tangent: fx.Node, loss_joint: fx.Node) -> None:
        """The backward's seed: d loss / d loss = 1, or the loss scale under loss scaling."""
        loss = self.env[loss_joint]
        if self.spec.scaling is not None:
            seed = self.graph.call_function(torch.ops.aten._to_copy.default,
                                            (self.scaler_nodes[SCALE],),
                                            {"dtype": loss.meta["val"].dtype})
        else:
            seed = self.graph.call_function(torch.ops.aten.ones_like.default, (loss,))
        seed.meta["val"] = loss.meta["val"]
        seed.meta["glmc"] = NodeInfo(Phase.BACKWARD, Role.GRADIENT, TensorSpec.of(seed.meta["val"]))
        self.env[tangent] = seed

    def _append_update(self, updates: list, grads: dict[str, fx.Node]
                       ) -> list[tuple[OutputSpec, fx.Node]]:
        live = [(name, group, states, lr) for name, group, states, lr in updates if name in grads]
        if not live:
            return []
        placeholders: list[fx.Node] = []
        for name, _, states, lr in live:
            placeholders += [self.param_nodes[name], grads[name], lr, *states.values()]
            grads[name].meta[GRAD_OF] = (*grads[name].meta.get(GRAD_OF, ()), name)
        if self.spec.scaling is not None:
            placeholders += [self.scaler_nodes[SCALE], self.scaler_nodes[TRACKER]]
        rule = self.spec.optimizer.rule
        update_all = _UpdateFn(rule, live, self.spec.scaling,
                               self.spec.foreach and rule.update_foreach is not None,
                               self.spec.fused)
        with self.fake_mode:
            opt_gm = make_fx(update_all)(*(n.meta["val"] for n in placeholders))
        produced = self._inline(opt_gm, placeholders)
        outputs, j = [], 0
        for name, _, states, _ in live:
            outputs.append((OutputSpec(OutputKind.PARAM, name), produced[j]))
            outputs += [(OutputSpec(OutputKind.STATE, f"{k}:{name}"), produced[j + 1 + m])
                        for m, k in enumerate(states)]
            j += 1 + len(states)
        if self.spec.scaling is not None:
            outputs += [(OutputSpec(OutputKind.STATE, SCALE), produced[j]),
                        (OutputSpec(OutputKind.STATE, TRACKER), produced[j + 1])]
        return outputs

    def _inline(self, sub: fx.GraphModule, args: list[fx.Node]) -> list[fx.Node]:
        env: dict[fx.Node, fx.Node] = {}
        ph = iter(args)
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(ph)
            elif n.op == "output":
                return [env[a] for a in n.args[0]]
            else:
                new = self.graph.node_copy(n, lambda a: env[a])
                new.meta["glmc"] = NodeInfo(Phase.OPTIMIZER, Role.UPDATE,
                                            TensorSpec.of(n.meta.get("val")))
                env[n] = new
        raise CaptureError("capture: optimizer graph has no output")


class _UpdateFn:
    """The optimizer update of every live parameter as one function of flat tensors:
    per parameter (param, grad, lr, *states), then (scale, tracker) under loss scaling."""

    def __init__(self, rule: OptimizerRule, live: list, scaling: LossScaling | None,
                 foreach: bool, fused: bool = False) -> None:
        self.rule, self.live, self.scaling, self.foreach = rule, live, scaling, foreach
        self.fused = fused
        width = [3 + len(states) for _, _, states, _ in live]
        self.starts = [sum(width[:k]) for k in range(len(live))]

    def __call__(self, *flat: torch.Tensor) -> list[torch.Tensor]:
        grads = [flat[i + 1] for i in self.starts]
        found_inf = None
        if self.scaling is not None:
            grads, found_inf = amp.unscale(grads, flat[-2])
        olds = [(flat[i], dict(zip(states, flat[i + 3:i + 3 + len(states)])))
                for (_, _, states, _), i in zip(self.live, self.starts)]
        results = self._foreach(flat, grads, olds) if self.foreach else {
            k: self.rule.update(olds[k][0], grads[k], olds[k][1], flat[self.starts[k] + 2],
                                self.live[k][1]) for k in range(len(self.live))}
        outs = []
        for k, (_, _, states, _) in enumerate(self.live):
            new_p, new_s = results[k]
            new = [new_p, *(new_s[key] for key in states)]
            if found_inf is not None:  # an overflowing step leaves every tensor as it was
                old = [olds[k][0], *olds[k][1].values()]
                new = [amp.skip_if(found_inf, o, v) for o, v in zip(old, new)]
            outs += new
        if self.scaling is not None:
            outs += list(amp.update(flat[-2], flat[-1], found_inf, self.scaling))
        return outs

    def _foreach(self, flat: tuple, grads: list, olds: list) -> dict[int, tuple]:
        """One multi-tensor update per param group (groups share their lr input)."""
        groups: dict[int, list[int]] = {}
        for k, (_, _, _, lr) in enumerate(self.live):
            groups.setdefault(id(lr), []).append(k)
        results: dict[int, tuple] = {}
        for ks in groups.values():
            new_ps, new_ss = self.rule.update_group(
                [olds[k][0] for k in ks], [grads[k] for k in ks], [olds[k][1] for k in ks],
                flat[self.starts[ks[0]] + 2], self.live[ks[0]][1],
                "fused" if self.fused else "foreach")
            results.update(zip(ks, zip(new_ps, new_ss)))
        return results


def build_step(joint: fx.GraphModule, spec: StepSpec) -> TrainGraph:
    """The step graph of an AOTAutograd joint export, with the update of `spec` appended."""
    graph = _StepBuilder(joint, spec).build()
    _mark_rng(graph)
    graph.gm.graph.eliminate_dead_code()  # drop joint-only leftovers (e.g. unused detaches)
    graph.gm.recompile()
    graph.verify()
    return graph


def _mark_rng(graph: TrainGraph) -> None:
    ordinal = 0
    for n in graph.compute_nodes():
        name = op_name(n)
        if name in RANDOM_OPS:
            n.meta["glmc"] = TrainGraph.info(n).replace(rng=RngSite(ordinal, name))
            ordinal += 1


def _annotate_joint(node: fx.Node, src: fx.Node, seq_source: dict) -> None:
    """Phase from AOTAutograd's partitioner tag; backward nodes inherit their forward op's
    source line and module through the autograd sequence number."""
    phase = Phase.BACKWARD if src.meta.get("partitioner_tag") == "is_backward" else Phase.FORWARD
    old = src.meta.get("glmc")  # re-derivation: forward nodes keep their metadata
    source = _source_line(src.meta.get("stack_trace")) or (old.source if old else None)
    module = _module_path(src.meta.get("nn_module_stack")) or (old.module if old else None)
    seq = src.meta.get("seq_nr")
    if phase is Phase.FORWARD and seq is not None and (source or module):
        seq_source.setdefault(seq, (source, module))
    elif phase is Phase.BACKWARD and seq in seq_source and not source:
        source, module = seq_source[seq]
    role = Role.ACTIVATION if phase is Phase.FORWARD else Role.GRADIENT
    node.meta["glmc"] = NodeInfo(phase, role, TensorSpec.of(src.meta.get("val")),
                                 source=source, module=module)


def _source_line(stack_trace: str | None) -> str | None:
    """The innermost user frame of a node's stack trace, as "file:line in func"."""
    if not stack_trace:
        return None
    lines = [ln.strip() for ln in stack_trace.splitlines() if ln.strip().startswith("File ")]
    user = [ln for ln in lines if "/torch/" not in ln and "/glmc/" not in ln]
    if not user:
        return None
    parts = user[-1].split('"')
    if len(parts) < 3:
        return user[-1]
    rest = parts[2].strip(", ").replace("line ", "")
    line, _, func = rest.partition(", in ")
    return f"{parts[1]}:{line} in {func}"


source_line = _source_line


def _module_path(stack: dict | None) -> str | None:
    if not stack:
        return None
    path, _cls = list(stack.values())[-1]
    for prefix in ("L['self'].model.", "L['s'].model.", "L['self'].", "L['s']."):
        if path.startswith(prefix):
            return path[len(prefix):] or None
    return path


#: a joint graph placeholder's meta key: the parameter it stands for (`capture_stage`)
PARAM_META = "glmc_param"


def joint_to_traingraph(gm: fx.GraphModule) -> TrainGraph:
    """A TrainGraph view of an AOTAutograd joint graph (placeholders primals_*/tangents_*).
    Where its placeholders name their parameters (`PARAM_META`), each forward node's module
    is the block (`glmc.ir.blocks.block_names`) of the parameters it is made from — the one
    the forward reaches last: a layer's values are its layer's, the residual stream's up to
    the next layer's first parameter its layer's too."""
    g = gm.graph
    inputs, backward = [], set()
    names = {n: n.meta[PARAM_META] for n in g.nodes if PARAM_META in n.meta}
    blocks = block_names(names.values())
    where: dict[fx.Node, str] = {n: blocks[name] for n, name in names.items()}
    first: dict[str, int] = {}  # block -> when the forward first reads it
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
            made = [where[a] for a in n.all_input_nodes if a in where] if not is_bwd else []
            for b in made:
                first.setdefault(b, len(first))
            if made:
                where[n] = max(made, key=first.__getitem__)
            n.meta["glmc"] = NodeInfo(phase, role, TensorSpec.of(n.meta.get("val")),
                                      source=source_line(n.meta.get("stack_trace")),
                                      module=where.get(n))
    out = next(n for n in reversed(g.nodes) if n.op == "output")
    outputs = [OutputSpec(OutputKind.GRADIENT if isinstance(v, fx.Node) and v in backward
                          else OutputKind.FORWARD, str(i))
               for i, v in enumerate(out.args[0])]
    return TrainGraph(gm, inputs, outputs)
