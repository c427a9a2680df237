"""A model cut into pipeline stage modules at its blocks.

The model is traced with torch.fx, its blocks (`embed`, `blocks.0`, ...) kept as leaf calls;
where torch.fx cannot trace it (transformers' models) or the batch is by keyword, it is
exported by torch.export and each node belongs to the block its module stack names
(`export_blocks`). Every other node (glue: residual adds, the loss) runs on the stage of the
latest block it depends on; nodes that depend on no block are copied into every stage that
reads them (`split_module`). The stage modules share the model's parameter tensors."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from glmc.errors import ConfigError
from glmc.trace.capture import split_batch


class _BlockTracer(fx.Tracer):
    def __init__(self, blocks: set[str]) -> None:
        super().__init__()
        self.blocks = blocks
        self.proxy_buffer_attributes = True  # `self.cos[:s]` with a traced `s`

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.blocks or (not self.blocks and super().is_leaf_module(m, qualname))


BLOCK = "glmc_block"  #: node meta of an exported graph: the block the node computes


@dataclass
class StageModule:
    """One stage: `module(*[leaf or received value for each arg])` -> sent values or loss."""

    index: int
    module: fx.GraphModule
    args: list[int | str]  #: batch leaf index, or the name of a received value
    send: list[str]


def trace_blocks(model: nn.Module, blocks: Sequence[str], loss_fn: Any = None,
                 example: Any = None) -> fx.GraphModule:
    """`model`'s forward (then the loss) as an fx graph over `blocks`. torch.fx's symbolic
    trace, the blocks kept as leaf calls; where that cannot trace the model (transformers'
    models: decorators, data-dependent Python) or the batch is by keyword, torch.export's
    graph of model and loss on the `example` microbatch (`export_blocks`)."""
    fx_error = "a keyword batch"
    if example is None or not split_batch(example)[1]:
        try:
            graph = _BlockTracer(set(blocks)).trace(model)
        except Exception as e:
            fx_error = f"{type(e).__name__}: {e}"
        else:
            if loss_fn is not None:
                out = next(n for n in graph.nodes if n.op == "output")
                last_ph = [n for n in graph.nodes if n.op == "placeholder"][-1]
                with graph.inserting_after(last_ph):
                    target = graph.placeholder("target")
                with graph.inserting_before(out):
                    loss = graph.call_function(loss_fn, (out.args[0], target))
                out.args = (loss,)
            return fx.GraphModule(model, graph)
    if example is None:
        raise ConfigError(f"pipeline: the model's forward cannot be traced by torch.fx to split "
                          f"it into stages ({fx_error})")
    return export_blocks(model, blocks, loss_fn, example, fx_error)


def export_blocks(model: nn.Module, blocks: Sequence[str], loss_fn: Any, example: Any,
                  fx_error: str = "") -> fx.GraphModule:
    """Model and loss exported by torch.export (non-strict) on `example`, as one fx graph:
    batch leaves as placeholders (`split_batch` order), parameters and buffers read from the
    model itself (get_attr: stage modules share its tensors), every node computed inside a
    block marked `node.meta[BLOCK]` (from the module stack export records), the loss as the
    output. Shapes are those of `example` (one microbatch)."""
    from glmc.passes.partition import owner
    from glmc.trace.capture import LossModule

    wrapper = LossModule(model, loss_fn)  # holds the model as `model`: paths start "model."
    args, kwargs = split_batch(example)
    try:
        ep = torch.export.export(wrapper, tuple(args), dict(kwargs), strict=False)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(f"pipeline: the model's forward cannot be traced to split it into "
                          f"stages: torch.fx failed ({fx_error}) and torch.export failed "
                          f"({type(e).__name__}: {first})") from None
    sig = ep.graph_signature
    if sig.buffers_to_mutate or sig.user_inputs_to_mutate:
        raise ConfigError("pipeline: the forward updates buffers or inputs in place (e.g. "
                          "BatchNorm running statistics: "
                          f"{sorted(sig.buffers_to_mutate.values())[:3]}); a model traced by "
                          "torch.export cannot be pipelined with them yet")
    # the root: the model's own children and tensors (names as in model.state_dict()), plus
    # the tensor constants export lifted out of the forward
    root = nn.Module()
    for name, child in model.named_children():
        root.add_module(name, child)
    for name, p in model.named_parameters(recurse=False):
        root.register_parameter(name, p)
    for name, b in model.named_buffers(recurse=False):
        root.register_buffer(name, b)
    state = {ph: fqn.removeprefix("model.")
             for ph, fqn in {**sig.inputs_to_parameters, **sig.inputs_to_buffers}.items()}
    consts = {}
    for i, (ph, name) in enumerate(sig.inputs_to_lifted_tensor_constants.items()):
        root.register_buffer(f"_glmc_const{i}", ep.constants[name], persistent=False)
        consts[ph] = f"_glmc_const{i}"
    graph, env = fx.Graph(), {}
    for n in ep.graph.nodes:
        if n.op == "placeholder":
            attr = state.get(n.name) or consts.get(n.name)
            env[n] = graph.get_attr(attr) if attr else graph.placeholder(n.name)
            env[n].meta = dict(n.meta)
        elif n.op == "output":
            graph.output(env[n.args[0][0]])  # LossModule returns (loss,)
        else:
            env[n] = graph.node_copy(n, lambda a: env[a])
            stack = list((n.meta.get("nn_module_stack") or {}).values())
            block = owner(stack[-1][0].removeprefix("model."), blocks) if stack else None
            if block is not None:
                env[n].meta[BLOCK] = block
    return fx.GraphModule(root, graph)


def split_module(gm: fx.GraphModule, stage_blocks: Sequence[Sequence[str]]) -> list[StageModule]:
    """Cut `gm` (from `trace_blocks`) into one module per stage (see the module docstring)."""
    where = {b: s for s, bs in enumerate(stage_blocks) for b in bs}
    stage: dict[fx.Node, int | None] = {}  # None: depends on no block (copied where read)
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        deps = [stage[a] for a in n.all_input_nodes if stage[a] is not None]
        block = n.target if n.op == "call_module" else n.meta.get(BLOCK)
        if block in where:
            if deps and max(deps) > where[block]:
                raise ConfigError(f"pipeline: block {block!r} (stage {where[block]}) reads "
                                  f"a value of stage {max(deps)}; cut in forward order")
            stage[n] = where[block]
        else:
            stage[n] = max(deps) if deps else None
    leaves = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    if stage[out.args[0]] != len(stage_blocks) - 1:
        raise ConfigError("pipeline: the loss must be computed on the last stage")
    return [_stage_module(gm, stage, leaves, s, len(stage_blocks), out.args[0])
            for s in range(len(stage_blocks))]


def _stage_module(gm: fx.GraphModule, stage: dict, leaves: list[fx.Node], s: int, n: int,
                  loss: fx.Node) -> StageModule:
    own = [x for x in gm.graph.nodes if stage.get(x) == s and x.op != "placeholder"]
    recv = sorted({a for x in own for a in x.all_input_nodes
                   if stage[a] is not None and stage[a] != s}, key=list(gm.graph.nodes).index)
    for a in recv:
        if stage[a] != s - 1:
            raise ConfigError(f"pipeline: {a.name!r} goes from stage {stage[a]} to stage {s}; "
                              "only neighbouring stages exchange values")
    send = [x for x in own if any(stage.get(u) is not None and stage[u] > s for u in x.users)]
    g, env = fx.Graph(), {}
    args: list[int | str] = []
    needed = _free_closure(own, stage)
    for i, ph in enumerate(leaves):
        if ph in needed:
            env[ph] = g.placeholder(ph.name)
            args.append(i)
    for a in recv:
        env[a] = g.placeholder(a.name)
        args.append(a.name)
    for x in gm.graph.nodes:
        if x.op != "placeholder" and (x in own or x in needed):
            env[x] = g.node_copy(x, lambda a: env[a])
    g.output(env[loss] if s == n - 1 else tuple(env[x] for x in send))
    return StageModule(s, fx.GraphModule(gm, g), args, [x.name for x in send])


def _free_closure(own: list[fx.Node], stage: dict) -> set[fx.Node]:
    """The block-free nodes (and batch leaves) `own` reads, transitively."""
    seen: set[fx.Node] = set()
    todo = [a for x in own for a in x.all_input_nodes if stage[a] is None]
    while todo:
        a = todo.pop()
        if a not in seen:
            seen.add(a)
            todo += [b for b in a.all_input_nodes if stage[b] is None]
    return seen
