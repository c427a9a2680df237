"""The glmc IR: one ATen-level torch.fx graph of a whole training step, with typed metadata.

A `TrainGraph` is a functional program

    step(params, buffers, optimizer_state, hyperparams, batch)
        -> (loss, new_params, new_buffers, new_optimizer_state)

Every node carries a `NodeInfo` (phase, role, tensor spec, source location, creator). Passes
rewrite `graph.gm.graph`; backends lower it. State write-back into the user's tensors is a
backend lowering (`glmc.backends.base.lower_writeback`), so the IR itself stays functional.

Programs that span devices (`glmc.ir.program`) use the same graphs: `TensorSpec.placements` says
how a value is laid out over a `MeshSpec`, and `NodeInfo.comm` marks torch's functional
collectives and their waits.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import operator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.fx as fx

from glmc.errors import PassError

if TYPE_CHECKING:
    from torch.distributed.tensor.placement_types import Placement


class Phase(enum.Enum):
    """Which part of the training step computes a value."""

    INPUT = "input"  #: a graph input (placeholder); not computed in the step
    FORWARD = "forward"  #: model forward and loss
    BACKWARD = "backward"  #: gradients of the loss
    OPTIMIZER = "optimizer"  #: the parameter and optimizer-state update
    OUTPUT = "output"  #: the output node


class Role(enum.Enum):
    """What a value is to the user. Set from the capture signature, never guessed from names."""

    PARAMETER = "parameter"  #: a trainable parameter of the model (input)
    BUFFER = "buffer"  #: a model buffer, e.g. BatchNorm running stats (input)
    INPUT = "input"  #: a batch tensor the user passes to `step`
    OPTIMIZER_STATE = "optimizer_state"  #: exp_avg, momentum buffers, step counters (input)
    CONSTANT = "constant"  #: a tensor constant baked into the graph (get_attr)
    HYPERPARAM = "hyperparam"  #: a per-group scalar the user may change between steps (lr)
    SCALER = "scaler"  #: loss-scaler state kept by the Trainer (scale, growth tracker)
    ACTIVATION = "activation"  #: a forward value
    GRADIENT = "gradient"  #: a backward value
    UPDATE = "update"  #: an optimizer-phase value (new parameter or state)
    OUTPUT = "output"  #: the output node
    BOUNDARY = "boundary"  #: a value received from another pipeline stage (input)
    SAVED = "saved"  #: a forward value this stage's backward reads, kept per microbatch (input)
    #: a value the runtime carries between the micro-batches of one step (accumulated
    #: gradient buckets and loss, the 1/k scale; glmc.parallel.data)
    ACCUMULATOR = "accumulator"
    #: per-rank communication state kept across steps (error-feedback residuals, PowerSGD's
    #: Q matrices; glmc.passes.compress), input and STATE output
    COMM_STATE = "comm_state"


class OutputKind(enum.Enum):
    """What an output of the step is written back to."""

    LOSS = "loss"
    PARAM = "param"  #: new value of a parameter
    BUFFER = "buffer"  #: new value of a mutated buffer
    STATE = "state"  #: new value of an optimizer-state tensor
    FORWARD = "forward"  #: a forward output of a joint graph (drop-in torch.compile path)
    GRADIENT = "gradient"  #: a gradient output of a joint graph (drop-in torch.compile path)
    SEND = "send"  #: a value sent to another pipeline stage (target: the boundary's name)
    SAVED = "saved"  #: a forward value kept for this stage's backward (target: its name)
    ACCUMULATOR = "accumulator"  #: a micro-batch's running sum (gradient bucket, loss)


@dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype and device of a value; `shape` is what this rank's graph computes.

    `placements` (torch DTensor vocabulary: `Replicate()`, `Shard(d)`, `Partial(op)`, one per
    mesh dim of the program's `MeshSpec`) say how the per-rank tensors form the global one;
    None is an ordinary single-device tensor.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    placements: "tuple[Placement, ...] | None" = None

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n * torch.empty((), dtype=self.dtype).element_size()

    @staticmethod
    def of(value: Any) -> "TensorSpec | None":
        if isinstance(value, torch.Tensor):
            return TensorSpec(tuple(int(s) for s in value.shape), value.dtype, value.device.type)
        return None


@dataclass(frozen=True)
class MeshSpec:
    """A device mesh as data (what `torch.distributed.DeviceMesh` is at run time): its shape,
    one name per dim ("dp", "pp", ...) and the device type. A program names mesh dims, never
    process groups, so it is not tied to one process."""

    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    device_type: str = "cpu"
    #: named flattenings of several dims, as `DeviceMesh._flatten` makes them: (name, dims).
    #: On a (node, local) mesh, ("dp", ("node", "local")) is the group of all ranks; a
    #: collective over it reads and writes the placements of every dim it covers
    flattened: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.dim_names) or len(set(self.dim_names)) != len(self.shape):
            raise PassError(f"ir: mesh shape {self.shape} needs one distinct name per dim, got "
                            f"{self.dim_names}")
        for name, dims in self.flattened:
            if name in self.dim_names or not dims or any(d not in self.dim_names for d in dims):
                raise PassError(f"ir: flattened mesh dim {name!r} must be a new name over "
                                f"existing dims {self.dim_names}, got {dims}")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self, name: str) -> int:
        """Index of the mesh dim called `name` (not a flattened one: see `dims`)."""
        if name not in self.dim_names:
            raise PassError(f"ir: mesh has no dim {name!r}; its dims are {self.dim_names}")
        return self.dim_names.index(name)

    def dims(self, name: str) -> tuple[int, ...]:
        """Indices of the mesh dims a dim or a flattened dim called `name` covers."""
        for flat, covered in self.flattened:
            if flat == name:
                return tuple(self.dim(d) for d in covered)
        if name not in self.dim_names:
            known = self.dim_names + tuple(f for f, _ in self.flattened)
            raise PassError(f"ir: mesh has no dim {name!r}; its dims are {known}")
        return (self.dim(name),)

    def size(self, name: str) -> int:
        """Ranks in the group of dim (or flattened dim) `name`."""
        return math.prod(self.shape[i] for i in self.dims(name))

    @staticmethod
    def of(mesh: Any, flattened: tuple[tuple[str, tuple[str, ...]], ...] = ()) -> "MeshSpec":
        """The spec of a `torch.distributed.DeviceMesh` (its dims must be named) and of the
        flattened dims made on it."""
        if mesh.mesh_dim_names is None:
            raise PassError("ir: the DeviceMesh has no dim names; pass mesh_dim_names=")
        return MeshSpec(tuple(mesh.shape), tuple(mesh.mesh_dim_names), mesh.device_type,
                        flattened)


@dataclass(frozen=True)
class CommInfo:
    """Marks a communication node: a functional collective (`all_reduce`,
    `reduce_scatter_tensor`, `all_gather_into_tensor`) or its `wait_tensor`, over the group of
    one mesh dim. `reduce_op` uses c10d's names ("sum", "avg", ...); None for gathers/waits."""

    collective: str
    mesh_dim: str
    reduce_op: str | None = None
    #: ranks in the group (the mesh dim's size, so not part of equality), for the
    #: communication model; None: unknown
    group_size: int | None = field(default=None, compare=False)


@dataclass(frozen=True)
class RngSite:
    """A random op. `ordinal` is its position among the step's random ops, in program order.

    The step draws from the device's default generator in exactly the order eager PyTorch
    does, so masks equal eager's. A pass that recomputes a random op must replay the generator
    state saved at this site (torch's `run_and_save_rng_state` / `run_with_rng_state`).
    """

    ordinal: int
    op: str


@dataclass(frozen=True)
class NodeInfo:
    """Typed metadata of one node; stored in `node.meta["glmc"]`."""

    phase: Phase
    role: Role
    spec: TensorSpec | None = None
    source: str | None = None  #: "file:line in func | module path", where known
    module: str | None = None  #: owning nn.Module path, where known
    created_by: str = "capture"  #: the pass that created the node
    target: str | None = None  #: for inputs: parameter / buffer / state / batch name
    rng: RngSite | None = None
    comm: CommInfo | None = None  #: set on collectives and their waits (see `CommInfo`)
    stage: int | None = None  #: the pipeline stage a node belongs to, in a staged program

    def replace(self, **changes: Any) -> "NodeInfo":
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"NodeInfo.replace: unknown field(s) {sorted(unknown)}")
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class InputSpec:
    role: Role
    target: str  #: e.g. "layers.0.attn.wq.weight", "exp_avg:layers.0.attn.wq.weight", "lr:0", "x"


@dataclass(frozen=True)
class OutputSpec:
    kind: OutputKind
    target: str  #: matches the InputSpec target it replaces ("" for the loss)


#: node.meta key marking a deliberate recomputation (a copy of a forward value made again in the
#: backward); cleanup's CSE must not merge it back into the value it duplicates. Cleanup also
#: never merges nodes of different phases, so a backward copy of a forward value survives
#: whether or not it is marked; mark copies made on purpose *within* one phase.
REMAT = "glmc_remat"

#: node.meta key on a fused optimizer call placed inside the backward, right after its
#: parameter's gradient is complete (`glmc.planning.updates`): its in-place form stays there
#: instead of moving after every output of the step (`glmc.ir.kernels.in_place_fused_updates`)
EARLY_UPDATE = "glmc_early_update"

#: node.meta key on a backward value the optimizer update reads as a parameter's gradient: the
#: parameter names (a tuple). Set by the step builder; a pass that replaces such a node by
#: another carries it over (`replace_uses`). Sharding finds each gradient by it.
GRAD_OF = "glmc_grad_of"

#: node meta of a forward collective the recompute pass may issue again in the backward: the
#: predicted seconds of doing so, which it weighs against keeping the value, as it weighs
#: recomputing an activation (a ZeRO-3 all-gather whose gathered parameters the backward
#: reads, shard reshard=budget; a tensor-parallel all-reduce); a collective without it is
#: never made again
REGATHER_S = "glmc_regather_s"

#: TrainGraph.meta key of the gradient outputs the graph makes and owns
#: (glmc.planning.schedule.fresh_gradients); derived from the graph too
FRESH_GRADIENTS = "glmc.fresh_gradients"

#: node.meta key on a node one of whose int arguments is this process's coordinate on a mesh
#: dim: (mesh dim, argument index). `glmc.ir.program.bind_mesh` fills it in per process.
RANK_ARG = "glmc_rank_arg"

#: node.meta key on a gradient bucket's collective: the bucket's index in the ShardPlan
GRAD_BUCKET = "glmc_grad_bucket"

#: node.meta key on the running sums a micro-batch step outputs under gradient accumulation:
#: the InputSpec target of the accumulator it feeds (see passes/shard.py)
ACCUMULATES = "glmc_accumulates"


def replace_uses(old: fx.Node, new: fx.Node) -> None:
    """`old.replace_all_uses_with(new)`, carrying `old`'s gradient marks (GRAD_OF) to `new`."""
    marks = old.meta.get(GRAD_OF)
    if marks:
        new.meta[GRAD_OF] = tuple(dict.fromkeys((*new.meta.get(GRAD_OF, ()), *marks)))
    old.replace_all_uses_with(new)

RANDOM_OPS = frozenset({
    "native_dropout", "bernoulli", "rand", "rand_like", "randn", "randn_like", "randint",
    "randint_like", "normal", "uniform", "multinomial", "randperm", "exponential",
})


def op_name(node: fx.Node) -> str:
    """Short ATen op name of a call_function node ("mm", "native_dropout"), else the op kind."""
    if node.op != "call_function":
        return node.op
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return getattr(target, "__name__", str(target))


@dataclass
class TrainGraph:
    """A captured training step. `gm.graph` is the program; `inputs`/`outputs` its signature."""

    gm: fx.GraphModule
    inputs: list[InputSpec]
    outputs: list[OutputSpec]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op == "placeholder"]

    def output_node(self) -> fx.Node:
        return next(n for n in reversed(self.graph.nodes) if n.op == "output")

    def output_values(self) -> list[fx.Node]:
        return list(self.output_node().args[0])

    def compute_nodes(self) -> Iterator[fx.Node]:
        return (n for n in self.graph.nodes if n.op == "call_function")

    @staticmethod
    def info(node: fx.Node) -> NodeInfo:
        info = node.meta.get("glmc")
        if info is None:
            raise PassError(f"ir: node '{node.name}' has no glmc metadata; passes must create "
                            "nodes through TrainGraph.annotate or copy metadata")
        return info

    def copy(self) -> "TrainGraph":
        """A TrainGraph over a copy of the fx graph; node metadata is copied shallowly."""
        new = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for n in self.graph.nodes:
            env[n] = new.node_copy(n, lambda a: env[a])
        meta = {k: v for k, v in self.meta.items()  # the cached forms were made from this graph
                if k != FRESH_GRADIENTS}
        return TrainGraph(fx.GraphModule(self.gm, new), list(self.inputs), list(self.outputs),
                          meta)

    def signature(self) -> tuple[tuple[InputSpec, ...], tuple[OutputSpec, ...]]:
        return tuple(self.inputs), tuple(self.outputs)

    def to_networkx(self) -> Any:
        """Data-dependence DAG: node name -> attributes {op, phase, role, bytes}."""
        import networkx as nx  # imported when used: 0.2 s off every `import glmc`
        g = nx.DiGraph()
        for n in self.graph.nodes:
            info = n.meta.get("glmc")
            g.add_node(n.name, op=op_name(n),
                       phase=info.phase if info else None, role=info.role if info else None,
                       bytes=info.spec.nbytes if info and info.spec else 0)
            for a in n.all_input_nodes:
                g.add_edge(a.name, n.name)
        return g

    def code(self) -> str:
        """Readable Python of the step, for dumps and debugging."""
        self.gm.recompile()
        return self.gm.code

    def count_ops(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.compute_nodes():
            counts[op_name(n)] = counts.get(op_name(n), 0) + 1
        return counts

    def verify(self, signature: tuple | None = None) -> None:
        """Well-formed, topologically ordered, typed, and (optionally) signature unchanged."""
        try:
            self.graph.lint()
        except Exception as e:  # fx raises RuntimeError for malformed graphs
            raise PassError(f"ir: graph is malformed: {e}") from e
        placeholders = self.placeholders()
        if len(placeholders) != len(self.inputs):
            raise PassError(f"ir: {len(placeholders)} placeholders but {len(self.inputs)} inputs")
        if len(self.output_values()) != len(self.outputs):
            raise PassError("ir: output arity does not match the step signature")
        for n in self.graph.nodes:
            if n.op in ("placeholder", "call_function") and "glmc" not in n.meta:
                raise PassError(f"ir: node '{n.name}' lost its glmc metadata")
        if signature is not None and signature != self.signature():
            raise PassError("ir: the step signature changed (inputs or outputs differ)")


@lru_cache(maxsize=1)
def is_view(node: fx.Node) -> bool:
    """True when the node's result aliases an input's storage (view ops, getitem, in-place)."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target in (torch.ops.aten._unsafe_view.default,):
        return True
    if comm_ops().get(target) == "wait_tensor":  # returns the collective's own output
        return True
    returns = target._schema.returns
    return bool(returns) and returns[0].alias_info is not None


def comm_ops() -> dict[Any, str]:
    """torch's functional collectives glmc knows, keyed by op: op -> `CommInfo.collective`.
    Empty where torch is built without distributed support."""
    ns = getattr(torch.ops, "_c10d_functional", None)
    names = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "wait_tensor")
    try:
        return {getattr(ns, name).default: name for name in names}
    except (AttributeError, RuntimeError):
        return {}


def is_comm(node: fx.Node) -> bool:
    """A functional collective or wait (by its op; `CommInfo` says which mesh dim)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    return node.target.namespace == "_c10d_functional" or node.target in comm_ops()


def is_collective(node: fx.Node) -> bool:
    """A collective whose result must be read through a `wait_tensor`."""
    return is_comm(node) and comm_ops().get(node.target) != "wait_tensor"


def is_impure(node: fx.Node) -> bool:
    """Whether dead-code elimination and CSE must leave `node` alone: graph inputs/outputs,
    random ops (dropping an unused draw shifts every later mask), mutating ops, communication
    (every rank must issue the same collectives in the same order: one rank dropping or merging
    one deadlocks the others), and whatever fx deems impure (RNG state)."""
    if node.op in ("placeholder", "output"):
        return True
    if op_name(node) in RANDOM_OPS or is_comm(node):
        return True
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.is_mutable
    return node.is_impure()
