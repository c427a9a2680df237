"""The glmc IR: one ATen-level torch.fx graph of a whole training step, with typed metadata.

A `TrainGraph` is a functional program

    step(params, buffers, optimizer_state, hyperparams, batch)
        -> (loss, new_params, new_buffers, new_optimizer_state)

Every node carries a `NodeInfo` (phase, role, tensor spec, source location, creator). Passes
rewrite `graph.gm.graph`; backends lower it. State write-back into the user's tensors is a
backend lowering (`glmc.backends.base.lower_writeback`), so the IR itself stays functional.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Iterator

import networkx as nx
import torch
import torch.fx as fx

from glmc.errors import PassError


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


class OutputKind(enum.Enum):
    """What an output of the step is written back to."""

    LOSS = "loss"
    PARAM = "param"  #: new value of a parameter
    BUFFER = "buffer"  #: new value of a mutated buffer
    STATE = "state"  #: new value of an optimizer-state tensor
    FORWARD = "forward"  #: a forward output of a joint graph (drop-in torch.compile path)
    GRADIENT = "gradient"  #: a gradient output of a joint graph (drop-in torch.compile path)


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str

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
#: backward); cleanup's CSE must not merge it back into the value it duplicates
REMAT = "glmc_remat"

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

    def signature(self) -> tuple[tuple[InputSpec, ...], tuple[OutputSpec, ...]]:
        return tuple(self.inputs), tuple(self.outputs)

    def to_networkx(self) -> nx.DiGraph:
        """Data-dependence DAG: node name -> attributes {op, phase, role, bytes}."""
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
