"""Programs that span devices: an SPMD step over a device mesh, and a pipeline of stages.

Plumbing only: the IR says *where* values live and *what* crosses devices; later passes decide
sharding and schedules. torch's vocabulary throughout: DTensor placements (`Replicate()`,
`Shard(d)`, `Partial(op)`) on `TensorSpec.placements`; communication nodes are torch's
functional collectives (`torch.ops._c10d_functional.*`), each read through a `wait_tensor`.

* `SpmdProgram` — one `TrainGraph` every rank runs, plus the `MeshSpec` it runs on. A
  collective names a mesh *dim* (`CommInfo.mesh_dim`); its process-group argument is bound at
  run time (`bind_mesh`), so a program is not tied to one process:

      before:  g = mm(...)                                  ; new_w = sub(w, mul(lr, g))
      after:   g = mm(...)                                  # Partial(avg) on dp
               r = all_reduce(g, "avg", "glmc-unbound:dp")  # CommInfo(all_reduce, dp, avg)
               gw = wait_tensor(r)                          # Replicate() on dp
               new_w = sub(w, mul(lr, gw))

* `StagedProgram` — one `Stage` per pipeline stage, each three graphs (forward F, backward B,
  optimizer update), explicit `Boundary` values between stages (activations forward, their
  gradients back), and a schedule as data (`glmc.planning.schedule`), run by one generic
  executor (`glmc.parallel.executor`). Stage capture is `glmc.trace.stages`; running a step in
  place is `glmc.compiler.inplace`.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, Sequence

import torch
import torch.fx as fx

from glmc.errors import ConfigError, PassError
from glmc.ir.graph import (RANK_ARG, CommInfo, InputSpec, MeshSpec, NodeInfo, OutputKind, Phase,
                           Role, TensorSpec, TrainGraph, comm_ops, is_collective, op_name)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.placement_types import Placement



class ScheduleLike(Protocol):
    """What a StagedProgram needs of its schedule (`glmc.planning.schedule.Schedule` is one). A
    protocol, not an import: glmc.planning.schedule imports this module."""

    num_microbatches: int

    def verify(self, num_stages: int, links: Any) -> None: ...

    def rank_of(self, stage: int) -> int: ...


#: the process-group argument of a collective before `bind_mesh`: this prefix + the mesh dim
UNBOUND = "glmc-unbound:"


@dataclass(frozen=True)
class _Collective:
    """How one functional collective reads and writes placements on its mesh dim."""

    src: Callable[[str | None], "Placement"]  #: what the input must be (given the reduce op)
    dst: Callable[[], "Placement"]  #: what the output is
    local_shape: Callable[[tuple[int, ...], int], tuple[int, ...]]  #: (shape, group size)
    args: Callable[[str | None, int, str], tuple]  #: (reduce op, group size, group) -> args


def _collectives() -> dict[str, _Collective]:
    from torch.distributed.tensor import Partial, Replicate, Shard

    def scatter(s: tuple[int, ...], n: int) -> tuple[int, ...]:
        return (s[0] // n, *s[1:])

    def gather(s: tuple[int, ...], n: int) -> tuple[int, ...]:
        return (s[0] * n, *s[1:])

    return {  # functional reduce_scatter / all_gather work on dim 0
        "all_reduce": _Collective(lambda op: Partial(op), Replicate, lambda s, n: s,
                                  lambda op, n, g: (op, g)),
        "reduce_scatter_tensor": _Collective(lambda op: Partial(op), lambda: Shard(0), scatter,
                                             lambda op, n, g: (op, n, g)),
        "all_gather_into_tensor": _Collective(lambda op: Shard(0), Replicate, gather,
                                              lambda op, n, g: (n, g)),
    }


def _op(name: str) -> Any:
    return next(op for op, n in comm_ops().items() if n == name)


def _placements(spec: TensorSpec | None, mesh: MeshSpec) -> "tuple[Placement, ...]":
    from torch.distributed.tensor import Replicate

    if spec is not None and spec.placements is not None:
        return tuple(spec.placements)
    return tuple(Replicate() for _ in mesh.shape)


def insert_collective(graph: TrainGraph, value: fx.Node, collective: str, mesh: MeshSpec,
                      mesh_dim: str, reduce_op: str | None = None,
                      readers: Iterable[fx.Node] | None = None) -> fx.Node:
    """Communicate `value` over `mesh_dim` right after it is computed: inserts the collective
    and its `wait_tensor`, points `readers` (default: every reader of `value`) at the wait, and
    returns the wait. Both new nodes get `value`'s phase and role, a spec with placements, a
    `CommInfo` and `meta["val"]`; `value` is marked with the placement the collective expects
    (`Partial(reduce_op)` or `Shard(0)`) where it has none. The group argument stays unbound
    (`UNBOUND + mesh_dim`) until `bind_mesh`."""
    table = _collectives()
    if collective not in table:
        raise PassError(f"program: unknown collective {collective!r}; known: {sorted(table)}")
    if (reduce_op is None) != (collective == "all_gather_into_tensor"):
        raise PassError(f"program: {collective} {'needs' if reduce_op is None else 'takes no'} "
                        "reduce_op")
    rule, dims, size = table[collective], mesh.dims(mesh_dim), mesh.size(mesh_dim)
    readers = list(value.users) if readers is None else list(readers)
    src = _mark_source(value, rule.src(reduce_op), mesh, dims)
    dst = tuple(rule.dst() if k in dims else p for k, p in enumerate(src))
    g = graph.graph
    with g.inserting_after(value):
        coll = g.call_function(_op(collective),
                               (value, *rule.args(reduce_op, size, UNBOUND + mesh_dim)))
    with g.inserting_after(coll):
        wait = g.call_function(_op("wait_tensor"), (coll,))
    spec = TrainGraph.info(value).spec
    shape = rule.local_shape(spec.shape, size) if spec is not None else None
    _annotate_comm(coll, value, shape, dst, CommInfo(collective, mesh_dim, reduce_op, size))
    _annotate_comm(wait, value, shape, dst, CommInfo("wait_tensor", mesh_dim, None, size))
    for r in readers:
        r.replace_input_with(value, wait)
    return wait


def _mark_source(value: fx.Node, want: "Placement", mesh: MeshSpec,
                 dims: tuple[int, ...]) -> tuple:
    """`value`'s placements, after giving it `want` on mesh dims `dims` if it had none;
    raises if it has another placement there."""
    info = TrainGraph.info(value)
    src = list(_placements(info.spec, mesh))
    if info.spec is None:
        return tuple(src)
    if info.spec.placements is not None:
        for i in dims:
            if src[i] != want:
                raise PassError(f"program: the collective over {mesh.dim_names[i]!r} needs "
                                f"{want!r} there; '{value.name}' is {_fmt(src)}")
        return tuple(src)
    for i in dims:
        src[i] = want
    value.meta["glmc"] = info.replace(spec=dataclasses.replace(info.spec, placements=tuple(src)))
    return tuple(src)


def _annotate_comm(node: fx.Node, value: fx.Node, shape: tuple[int, ...] | None,
                   placements: tuple, comm: CommInfo) -> None:
    info = TrainGraph.info(value)
    val = value.meta.get("val")
    if isinstance(val, torch.Tensor) and shape is not None:
        node.meta["val"] = val.new_empty(shape)
    spec = None
    if info.spec is not None and shape is not None:
        spec = TensorSpec(shape, info.spec.dtype, info.spec.device, placements)
    node.meta["glmc"] = NodeInfo(info.phase, info.role, spec, source=info.source,
                                 module=info.module, created_by="insert_collective",
                                 comm=comm, stage=info.stage)


class NodeBuilder:
    """Creates typed nodes in `graph` for a pass: each gets its fake value (the op run on its
    arguments' fake values) and a NodeInfo (phase, role, spec, the source line of `like`)."""

    def __init__(self, graph: TrainGraph, created_by: str) -> None:
        from torch._guards import detect_fake_mode

        self.graph, self.created_by = graph, created_by
        vals = [n.meta["val"] for n in graph.graph.nodes
                if isinstance(n.meta.get("val"), torch.Tensor)]
        self.fake = detect_fake_mode(vals)
        if self.fake is None:
            raise PassError(f"{created_by}: the step's nodes carry no fake values to build from")

    def __call__(self, op: Any, args: tuple, phase: Phase, role: Role,
                 kwargs: dict | None = None, like: fx.Node | None = None) -> fx.Node:
        """A new node at the graph's current insertion point."""
        kwargs = kwargs or {}
        node = self.graph.graph.call_function(op, args, kwargs)
        vals = fx.map_arg((args, kwargs), lambda a: a.meta["val"])
        with self.fake:
            node.meta["val"] = op(*vals[0], **vals[1])
        src = TrainGraph.info(like) if like is not None else None
        node.meta["glmc"] = NodeInfo(phase, role, TensorSpec.of(node.meta["val"]),
                                     source=src.source if src else None,
                                     module=src.module if src else None,
                                     created_by=self.created_by)
        return node

    def input(self, target: str, role: Role, shape: Sequence[int], dtype: torch.dtype,
              device: Any) -> fx.Node:
        """A new step input, after the last placeholder and last in `graph.inputs`."""
        g = self.graph.graph
        with g.inserting_after(self.graph.placeholders()[-1]):
            ph = g.placeholder(target.replace(":", "_").replace(".", "_"))
        with self.fake:
            ph.meta["val"] = torch.empty(tuple(shape), dtype=dtype, device=device)
        ph.meta["glmc"] = NodeInfo(Phase.INPUT, role, TensorSpec.of(ph.meta["val"]),
                                   target=target, created_by=self.created_by)
        self.graph.inputs.append(InputSpec(role, target))
        return ph


def restore_topological_order(graph: TrainGraph) -> None:
    """Move nodes that now read a value defined after them (a rewrite pointed an early reader
    at a late value) to after it, keeping every other node where it was: the stable
    topological order (lexicographic by the current position)."""
    import networkx as nx
    nodes = list(graph.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    dag = nx.DiGraph()
    dag.add_nodes_from(nodes)
    dag.add_edges_from((a, n) for n in nodes for a in n.all_input_nodes)
    order = list(nx.lexicographical_topological_sort(dag, key=index.__getitem__))
    if order == nodes:
        return
    cursor = order[0]
    for n in order[1:]:
        cursor.append(n)
        cursor = n


def update_gradients(graph: TrainGraph) -> list[fx.Node]:
    """The backward values the optimizer update reads (the gradients), in graph order."""
    def reads_in_update(n: fx.Node) -> bool:
        return any(u.op == "call_function" and TrainGraph.info(u).phase is Phase.OPTIMIZER
                   for u in n.users)
    return [n for n in graph.compute_nodes()
            if TrainGraph.info(n).phase is Phase.BACKWARD and reads_in_update(n)]


def all_reduce_gradients(graph: TrainGraph, mesh: MeshSpec, mesh_dim: str,
                         reduce_op: str = "avg") -> list[fx.Node]:
    """Data parallelism by hand: all-reduce every gradient over `mesh_dim` before the update
    reads it. Returns the waits."""
    waits = []
    for grad in update_gradients(graph):
        readers = [u for u in grad.users if TrainGraph.info(u).phase is Phase.OPTIMIZER]
        waits.append(insert_collective(graph, grad, "all_reduce", mesh, mesh_dim, reduce_op,
                                       readers))
    graph.gm.recompile()
    return waits


def comm_nodes(graph: TrainGraph) -> list[fx.Node]:
    """Every communication node (collectives and waits), in program order."""
    return [n for n in graph.compute_nodes() if n.target in comm_ops()
            or TrainGraph.info(n).comm is not None]


def bind_mesh(graph: TrainGraph, mesh: "DeviceMesh", spec: MeshSpec | None = None
              ) -> TrainGraph:
    """A copy of `graph` whose collectives name `mesh`'s process groups (from
    `mesh.get_group(dim).group_name`, a flattened dim's too) and whose rank arguments
    (`RANK_ARG`) hold this process's mesh coordinates; `graph` itself stays unbound. `spec`:
    the mesh's spec with its flattened dims (default: `MeshSpec.of(mesh)`)."""
    spec = spec or MeshSpec.of(mesh)
    bound = graph.copy()
    for n in bound.compute_nodes():
        if RANK_ARG in n.meta:  # this process's coordinate on a mesh dim
            dim, k = n.meta[RANK_ARG]
            n.args = (*n.args[:k], mesh.get_local_rank(dim), *n.args[k + 1:])
        _bind_collective(n, mesh, spec)
    # collectives inside submodule graphs (a `cond`'s branches): the bound step gets its own
    # copies of those submodules
    for name, sub in list(bound.gm.named_children()):
        if isinstance(sub, fx.GraphModule) and any(is_collective(n) for n in sub.graph.nodes):
            sub = copy.deepcopy(sub)
            for n in sub.graph.nodes:
                _bind_collective(n, mesh, spec)
            sub.recompile()
            setattr(bound.gm, name, sub)
    bound.gm.recompile()
    return bound


def _bind_collective(n: fx.Node, mesh: "DeviceMesh", spec: MeshSpec) -> None:
    """A collective node `n` names the process group of its mesh dim (anything else stays)."""
    info = n.meta.get("glmc")
    comm = info.comm if info is not None else None
    if comm is None or not is_collective(n):
        return
    group = mesh.get_group(comm.mesh_dim)
    if spec.size(comm.mesh_dim) != group.size():
        raise PassError(f"program: mesh dim {comm.mesh_dim!r} has {spec.size(comm.mesh_dim)}"
                        f" ranks but its group has {group.size()}")
    n.args = (*n.args[:-1], group.group_name)


@dataclass
class SpmdProgram:
    """One step every rank of `mesh` runs on its own data; collectives are its only
    communication. `verify()` guarantees every communication node has a `CommInfo` naming a
    known mesh dim, every collective is read only through its own wait, and placements follow
    the collective (e.g. all_reduce: Partial(op) -> Replicate on its dim)."""

    graph: TrainGraph
    mesh: MeshSpec

    def verify(self) -> None:
        self.graph.verify()
        for n in comm_nodes(self.graph):
            _verify_comm(n, self.mesh)

    def bind(self, mesh: "DeviceMesh") -> TrainGraph:
        """The runnable step for this process (see `bind_mesh`); `mesh` must match."""
        if MeshSpec.of(mesh) != self.mesh:
            raise ConfigError(f"program: the DeviceMesh {MeshSpec.of(mesh)} differs from the "
                              f"program's {self.mesh}")
        return bind_mesh(self.graph, mesh)

    def code(self) -> str:
        """The step's Python, headed by the mesh and one line per communication node."""
        mesh = ", ".join(f"{d}={n}" for d, n in zip(self.mesh.dim_names, self.mesh.shape))
        lines = [f"# SPMD program on mesh ({mesh}) of {self.mesh.device_type}",
                 "# communication:"]
        lines += [f"#   {_describe_comm(n)}" for n in comm_nodes(self.graph)]
        return "\n".join(lines) + "\n" + self.graph.code()

    __str__ = code


def _describe_comm(n: fx.Node) -> str:
    """"w = wait_tensor(r) over 'dp': (Replicate()) -> (Replicate())"."""
    info, comm = TrainGraph.info(n), TrainGraph.info(n).comm
    if comm is None:
        return f"{n.name} = {op_name(n)}(...) WITHOUT CommInfo"
    src = n.args[0] if isinstance(n.args[0], fx.Node) else None
    before = TrainGraph.info(src).spec if src is not None else None
    reduce = f", {comm.reduce_op}" if comm.reduce_op else ""
    return (f"{n.name} = {comm.collective}({src}{reduce}) over {comm.mesh_dim!r}: "
            f"{_fmt(before and before.placements)} -> {_fmt(info.spec and info.spec.placements)}")


def _fmt(placements: Any) -> str:
    return "single-device" if placements is None else "(" + ", ".join(map(repr, placements)) + ")"


def _verify_comm(n: fx.Node, mesh: MeshSpec) -> None:
    info, name = TrainGraph.info(n), comm_ops().get(n.target)
    where = f"program: communication node '{n.name}'"
    if info.comm is None or name != info.comm.collective:
        raise PassError(f"{where} ({op_name(n)}) needs CommInfo({name!r}, mesh_dim, reduce_op)")
    mesh.dims(info.comm.mesh_dim)  # raises on an unknown dim
    placements = info.spec.placements if info.spec is not None else None
    if placements is None or len(placements) != mesh.ndim:
        raise PassError(f"{where} needs placements, one per mesh dim ({mesh.ndim})")
    src = n.args[0]
    src_info = TrainGraph.info(src) if isinstance(src, fx.Node) else None
    if name == "wait_tensor":
        if src_info is None or src_info.comm is None or src_info.spec != info.spec:
            raise PassError(f"{where}: a wait must read a collective and keep its spec")
        return
    readers = list(n.users)
    if len(readers) != 1 or comm_ops().get(readers[0].target) != "wait_tensor":
        raise PassError(f"{where} must be read by exactly one wait_tensor, not {readers}")
    if name != "all_reduce" and n.args[-2] != mesh.size(info.comm.mesh_dim):
        raise PassError(f"{where}: group size {n.args[-2]} differs from mesh dim "
                        f"{info.comm.mesh_dim!r}'s {mesh.size(info.comm.mesh_dim)}")
    before = src_info.spec.placements if src_info and src_info.spec else None
    _verify_transition(where, _collectives()[name], info.comm, mesh, before, placements)


def _verify_transition(where: str, rule: _Collective, comm: CommInfo, mesh: MeshSpec,
                       before: tuple | None, after: tuple) -> None:
    """On its mesh dim the collective turns `rule.src` into `rule.dst`; other dims keep."""
    dims = mesh.dims(comm.mesh_dim)
    want = rule.src(comm.reduce_op)
    if before is not None and (any(before[i] != want for i in dims)
                               or len(before) != len(after)):
        raise PassError(f"{where}: input is {_fmt(before)}, {comm.collective} over "
                        f"{comm.mesh_dim!r} needs {want!r} there")
    expected = tuple(rule.dst() if k in dims else p for k, p in enumerate(before or after))
    if after != expected:
        raise PassError(f"{where}: output is {_fmt(after)}, expected {_fmt(expected)}")


@dataclass(frozen=True)
class Boundary:
    """A value that crosses from stage `src_stage` to `dst_stage` once per microbatch: a
    forward activation (src < dst, F to F) or its gradient (src > dst, B to B). `spec` is one
    microbatch's value."""

    name: str
    src_stage: int
    dst_stage: int
    spec: TensorSpec

    @property
    def is_gradient(self) -> bool:
        return self.src_stage > self.dst_stage


@dataclass(frozen=True)
class Stage:
    """One pipeline stage as three graphs, one per action kind:

    forward   params, batch leaves, received activations -> sent activations | loss, saved
    backward  saved, cotangents (received gradients; the loss seed `(GRADIENT, "")`)
                                          -> parameter gradients, sent input gradients
    update    params, accumulated gradients, lr, optimizer state -> new params, new state
    """

    index: int
    forward: TrainGraph
    backward: TrainGraph
    update: TrainGraph
    #: the backward as I (input gradients; stashes what W needs) and W (parameter gradients),
    #: for zero-bubble schedules (`split_backward`); None until split
    split: tuple[TrainGraph, TrainGraph] | None = None

    def graphs(self) -> dict[Phase, TrainGraph]:
        return {Phase.FORWARD: self.forward, Phase.BACKWARD: self.backward,
                Phase.OPTIMIZER: self.update}


@dataclass
class StagedProgram:
    """A pipeline: stages, the boundary values between them, and a schedule (data; see
    `glmc.schedule`). `verify()` guarantees every stage graph is well formed, every sent value
    is received by exactly one stage with the same spec (and vice versa), and the schedule is
    acyclic and runs every stage's F and B for every microbatch and its update once.

    `shared`: parameters that several stages read (tied input and output embeddings cut
    apart), each as its ((stage, parameter name), ...) in those stages. Each stage holds a
    copy and updates it; the copies stay equal because every stage's update gets the *sum* of
    their gradients (`glmc.parallel.executor.run_rank` asks its `reduce_grads` to form it)."""

    stages: tuple[Stage, ...]
    boundaries: tuple[Boundary, ...]
    schedule: ScheduleLike
    shared: tuple[tuple[tuple[int, str], ...], ...] = ()

    def links(self) -> set[tuple[int, int]]:
        """(sender, receiver) stage pairs of forward activations."""
        return {(b.src_stage, b.dst_stage) for b in self.boundaries if not b.is_gradient}

    def verify(self) -> None:
        if [s.index for s in self.stages] != list(range(len(self.stages))):
            raise PassError("program: stages must be numbered 0, 1, ... in order")
        for stage in self.stages:
            for graph in stage.graphs().values():
                graph.verify()
        sends, recvs = _endpoints(self.stages)
        names = [b.name for b in self.boundaries]
        if len(set(names)) != len(names) or set(names) != set(sends) or set(names) != set(recvs):
            raise PassError(f"program: boundaries {sorted(names)} must name each sent value "
                            f"{sorted(sends)} and received value {sorted(recvs)} exactly once")
        for b in self.boundaries:
            _verify_boundary(b, sends[b.name], recvs[b.name])
        self._verify_shared()
        self.schedule.verify(len(self.stages), self.links())

    def _verify_shared(self) -> None:
        """Each shared parameter: a parameter input of 2+ different stages, of one spec, its
        stages on different ranks (two stages of one process would update one tensor twice)."""
        for copies in self.shared:
            specs = []
            for s, name in copies:
                if not 0 <= s < len(self.stages):
                    raise PassError(f"program: shared parameter {copies}: no stage {s}")
                fw = self.stages[s].forward
                ph = next((n for i, n in zip(fw.inputs, fw.placeholders())
                           if i.role is Role.PARAMETER and i.target == name), None)
                if ph is None:
                    raise PassError(f"program: shared parameter {copies}: stage {s} has no "
                                    f"parameter {name!r}")
                specs.append((tuple(ph.meta["val"].shape), ph.meta["val"].dtype))
            stages = [s for s, _ in copies]
            if len(set(stages)) < 2 or len(set(specs)) != 1:
                raise PassError(f"program: shared parameter {copies} must name one shape and "
                                "dtype in two or more different stages")
            ranks = [self.schedule.rank_of(s) for s in stages]
            if len(set(ranks)) != len(ranks):
                raise ConfigError(f"pipeline: stages {stages} share the parameter "
                                  f"{copies[0][1]!r} (tied weights) and would run on one rank "
                                  f"(ranks {ranks}); a rank cannot hold two copies of one "
                                  "tensor — choose a cut or schedule that puts them on "
                                  "different ranks")

    def code(self) -> str:
        """The boundaries, every stage's graphs with their typed signatures, the schedule."""
        lines = [f"# staged program: {len(self.stages)} stages, "
                 f"{self.schedule.num_microbatches} microbatches", "# boundaries:"]
        for b in self.boundaries:
            lines.append(f"#   {b.name}: stage {b.src_stage} -> stage {b.dst_stage} "
                         f"{'(gradient) ' if b.is_gradient else ''}{list(b.spec.shape)} "
                         f"{str(b.spec.dtype)[6:]}")
        for copies in self.shared:
            lines.append("# shared parameter (gradients summed before each update): "
                         + " = ".join(f"stage {s} {n}" for s, n in copies))
        for stage in self.stages:
            for phase, graph in stage.graphs().items():
                lines.append(f"# ---- stage {stage.index}: {_LABEL[phase]} ----")
                lines.append(_signature_code(graph))
        lines.append(str(self.schedule))
        return "\n".join(lines)

    __str__ = code


_LABEL = {Phase.FORWARD: "forward (F)", Phase.BACKWARD: "backward (B)",
          Phase.OPTIMIZER: "update (UPDATE)"}


def _signature_code(graph: TrainGraph) -> str:
    lines = [f"#   in  {ph.name}: {s.role.value} {s.target!r}"
             for ph, s in zip(graph.placeholders(), graph.inputs)]
    lines += [f"#   out {s.kind.value} {s.target!r}" for s in graph.outputs]
    return "\n".join(lines + [graph.code().strip("\n")])


def _endpoints(stages: Sequence[Stage]) -> tuple[dict, dict]:
    """name -> (stage, phase, spec) of every sent output and every received input."""
    sends: dict[str, tuple[int, Phase, TensorSpec | None]] = {}
    recvs: dict[str, tuple[int, Phase, TensorSpec | None]] = {}
    for stage in stages:
        for phase, graph in stage.graphs().items():
            ends = [(sends, o.target, v) for o, v in zip(graph.outputs, graph.output_values())
                    if o.kind is OutputKind.SEND]
            ends += [(recvs, i.target, ph) for i, ph in zip(graph.inputs, graph.placeholders())
                     if i.role is Role.BOUNDARY]
            for table, name, node in ends:
                if name in table:
                    raise PassError(f"program: two stages send or receive {name!r}; a boundary "
                                    "value has one sender and one receiver")
                table[name] = (stage.index, phase, TrainGraph.info(node).spec)
    return sends, recvs


def _verify_boundary(b: Boundary, send: tuple, recv: tuple) -> None:
    phase = Phase.BACKWARD if b.is_gradient else Phase.FORWARD
    for (stage, ph, spec), want, side in ((send, b.src_stage, "sent"),
                                          (recv, b.dst_stage, "received")):
        if stage != want or ph is not phase:
            raise PassError(f"program: boundary {b.name!r} is {side} by stage {stage} "
                            f"({ph.value}); expected stage {want} ({phase.value})")
        if spec != b.spec:
            raise PassError(f"program: boundary {b.name!r} is {spec} where {side}, but the "
                            f"boundary says {b.spec}")


def link(stages: Sequence[Stage]) -> tuple[Boundary, ...]:
    """The boundaries between `stages`, from what each sends and receives by name (the spec
    is the sender's)."""
    sends, recvs = _endpoints(stages)
    missing = sorted(set(sends) ^ set(recvs))
    if missing:
        raise PassError(f"program: values {missing} are sent but not received, or received but "
                        "not sent")
    return tuple(Boundary(name, src, recvs[name][0], spec)
                 for name, (src, _, spec) in sends.items())
