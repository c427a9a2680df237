"""Capture a whole training step (forward, loss, backward, optimizer update) into a TrainGraph.

Dynamo captures the model and loss (so every Dynamo-traceable model works unchanged, and nodes keep
the user's source lines); AOTAutograd's joint export turns that into one functional ATen graph of
forward and backward; the optimizer rule (glmc.optim) is traced on fake tensors and appended.
"""
from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

from glmc.errors import CaptureError, ConfigError, InputError, Offense
from glmc.ir import (RANDOM_OPS, InputSpec, NodeInfo, OutputKind, OutputSpec, Phase, RngSite,
                     Role, TensorSpec, TrainGraph, op_name)
from glmc.optim import ensure_state, rule_for
from glmc.scaler import SCALE, TRACKER, LossScaling
from glmc import scaler as amp

Batch = tuple[tuple[Any, ...], dict[str, Any]]


def split_batch(example_inputs: Any) -> Batch:
    """`example_inputs` is a tuple of positional args or a dict of keyword args."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise InputError(f"capture: example_inputs must be a tuple or dict of tensors, got "
                     f"{type(example_inputs).__name__}")


class LossModule(nn.Module):
    """model + loss as one module returning the scalar loss.

    Without `loss_fn` the model returns the loss (a scalar, or an object with `.loss`).
    With `loss_fn`, the last positional batch element (or the "labels" key) is the target:
    `loss_fn(model(*batch[:-1]), batch[-1])`.
    """

    def __init__(self, model: nn.Module, loss_fn: Any = None) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor]:
        if self.loss_fn is None:
            out = self.model(*args, **kwargs)
            loss = getattr(out, "loss", None) if not isinstance(out, torch.Tensor) else out
            if loss is None and isinstance(out, (tuple, list)) and out:
                loss = out[0]
        elif kwargs:
            target = kwargs.pop("labels")
            loss = self.loss_fn(self.model(*args, **kwargs), target)
        else:
            loss = self.loss_fn(self.model(*args[:-1]), args[-1])
        return (loss,)


def capture(model: nn.Module, example_inputs: Any, loss_fn: Any = None,
            optimizer: torch.optim.Optimizer | None = None) -> TrainGraph:
    """The whole training step of (model, loss, optimizer) on `example_inputs` as a TrainGraph."""
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return capture_step(model, split_batch(example_inputs), loss_fn, optimizer)


@dataclass(frozen=True)
class CaptureSource:
    """What a step was captured from. Passes that rewrite the forward re-derive the backward
    and the update from it (`glmc.rederive`); `auto` precision calibrates on the batch."""

    model: nn.Module
    batch: Batch
    loss_fn: Any
    optimizer: torch.optim.Optimizer


def capture_step(model: nn.Module, batch: Batch, loss_fn: Any,
                 optimizer: torch.optim.Optimizer) -> TrainGraph:
    rule_for(optimizer)
    ensure_state(optimizer)
    _check_loss_convention(batch, loss_fn)
    wrapper = LossModule(model, loss_fn)
    was_training = model.training
    model.train()
    try:
        dyn = _dynamo_capture(wrapper, batch)
        with contextlib.ExitStack() as stack, fx_traceback.preserve_node_meta():
            joint = _joint_export(stack, dyn, batch)
            graph = _build_step(joint.graph_module, model, optimizer)
    finally:
        model.train(was_training)
    graph.meta["source"] = CaptureSource(model, batch, loss_fn, optimizer)
    return graph


def _check_loss_convention(batch: Batch, loss_fn: Any) -> None:
    args, kwargs = batch
    if loss_fn is None:
        return
    if kwargs and "labels" not in kwargs:
        raise InputError("capture: with loss_fn and dict inputs, the target must be under the "
                         "key 'labels'; add it or let the model compute its own loss")
    if not kwargs and len(args) < 2:
        raise InputError("capture: with loss_fn, example_inputs must be (inputs..., target); "
                         "got a single element")


# ---- Dynamo / AOT ----------------------------------------------------------------------------

def _dynamo_capture(wrapper: LossModule, batch: Batch) -> fx.GraphModule:
    from torch._dynamo.functional_export import dynamo_graph_capture_for_export

    args, kwargs = batch
    try:
        return dynamo_graph_capture_for_export(wrapper)(*args, **kwargs)
    except Exception as e:  # Dynamo raises many internal types; all become one CaptureError
        offenses = _explain_breaks(wrapper, batch) or [Offense(_first_line(e), _user_frame(e))]
        raise CaptureError("capture: the model cannot be captured as one graph; rewrite or move "
                           "the code at these locations out of the model forward", offenses) from e


def _joint_export(stack: contextlib.ExitStack, dyn: fx.GraphModule, batch: Batch) -> Any:
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

    args, kwargs = batch
    try:
        return aot_export_joint_with_descriptors(stack, dyn, args, kwargs)
    except Exception as e:
        raise CaptureError("capture: the forward graph could not be differentiated or "
                           "functionalized", [Offense(_first_line(e), _user_frame(e))]) from e


def _explain_breaks(wrapper: nn.Module, batch: Batch) -> list[Offense]:
    """Every graph break Dynamo finds, with the user's source location."""
    import torch._dynamo as dynamo

    args, kwargs = batch
    try:
        explanation = dynamo.explain(wrapper)(*args, **kwargs)
    except Exception as e:
        return [Offense(_first_line(e), _user_frame(e))]
    finally:
        dynamo.reset()
    offenses = []
    for br in explanation.break_reasons:
        frame = br.user_stack[-1] if br.user_stack else None
        where = f"{frame.filename}:{frame.lineno} in {frame.name}" if frame else "<unknown>"
        offenses.append(Offense(_first_line(br.reason), where))
    return list(dict.fromkeys(offenses))


def _first_line(e: Any) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def _user_frame(e: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/torch/" not in f.filename]
    if not frames:
        return "<inside torch>"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}"


# ---- building the step graph -----------------------------------------------------------------

def _strip(target: str) -> str:
    return target[len("model."):] if target.startswith("model.") else target


class _StepBuilder:
    """Copies the joint graph into a fresh graph with the step signature, then adds the update."""

    def __init__(self, joint: fx.GraphModule, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scaling: LossScaling | None = None, foreach: bool = False):
        self.joint, self.model, self.optimizer = joint, model, optimizer
        self.scaling = scaling
        self.foreach = foreach
        self.scaler_nodes: dict[str, fx.Node] = {}
        self.graph = fx.Graph()
        self.inputs: list[InputSpec] = []
        self.env: dict[fx.Node, fx.Node] = {}
        self.param_nodes: dict[str, fx.Node] = {}
        self.params = dict(model.named_parameters())
        self.fake_mode = next(n.meta["val"].fake_mode for n in joint.graph.nodes
                              if n.op == "placeholder" and hasattr(n.meta.get("val"), "fake_mode"))

    def placeholder(self, role: Role, target: str, val: Any) -> fx.Node:
        node = self.graph.placeholder(f"{role.value}_{len(self.inputs)}")
        node.meta["val"] = val
        node.meta["glmc"] = NodeInfo(Phase.INPUT, role, TensorSpec.of(val), target=target)
        self.inputs.append(InputSpec(role, target))
        return node

    def build(self) -> TrainGraph:
        jp = [n for n in self.joint.graph.nodes if n.op == "placeholder"]
        by_desc = {type(n.meta["desc"]).__name__: [] for n in jp}
        for n in jp:
            by_desc[type(n.meta["desc"]).__name__].append(n)
        for n in by_desc.get("ParamAOTInput", []):
            name = _strip(n.meta["desc"].target)
            self.env[n] = self.param_nodes[name] = self.placeholder(Role.PARAMETER, name,
                                                                    n.meta["val"])
        for n in by_desc.get("BufferAOTInput", []):
            self.env[n] = self.placeholder(Role.BUFFER, _strip(n.meta["desc"].target),
                                           n.meta["val"])
        updates = self._state_placeholders()
        if self.scaling is not None:
            for key, value in self.scaling.initial_state().items():
                self.scaler_nodes[key] = self.placeholder(Role.SCALER, key,
                                                          self.fake_mode.from_tensor(value))
        for n in by_desc.get("PlainAOTInput", []):
            self.env[n] = self.placeholder(Role.INPUT, f"input:{n.meta['desc'].idx}",
                                           n.meta["val"])
        tangents = by_desc.get("TangentAOTInput", [])
        loss, buffers, grads = self._copy_joint(tangents)
        outputs = [(OutputSpec(OutputKind.LOSS, ""), loss)]
        outputs += [(OutputSpec(OutputKind.BUFFER, t), v) for t, v in buffers]
        outputs += self._append_update(updates, grads)
        self.graph.output(tuple(v for _, v in outputs))
        gm = fx.GraphModule(self.joint, self.graph)  # keeps the constants get_attr reads
        meta: dict[str, Any] = {"optimizer": type(self.optimizer).__name__}
        if self.scaling is not None:
            meta["loss_scaling"] = self.scaling
        if self.foreach:
            meta["foreach_update"] = True
        return TrainGraph(gm, self.inputs, [s for s, _ in outputs], meta=meta)

    def _state_placeholders(self) -> list[tuple[str, dict, dict[str, fx.Node], fx.Node]]:
        """(param name, group, {state key: placeholder}, lr placeholder) per optimized param."""
        rule = rule_for(self.optimizer)
        names = {id(p): n for n, p in self.params.items()}
        result = []
        lr_val = self.fake_mode.from_tensor(torch.tensor(0.0, dtype=torch.float64))
        lr_nodes = {gi: self.placeholder(Role.HYPERPARAM, f"lr:{gi}", lr_val)
                    for gi in range(len(self.optimizer.param_groups))}
        for gi, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in names:
                    raise ConfigError("optimizer: it holds a tensor that is not a parameter of "
                                      "the model; build it from model.parameters()")
                name = names[id(p)]
                state = self.optimizer.state[p]
                nodes = {k: self.placeholder(Role.OPTIMIZER_STATE, f"{k}:{name}",
                                             self.fake_mode.from_tensor(state[k]))
                         for k in rule.state_keys(group)}
                result.append((name, group, nodes, lr_nodes[gi]))
        return result

    def _copy_joint(self, tangents: list[fx.Node]):
        out = next(n for n in self.joint.graph.nodes if n.op == "output")
        descs = out.meta["desc"]
        values = out.args[0]
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
            self._annotate_joint(self.env[n], n, seq_source)
        if tangents and tangents[0] not in self.env:
            self._bind_tangent(tangents[0], loss_joint)
        loss = self.env[loss_joint]
        spec = TrainGraph.info(loss).spec
        if spec is None or spec.shape != ():
            raise CaptureError("capture: the loss must be a scalar tensor; reduce it (e.g. "
                               f".mean()) before returning it (got shape {spec and spec.shape})")
        buffers, grads = [], {}
        for v, d in zip(values, descs):
            kind = type(d).__name__
            if kind == "InputMutationAOTOutput":
                target = d.mutated_input
                if type(target).__name__ != "BufferAOTInput":
                    raise CaptureError("capture: the model mutates a parameter or an input in "
                                       f"place ({target}); only buffers may be mutated")
                buffers.append((_strip(target.target), self.env[v]))
            elif kind == "GradAOTOutput" and v is not None:
                grads[_strip(d.grad_of.target)] = self.env[v]
        return loss, buffers, grads

    def _bind_tangent(self, tangent: fx.Node, loss_joint: fx.Node) -> None:
        """The backward's seed: d loss / d loss = 1, or the loss scale under loss scaling."""
        loss = self.env[loss_joint]
        if self.scaling is not None:
            seed = self.graph.call_function(torch.ops.aten._to_copy.default,
                                            (self.scaler_nodes[SCALE],),
                                            {"dtype": loss.meta["val"].dtype})
        else:
            seed = self.graph.call_function(torch.ops.aten.ones_like.default, (loss,))
        seed.meta["val"] = loss.meta["val"]
        seed.meta["glmc"] = NodeInfo(Phase.BACKWARD, Role.GRADIENT, TensorSpec.of(seed.meta["val"]))
        self.env[tangent] = seed

    def _annotate_joint(self, node: fx.Node, src: fx.Node, seq_source: dict) -> None:
        tag = src.meta.get("partitioner_tag")
        phase = Phase.BACKWARD if tag == "is_backward" else Phase.FORWARD
        source = _source_line(src.meta.get("stack_trace"))
        module = _module_path(src.meta.get("nn_module_stack"))
        seq = src.meta.get("seq_nr")
        if phase is Phase.FORWARD and seq is not None and (source or module):
            seq_source.setdefault(seq, (source, module))
        elif phase is Phase.BACKWARD and seq in seq_source and not source:
            source, module = seq_source[seq]
        role = Role.ACTIVATION if phase is Phase.FORWARD else Role.GRADIENT
        node.meta["glmc"] = NodeInfo(phase, role, TensorSpec.of(src.meta.get("val")),
                                     source=source, module=module)

    def _append_update(self, updates, grads: dict[str, fx.Node]) -> list[tuple[OutputSpec, fx.Node]]:
        rule = rule_for(self.optimizer)
        live = [(name, group, states, lr) for name, group, states, lr in updates if name in grads]
        if not live:
            return []
        placeholders: list[fx.Node] = []
        for name, _, states, lr in live:
            placeholders += [self.param_nodes[name], grads[name], lr, *states.values()]
        scaling = self.scaling
        foreach = self.foreach and rule.update_foreach is not None
        if scaling is not None:
            placeholders += [self.scaler_nodes[SCALE], self.scaler_nodes[TRACKER]]

        def update_all(*flat: torch.Tensor) -> list[torch.Tensor]:
            width = [3 + len(states) for _, _, states, _ in live]
            starts = [sum(width[:k]) for k in range(len(live))]
            grads_in = [flat[i + 1] for i in starts]
            found_inf = None
            if scaling is not None:
                scale, tracker = flat[-2:]
                grads_in, found_inf = amp.unscale(grads_in, scale)
            olds = [(flat[i], dict(zip(states, flat[i + 3:i + 3 + len(states)])))
                    for (_, _, states, _), i in zip(live, starts)]
            if foreach:  # one multi-tensor update per param group
                groups: dict[int, list[int]] = {}
                for k, (_, group, _, _) in enumerate(live):
                    groups.setdefault(id(group), []).append(k)
                results: dict[int, tuple] = {}
                for ks in groups.values():
                    new_ps, new_ss = rule.update_foreach(  # type: ignore[misc]
                        [olds[k][0] for k in ks], [grads_in[k] for k in ks],
                        [olds[k][1] for k in ks], flat[starts[ks[0]] + 2], live[ks[0]][1])
                    results.update(zip(ks, zip(new_ps, new_ss)))
            else:
                results = {k: rule.update(olds[k][0], grads_in[k], olds[k][1],
                                          flat[starts[k] + 2], live[k][1])
                           for k in range(len(live))}
            outs = []
            for k, (_, _, states, _) in enumerate(live):
                p, st = olds[k]
                new_p, new_s = results[k]
                new = [new_p, *(new_s[key] for key in states)]
                if found_inf is not None:  # an overflowing step leaves every tensor as it was
                    old = [p, *st.values()]
                    new = [amp.skip_if(found_inf, o, v) for o, v in zip(old, new)]
                outs += new
            if scaling is not None:
                outs += list(amp.update(scale, tracker, found_inf, scaling))
            return outs

        with self.fake_mode:
            opt_gm = make_fx(update_all)(*(n.meta["val"] for n in placeholders))
        produced = self._inline(opt_gm, placeholders)
        outputs, j = [], 0
        for name, _, states, _ in live:
            outputs.append((OutputSpec(OutputKind.PARAM, name), produced[j]))
            outputs += [(OutputSpec(OutputKind.STATE, f"{k}:{name}"), produced[j + 1 + m])
                        for m, k in enumerate(states)]
            j += 1 + len(states)
        if scaling is not None:
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


def _build_step(joint: fx.GraphModule, model: nn.Module, optimizer: torch.optim.Optimizer,
                scaling: LossScaling | None = None, foreach: bool = False) -> TrainGraph:
    builder = _StepBuilder(joint, model, optimizer, scaling, foreach)
    graph = builder.build()
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


def _source_line(stack_trace: str | None) -> str | None:
    """The innermost user frame of a node's stack trace, as "file:line in func"."""
    if not stack_trace:
        return None
    lines = [ln.strip() for ln in stack_trace.splitlines() if ln.strip().startswith("File ")]
    user = [ln for ln in lines if "/torch/" not in ln and "/glmc/capture.py" not in ln]
    if not user:
        return None
    parts = user[-1].split('"')
    if len(parts) < 3:
        return user[-1]
    rest = parts[2].strip(", ").replace("line ", "")
    line, _, func = rest.partition(", in ")
    return f"{parts[1]}:{line} in {func}"


def _module_path(stack: dict | None) -> str | None:
    if not stack:
        return None
    path, _cls = list(stack.values())[-1]
    for prefix in ("L['self'].model.", "L['s'].model.", "L['self'].", "L['s']."):
        if path.startswith(prefix):
            return path[len(prefix):] or None
    return path
