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
  gradients back), and a schedule as data (`glmc.schedule`), run by one generic executor.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from glmc.errors import CaptureError, ConfigError, PassError
from glmc.ir import (COMPILED_STEP, INPLACE_GM, RANK_ARG, CommInfo, InputSpec, MeshSpec,
                     NodeInfo, OutputKind, OutputSpec, Phase, Role, TensorSpec, TrainGraph,
                     comm_ops, is_collective, op_name)
from glmc.optim import ensure_state, rule_for

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.placement_types import Placement

class ScheduleLike(Protocol):
    """What a StagedProgram needs of its schedule (`glmc.schedule.Schedule` is one). A
    protocol, not an import: the executor in glmc.schedule imports this module."""

    num_microbatches: int

    def verify(self, num_stages: int, links: Any) -> None: ...

    def rank_of(self, stage: int) -> int: ...


#: the process-group argument of a collective before `bind_mesh`: this prefix + the mesh dim
UNBOUND = "glmc-unbound:"

Values = dict[tuple[Role, str], torch.Tensor]  #: step inputs by (role, target)


# ---- collectives -------------------------------------------------------------------------------

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


# ---- SPMD --------------------------------------------------------------------------------------

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


# ---- running a step against a module and its optimizer ----------------------------------------

def state_values(module: nn.Module, optimizer: torch.optim.Optimizer) -> Values:
    """The state a step reads, by (role, target): parameters, buffers, optimizer state and
    learning rates (float64 scalars, as `glmc.runtime` passes them)."""
    ensure_state(optimizer)
    names = {id(p): n for n, p in module.named_parameters()}
    values: Values = {(Role.PARAMETER, n): p.detach() for n, p in module.named_parameters()}
    values.update({(Role.BUFFER, n): b for n, b in module.named_buffers()})
    for gi, group in enumerate(optimizer.param_groups):
        values[(Role.HYPERPARAM, f"lr:{gi}")] = torch.tensor(float(group["lr"]),
                                                             dtype=torch.float64)
        for p in group["params"]:
            for key, t in optimizer.state[p].items():
                if isinstance(t, torch.Tensor) and id(p) in names:
                    values[(Role.OPTIMIZER_STATE, f"{key}:{names[id(p)]}")] = t
    return values


def batch_values(batch: Sequence[torch.Tensor]) -> Values:
    return {(Role.INPUT, f"input:{i}"): t for i, t in enumerate(batch)}


def gather(graph: TrainGraph, *sources: Values) -> list[torch.Tensor]:
    """The graph's inputs in signature order, each from the first source that has it."""
    out = []
    for spec in graph.inputs:
        key = (spec.role, spec.target)
        found = next((s[key] for s in sources if key in s), None)
        if found is None:
            raise ConfigError(f"program: no value for input {spec.role.value} {spec.target!r}")
        out.append(found)
    return out


def write_back(graph: TrainGraph, outputs: Sequence[torch.Tensor], module: nn.Module,
               optimizer: torch.optim.Optimizer) -> dict[tuple[OutputKind, str], torch.Tensor]:
    """Copies new parameters, buffers and optimizer state into the user's tensors; returns the
    other outputs (loss, sent values, saved values, gradients) by (kind, target)."""
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    rest = {}
    with torch.no_grad():
        for spec, value in zip(graph.outputs, outputs):
            if spec.kind is OutputKind.PARAM:
                params[spec.target].copy_(value)
            elif spec.kind is OutputKind.BUFFER:
                buffers[spec.target].copy_(value)
            elif spec.kind is OutputKind.STATE:
                key, _, name = spec.target.partition(":")
                optimizer.state[params[name]][key].copy_(value)
            else:
                rest[(spec.kind, spec.target)] = value
    return rest


def run_inplace(graph: TrainGraph, *sources: Values,
                consume: Iterable[Role | tuple[Role, str]] = ()
                ) -> dict[tuple[OutputKind, str], torch.Tensor]:
    """Run `graph` on its inputs from `sources` (`gather`) in its write-back form
    (`glmc.writeback.lower_writeback`, made once and kept in `graph.meta`): each new parameter,
    buffer and optimizer-state value is copied into the tensor it was read from as soon as the
    old value's last read is done, so an update holds one parameter's new values at a time,
    not a whole stage's. The inputs of the roles in `consume` are taken out of `sources` and
    handed to the graph alone (fx's boxed calling convention), so each is freed after its
    last read inside the graph — a backward frees its saved activations as it goes, an update
    each gradient; a (role, target) key in `consume` takes that one input. Returns the other
    outputs (loss, sent, saved values, gradients) by (kind, target)."""
    from glmc.writeback import STATE_KINDS
    compiled = graph.meta.get(COMPILED_STEP)
    gm = inplace_module(graph) if compiled is None else None
    args = gather(graph, *sources)
    consume = set(consume)
    for spec in graph.inputs:
        if spec.role in consume or (spec.role, spec.target) in consume:
            for source in sources:
                source.pop((spec.role, spec.target), None)
    with torch.no_grad():  # copies into leaf parameters
        if compiled is not None:
            call = _conform(graph, args)
            args.clear()  # the compiled step holds the only references (when boxed)
            outs = compiled.boxed(call) if compiled.boxed is not None else compiled(call)
        else:
            outs = gm(args)  # clears `args`: the graph holds the only references
    kept = [spec for spec in graph.outputs if spec.kind not in STATE_KINDS]
    return {(spec.kind, spec.target): v for spec, v in zip(kept, outs)}


def compile_inplace(graph: TrainGraph, backend: Any) -> None:
    """Compile `graph`'s write-back form with `backend` (a glmc Backend that updates state in
    place: eager, Inductor) once and keep it in `graph.meta`: `run_inplace` then runs the
    compiled step instead of the fx module (a copy of the graph does not carry it)."""
    graph.meta[COMPILED_STEP] = backend.compile(graph, inplace=True)


def _conform(graph: TrainGraph, args: list[torch.Tensor]) -> list[torch.Tensor]:
    """`args` with every value the graph takes over (saved, received, gradients: not state,
    which must be written in place) in the layout its placeholder was compiled for: a compiled
    step checks its inputs' strides, and a gradient may arrive expanded or as a view."""
    from glmc.writeback import NOT_STATE
    out = []
    for ph, spec, t in zip(graph.placeholders(), graph.inputs, args):
        want = ph.meta.get("val")
        if spec.role in NOT_STATE and isinstance(want, torch.Tensor) and \
                isinstance(t, torch.Tensor) and not _same_layout(t, want):
            t = torch.empty_strided(want.shape, want.stride(), dtype=t.dtype,
                                    device=t.device).copy_(t)
        out.append(t)
    return out


def _same_layout(t: torch.Tensor, want: torch.Tensor) -> bool:
    return tuple(t.shape) == tuple(want.shape) and all(
        a == b for a, b, n in zip(t.stride(), want.stride(), t.shape) if n > 1)


def inplace_module(graph: TrainGraph) -> fx.GraphModule:
    """`graph`'s early write-back form with fx's boxed calling convention (`gm(args)` clears
    `args`), made once and kept in `graph.meta`: what `run_inplace` runs and what
    `glmc.schedule.predicted_peaks` simulates. ATen's fused optimizer kernels in it run in
    place on the state (`glmc.kernels.in_place_fused_updates`)."""
    from torch.fx.graph import _BoxedCodeGen

    from glmc.kernels import in_place_fused_updates
    from glmc.writeback import lower_writeback
    gm = graph.meta.get(INPLACE_GM)
    if gm is None:
        gm = lower_writeback(graph)
        in_place_fused_updates(gm)
        gm.graph.set_codegen(_BoxedCodeGen())
        gm.recompile()
        graph.meta[INPLACE_GM] = gm
    return gm


def run_step(graph: TrainGraph, module: nn.Module, optimizer: torch.optim.Optimizer,
             batch: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One step of a (bound) step graph on `batch`, updating `module` and `optimizer`;
    returns the loss."""
    inputs = gather(graph, state_values(module, optimizer), batch_values(batch))
    rest = write_back(graph, graph.gm(*inputs), module, optimizer)
    return rest.get((OutputKind.LOSS, ""))


# ---- pipeline stages ---------------------------------------------------------------------------

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

    def saved_bytes(self) -> int:
        """New bytes one forward leaves behind (what it saves for the backward, and what it
        sends): glmc.memory's liveness simulation at the forward's end, above its inputs —
        saved views of parameters or received values share their storage and add nothing."""
        from glmc.memory import simulate
        return simulate(self.forward.graph).left_bytes


@dataclass
class StagedProgram:
    """A pipeline: stages, the boundary values between them, and a schedule (data; see
    `glmc.schedule`). `verify()` guarantees every stage graph is well formed, every sent value
    is received by exactly one stage with the same spec (and vice versa), and the schedule is
    acyclic and runs every stage's F and B for every microbatch and its update once.

    `shared`: parameters that several stages read (tied input and output embeddings cut
    apart), each as its ((stage, parameter name), ...) in those stages. Each stage holds a
    copy and updates it; the copies stay equal because every stage's update gets the *sum* of
    their gradients (`glmc.schedule.run_rank` asks its `reduce_grads` to form it)."""

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


# ---- capturing a stage -------------------------------------------------------------------------

StageArg = tuple["int | str", torch.Tensor]  #: (batch leaf index | received boundary, example)


def capture_stage(index: int, module: nn.Module, optimizer: torch.optim.Optimizer,
                  args: Sequence[StageArg], *, send: Sequence[str] = (), loss_fn: Any = None,
                  target: tuple[int, torch.Tensor] | None = None,
                  partition: Callable[[fx.GraphModule], Any] | None = None,
                  update: str = "fused",
                  rewrites: Sequence[Callable[[fx.GraphModule, list[InputSpec]], Any]] = ()
                  ) -> Stage:
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
    glmc rule (`glmc.optim`): with `update="single"` one parameter at a time, as
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
    backward follows the rewrites."""
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

    frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
    if frozen:  # Whisper's positions: the stage programs would train them (KeyError before)
        raise ConfigError(f"capture_stage: stage {index} holds frozen parameters {frozen} "
                          "(requires_grad=False); glmc's pipeline does not support them yet "
                          "(a stage updates every parameter it holds): train this model "
                          "data-parallel (--zero), which does")
    examples = [p.detach().requires_grad_() for p in module.parameters()]
    examples += [b.detach() for b in module.buffers()]
    examples += [t.detach().requires_grad_(isinstance(k, str)) for k, t in leaves]
    ins = [InputSpec(Role.PARAMETER, n) for n in names]
    ins += [InputSpec(Role.BUFFER, n) for n in buffers]
    ins += [InputSpec(Role.BOUNDARY, k) if isinstance(k, str) else InputSpec(Role.INPUT,
            f"input:{k}") for k, _ in leaves]
    fn: Callable = step
    for rewrite in rewrites:  # each traced afresh: a rewrite sees its input's values
        fn = _rewritten(fn, examples, ins, rewrite)
    fw, bw, n_out = _aot_graphs(fn, examples, partition, index, send)
    if n_out != max(len(send), 1):
        raise ConfigError(f"capture_stage: stage {index} returns {n_out} values but send= "
                          f"names {len(send)} (a stage that writes a buffer returns more)")
    n_saved = len(_output_args(fw)) - n_out
    outs = [OutputSpec(OutputKind.SEND, n) for n in send] or [OutputSpec(OutputKind.LOSS, "")]
    forward = _retype(fw, ins, [*outs, *(OutputSpec(OutputKind.SAVED, f"saved:{k}")
                                         for k in range(n_saved))], Phase.FORWARD, index)
    backward = _backward(index, bw, names, len(buffers), leaves, send, n_saved)
    return Stage(index, forward, backward, _update_graph(index, module, optimizer, update))


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
                send: Sequence[str] = ()) -> tuple[fx.GraphModule, fx.GraphModule, int]:
    """AOTAutograd's forward and backward graphs of `fn` (run once on `examples`), split by
    the default partition after `partition`'s rewrite of the joint graph (`capture_stage`)."""
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
            partition(joint)
            joint.recompile()
        return default_partition(joint, joint_inputs, **kw)

    compiled = aot_function(fn, fw_compiler=keep("F"), bw_compiler=keep("B"), partition_fn=split)
    out = compiled(*examples)
    outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    inert = [name for name, o in zip(send or [""], outs) if not o.requires_grad]
    if inert:
        raise CaptureError(
            f"capture_stage: stage {index} sends {inert} across the cut, which carries no "
            "gradient (computed from the batch alone, e.g. an attention mask made once and "
            "read by every block, as in T5); glmc's pipeline "
            "sends a gradient back for every value it passes on. Not supported yet: cut "
            "elsewhere (cut=), or train this model data-parallel (--zero)")
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    return got["F"], got["B"], len(outs)


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
    outs: list[OutputSpec | None] = [OutputSpec(OutputKind.GRADIENT, n) for n in names]
    outs += [None] * n_buffers
    outs += [OutputSpec(OutputKind.SEND, f"grad:{k}") if isinstance(k, str) else None
             for k, _ in leaves]
    return _retype(bw, ins, outs, Phase.BACKWARD, index)


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
            info = NodeInfo(phase, role, created_by="capture_stage", stage=stage)
        env[n].meta = {"val": n.meta.get("val"),
                       "glmc": info.replace(spec=TensorSpec.of(n.meta.get("val")))}
    graph = TrainGraph(fx.GraphModule(gm, g), list(inputs), [o for o, _ in picked],
                       meta={"stage": stage, "phase": phase.value})
    graph.verify()
    return graph


def _update_graph(index: int, module: nn.Module, optimizer: torch.optim.Optimizer,
                  update: str = "fused") -> TrainGraph:
    """(lr per group, then per parameter: param, gradient, state...) -> (param, state...);
    `update` as `capture_stage` says."""
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
            examples += [p.detach(), torch.zeros_like(p), *(optimizer.state[p][k] for k in keys)]
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
    return _retype(gm, ins, outs, Phase.OPTIMIZER, index)


# ---- zero-bubble: the backward as input gradients (I) and weight gradients (W) -----------------

def split_backward(stage: Stage) -> Stage:
    """`stage` with its backward also split in two graphs, for zero-bubble schedules:

    I  saved, cotangents -> sent input gradients, stash   (what the previous stage waits for)
    W  saved, stash      -> parameter gradients           (can run later, filling bubbles)

    I holds every node the input gradients need; W the rest of what the parameter gradients
    need; `stash` is the I values W reads (outputs `SAVED "stash:k"`). I + W compute exactly
    the backward's nodes, so the gradients are bit-identical to B's."""
    bw = stage.backward
    outs = list(zip(bw.outputs, bw.output_values()))
    sends = [(o, v) for o, v in outs if o.kind is OutputKind.SEND]
    grads = [(o, v) for o, v in outs if o.kind is not OutputKind.SEND]
    in_i = _ancestors([v for _, v in sends])
    w_all = _ancestors([v for _, v in grads])
    in_w = w_all - in_i
    stash = []
    for n in bw.graph.nodes:
        if n in in_i and n.op != "placeholder" and (any(u in in_w for u in n.users)
                                                    or any(v is n for _, v in grads)):
            # a node of several outputs (a fused op's backward) is stashed as the items W
            # reads: a graph output must be a tensor
            tuple_valued = isinstance(n.meta.get("val"), (tuple, list))
            stash += [u for u in n.users if u in in_w] if tuple_valued else [n]
    phs = dict(zip(bw.placeholders(), bw.inputs))
    stash_specs = [InputSpec(Role.SAVED, f"stash:{k}") for k in range(len(stash))]
    i_graph = _subgraph(bw, [(phs[p], p) for p in bw.placeholders() if p in in_i],
                        sends + [(OutputSpec(OutputKind.SAVED, s.target), n)
                                 for s, n in zip(stash_specs, stash)], "I")
    w_inputs = [(phs[p], p) for p in bw.placeholders() if p in w_all]
    w_inputs += list(zip(stash_specs, stash))
    w_graph = _subgraph(bw, w_inputs, grads, "W")
    return dataclasses.replace(stage, split=(i_graph, w_graph))


@dataclass
class UpdateSplit:
    """A step cut in two before its optimizer update (`split_update`): `front` computes the
    forward and the backward, `update` the new parameters and optimizer state. Wiring, by
    index: `front_inputs[j]` is the step input front's input j is; `update_inputs[j]` is
    ("input", i) for step input i or ("front", k) for front's output k (a gradient); each step
    output is `outputs[k]` = ("front" | "update", index into that part's outputs)."""

    front: TrainGraph
    update: TrainGraph
    front_inputs: list[int]
    update_inputs: list[tuple[str, int]]
    outputs: list[tuple[str, int]]


def split_update(graph: TrainGraph) -> UpdateSplit | None:
    """`graph` cut before its optimizer-phase nodes, for a backend that runs the forward and
    backward itself and leaves the update to torch's kernels (ONNX Runtime: ATen's fused
    Adam in place). What the update reads from the rest crosses as front outputs `SAVED
    "update:k"` (gradients, the loss scaler's overflow flag). None when the step has no update
    or a forward/backward node reads an update value (nothing to cut)."""
    update = {n for n in graph.compute_nodes() if TrainGraph.info(n).phase is Phase.OPTIMIZER}
    if not update or any(u in update for n in graph.compute_nodes() if n not in update
                         for u in n.all_input_nodes):
        return None
    outs = list(zip(graph.outputs, graph.output_values()))
    phs = graph.placeholders()
    slot = {ph: i for i, ph in enumerate(phs)}
    crossing = [n for n in graph.compute_nodes() if n not in update
                and any(u in update for u in n.users)]
    if any(isinstance(n.meta.get("val"), (tuple, list)) for n in crossing):
        return None  # a tuple-valued node read whole by the update: not a graph output
    front_outs = [(s, v) for s, v in outs if v not in update]
    front_outs += [(OutputSpec(OutputKind.SAVED, f"update:{k}"), n)
                   for k, n in enumerate(crossing)]
    front_phs = sorted((n for n in _ancestors([v for _, v in front_outs]) if n in slot),
                       key=slot.__getitem__)
    front = _subgraph(graph, [(graph.inputs[slot[p]], p) for p in front_phs], front_outs,
                      "front")
    states = {s.target for s, v in outs if v in update}  # its state inputs, read or not
    update_phs = [p for p in phs if any(u in update for u in p.users)
                  or graph.inputs[slot[p]].target in states]
    inputs = [(graph.inputs[slot[p]], p) for p in update_phs]
    inputs += [(InputSpec(Role.SAVED, f"update:{k}"), n) for k, n in enumerate(crossing)]
    back = _subgraph(graph, inputs, [(s, v) for s, v in outs if v in update], "update")
    n_front = len(front_outs) - len(crossing)
    wires = [("input", slot[p]) for p in update_phs]
    wires += [("front", n_front + k) for k in range(len(crossing))]
    where, kf, ku = [], 0, 0
    for _, v in outs:
        if v in update:
            where.append(("update", ku))
            ku += 1
        else:
            where.append(("front", kf))
            kf += 1
    return UpdateSplit(front, back, [slot[p] for p in front_phs], wires, where)


def _ancestors(values: Sequence[Any], stop: Iterable[fx.Node] = ()) -> set[fx.Node]:
    """`values` and what they read, not looking past `stop`."""
    seen: set[fx.Node] = set()
    stop = set(stop)
    todo = [v for v in values if isinstance(v, fx.Node)]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += [] if n in stop else n.all_input_nodes
    return seen


def _subgraph(graph: TrainGraph, inputs: list[tuple[InputSpec, fx.Node]],
              outputs: list[tuple[OutputSpec, Any]], part: str) -> TrainGraph:
    """A TrainGraph computing `outputs` of `graph` from `inputs` (any nodes of it)."""
    g, env = fx.Graph(), {}
    for spec, n in inputs:
        env[n] = g.placeholder(f"{spec.role.value}_{len(env)}")
        info = TrainGraph.info(n)
        env[n].meta = {"val": n.meta.get("val"),
                       "glmc": NodeInfo(Phase.INPUT, spec.role, info.spec, target=spec.target,
                                        stage=info.stage)}
    need = _ancestors([v for _, v in outputs], stop=[n for _, n in inputs])
    for n in graph.graph.nodes:
        if n in need and n not in env and n.op in ("call_function", "get_attr"):
            env[n] = g.node_copy(n, lambda a: env[a])
            env[n].meta = dict(n.meta)
    g.output(tuple(env[v] for _, v in outputs))
    out = TrainGraph(fx.GraphModule(graph.gm, g), [s for s, _ in inputs],
                     [s for s, _ in outputs], meta={**graph.meta, "part": part})
    out.verify()
    return out
