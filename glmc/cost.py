"""Cost model: FLOPs and bytes moved per ATen op, and the predicted step time on a device.

The model (stated once, used by every pass):

    time(kernel) = max(flops / F(kind, dtype, size), bytes / B(bytes)) + overhead

summed over the kernels of the step in execution order (one device stream, no overlap).

* A *kernel* is one ATen op on a backend that runs ops one by one (`eager`), or one fused group
  on a backend that fuses (`BackendTraits.fusion`, e.g. Inductor's pointwise inlining): ops
  inlined into their consumer move no bytes of their own.
* F is the matmul rate for matmul-like ops (mm, bmm, addmm, convolution, attention; FLOPs from
  `torch.utils.flop_counter`), the vector rate for the rest, from a `DeviceProfile`
  (`glmc.profiles`): on the host CPU measured by `glmc.calibration` as curves over problem size
  and cached per machine; the GPU and Kunpeng profiles use published peak figures times a
  stated efficiency. `get_profile` picks one; every profile says where it came from.
* overhead is the per-op dispatch cost (Python + ATen dispatcher) for `eager`, the per-kernel
  launch cost for fused backends.

Ops the model has no rule for are costed by the generic bytes rule, counted and reported as
`unknown` — never silently zero. A profile-guided mode (`measure_node_times`) times every node
on real tensors and replaces the formulas.
"""
from __future__ import annotations

import operator
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from glmc.calibration import calibrate, default_cpu_profile, host_profile
from glmc.errors import ConfigError
from glmc.ir import op_name
from glmc.profiles import BUILTIN, GPU_FALLBACK, GPU_KEYS, DeviceProfile, Provenance, _interp
from glmc.target import EAGER, BackendTraits

__all__ = ["BUILTIN", "DeviceProfile", "Provenance", "calibrate", "host_profile", "_interp",
           "get_profile", "estimate_time", "op_cost", "kind_of", "is_view", "node_time"]

aten = torch.ops.aten

# ---- op classification ------------------------------------------------------------------------

#: FLOPs per output element of pointwise ops that are not a single add/mul (transcendentals etc.)
_POINTWISE_WEIGHT = {
    "exp": 8, "log": 8, "sqrt": 4, "rsqrt": 4, "pow": 8, "tanh": 10, "sigmoid": 10, "silu": 12,
    "silu_backward": 16, "gelu": 16, "gelu_backward": 24, "erf": 10, "div": 4, "lerp": 3,
    "addcmul": 3, "addcdiv": 4, "sin": 8, "cos": 8, "native_dropout_backward": 2,
}
#: non-pointwise, non-matmul ops with a known cost rule: name -> FLOPs per element of the
#: largest input (bytes come from inputs + outputs)
_KNOWN = {
    "_softmax": 5, "_softmax_backward_data": 3, "_log_softmax": 5, "_log_softmax_backward_data": 3,
    "nll_loss_forward": 1, "nll_loss_backward": 1, "embedding": 0, "embedding_dense_backward": 1,
    "native_layer_norm": 8, "native_layer_norm_backward": 12,
    "_native_batch_norm_legit_functional": 8,
    "native_batch_norm": 8, "native_batch_norm_backward": 12, "_native_batch_norm_legit": 8,
    "_native_batch_norm_legit_no_training": 4, "max_pool2d_with_indices": 1,
    "max_pool2d_with_indices_backward": 1, "avg_pool2d": 1, "avg_pool2d_backward": 1,
    "cross_entropy": 6, "cross_entropy_backward": 5,  # glmc.kernels: chunked fp32 loss
    "cat": 0, "stack": 0, "clone": 0, "_to_copy": 0, "copy": 0, "copy_": 0, "triu": 1, "tril": 1,
    "slice_backward": 0, "select_backward": 0, "slice_scatter": 0, "index_select": 0,
    "gather": 0, "scatter": 0,
    "scatter_add": 1, "index": 0, "index_put": 0, "index_add": 1, "native_dropout": 4,
    "bernoulli": 4, "rand": 4, "randn": 8, "rand_like": 4, "randn_like": 8, "where": 1,
    "zeros": 0, "ones": 0, "full": 0, "empty": 0, "zeros_like": 0, "ones_like": 0,
    "full_like": 0, "empty_like": 0, "scalar_tensor": 0, "arange": 1, "cumsum": 1,
    "_unsafe_index": 0, "constant_pad_nd": 0, "fill": 0, "masked_fill": 1, "topk": 4, "sort": 8,
    "_fused_adam": 16, "_fused_adamw": 16, "_fused_sgd": 4,
}
#: ops that allocate but never read their input's data (only its shape)
_SHAPE_ONLY = {"zeros_like", "ones_like", "full_like", "empty_like", "zeros", "ones", "full",
               "empty", "scalar_tensor", "arange", "rand", "randn", "rand_like", "randn_like"}


def is_view(node: fx.Node) -> bool:
    """True when the node's result aliases an input's storage (view ops, getitem, in-place)."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target in (aten._unsafe_view.default,):
        return True
    returns = target._schema.returns
    return bool(returns) and returns[0].alias_info is not None


def kind_of(node: fx.Node) -> str:
    """'view' | 'matmul' | 'pointwise' | 'reduction' | 'known' | 'unknown' | 'input'."""
    if node.op in ("placeholder", "get_attr"):
        return "input"
    if node.op != "call_function":
        return "view"
    if is_view(node):
        # in-place ops alias their input but still compute
        t = node.target
        if isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable:
            return "known"
        return "view"
    t = node.target
    if not isinstance(t, torch._ops.OpOverload):
        return "unknown"
    if t.overloadpacket in _flop_registry():
        return "matmul"
    name = op_name(node)
    if torch.Tag.pointwise in t.tags:
        return "pointwise"
    if name.startswith("_foreach_"):
        return "known"  # multi-tensor pointwise: one pass over every tensor of the lists
    if torch.Tag.reduction in t.tags:
        return "reduction"
    if name in _KNOWN:
        return "known"
    return "unknown"


def _flop_registry() -> dict:
    from torch.utils.flop_counter import flop_registry
    return flop_registry


def value_bytes(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (list, tuple)):
        return sum(value_bytes(x) for x in v)
    return 0


def _val_numel(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel()
    if isinstance(v, (list, tuple)):
        return sum(_val_numel(x) for x in v)
    return 0


def _val_dtype(v: Any) -> torch.dtype | None:
    if isinstance(v, torch.Tensor):
        return v.dtype
    if isinstance(v, (list, tuple)):
        for x in v:
            d = _val_dtype(x)
            if d is not None:
                return d
    return None


@dataclass(frozen=True)
class OpCost:
    kind: str
    flops: float
    bytes_read: int
    bytes_written: int
    dtype: str
    name: str = ""

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written


def op_cost(node: fx.Node) -> OpCost:
    """FLOPs and bytes of one node computed alone (no fusion)."""
    kind = kind_of(node)
    out = node.meta.get("val")
    dtype = str(_val_dtype(out) or torch.float32).replace("torch.", "")
    if kind in ("view", "input") or node.op != "call_function":
        return OpCost(kind, 0.0, 0, 0, dtype, op_name(node))
    ins = [a.meta.get("val") for a in node.all_input_nodes]
    name = op_name(node)
    read = 0 if name in _SHAPE_ONLY else sum(value_bytes(v) for v in ins)
    written = value_bytes(out)
    if kind == "matmul":
        flops = _matmul_flops(node)
    elif kind == "pointwise":
        flops = _val_numel(out) * _POINTWISE_WEIGHT.get(name, 1)
    elif kind == "reduction":
        flops = max((_val_numel(v) for v in ins), default=0)
    elif kind == "known":
        if node.target._schema.is_mutable and is_view(node):  # copy_: reads src, writes dest
            written = value_bytes(ins[1]) if len(ins) > 1 else written
            read = written
        flops = max((_val_numel(v) for v in ins), default=_val_numel(out)) * _KNOWN.get(name, 1)
        if name.startswith("_foreach_"):
            flops = _val_numel(out)
    else:  # unknown: generic bytes rule, one FLOP per element
        flops = max(_val_numel(out), max((_val_numel(v) for v in ins), default=0))
    return OpCost(kind, float(flops), read, written, dtype, name)


def _matmul_flops(node: fx.Node) -> float:
    """FLOPs from torch.utils.flop_counter's formulas (they take tensors or shapes)."""
    fn = _flop_registry()[node.target.overloadpacket]

    def val(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return a.meta.get("val")
        if isinstance(a, (list, tuple)):
            return type(a)(val(x) for x in a)
        return a
    return float(fn(*[val(a) for a in node.args], **{k: val(v) for k, v in node.kwargs.items()},
                    out_val=node.meta.get("val")))


# ---- choosing a device profile -----------------------------------------------------------------


def get_profile(spec: Any = None, device: str = "cpu") -> DeviceProfile:
    """A profile by name ('host', 'generic-cpu', 'h100', 'h200', 'a100', 'kunpeng920'), a
    DeviceProfile, or the default for `device`: the calibrated host CPU (`generic-cpu` when
    GLMC_CALIBRATE=0), or on CUDA the built-in profile matching the GPU's name."""
    if isinstance(spec, DeviceProfile):
        return spec
    if isinstance(spec, str) and spec.lower() in BUILTIN:
        return BUILTIN[spec.lower()]
    if spec in (None, "host", "cpu"):
        if device == "cuda" and spec is None:
            return gpu_profile(torch.cuda.get_device_name() if torch.cuda.is_available() else "")
        return default_cpu_profile()
    raise ConfigError(f"cost: unknown device profile {spec!r}; use 'host' or one of "
                      f"{sorted(BUILTIN)}, or pass a glmc.profiles.DeviceProfile")


def gpu_profile(gpu_name: str) -> DeviceProfile:
    """The built-in profile whose key is in the GPU's name; for any other GPU, a warning and
    the `GPU_FALLBACK` profile marked as a stand-in."""
    for key in GPU_KEYS:
        if key in gpu_name.lower():
            return BUILTIN[key]
    fallback = BUILTIN[GPU_FALLBACK]
    warnings.warn(
        f"cost: no built-in profile for the GPU {gpu_name or '(unnamed)'!r}; predicting with "
        f"the {GPU_FALLBACK!r} profile ({fallback.name}), so predicted times may be far off. "
        f"Choose one with profile= (one of {', '.join(GPU_KEYS)}) or pass a "
        "glmc.profiles.DeviceProfile with your GPU's figures", stacklevel=3)
    note = f"stand-in for the unrecognised GPU {gpu_name!r}"
    prov = fallback.provenance or Provenance("builtin", fallback.source)
    return fallback.with_provenance(Provenance("fallback", prov.detail, notes=(note,)))


# ---- step-time prediction ---------------------------------------------------------------------


@dataclass
class CostEstimate:
    seconds: float
    flops: float
    bytes: float
    kernels: int
    by_kind: dict[str, float]  #: predicted seconds per op kind
    unknown: dict[str, int]  #: ops costed by the generic rule, with counts
    profile: str
    fused: bool
    node_seconds: dict[str, float] = field(default_factory=dict, repr=False)
    provenance: str = ""  #: where the profile's figures come from (one line)
    provenance_record: dict[str, Any] | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "gflops": round(self.flops / 1e9, 3),
                "gbytes": round(self.bytes / 1e9, 3), "kernels": self.kernels,
                "by_kind": {k: round(v, 6) for k, v in self.by_kind.items()},
                "unknown_ops": self.unknown, "profile": self.profile, "fused": self.fused,
                "profile_provenance": self.provenance,
                "profile_provenance_record": self.provenance_record}


def node_time(c: OpCost, prof: DeviceProfile, overhead: float) -> float:
    if c.kind == "matmul":
        compute = c.flops / prof.matmul_rate(c.dtype, c.flops)
    else:
        compute = c.flops / prof.vector_flops
    rate = prof.kernel_rates.get(c.name) if c.name else None
    memory = c.bytes / (rate or prof.bandwidth_at(c.bytes))
    return max(compute, memory) + overhead


def dispatch_overhead(prof: DeviceProfile, traits: BackendTraits) -> float:
    """Seconds added per kernel: a launch on a fusing backend, a dispatched op otherwise."""
    return prof.kernel_overhead_s if traits.fuses else prof.op_overhead_s


@dataclass
class _Totals:
    seconds: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    kernels: int = 0
    by_kind: dict[str, float] = field(default_factory=dict)
    unknown: dict[str, int] = field(default_factory=dict)
    node_seconds: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, c: OpCost, t: float) -> None:
        self.node_seconds[name] = t
        self.seconds += t
        self.flops += c.flops
        self.bytes += c.bytes
        self.kernels += 1
        self.by_kind[c.kind] = self.by_kind.get(c.kind, 0.0) + t


def estimate_time(graph: fx.Graph, prof: DeviceProfile, traits: BackendTraits = EAGER,
                  measured: dict[str, float] | None = None) -> CostEstimate:
    """Predicted step time of `graph` (the lowered step) on `prof` for the backend described
    by `traits` (its fusion model decides which ops are kernels of their own).

    `measured`: node name -> seconds from `measure_node_times` (profile-guided mode) overrides
    the formulas.
    """
    fusion = traits.fusion(graph) if traits.fusion is not None else None
    overhead = dispatch_overhead(prof, traits)
    tot = _Totals()
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        c = op_cost(n)
        if c.kind == "unknown":
            tot.unknown[c.name] = tot.unknown.get(c.name, 0) + 1
        if c.kind == "view":
            continue
        if fusion is not None:
            if fusion.inlined(n):
                tot.flops += c.flops  # its work is counted inside the consumer's kernel
                continue
            c = fusion.kernel_cost(n, c)
        t = measured[n.name] if measured is not None and n.name in measured else \
            node_time(c, prof, overhead)
        tot.add(n.name, c, t)
    record = prof.provenance.to_dict() if prof.provenance is not None else None
    return CostEstimate(tot.seconds, tot.flops, tot.bytes, tot.kernels, tot.by_kind,
                        tot.unknown, prof.name + (" (profile-guided)" if measured else ""),
                        traits.fuses, tot.node_seconds, prof.describe_provenance(), record)


def measure_node_times(gm: fx.GraphModule, inputs: list[torch.Tensor],
                       reps: int = 3) -> dict[str, float]:
    """Profile-guided mode: run every node of a *functional* graph on real tensors (eager ATen
    kernels) and return its median time. The graph must not mutate its inputs."""

    class _Timer(fx.Interpreter):
        def __init__(self, module: fx.GraphModule) -> None:
            super().__init__(module)
            self.times: dict[str, float] = {}

        def run_node(self, n: fx.Node) -> Any:
            if n.op != "call_function":
                return super().run_node(n)
            samples = []
            result = None
            for _ in range(reps):
                t0 = time.perf_counter()
                result = super().run_node(n)
                samples.append(time.perf_counter() - t0)
            self.times[n.name] = statistics.median(samples)
            return result

    timer = _Timer(gm)
    rng = torch.get_rng_state()
    with torch.no_grad():
        timer.run(*inputs)
    torch.set_rng_state(rng)
    return timer.times
