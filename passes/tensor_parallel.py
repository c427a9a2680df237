"""`tensor_parallel`: Megatron-style tensor parallelism derived from the step's ATen graph.

Runs on the whole step (forward, backward, optimizer update) over a 1-D mesh dim "tp" of N
ranks, every rank holding the whole batch. Two steps:

1. **Seeds.** Each linear layer's weight (a 2-D parameter read as `t(w)` by `mm`/`addmm`) is
   placed by a walk over the forward: the linears that read one value (q, k and v; gate and
   up) form a group; from their outputs the walk follows every op whose other operands do not
   come from outside the group (rotary embeddings, attention, activations, the gate's
   product) and stops at a feature reduction (`mean`, `var`, a norm) or a value from outside
   (the residual add). Every linear the walk reaches is *row* parallel (weight `Shard(1)`,
   its output a partial sum) and the group *column* parallel (weight and bias `Shard(0)`,
   output sharded on features): attention heads and the MLP's hidden dim are sharded, with
   one all-reduce after each block in the forward and one in the backward. A column weight
   whose output is split in k equal parts along the features (a fused `gate_up`) is stored
   interleaved: rank r holds rows r of each part, so each part is sharded like its own
   linear. The LM head into cross-entropy and the embedding tables are vocab-parallel
   (`Shard(0)`; a table only where its rows divide); norms are replicated. `plan=` pins
   weights by name (`glob:column|row|replicate;...`, fnmatch globs on parameter names).
2. **Propagation.** The step is interpreted with DTensors over the mesh (the parameters and
   their optimizer state with their seeds, every other input `Replicate()`) and traced into a
   local program with torch's functional collectives: DTensor's per-op sharding strategies
   give every value a placement and insert the redistribution where placements change. A
   partial sum is reduced where it is made (one all-reduce per value, never one per reader).
   The collectives are rebound to the mesh dim `tp` (`glmc.ir.program.UNBOUND`), so the
   program is an SPMD program like the shard pass's, and every node keeps the metadata of
   the node it came from.

3. **Sequence parallelism** (`sequence=true`, `_Tokens`): values shaped like the tokens
   ([batch, seq, ...] or [batch * seq, ...]) are sharded over the tokens between the blocks:
   each partial sum of that shape is reduce-scattered (not all-reduced), the embedding's
   output is sliced, and token-local ops (pointwise, views, norms, reductions) keep the
   sharding; any other op (a matmul, a transpose, attention, the loss) reads such a value
   whole, all-gathered once per value and phase (the backward gathers again, so only the
   shard is saved for it). A norm weight's gradient becomes a partial sum, all-reduced
   (a few KB). Each rank holds a block of whole sequences where the batch divides by the tp
   size, else (a batch of one sequence) a block of its positions: `Shard(1)` of [1, seq, ...]
   values, `Shard(0)` of their flattened views.

Equal to one process up to the order of the reduced sums. Not yet: the cost model choosing
between placements; under sequence parallelism, a batch of several sequences that does not
divide by the tp size.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from glmc.compiler.passmanager import Effect, Need, Pass, PassContext, PassResult
from glmc.errors import ConfigError, Offense, PassError
from glmc.ir.graph import (RANDOM_OPS, RANK_ARG, REGATHER_S, CommInfo, InputSpec, MeshSpec,
                           NodeInfo, OutputKind, OutputSpec, Phase, Role, TensorSpec, TrainGraph,
                           comm_ops, op_name)
from glmc.ir.kernels import POINTWISE
from glmc.ir.plans import DIM, TP, Tile, TpPlan, block_rows
from glmc.ir.program import UNBOUND, SpmdProgram

aten = torch.ops.aten

KINDS = ("column", "row", "replicate")
#: ops that reduce over features: a seed's walk stops there (norms)
_STOP = {"mean", "var", "var_mean", "native_layer_norm", "native_layer_norm_backward",
         "_fused_rms_norm", "rsqrt", "nll_loss_forward", "_log_softmax"}
_LINEAR = {"mm", "addmm"}
_SPLIT = {"split", "split_with_sizes"}


@dataclass(frozen=True)
class TensorParallelStats:
    size: int
    column: int  #: weights sharded on their output features
    row: int  #: weights sharded on their input features
    replicated: int  #: parameters kept whole on every rank
    collectives: dict[str, int]  #: kind -> count in the step
    volume: dict[str, int]  #: kind -> bytes each rank sends into it per step
    placements: dict[str, str]  #: the largest parameters -> their placement
    #: ops without a DTensor rule run on gathered operands (sharded ones) -> count
    whole_ops: dict[str, int] = dataclasses.field(default_factory=dict)
    #: the largest parameters: (name, whole shape, this rank's shape, placement)
    tensors: tuple[tuple[str, str, str, str], ...] = ()
    #: the ops run on whole operands, with their source lines
    whole_at: tuple[str, ...] = ()
    #: per unit the seeds found: (unit, "sharded"|"whole", predicted ms the shards save, ms
    #: their collectives cost, MiB per rank sharding saves) — the cost model's view
    units: tuple[tuple[str, str, str, str, str], ...] = ()

    def report_section(self, ctx: Any) -> Any:
        """The report's section: the layout (the largest parameters' placements and
        per-rank shapes) and the communication per collective kind."""
        from glmc.compiler.report_parts import ReportSection, Table, Text
        comm = ", ".join(f"{n} {k}" for k, n in self.collectives.items()) or "none"
        text = (f"tp={self.size}: {self.column} column- and {self.row} row-parallel weights, "
                f"{self.replicated} parameters replicated on every rank; per step {comm}.")
        blocks: list[Any] = [Text(text)]
        blocks.append(Table(("parameter", "whole", "this rank", "placement"), self.tensors,
                            "llll"))
        blocks.append(Table(("collective", "per step", "MiB per rank per step"), tuple(
            (k, n, f"{self.volume.get(k, 0) / 2**20:.3f}") for k, n in
            self.collectives.items()), "lrr"))
        if self.units:
            blocks.append(Table(("unit", "layout", "compute saved (ms)", "collectives (ms)",
                                 "MiB saved per rank"), self.units, "llrrr"))
        if self.whole_at:
            blocks.append(Text(f"{len(self.whole_at)} op(s) without a sharding rule run on "
                               "whole operands:", "warn"))
            blocks.append(Table(("op and source",), tuple((w.strip(),) for w in
                                                          self.whole_at), "l"))
        return ReportSection(f"Tensor parallelism (tp={self.size})", tuple(blocks),
                             f"tp={self.size}, {comm}")


@dataclass(frozen=True)
class TensorParallelPass(Pass):
    """Tensor parallelism over mesh dim "tp" (see the module docstring)."""

    name = "tensor_parallel"
    size: int = 2
    #: pins by parameter name: "glob:column|row|replicate;..." (default: derived from the graph)
    plan: str = ""
    #: sequence parallelism: between the blocks (norms, residual adds) activations are sharded
    #: over the tokens; a reduce-scatter replaces each all-reduce and an all-gather feeds
    #: each group of sharded linears (Megatron-LM's sequence parallelism)
    sequence: bool = False
    #: an op without a sharding rule that must run on whole (gathered) operands is a typed
    #: error naming it and its source line, instead of running replicated
    strict: bool = False
    #: "layout": shard every unit the seeds find (Megatron's layout); "time": keep a unit
    #: whole (replicated) where the cost model predicts sharding it makes the step slower —
    #: its collectives cost more than the compute it splits (memory is not weighed); pins win
    choose: str = "layout"
    #: the link tp's collectives cross, for the cost model (`glmc.analysis.comm.get_link`:
    #: a profile name or "ALPHAus:BETAGBps[:CALLus]"); "" NVLink 4, inside a DGX node
    link: str = ""

    def needs(self) -> frozenset[Need]:
        return frozenset({Need.STEP})

    def effects(self) -> frozenset[Effect]:
        return frozenset({Effect.INSERTS_COMM})

    def pins(self) -> list[tuple[str, str]]:
        out = []
        for item in filter(None, (s.strip() for s in self.plan.split(";"))):
            glob, _, kind = item.rpartition(":")
            if not glob or kind not in KINDS:
                raise ConfigError(f"tensor_parallel: plan item {item!r} must be "
                                  f"'glob:{'|'.join(KINDS)}'")
            out.append((glob, kind))
        return out

    def run(self, graph: TrainGraph, ctx: PassContext) -> PassResult:
        _check_size(self.size)
        mesh = ctx.mesh
        if mesh is None:
            raise ConfigError("tensor_parallel: the step is not compiled for a tensor-parallel "
                              "mesh; run it through glmc.optimize(..., parallel={'tp': N}) or "
                              "glmc compile FILE --nproc N --tp N")
        if TP not in mesh.dim_names or mesh.size(TP) != self.size:
            raise ConfigError(f"tensor_parallel: the step runs on mesh {mesh.dim_names}="
                              f"{mesh.shape}; size={self.size} needs a mesh dim 'tp' of "
                              f"{self.size} ranks")
        if set(mesh.dim_names) - {TP, DIM} or mesh.flattened:
            raise ConfigError(f"tensor_parallel: the mesh {mesh.dim_names} has dims beside 'tp' "
                              "and 'dp'; several nodes with tensor parallelism are not "
                              "supported yet (pipeline stages are sharded by run_joint)")
        if "sharding" in graph.meta or TP_META in graph.meta:
            raise PassError("tensor_parallel: the step is already sharded")
        plan, stats, offenses = self._shard(graph, mesh, ctx)
        graph.meta[TP_META] = plan
        SpmdProgram(graph, mesh).verify()
        graph.meta[WHOLE_META] = offenses
        return PassResult(True, stats)

    def _shard(self, graph: TrainGraph, mesh: MeshSpec, ctx: PassContext | None,
               device_mesh: Any = None, every_pin: bool = True
               ) -> tuple[TpPlan, "TensorParallelStats", list[Offense]]:
        """What `run` and `run_joint` share: the seeds (the units `choose` keeps, then the
        pins), the propagation into the local program adopted as `graph` (`strict`: ops on
        whole operands are a ConfigError), the plan, the stats and the ops run whole."""
        units = seed_units(graph, self.size)
        costs, keep = self._costs(graph, units, ctx)
        tiles = seed_tiles(graph, self.size, self.pins(), keep, every_pin, units)
        whole_shapes = {TrainGraph.info(p).target: TrainGraph.info(p).spec.shape
                        for p in graph.placeholders() if TrainGraph.info(p).spec is not None}
        tokens = _tokens(graph, self.size) if self.sequence else None
        traced, whole = _propagate(graph, mesh, tiles, tokens, device_mesh)
        offenses = [_offense(n) for n in whole]
        if self.strict and offenses:
            raise ConfigError("\n".join(
                [f"tensor_parallel: {len(offenses)} op(s) have no sharding rule and would run "
                 "on whole (gathered) operands (strict=true); pin the parameters they read "
                 "with plan='name:replicate' or drop strict"] + [str(o) for o in offenses]))
        plan = TpPlan(self.size, _state_tiles(graph, tiles))
        _adopt(graph, traced, mesh, plan)
        _price_collectives(graph, self.size, self.link)
        names = [op_name(n) for n in whole]
        stats = dataclasses.replace(
            _stats(graph, plan, self.size, whole_shapes),
            whole_ops={op: names.count(op) for op in sorted(set(names))},
            whole_at=tuple(str(o) for o in offenses), units=_unit_rows(costs, plan))
        return plan, stats, offenses

    def _costs(self, graph: TrainGraph, units: list[tuple["Unit", Any]],
               ctx: PassContext | None) -> tuple[list["UnitCost"], Any]:
        """The cost model's view of every unit (`unit_costs`), and the `keep` predicate of
        `seed_tiles` that `choose` asks for (None: every unit)."""
        if self.choose not in ("layout", "time"):
            raise ConfigError(f"tensor_parallel: choose={self.choose!r}; use 'layout' (shard "
                              "every unit the seeds find) or 'time' (keep whole the units the "
                              "cost model predicts slower sharded)")
        costs = unit_costs(graph, self.size, ctx, self.link, units)
        if self.choose == "layout":
            return costs, None
        faster = {c.params for c in costs if c.saved_s >= c.comm_s}
        if ctx is not None and ctx.agree is not None:  # the ranks that shard these units
            faster = ctx.agree(faster)  # together take the first one's choice (each prices
        return costs, lambda u: u.params in faster  # with its own calibrated profile)

    def run_joint(self, joint: fx.GraphModule, inputs: list[InputSpec],
                  outputs: list[OutputSpec | None], mesh: MeshSpec, device_mesh: Any = None,
                  ctx: PassContext | None = None
                  ) -> tuple[fx.GraphModule, TpPlan, "TensorParallelStats"]:
        """The pass on a pipeline stage's joint graph (AOTAutograd's forward + backward of the
        stage, before the partition; `glmc.trace.stages.capture_stage`): `inputs` name its
        placeholders in order (parameters, buffers, batch leaves and received values as
        `Role.INPUT`, then the cotangents of its outputs as `Role.GRADIENT`), `outputs` its
        outputs (the stage's loss or sent values, then a gradient per input, None where there
        is none). Seeds and propagation as on a whole step; the sent values and the gradients
        of received ones are made whole (`Replicate`), so the stages exchange whole values
        between peers of the same tp index. Returns the local joint graph (its placeholders
        still AOTAutograd's `primals_*`/`tangents_*`, collectives bound to "tp" later), the
        parameters' tiles and the stats. The stage's update runs on the blocks as it is."""
        _check_size(self.size)
        if TP not in mesh.dim_names or mesh.size(TP) != self.size:
            raise ConfigError(f"tensor_parallel: the stage runs on mesh {mesh.dim_names}="
                              f"{mesh.shape}; size={self.size} needs a mesh dim 'tp' of "
                              f"{self.size} ranks")
        graph = _joint_graph(joint, inputs, outputs)
        names = [p.target for p in graph.placeholders()]
        plan, stats, _ = self._shard(graph, mesh, ctx, device_mesh, every_pin=False)
        for ph, name in zip(graph.placeholders(), names):  # the partition's primals/tangents
            ph.target = name
            ph._rename(name)
        for n in graph.compute_nodes():  # AOTAutograd's tag: a mutating op of the backward
            if TrainGraph.info(n).phase is Phase.BACKWARD:  # stays there (the partition's
                n.meta["partitioner_tag"] = "is_backward"  # rule)
        graph.gm.recompile()
        return graph.gm, plan, stats


def _flat(v: Any) -> list[Any]:
    """Nested tuples and lists of nodes, flat in order, None kept."""
    if isinstance(v, (tuple, list)):
        return [x for item in v for x in _flat(item)]
    return [v]


def _check_size(size: Any) -> None:
    if not isinstance(size, int) or size < 2:
        raise ConfigError(f"tensor_parallel: size must be a whole number >= 2, got {size!r}")


def _joint_graph(joint: fx.GraphModule, inputs: list[InputSpec],
                 outputs: list[OutputSpec | None]) -> TrainGraph:
    """A stage's joint graph as a TrainGraph for the pass (`TensorParallelPass.run_joint`):
    glmc metadata on every node (the forward: what the stage's loss or sent values are
    computed from; the rest backward) and a signature (a gradient output that is None keeps
    a spec no input matches)."""
    phs = [n for n in joint.graph.nodes if n.op == "placeholder"]
    if len(phs) != len(inputs):
        raise PassError(f"tensor_parallel: the stage's joint graph takes {len(phs)} inputs, "
                        f"its signature names {len(inputs)}")
    out = next(n for n in reversed(joint.graph.nodes) if n.op == "output")
    results = _flat(out.args[0])
    out.args = (results,)  # AOTAutograd's (outputs, gradients), flat
    for n in list(joint.graph.nodes):  # metadata asserts (a `.to()`'s): on sharded values
        if n.op == "call_function" and op_name(n).startswith("_assert") and not n.users:
            joint.graph.erase_node(n)  # they would gather them first (checked when traced)
    joint.graph._codegen = fx.graph.CodeGen()  # flat in, flat out (no pytree calling form)
    joint.recompile()
    n_fwd = sum(1 for o in outputs if o is not None and o.kind in (OutputKind.LOSS,
                                                                    OutputKind.SEND)
                and not o.target.startswith("grad:"))
    forward: set[fx.Node] = set()
    stack = [r for r in results[:n_fwd] if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n not in forward:
            forward.add(n)
            stack.extend(n.all_input_nodes)
    for n, spec in zip(phs, inputs):
        n.meta["glmc"] = NodeInfo(Phase.INPUT, spec.role, TensorSpec.of(n.meta.get("val")),
                                  target=spec.target)
    for n in joint.graph.nodes:
        if n.op == "get_attr":
            n.meta["glmc"] = NodeInfo(Phase.INPUT, Role.CONSTANT,
                                      TensorSpec.of(n.meta.get("val")))
        elif n.op == "call_function":
            fwd = n in forward
            n.meta["glmc"] = NodeInfo(Phase.FORWARD if fwd else Phase.BACKWARD,
                                      Role.ACTIVATION if fwd else Role.GRADIENT,
                                      TensorSpec.of(n.meta.get("val")), created_by="stage")
    specs = [o if o is not None else OutputSpec(OutputKind.GRADIENT, f"none:{k}")
             for k, o in enumerate(outputs)]
    return TrainGraph(joint, list(inputs), specs, meta={"joint": True})


TP_META = "tensor_parallel"
#: graph.meta: the ops the pass ran on whole operands (`Offense`s with their source lines)
WHOLE_META = "tensor_parallel_whole"

FROM = "glmc_tp_from"  #: a traced node's metadata: that of the step node it was traced for
#: where a step node came from (its module, the forward module of a backward node, its source
#: line): carried to the nodes traced for it, for the partition, the planner and reports
_SOURCE_META = ("fwd_nn_module_stack", "nn_module_stack", "stack_trace")


def _offense(n: fx.Node) -> Offense:
    info = TrainGraph.info(n)
    return Offense(f"{op_name(n)} ({info.phase.value}): no sharding rule keeps its operands "
                   "sharded; runs on whole operands (a sharded one all-gathered first)",
                   info.source or info.module or n.name)


# ---- seeds ------------------------------------------------------------------------------------

def _linears(graph: TrainGraph) -> dict[fx.Node, str]:
    """Forward `mm`/`addmm` nodes whose right operand is `t(w)` of a 2-D parameter (cast
    before or after the transpose: the precision pass's low-precision copy) -> its name."""
    out = {}
    for mm in graph.compute_nodes():
        if op_name(mm) not in _LINEAR or TrainGraph.info(mm).phase is not Phase.FORWARD or \
                not isinstance(mm.args[-1], fx.Node):
            continue
        w, transposes = mm.args[-1], 0
        while op_name(w) in ("t", *_CASTS):
            transposes += op_name(w) == "t"
            w = w.args[0]
        info = TrainGraph.info(w) if w.op == "placeholder" else None
        if transposes == 1 and info is not None and info.role is Role.PARAMETER and \
                info.spec is not None and len(info.spec.shape) == 2:
            out[mm] = info.target
    return out


#: ops that copy a value as it is or in another dtype
_CASTS = ("_to_copy", "clone", "alias", "convert_element_type")


def _source(n: fx.Node) -> fx.Node:
    """The value a linear reads, through views and copies."""
    while op_name(n) in ("view", "_unsafe_view", "reshape", *_CASTS):
        n = n.args[0]
    return n


def _group_walk(graph: TrainGraph, starts: list[fx.Node], linears: dict[fx.Node, str],
                stream: set[fx.Node]) -> tuple[set[str], set[fx.Node], list[fx.Node]]:
    """The linears reached from `starts` through forward ops fed only from inside (see the
    module docstring; one pass in program order): their names, the ops walked through, and
    the reached linears' nodes."""
    inside: set[fx.Node] = set(starts)
    reached: set[str] = set()
    rows: list[fx.Node] = []
    for u in graph.compute_nodes():
        if u in inside or TrainGraph.info(u).phase is not Phase.FORWARD:
            continue
        ins = u.all_input_nodes
        if not any(a in inside for a in ins):
            continue
        if u in linears:
            if u.args[-2] in inside:
                reached.add(linears[u])
                rows.append(u)
            continue
        name = op_name(u)
        if name in _STOP or name in _LINEAR or \
                any(a not in inside and a in stream for a in ins):
            continue
        inside.add(u)
    return reached, inside, rows


def _stream(graph: TrainGraph) -> set[fx.Node]:
    """The nodes that depend on the batch (the step's data flow; not parameters, buffers or
    constants made in the step)."""
    out: set[fx.Node] = set()
    for n in graph.graph.nodes:
        if n.op == "placeholder":
            if TrainGraph.info(n).role is Role.INPUT:
                out.add(n)
        elif any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _tokens(graph: TrainGraph, size: int) -> tuple[int, int]:
    """(batch, sequence) of the step's token dims: those of its first batch input with two
    or more dims (the token ids). Sequence parallelism shards the flattened tokens in
    `size` contiguous blocks: a block of whole sequences per rank where the batch divides,
    else (a batch of one sequence, as pipelines and Megatron-LM run micro-batches) a block of
    the sequence's positions."""
    for ph in graph.placeholders():
        val = ph.meta.get("val")
        if TrainGraph.info(ph).role is Role.INPUT and isinstance(val, torch.Tensor) and \
                val.dim() >= 2:
            batch, seq = int(val.shape[0]), int(val.shape[1])
            if batch % size and (batch != 1 or seq % size):
                raise ConfigError(f"tensor_parallel: sequence=true shards the {batch} x {seq} "
                                  f"tokens in {size} contiguous blocks: the batch ({batch}) "
                                  f"must divide by tp={size}, or be one sequence whose length "
                                  f"divides by {size} (a block of whole sequences or of one "
                                  "sequence's positions per rank)")
            return batch, seq
    raise ConfigError("tensor_parallel: sequence=true needs a batch input of shape "
                      "(batch, sequence, ...) (token ids); the step has none")


def _split_of(mm: fx.Node) -> tuple[fx.Node | None, int]:
    """The split of a linear's output into equal parts along its features (a fused gate/up),
    and the number of parts; (None, 1) when its output is not split so."""
    features = mm.meta["val"].shape[-1]
    for v in [mm, *(u for u in mm.users if op_name(u) in ("view", "_unsafe_view", "reshape")
                    and u.meta["val"].shape[-1] == features)]:
        for u in v.users:
            if op_name(u) not in _SPLIT or u.args[0] is not v:
                continue
            sizes = u.args[1]
            dim = u.args[2] if len(u.args) > 2 else u.kwargs.get("dim", 0)
            if dim not in (-1, v.meta["val"].dim() - 1):
                continue
            if isinstance(sizes, int) and features % sizes == 0 and features > sizes:
                return u, features // sizes
            if isinstance(sizes, (list, tuple)) and len(sizes) > 1 and len(set(sizes)) == 1:
                return u, len(sizes)
    return None, 1


def _roots(n: fx.Node) -> fx.Node:
    """The value `n` is a view or transpose of (a parameter for `t(w)`)."""
    while op_name(n) in ("view", "_unsafe_view", "reshape", "t", "permute", "transpose",
                         "clone", "alias", "_to_copy", "expand"):
        n = n.args[0]
    return n


def interleaved_ops(graph: TrainGraph, tiles: dict[str, Tile]) -> dict[fx.Node, int]:
    """The splits (forward) and concatenations (their gradients) to run shard by shard: those
    of the outputs of linears whose weight is stored in `groups` > 1 interleaved parts. Any
    other equal split of a sharded value keeps DTensor's meaning."""
    weights = {ph: tiles[TrainGraph.info(ph).target].groups for ph in graph.placeholders()
               if TrainGraph.info(ph).target in tiles and
               tiles[TrainGraph.info(ph).target].groups > 1}
    out: dict[fx.Node, int] = {}
    for mm in _linears(graph):
        w = _roots(mm.args[-1])
        if w in weights:
            split, parts = _split_of(mm)
            if split is not None and parts == weights[w]:
                out[split] = parts
    for n in graph.compute_nodes():  # a cat read (through views) by a matmul with the weight
        if op_name(n) != "cat" or len(n.args[0]) < 2:
            continue
        readers = [n]
        for r in list(readers):
            readers += [u for u in r.users if op_name(u) in ("view", "_unsafe_view", "reshape")]
        for r in readers:
            for u in r.users:
                if op_name(u) in _LINEAR and any(_roots(a) in weights and
                                                 weights[_roots(a)] == len(n.args[0])
                                                 for a in u.args if isinstance(a, fx.Node)):
                    out[n] = len(n.args[0])
    return out


@dataclass(frozen=True)
class Unit:
    """What the seeds shard together: a group of column linears with the row linears its
    walk reaches (a block's attention or MLP), an LM head, or an embedding table."""

    name: str  #: the common prefix of its weights' names
    params: tuple[str, ...]
    forward: tuple[fx.Node, ...]  #: the forward ops that run on shards when it is sharded
    #: the values sharding it all-reduces once per step: partial sums of the forward (row
    #: outputs, a vocab-parallel lookup) and values whose gradient is one (its input)
    reduced: tuple[fx.Node, ...]


def seed_units(graph: TrainGraph, size: int) -> list[tuple[Unit, dict[str, Tile]]]:
    """The units the walk finds (see the module docstring), each with the tiles it gives
    its weights: column groups with their row linears, then the LM heads into
    cross-entropy and the embedding tables whose rows divide among the ranks
    (vocab-parallel, Megatron's)."""
    linears = _linears(graph)
    stream = _stream(graph)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for mm in linears:
        groups.setdefault(_source(mm.args[-2]), []).append(mm)
    taken: dict[str, Tile] = {}
    out: list[tuple[Unit, dict[str, Tile]]] = []
    for source, members in groups.items():
        outs = [_output(mm) for mm in members]
        reached, inside, rows = _group_walk(graph, outs, linears, stream)
        if not reached:
            continue
        mine = {linears[mm]: Tile("column", 0, _split_of(mm)[1]) for mm in members}
        mine.update({name: Tile("row", 1, 1) for name in reached
                     if name not in taken and name not in mine})
        taken.update(mine)
        rows = [mm for mm in rows if linears[mm] in mine]  # not another unit's
        ops = [n for n in graph.compute_nodes() if n in inside or n in members or n in rows]
        out.append((Unit(_prefix(list(mine)), tuple(mine), tuple(ops),
                         (*(_output(mm) for mm in rows), source)), mine))
    for mm, name in linears.items():  # the LM head: vocab-parallel into the loss
        if _feeds_log_softmax(mm) and name not in taken:
            taken[name] = Tile("column", 0, 1)
            out.append((Unit(name, (name,), (mm,), (_source(mm.args[-2]),)),
                        {name: taken[name]}))
    for n, name, rows in _embeddings(graph):  # vocab-parallel tables
        if name not in taken and rows >= size:
            taken[name] = Tile("column", 0, 1)
            out.append((Unit(name, (name,), (n,), (n,)), {name: taken[name]}))
    return out


def _prefix(names: list[str]) -> str:
    """The common dotted prefix of parameter names (a block's attention: "blocks.0.attn")."""
    parts = [n.split(".") for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common) or names[0]


def seed_tiles(graph: TrainGraph, size: int, pins: list[tuple[str, str]],
               keep: Any = None, every_pin: bool = True,
               units: list[tuple[Unit, dict[str, Tile]]] | None = None) -> dict[str, Tile]:
    """Parameter name -> its tile: column/row linears found by the walk (the units `keep`
    accepts, default all: `seed_units`, or `units` if given), then the pins. `every_pin`: a
    pin that matches no parameter is a ConfigError (a pipeline stage holds some of the
    parameters: the pipeline checks its pins against every stage)."""
    units = seed_units(graph, size) if units is None else units
    tiles = {name: tile for u, unit_tiles in units
             if keep is None or keep(u) for name, tile in unit_tiles.items()}
    linears = _linears(graph)
    tables = {name for _, name, _ in _embeddings(graph)}
    heads = {name for mm, name in linears.items() if _feeds_log_softmax(mm)}
    vocab = heads | tables  #: cut on their rows unevenly where the vocabulary must
    shapes = {TrainGraph.info(ph).target: TrainGraph.info(ph).spec.shape
              for ph in graph.placeholders()
              if TrainGraph.info(ph).role is Role.PARAMETER and TrainGraph.info(ph).spec}
    for glob, kind in pins:
        hit = [n for n in shapes if fnmatch.fnmatchcase(n, glob)]
        if not hit and every_pin:
            raise ConfigError(f"tensor_parallel: plan pin {glob!r} matches no parameter; "
                              f"parameters are e.g. {sorted(shapes)[:4]}")
        for n in hit:
            if kind == "replicate":
                tiles.pop(n, None)
            elif len(shapes[n]) != 2:
                raise ConfigError(f"tensor_parallel: {n} has shape {shapes[n]}; only 2-D "
                                  "weights are column or row parallel")
            else:
                parts = max((_split_of(mm)[1] for mm, w in linears.items() if w == n),
                            default=1)
                tiles[n] = Tile("column", 0, parts) if kind == "column" else Tile("row", 1)
    for name, tile in list(tiles.items()):  # a column linear's bias follows its weight
        bias = name.rsplit(".", 1)[0] + ".bias"
        if tile.kind == "column" and name.endswith(".weight") and bias in shapes:
            tiles[bias] = Tile("column", 0, tile.groups)
    for name, tile in tiles.items():
        extent = shapes[name][tile.dim]
        if name in vocab and tile.dim == 0 and tile.groups == 1 and extent >= size:
            continue  # a vocabulary that does not divide: uneven blocks (torch.chunk's)
        if extent % (size * tile.groups):
            parts = f" x {tile.groups} parts" if tile.groups > 1 else ""
            raise ConfigError(f"tensor_parallel: {name} {tuple(shapes[name])} is {tile.kind} "
                              f"parallel on dim {tile.dim} ({extent}), which does not divide "
                              f"by {size} ranks{parts}"
                              f"; pin it with plan='{name}:replicate' or choose another size")
    return tiles


@dataclass(frozen=True)
class UnitCost:
    """The cost model's view of sharding one unit over tp ranks, per step: the compute its
    shards save (forward and backward: three times the forward's predicted time, less its
    1/tp share), what its all-reduces cost on the link, and the state bytes per rank it
    saves (its parameters, their gradients and the optimizer state the graph holds — a
    pipeline stage's joint graph holds none — less 1/tp)."""

    name: str
    params: tuple[str, ...]
    saved_s: float
    comm_s: float
    state_bytes: int


def unit_costs(graph: TrainGraph, size: int, ctx: PassContext | None = None,
               link: str = "", units: list[tuple[Unit, Any]] | None = None
               ) -> list[UnitCost]:
    """`UnitCost` of every unit `seed_units` finds (or of `units`), on `ctx`'s device
    profile (default:
    this host) and `link` (`TensorParallelPass.link`). The compute is the ops' roofline
    time without per-launch overhead (a shard launches as many kernels as the whole).
    Under sequence parallelism an all-reduce becomes a reduce-scatter and an all-gather of
    the same bytes in all: priced alike."""
    from glmc.analysis.comm import collective_seconds, get_link
    from glmc.analysis.cost import get_profile, roofline_time
    from glmc.analysis.opcost import op_cost, value_bytes

    prof = get_profile(ctx.profile if ctx is not None else None)
    wire = get_link(link or "nvlink4")
    state: dict[str, int] = {}
    for ph in graph.placeholders():
        info = TrainGraph.info(ph)
        if info.role in (Role.PARAMETER, Role.OPTIMIZER_STATE) and info.spec is not None:
            name = info.target.partition(":")[2] if info.role is Role.OPTIMIZER_STATE \
                else info.target
            grad = 2 if info.role is Role.PARAMETER else 1  # a parameter and its gradient
            state[name] = state.get(name, 0) + grad * info.spec.nbytes
    out = []
    for unit, _ in seed_units(graph, size) if units is None else units:
        forward = sum(roofline_time(op_cost(n), prof) for n in unit.forward)
        comm = sum(collective_seconds("all_reduce", value_bytes(v.meta.get("val")), size, wire)
                   for v in unit.reduced)
        kept = sum(state.get(n, 0) for n in unit.params)
        out.append(UnitCost(unit.name, unit.params, 3 * forward * (1 - 1 / size), comm,
                            int(kept * (1 - 1 / size))))
    return out


def _unit_rows(costs: list[UnitCost], plan: TpPlan) -> tuple[tuple[str, ...], ...]:
    """The report's rows of `UnitCost`s under `plan` (a unit is sharded where any of its
    weights is: a pin may keep part of it whole)."""
    return tuple((c.name, "sharded" if any(n in plan.tiles for n in c.params) else "whole",
                  f"{c.saved_s * 1e3:.3f}", f"{c.comm_s * 1e3:.3f}",
                  f"{c.state_bytes / 2**20:.2f}") for c in costs)


def _embeddings(graph: TrainGraph) -> list[tuple[fx.Node, str, int]]:
    """The forward's embedding lookups of a parameter table (`embedding(w, ids)`): (lookup,
    table name, table rows)."""
    out = []
    for n in graph.compute_nodes():
        w = n.args[0] if op_name(n) == "embedding" else None
        if isinstance(w, fx.Node) and w.op == "placeholder" and \
                TrainGraph.info(w).role is Role.PARAMETER and TrainGraph.info(n).phase is \
                Phase.FORWARD and TrainGraph.info(w).spec is not None:
            out.append((n, TrainGraph.info(w).target, TrainGraph.info(w).spec.shape[0]))
    return out


def _vocab_ids(graph: TrainGraph, state: dict[str, Tile]) -> set[tuple[fx.Node, int]]:
    """(token ids, table rows) of embeddings whose table is sharded on its rows
    (vocab-parallel): their backward (`embedding_dense_backward` of the same ids and rows)
    runs on each rank's rows."""
    return {(n.args[1], rows) for n, name, rows in _embeddings(graph)
            if state.get(name, Tile("", 1)).dim == 0}


def _embedding_backward(n: fx.Node, interp: fx.Interpreter, dm: Any) -> Any:
    """The gradient of a vocab-parallel embedding table on each rank's own rows (DTensor has
    no row-sharded rule for it): the rank's ids shifted to its rows, the other tokens'
    gradients masked to zero; `Shard(0)`, like the table. Sums the same tokens' rows in the
    same order as one process."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    (grad, ids, rows, padding, by_freq), _ = interp.fetch_args_kwargs_from_env(n)
    if by_freq:  # counts would include the masked tokens: DTensor's own rule
        return n.target(grad, ids, rows, padding, by_freq)
    grad, ids = (v.redistribute(dm, [Replicate()]).to_local() if isinstance(v, DTensor) else v
                 for v in (grad, ids))
    start, size = block_rows(rows, dm.get_local_rank(), dm.size())
    mine = (ids >= start) & (ids < start + size)
    local = torch.where(mine, ids - start, torch.zeros_like(ids))
    grad = torch.where(mine.unsqueeze(-1), grad, torch.zeros_like(grad))  # no 0 * inf
    padding = padding - start if 0 <= padding - start < size else -1
    out = n.target(grad, local, size, padding, by_freq)
    return _placed(out, dm, [Shard(0)], (rows, *out.shape[1:]))


def _feeds_log_softmax(mm: fx.Node) -> bool:
    """Whether a linear's output reaches `_log_softmax` over its features through views and
    casts only (an LM head into cross-entropy, which torch's loss-parallel rules compute on
    vocab-sharded logits)."""
    frontier, seen = [mm], set()
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            if op_name(u) == "_log_softmax" and u.args[1] in (-1, u.args[0].meta["val"].dim() - 1):
                return True
            if op_name(u) in ("view", "_unsafe_view", "reshape", "_to_copy", "clone") or \
                    (op_name(u) == "slice" and u.args[1] not in (-1, u.args[0].meta["val"].dim()
                                                                 - 1)):  # a shift of positions
                frontier.append(u)
    return False


def _output(mm: fx.Node) -> fx.Node:
    """A linear's output through the view back to the batch's shape."""
    users = list(mm.users)
    if len(users) == 1 and op_name(users[0]) in ("view", "_unsafe_view", "reshape"):
        return users[0]
    return mm


def _state_tiles(graph: TrainGraph, tiles: dict[str, Tile]) -> dict[str, Tile]:
    """The parameters' tiles and their optimizer states' (same shape, same tile)."""
    shapes = {TrainGraph.info(ph).target: TrainGraph.info(ph).spec.shape
              for ph in graph.placeholders() if TrainGraph.info(ph).spec is not None}
    out = dict(tiles)
    for spec in graph.inputs:
        if spec.role is Role.OPTIMIZER_STATE:
            name = spec.target.partition(":")[2]
            if name in tiles and shapes.get(spec.target) == shapes.get(name):
                out[spec.target] = tiles[name]
    return out


# ---- propagation ------------------------------------------------------------------------------

def _placement(tile: Tile | None) -> Any:
    from torch.distributed.tensor import Replicate, Shard
    return Replicate() if tile is None else Shard(tile.dim)


@contextlib.contextmanager
def _device_mesh(mesh: MeshSpec, given: Any = None) -> Iterator[Any]:
    """A DeviceMesh to trace on: `given` (the runtime's, e.g. a pipeline's ("pp", "tp")
    mesh), else the running processes' when torch.distributed is up (every rank compiles the
    step together), else a fake process group of `mesh`'s size, taken down afterwards
    (tracing issues no real communication)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if given is not None:
        yield given[TP]
        return
    made = False
    if not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0,
                                world_size=math.prod(mesh.shape))
        made = True
    elif dist.get_world_size() != math.prod(mesh.shape):
        raise ConfigError(f"tensor_parallel: {dist.get_world_size()} processes run, the mesh "
                          f"{mesh.dim_names}={mesh.shape} needs {math.prod(mesh.shape)}")
    try:
        yield init_device_mesh(mesh.device_type, mesh.shape, mesh_dim_names=mesh.dim_names)[TP]
    finally:
        if made:
            dist.destroy_process_group()


def _propagate(graph: TrainGraph, mesh: MeshSpec, tiles: dict[str, Tile],
               tokens: tuple[int, int] | None = None, device_mesh: Any = None
               ) -> tuple[fx.GraphModule, list[str]]:
    """The local program of `graph` with `tiles` (see the module docstring); with `tokens`
    (batch, sequence), sequence-parallel (`_Tokens`); `device_mesh`: the DeviceMesh to trace
    on (default: `_device_mesh`'s)."""
    import torch.fx.traceback as fx_traceback
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.fx.experimental.proxy_tensor import make_fx

    state = _state_tiles(graph, tiles)
    phs = graph.placeholders()
    with _device_mesh(mesh, device_mesh) as dm:
        places = [[_placement(state.get(TrainGraph.info(p).target))] for p in phs]
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with fake:
            local = [_local_empty(p.meta["val"], pl[0], mesh.size(TP), dm.get_local_rank())
                     for p, pl in zip(phs, places)]
        run = _Local(graph.gm, dm, places, state, graph,
                     _Tokens(*tokens, dm) if tokens is not None else None)
        try:
            # cross-entropy on vocab-sharded logits without gathering them (torch's
            # loss-parallel rules for _log_softmax / nll_loss and their backward), where
            # the LM head is vocab-parallel (they refuse whole logits)
            heads = {name for mm, name in _linears(graph).items() if _feeds_log_softmax(mm)}
            vocab = loss_parallel() if heads & set(tiles) else contextlib.nullcontext()
            with fx_traceback.preserve_node_meta(), vocab:
                traced = make_fx(run, tracing_mode="fake", _allow_non_fake_inputs=True)(*local)
        except ConfigError:
            raise
        except Exception as e:  # DTensor has no rule for an op, or a shape does not divide
            where = run.current.name if run.current is not None else "?"
            raise PassError(f"tensor_parallel: sharding propagation failed at '{where}' "
                            f"({op_name(run.current) if run.current is not None else '?'}): "
                            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}; pin "
                            "the weights around it with plan='name:replicate'") from e
    return traced, run.whole


def _local_empty(val: Any, placement: Any, n: int, rank: int) -> Any:
    if not isinstance(val, torch.Tensor):
        return val
    shape = list(val.shape)
    if hasattr(placement, "dim") and shape:
        shape[placement.dim] = block_rows(shape[placement.dim], rank, n)[1]
    return torch.empty(shape, dtype=val.dtype, device=val.device)


#: ops a rank runs on its own tokens' rows (besides pointwise ops and views): row-wise norms
#: and reductions (`_REDUCTIONS`, `_LAST_DIM`); anything else reads token-sharded values whole
_TOKEN_LOCAL = {"rms_norm", "rms_norm_backward", "native_layer_norm",
                "native_layer_norm_backward", "clone", "_to_copy", "alias", "detach", "copy_",
                "view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "expand"}
#: reductions DTensor runs on each rank's rows: over the features a row-wise result, over
#: the tokens a partial sum (an unfused norm's weight gradient: all-reduced, not gathered)
_REDUCTIONS = {"mean", "sum"}
_LAST_DIM = {"var", "var_mean", "amax"}


class _Marks:
    """DTensors marked while the step is interpreted, by identity (weakly: a freed tensor's
    id may be reused by a new one, which is not marked)."""

    def __init__(self) -> None:
        self.refs: dict[int, Any] = {}

    def add(self, v: Any) -> None:
        import weakref
        self.refs[id(v)] = weakref.ref(v)

    def __contains__(self, v: Any) -> bool:
        ref = self.refs.get(id(v))
        return ref is not None and ref() is v


class _Tokens:
    """Sequence parallelism's token sharding. A partial sum shaped like the tokens
    ([batch, seq, ...] or [batch * seq, ...]) is reduce-scattered to `Shard(0)`, and what a
    token-local op makes from such values stays so (marked); an op that is not token-local (a
    matmul, a transpose, attention, the loss) reads them whole: one all-gather per value and
    phase, kept for its other readers in that phase (the backward's all-gather of a gradient
    feeds both its matmuls; the forward's gathered input is gathered again for the weight
    gradient, so the backward keeps only the shard)."""

    def __init__(self, batch: int, seq: int, dm: Any) -> None:
        self.batch, self.seq, self.dm = batch, seq, dm
        self.marked = _Marks()  #: the token-sharded DTensors
        #: (id, phase) -> (weak ref, gathered DTensor)
        self.whole: dict[tuple[int, Any], tuple[Any, Any]] = {}

    def shaped(self, v: Any) -> bool:
        shape = tuple(v.shape)
        return len(shape) >= 2 and (shape[:2] == (self.batch, self.seq)
                                    or shape[0] == self.batch * self.seq)

    def place(self, v: Any) -> Any:
        """The placement of token-shaped `v` (whole shape): `Shard(0)` — blocks of whole
        sequences, or of flattened tokens — except a [1, seq, ...] value of a batch of one,
        cut along its positions (`Shard(1)`: the same tokens as `Shard(0)` of its flattened
        [seq, ...] view)."""
        from torch.distributed.tensor import Shard
        if self.batch % self.dm.size() == 0 or v.shape[0] == self.batch * self.seq:
            return Shard(0)
        return Shard(1)

    def is_sharded(self, v: Any) -> bool:
        return v in self.marked

    def mark(self, v: Any) -> None:
        self.marked.add(v)

    def settle(self, n: fx.Node, ins: list[Any], out: Any) -> Any:
        """`out` of `n`, marked where `n` made it on token-sharded inputs and it is itself
        sharded on the tokens; the embedding's output sliced (the residual stream starts
        sharded)."""
        from torch.distributed.tensor import DTensor, Replicate
        if op_name(n) == "embedding" and isinstance(out, DTensor) and \
                out.placements == (Replicate(),) and self.shaped(out):
            out = out.redistribute(self.dm, [self.place(out)])
            self.mark(out)
        if any(self.is_sharded(v) for v in ins):
            for v in _leaves(out):
                if self.shaped(v) and v.placements == (self.place(v),):
                    self.mark(v)
        return out

    def gather_for(self, n: fx.Node, interp: fx.Interpreter) -> list[tuple[fx.Node, Any]]:
        """Token-sharded inputs of `n`, unless `n` is token-local, replaced in the
        interpreter's environment by their whole value; returns what to put back after `n`."""
        if _is_token_local(n):
            return []
        import weakref

        from torch.distributed.tensor import DTensor, Replicate
        back = []
        phase = TrainGraph.info(n).phase if "glmc" in n.meta else None
        for a in n.all_input_nodes:
            v = interp.env.get(a)
            if not isinstance(v, DTensor) or not self.is_sharded(v):
                continue
            # per phase: the backward gathers again rather than keep the forward's whole
            # copy alive for it (Megatron's sequence parallelism: only the shard is saved)
            hit = self.whole.get((id(v), phase))
            if hit is None or hit[0]() is not v:
                hit = (weakref.ref(v), v.redistribute(self.dm, [Replicate()]))
                self.whole[(id(v), phase)] = hit
            back.append((a, v))
            interp.env[a] = hit[1]
        return back


def _is_token_local(n: fx.Node) -> bool:
    name = op_name(n)
    if name in _TOKEN_LOCAL or name in POINTWISE or name in _REDUCTIONS or \
            torch.Tag.pointwise in getattr(n.target, "tags", ()):
        return True
    if name in _LAST_DIM and len(n.args) > 1 and isinstance(n.args[1], (list, tuple)):
        rank = n.args[0].meta["val"].dim() if isinstance(n.args[0], fx.Node) else 0
        return bool(n.args[1]) and all(d in (-1, rank - 1) for d in n.args[1])
    return False


class _Local:
    """The step run on DTensors, returning local tensors (what make_fx traces)."""

    def __init__(self, gm: fx.GraphModule, dm: Any, places: list, state: dict[str, Tile],
                 graph: TrainGraph, tokens: _Tokens | None = None) -> None:
        self.gm, self.dm, self.places, self.state, self.graph = gm, dm, places, state, graph
        self.tokens = tokens  #: sequence parallelism's token sharding (None: off)
        self.current: fx.Node | None = None
        self.whole: list[fx.Node] = []  #: ops run on whole (replicated) operands, in order
        #: the splits and concatenations of interleaved parts run shard by shard
        self.allowed = interleaved_ops(graph, state)
        #: DTensors in an interleaved layout: their blocks are not DTensor's contiguous
        #: blocks, so no redistribution may touch them
        self.interleaved = _Marks()
        self.vocab_ids = _vocab_ids(graph, state)  #: ids of vocab-parallel embeddings

    def is_interleaved(self, v: Any) -> bool:
        return v in self.interleaved

    def mark(self, v: Any) -> None:
        self.interleaved.add(v)

    def __call__(self, *local: Any) -> list[Any]:
        from torch.distributed.tensor import DTensor, Shard
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        dm, owner = self.dm, self

        class Interp(fx.Interpreter):
            def run_node(self, n: fx.Node) -> Any:
                owner.current = n
                traced = get_proxy_mode().tracer.graph
                last = traced._root.prev  # what is traced after it carries n's metadata
                # sequence parallelism: token-sharded inputs gathered first (a gather of
                # activations, not a redistribution of an interleaved weight: the check
                # below starts after it)
                back = owner.tokens.gather_for(n, self) if owner.tokens is not None and \
                    n.op == "call_function" else []
                gathered = traced._root.prev
                ins = [v for v in fx.node.map_aggregate(self.fetch_args_kwargs_from_env(n),
                                                        lambda v: v)
                       for v in _leaves(v)] if n.op == "call_function" else []
                mixed = any(owner.is_interleaved(v) for v in ins)
                out = _local_split(n, self, dm, owner.allowed)
                if out is None and (n.target in _FOREACH or _is_foreach_pointwise(n)):
                    out = _foreach(n, self, dm)
                if out is None:
                    # partial sums that only add up (the gradient of a value several column
                    # linears read) are reduced once, after the sum
                    try:
                        if n.target in _HEADWISE or op_name(n) in POINTWISE or \
                                (op_name(n) in RANDOM_OPS and n.target is not DROPOUT):
                            raise NotImplementedError  # by blocks (DTensor would decompose;
                            # a random op: whole, from the generator as one process draws)
                        if n.target is DROPOUT:
                            out = _dropout(n, self, dm)
                        elif n.target is aten.nll_loss_backward.default:
                            out = _nll_backward(n, self)
                        elif n.target is aten.embedding_dense_backward.default and \
                                (n.args[1], n.args[2]) in owner.vocab_ids:
                            out = _embedding_backward(n, self, dm)
                        else:
                            out = super().run_node(n)
                    except NotImplementedError:  # no DTensor rule: a glmc fused op
                        out = _replicated(n, self, dm, owner)
                    except RuntimeError as e:  # DTensor's global strides can differ from
                        if n.target not in _VIEWS or "view" not in str(e):  # the capture's
                            raise
                        args, kwargs = self.fetch_args_kwargs_from_env(n)
                        out = aten.reshape.default(*args, **kwargs)  # copies if it must
                    if mixed and _communicated(gathered, traced):
                        raise PassError(
                            f"tensor_parallel: '{n.name}' ({op_name(n)}) would redistribute a "
                            "weight stored in interleaved parts (a fused gate/up) or a value "
                            "computed from it, which DTensor would read as contiguous blocks; "
                            "pin that weight with plan='name:replicate'")
                    out = owner.lift(out, _sums_only(n))
                if n not in owner.whole[-1:] and _communicated(gathered, traced, GATHER):
                    owner.whole.append(n)  # its rule read a sharded operand whole
                if owner.tokens is not None:
                    out = owner.tokens.settle(n, ins, out)
                    for a, v in back:  # other readers see the sharded value again
                        self.env[a] = v
                if n.op == "placeholder" and owner.state.get(
                        TrainGraph.info(n).target, Tile("", 0)).groups > 1:
                    owner.mark(out)
                elif (mixed and n not in owner.allowed) or \
                        (n in owner.allowed and op_name(n) == "cat"):
                    for v in _leaves(out):  # still interleaved where still sharded
                        if any(isinstance(p, Shard) for p in v.placements):
                            owner.mark(v)
                _carry_meta(n, last, traced, out)
                return out

        whole = [p.meta.get("val") for p in self.graph.placeholders()]
        dts = [_placed(t, dm, pl, w) if isinstance(t, torch.Tensor) else t
               for t, pl, w in zip(local, self.places, whole)]
        outs = Interp(self.gm).run(*dts)
        owner.current = None
        return [o.to_local() if isinstance(o, DTensor) else o for o in self.settle(outs)]

    def lift(self, r: Any, keep: bool = False) -> Any:
        """`r` as the step's value: a partial sum reduced where it is made (unless `keep`),
        over the tokens' blocks under sequence parallelism (a reduce-scatter); a plain tensor
        (a constant made in the step, a mask) replicated."""
        from torch.distributed.tensor import DTensor, Replicate
        from torch.distributed.tensor.placement_types import Partial
        if isinstance(r, DTensor):
            if not keep and any(isinstance(p, Partial) for p in r.placements):
                if self.tokens is not None and self.tokens.shaped(r):
                    r = r.redistribute(self.dm, [self.tokens.place(r)])
                    self.tokens.mark(r)
                    return r
                return r.redistribute(self.dm, [Replicate()])
            return r
        if isinstance(r, torch.Tensor):
            return DTensor.from_local(r, self.dm, [Replicate()], run_check=False)
        if isinstance(r, (tuple, list)):
            return type(r)(self.lift(x, keep) for x in r)
        return r

    def settle(self, outs: list[Any]) -> list[Any]:
        """Each new parameter or state placed as the input it replaces (the runtime writes
        it back into that input's block)."""
        from torch.distributed.tensor import DTensor, Replicate
        where = {spec.target: pl for spec, pl in zip(self.graph.inputs, self.places)}
        settled = []
        for spec, o in zip(self.graph.outputs, outs):
            want = where.get(spec.target) if spec.target else None
            if want is None and spec.kind is OutputKind.SEND and isinstance(o, DTensor):
                want = (Replicate(),)  # a pipeline stage's sent value: the next one's whole
            if isinstance(o, DTensor) and want is not None and tuple(o.placements) != \
                    tuple(want):
                tokens = self.tokens is not None and self.tokens.is_sharded(o)  # not a
                # weight's interleaved parts: blocks of tokens (sequence parallelism)
                if (self.is_interleaved(o) and not tokens) or \
                        self.state.get(spec.target, Tile("", 0)).groups > 1:
                    raise PassError(f"tensor_parallel: the step's new {spec.target} is "
                                    f"{o.placements}, its input {tuple(want)} in interleaved "
                                    "parts; pin the weight with plan='name:replicate'")
                o = o.redistribute(self.dm, list(want))
            settled.append(o)
        return settled


def _carry_meta(n: fx.Node, last: fx.Node, traced: fx.Graph, out: Any) -> None:
    """The nodes traced for `n` (after `last`) carry its metadata; a value it marks (e.g. the
    gradient of a parameter) marks the node that made `out`."""
    from torch.distributed.tensor import DTensor
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot
    made = last.next
    while made is not traced._root:
        if "glmc" in n.meta:
            made.meta[FROM] = n.meta["glmc"]
        made.meta.update({k: n.meta[k] for k in _SOURCE_META
                          if k in n.meta and k not in made.meta})
        made = made.next
    marks = {k: v for k, v in n.meta.items()
             if k.startswith("glmc_") and k not in (FROM, RANK_ARG)}
    if marks and isinstance(out, DTensor):
        made = get_proxy_slot(out._local_tensor, get_proxy_mode().tracer).proxy.node
        made.meta.update(marks)


DROPOUT = aten.native_dropout.default


def _dropout(n: fx.Node, interp: fx.Interpreter, dm: Any) -> Any:
    """`native_dropout` drawing one process's masks: on a sharded value, the whole value's
    mask is drawn (dropout of ones: the same generator calls, shape and order as one
    process, no communication) and each rank keeps its block of it; `x * (mask * scale)` is
    bitwise `x * mask * scale`. A replicated value (a partial sum reduced first) draws as
    one process on every rank. Every rank of the group must hold the same generator state
    (the strategy checks)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    args, kwargs = interp.fetch_args_kwargs_from_env(n)
    x = args[0]
    if not isinstance(x, DTensor):
        return n.target(*args, **kwargs)
    if not all(isinstance(pl, Shard) for pl in x.placements):
        x = x.redistribute(dm, [Replicate()] * len(x.placements))
    if all(isinstance(pl, Replicate) for pl in x.placements):
        outs = n.target(x.to_local(), *args[1:], **kwargs)
        return tuple(DTensor.from_local(t, dm, x.placements, run_check=False) for t in outs)
    (place,) = x.placements
    local = x.to_local()
    scaled, mask = n.target(torch.ones(x.shape, dtype=x.dtype, device=local.device),
                            *args[1:], **kwargs)
    start, size = block_rows(x.shape[place.dim], dm.get_local_rank(), dm.size())
    out = local * scaled.narrow(place.dim, start, size)
    return (_placed(out, dm, [place], scaled),
            _placed(mask.narrow(place.dim, start, size).contiguous(), dm, [place], mask))


def _nll_backward(n: fx.Node, interp: fx.Interpreter) -> Any:
    """`nll_loss_backward` with its `total_weight` as a plain tensor: torch's loss-parallel
    rule divides the local gradient by it (its forward rule's output is a DTensor here)."""
    from torch.distributed.tensor import DTensor
    args, kwargs = interp.fetch_args_kwargs_from_env(n)
    args = list(args)
    if isinstance(args[6], DTensor):
        args[6] = args[6].full_tensor()
    return n.target(*args, **kwargs)


def _leaves(v: Any) -> list[Any]:
    """The DTensors in a value (a tensor, or nested lists and tuples of them)."""
    from torch.distributed.tensor import DTensor
    if isinstance(v, DTensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [x for item in v for x in _leaves(item)]
    if isinstance(v, dict):
        return [x for item in v.values() for x in _leaves(item)]
    return []


GATHER = "all_gather_into_tensor"


def _communicated(last: fx.Node, traced: fx.Graph, kind: str | None = None) -> bool:
    """Whether a collective (of `kind`, or any) was traced after `last`."""
    comm = comm_ops()
    n = last.next
    while n is not traced._root:
        if n.op == "call_function" and n.target in comm and comm[n.target] != "wait_tensor" \
                and kind in (None, comm[n.target]):
            return True
        n = n.next
    return False


#: attention ops computed head by head (inputs and outputs [batch, heads, ...]): with every
#: operand sharded on the heads (Megatron's attention) each rank runs its own heads
_HEADWISE = {aten._scaled_dot_product_flash_attention_for_cpu.default,
             aten._scaled_dot_product_flash_attention_for_cpu_backward.default}


def _replicated(n: fx.Node, interp: fx.Interpreter, dm: Any, owner: _Local) -> Any:
    """`n`, an op without a DTensor sharding rule: on each rank's blocks where that is the
    same computation (a pointwise glmc kernel on equally placed operands; attention on
    operands sharded by heads), else on whole operands (gathered where sharded, reduced where
    partial; recorded in `owner.whole`), the result replicated."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    args, kwargs = interp.fetch_args_kwargs_from_env(n)
    blocks = [a for a in (*args, *kwargs.values()) if isinstance(a, DTensor)]
    place = None
    if op_name(n) in POINTWISE and op_name(n) not in RANDOM_OPS and blocks and \
            len({(a.placements, a.shape) for a in blocks}) == 1:
        place = blocks[0].placements
    elif op_name(n) in _ROWWISE and owner.tokens is not None and \
            owner.tokens.is_sharded(blocks[0] if blocks else None) and \
            all(owner.tokens.is_sharded(a) or (a.placements == (Replicate(),) and a.dim() == 1)
                for a in blocks):
        return _rowwise(n, args, kwargs, dm, owner, blocks[0].placements)
    elif n.target in _HEADWISE and any(a.placements == (Shard(1),) for a in blocks) and \
            all(a.placements == (Shard(1),) or (a.placements == (Replicate(),) and
                                                (a.dim() < 2 or a.shape[1] == 1))
                for a in blocks):  # a mask broadcast over the heads stays whole
        place = (Shard(1),)
    if place is not None:  # each rank's block, placed as its operands
        def block(a: Any) -> Any:
            return a.to_local() if isinstance(a, DTensor) else a
        out = n.target(*fx.node.map_aggregate(args, block),
                       **fx.node.map_aggregate(kwargs, block))
        return fx.node.map_aggregate(out, lambda r: DTensor.from_local(
            r, dm, place, run_check=False) if isinstance(r, torch.Tensor) else r)
    if any(a.placements != (Replicate(),) for a in blocks):
        owner.whole.append(n)

    def whole(a: Any) -> Any:
        return a.redistribute(dm, [Replicate()]).to_local() if isinstance(a, DTensor) else a

    out = n.target(*fx.node.map_aggregate(args, whole), **fx.node.map_aggregate(kwargs, whole))
    return fx.node.map_aggregate(out, lambda r: DTensor.from_local(r, dm, [Replicate()],
                                                                   run_check=False)
                                 if isinstance(r, torch.Tensor) else r)


#: glmc's row-wise kernels -> the placements of their outputs on token-sharded rows: a
#: norm's output and per-row statistics stay on each rank's rows; its weight's gradient is
#: each rank's partial sum
_ROWWISE = {"rms_norm": ("shard", "shard"), "rms_norm_backward": ("shard", "partial")}


def _rowwise(n: fx.Node, args: Any, kwargs: Any, dm: Any, owner: _Local, rows: Any) -> Any:
    """`n` on each rank's rows (`rows`: the token-sharded input's placement)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Partial

    def block(a: Any) -> Any:
        return a.to_local() if isinstance(a, DTensor) else a
    out = n.target(*fx.node.map_aggregate(args, block), **fx.node.map_aggregate(kwargs, block))
    kinds = _ROWWISE[op_name(n)]
    placed = tuple(DTensor.from_local(r, dm, list(rows) if k == "shard" else [Partial()],
                                      run_check=False) for r, k in zip(out, kinds))
    for v, k in zip(placed, kinds):
        if k == "shard":
            owner.tokens.mark(v)
    return placed


#: optimizer ops over lists of tensors, element by element within each index
_FOREACH = {aten._fused_adam.default, aten._fused_adamw.default, aten._fused_adam.tensor_lr,
            aten._fused_adamw.tensor_lr}
#: `_foreach_*` ops that reduce each tensor (not element by element)
_FOREACH_REDUCING = ("_foreach_norm", "_foreach_max")


def _is_foreach_pointwise(n: fx.Node) -> bool:
    """A torch `_foreach_*` op that is elementwise within each index (the unfused optimizers'
    update: `_foreach_mul`, `_foreach_addcdiv`, `_foreach_lerp`, ...)."""
    name = op_name(n)
    return n.op == "call_function" and name.startswith("_foreach_") and \
        not name.startswith(_FOREACH_REDUCING)


def _foreach(n: fx.Node, interp: fx.Interpreter, dm: Any) -> Any:
    """An update over lists of tensors run on each rank's blocks: the i-th tensor of every
    list is placed like the i-th tensor of the first list (a parameter; a gradient sliced to
    a sharded parameter's block); tensors of another shape (step counters, scalars) stay
    whole. None (DTensor's own rules, or whole values) where a list does not line up so.
    Without it, DTensor's rules gather a list whose blocks are uneven (a vocabulary that
    does not divide) and every other tensor of it with them."""
    from torch.distributed.tensor import DTensor, Replicate

    args, kwargs = interp.fetch_args_kwargs_from_env(n)
    lists = [a for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple)) and a and
             all(isinstance(t, DTensor) for t in a)]
    if not lists:
        return None
    params = lists[0]
    places = [p.placements for p in params]
    whole = (Replicate(),) * dm.ndim

    def local(a: Any) -> Any:
        if isinstance(a, (list, tuple)) and len(a) == len(params) and \
                all(isinstance(t, DTensor) for t in a):
            return [t.redistribute(dm, pl).to_local() if t.shape == p.shape else
                    t.redistribute(dm, whole).to_local()  # step counters stay whole
                    for t, p, pl in zip(a, params, places)]
        if isinstance(a, (list, tuple)) and any(isinstance(t, DTensor) for t in a):
            raise _Unaligned
        return a.redistribute(dm, whole).to_local() if isinstance(a, DTensor) else a

    try:
        out = n.target(*[local(a) for a in args], **{k: local(v) for k, v in kwargs.items()})
    except _Unaligned:
        return None
    if out is None or not isinstance(out, (list, tuple)):
        return out
    if n.target in _FOREACH:  # a tuple of lists
        return tuple([_placed(t, dm, pl, p) for t, pl, p in zip(lst, places, params)]
                     for lst in out)
    return [_placed(t, dm, pl, p) for t, pl, p in zip(out, places, params)]


class _Unaligned(Exception):
    """A list of tensors `_foreach` cannot place index by index."""


def _placed(local: torch.Tensor, dm: Any, placements: Any, whole: Any) -> Any:
    """`local` as a DTensor of `whole`'s global shape (a block of a vocabulary that does not
    divide: DTensor would take the global extent as tp x this block's)."""
    from torch.distributed.tensor import DTensor
    shape = whole.shape if isinstance(whole, torch.Tensor) else whole
    if shape is None or all(not hasattr(p, "dim") for p in placements):
        return DTensor.from_local(local, dm, placements, run_check=False)
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))  # contiguous
    return DTensor.from_local(local, dm, placements, run_check=False,
                              shape=torch.Size(shape), stride=stride)


_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


def _sums_only(n: fx.Node) -> bool:
    """Whether every use of `n` (through views) is an `add`: a partial sum may stay partial."""
    return bool(n.users) and all(u.target is aten.add.Tensor or
                                 (u.target in _VIEWS and _sums_only(u)) for u in n.users)


def _local_split(n: fx.Node, interp: fx.Interpreter, dm: Any,
                 allowed: dict[fx.Node, int]) -> Any:
    """A split or cat along a sharded dim into/from equal parts (an interleaved fused
    weight's output and its gradient) done shard by shard; None for any other node."""
    from torch.distributed.tensor import DTensor, Shard

    if n.op != "call_function" or op_name(n) not in ("split", "split_with_sizes", "cat"):
        return None
    args = interp.map_nodes_to_values(n.args, n)
    if op_name(n) == "cat":
        parts, dim = args[0], (args[1] if len(args) > 1 else 0)
        # torch.cat skips 1-D empty tensors (a KV cache's initial value); DTensor cannot
        # place one beside a sharded part
        kept = [p for p in parts if not (p.dim() == 1 and p.numel() == 0)]
        if len(kept) == 1 and len(parts) > 1 and isinstance(kept[0], DTensor):
            return kept[0]
    if n not in allowed:
        return None
    if op_name(n) == "cat":
        if not parts or not all(isinstance(p, DTensor) for p in parts):
            return None
        dim = dim % parts[0].dim()
        if len({p.shape[dim] for p in parts}) != 1 or len(parts) != allowed[n] or \
                not all(p.placements == (Shard(dim),) for p in parts):
            return None
        local = torch.cat([p.to_local() for p in parts], dim)
        return DTensor.from_local(local, dm, [Shard(dim)], run_check=False)
    x, sizes = args[0], args[1]
    dim = (args[2] if len(args) > 2 else 0) % x.dim() if isinstance(x, DTensor) else 0
    if not isinstance(x, DTensor) or x.placements != (Shard(dim),):
        return None
    total = x.shape[dim]
    count = total // sizes if isinstance(sizes, int) else len(sizes)
    if (isinstance(sizes, int) and total % sizes) or count != allowed[n] or \
            (not isinstance(sizes, int) and len(set(sizes)) != 1):
        return None
    pieces = torch.chunk(x.to_local(), count, dim)
    return [DTensor.from_local(p, dm, [Shard(dim)], run_check=False) for p in pieces]


# ---- the traced program becomes the step ------------------------------------------------------

def _price_collectives(graph: TrainGraph, size: int, link: str) -> None:
    """Each forward collective carries its predicted seconds on `link` (`REGATHER_S`): the
    recompute pass, choosing what to make again, then prices issuing it again in the
    backward. Unpriced, a collective looked free, and the pass at `selective` made 7
    all-reduces of a 4-layer Llama again (5 ms predicted for a backward 80 ms slower on
    gloo)."""
    from glmc.analysis.comm import collective_seconds, get_link
    from glmc.analysis.opcost import value_bytes
    wire = get_link(link or "nvlink4")
    comm = comm_ops()
    for n in graph.compute_nodes():
        kind = comm.get(n.target)
        if kind in (None, "wait_tensor") or graph.info(n).phase is not Phase.FORWARD:
            continue
        full = max([value_bytes(n.meta.get("val"))] +
                   [value_bytes(a.meta.get("val")) for a in n.all_input_nodes])
        n.meta[REGATHER_S] = collective_seconds(kind, full, size, wire)


def _adopt(graph: TrainGraph, traced: fx.GraphModule, mesh: MeshSpec, plan: TpPlan) -> None:
    """`graph` becomes `traced`: same signature, each node with the metadata of the node it was
    traced from (spec from its value, placements on inputs), collectives rebound to 'tp'."""
    from torch.distributed.tensor import Replicate, Shard

    old = {TrainGraph.info(p).target: p for p in graph.placeholders()}
    comm = comm_ops()
    size = mesh.size(TP)
    new_phs = [n for n in traced.graph.nodes if n.op == "placeholder"]
    for ph, spec in zip(new_phs, graph.inputs):
        info = TrainGraph.info(old[spec.target])
        tile = plan.tiles.get(spec.target)
        local = TensorSpec.of(ph.meta.get("val"))
        placements = _on_tp(mesh, Shard(tile.dim) if tile else Replicate())
        ph.meta["glmc"] = info.replace(
            spec=dataclasses.replace(local, placements=placements) if local else None,
            created_by="tensor_parallel" if tile else info.created_by)
    for n in traced.graph.nodes:
        if n.op != "call_function":
            continue
        base: NodeInfo | None = n.meta.pop(FROM, None)
        if base is None:
            base = _nearest(n)
        spec = TensorSpec.of(n.meta.get("val"))
        kind = comm.get(n.target)
        # the random op traced for a random op keeps its site (recompute replays it)
        info = base.replace(spec=spec, created_by=base.created_by,
                            rng=base.rng if op_name(n) in RANDOM_OPS else None)
        if kind is not None:
            reduce_op = n.args[1] if kind in ("all_reduce", "reduce_scatter_tensor") else None
            info = info.replace(comm=CommInfo(kind, TP, reduce_op, size),
                                created_by="tensor_parallel")
            if kind != "wait_tensor":
                n.args = (*n.args[:-1], UNBOUND + TP)
        n.meta["glmc"] = info
    for n in traced.graph.nodes:  # placements of collective results for the verifier
        info = n.meta.get("glmc")
        if n.op == "call_function" and info is not None and info.comm is not None \
                and info.spec is not None:
            src = n.args[0].meta.get("glmc") if info.comm.collective == "wait_tensor" else None
            placements = src.spec.placements if src is not None and src.spec is not None \
                else _after(info.comm.collective, mesh)  # a wait keeps its collective's
            n.meta["glmc"] = info.replace(spec=dataclasses.replace(info.spec,
                                                                   placements=placements))
        elif n.op == "call_function" and info is not None and info.spec is not None:
            n.meta["glmc"] = info.replace(spec=dataclasses.replace(info.spec, placements=None))
    for n in traced.graph.nodes:  # collective inputs carry the placement the collective reads
        info = n.meta.get("glmc")
        if n.op == "call_function" and info is not None and info.comm is not None and \
                info.comm.collective != "wait_tensor":
            src = n.args[0]
            sinfo = src.meta.get("glmc")
            if sinfo is not None and sinfo.spec is not None and src.op != "placeholder":
                src.meta["glmc"] = sinfo.replace(spec=dataclasses.replace(
                    sinfo.spec, placements=_before(info.comm, mesh)))
    _settle_views(traced.graph)
    traced.recompile()
    graph.gm = traced


def _settle_views(g: fx.Graph) -> None:
    """The views DTensor traces between local blocks (`from_local`/`to_local`): one that
    keeps the shape goes, its marks (a gradient's) moved to its source, so that a later pass
    (ZeRO's shard) reshaping a state and its update finds no literal shape; a view of an
    input is in the phase of its readers (an optimizer state's in the update)."""
    for n in list(g.nodes):
        if n.op != "call_function" or n.target not in _VIEWS:
            continue
        src = n.args[0]
        if "val" in src.meta and "val" in n.meta and \
                src.meta["val"].shape == n.meta["val"].shape:
            src.meta.update({k: v for k, v in n.meta.items()
                             if k.startswith("glmc_") and k != RANK_ARG and k not in src.meta})
            n.replace_all_uses_with(src)
            g.erase_node(n)
            continue
        if not n.users or any(a.op != "placeholder" for a in n.all_input_nodes):
            continue
        phases = {TrainGraph.info(u).phase for u in n.users}
        if len(phases) == 1 and (phase := phases.pop()) is not TrainGraph.info(n).phase:
            role = TrainGraph.info(next(iter(n.users))).role
            n.meta["glmc"] = TrainGraph.info(n).replace(phase=phase, role=role)


def _on_tp(mesh: MeshSpec, placement: Any) -> tuple:
    """`placement` on the mesh dim "tp", `Replicate()` on the others (a data-parallel dim)."""
    from torch.distributed.tensor import Replicate
    return tuple(placement if d == TP else Replicate() for d in mesh.dim_names)


def _after(kind: str, mesh: MeshSpec) -> tuple:
    from torch.distributed.tensor import Replicate, Shard
    return _on_tp(mesh, Shard(0) if kind == "reduce_scatter_tensor" else Replicate())


def _before(comm: CommInfo, mesh: MeshSpec) -> tuple:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import Partial
    return _on_tp(mesh, Shard(0) if comm.collective == "all_gather_into_tensor" else
                  Partial(comm.reduce_op))


def _nearest(n: fx.Node) -> NodeInfo:
    """Metadata for a traced node that carries none: its nearest annotated input's."""
    stack = list(n.all_input_nodes)
    seen: set[fx.Node] = set()
    while stack:
        a = stack.pop(0)
        if a in seen:
            continue
        seen.add(a)
        info = a.meta.get("glmc")
        if info is not None:
            phase = Phase.FORWARD if info.phase is Phase.INPUT else info.phase
            return NodeInfo(phase, Role.ACTIVATION if info.phase is Phase.INPUT else info.role,
                            created_by="tensor_parallel")
        stack.extend(a.all_input_nodes)
    return NodeInfo(Phase.FORWARD, Role.ACTIVATION, created_by="tensor_parallel")


def _stats(graph: TrainGraph, plan: TpPlan, size: int,
           whole: dict[str, tuple[int, ...]]) -> TensorParallelStats:
    counts: dict[str, int] = {}
    volume: dict[str, int] = {}
    for n in graph.compute_nodes():
        comm = TrainGraph.info(n).comm
        if comm is None or comm.collective == "wait_tensor":
            continue
        counts[comm.collective] = counts.get(comm.collective, 0) + 1
        spec = TrainGraph.info(n.args[0]).spec
        volume[comm.collective] = volume.get(comm.collective, 0) + (spec.nbytes if spec else 0)
    params = [(TrainGraph.info(p).target, TrainGraph.info(p).spec) for p in graph.placeholders()
              if TrainGraph.info(p).role is Role.PARAMETER]
    largest = sorted(params, key=lambda t: -math.prod(whole.get(t[0], t[1].shape)))
    shown = {name: (f"{plan.tiles[name].kind} Shard({plan.tiles[name].dim})"
                    + (f" x{plan.tiles[name].groups} parts" if plan.tiles[name].groups > 1
                       else "")) if name in plan.tiles else "Replicate"
             for name, _ in largest[:8]}
    tensors = tuple((name, str(tuple(whole.get(name, spec.shape))), str(tuple(spec.shape)),
                     shown[name]) for name, spec in largest[:8])
    kinds = [t.kind for name, t in plan.tiles.items() if ":" not in name and
             not name.endswith(".bias")]
    return TensorParallelStats(size, kinds.count("column"), kinds.count("row"),
                               len(params) - sum(1 for n in plan.tiles if ":" not in n),
                               counts, volume, shown, tensors=tensors)
