"""Cost model: FLOPs and bytes moved per ATen op, device profiles, predicted step time.

The model (stated once, used by every pass):

    time(kernel) = max(flops / F(kind, dtype, size), bytes / B(bytes)) + overhead

summed over the kernels of the step in execution order (one device stream, no overlap).

* A *kernel* is one ATen op on a backend that runs ops one by one (`eager`), or one fused group
  on a backend that fuses pointwise ops (`inductor`): pointwise ops inlined into their consumer
  move no bytes of their own (see `glmc.memory.fusion_groups`).
* F is the matmul rate for matmul-like ops (mm, bmm, addmm, convolution, attention; FLOPs from
  `torch.utils.flop_counter`), the vector rate for the rest. On the host CPU, F and B are
  measured by `calibrate()` as curves over problem size (caches matter on CPUs) and cached per
  machine; the GPU and Kunpeng profiles use published peak figures times a stated efficiency.
* overhead is the per-op dispatch cost (Python + ATen dispatcher) for `eager`, the per-kernel
  launch cost for fused backends.

Ops the model has no rule for are costed by the generic bytes rule, counted and reported as
`unknown` — never silently zero. A profile-guided mode (`measure_node_times`) times every node
on real tensors and replaces the formulas.
"""
from __future__ import annotations

import hashlib
import json
import math
import operator
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.fx as fx

from glmc.ir import op_name

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
    "native_layer_norm": 8, "native_layer_norm_backward": 12, "_native_batch_norm_legit_functional": 8,
    "native_batch_norm": 8, "native_batch_norm_backward": 12, "_native_batch_norm_legit": 8,
    "_native_batch_norm_legit_no_training": 4, "max_pool2d_with_indices": 1,
    "max_pool2d_with_indices_backward": 1, "avg_pool2d": 1, "avg_pool2d_backward": 1,
    "cross_entropy": 6, "cross_entropy_backward": 5,  # glmc.kernels: chunked fp32 loss
    "cat": 0, "stack": 0, "clone": 0, "_to_copy": 0, "copy": 0, "copy_": 0, "triu": 1, "tril": 1,
    "slice_backward": 0, "select_backward": 0, "slice_scatter": 0, "index_select": 0, "gather": 0, "scatter": 0,
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


# ---- device profiles --------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceProfile:
    """Throughput of one device. Curves are ((size, rate), ...) sorted by size; a single point
    is a flat rate. Sizes: FLOPs of one matmul / bytes moved by one op."""

    name: str
    kind: str  #: "cpu" | "cuda"
    matmul: dict[str, tuple[tuple[float, float], ...]]  #: dtype -> curve of FLOP/s
    vector_flops: float  #: FLOP/s of elementwise arithmetic
    bandwidth: tuple[tuple[float, float], ...]  #: curve of bytes/s
    op_overhead_s: float  #: per op dispatched one by one (eager)
    kernel_overhead_s: float  #: per fused kernel (compiled backends)
    source: str  #: where the figures come from
    #: measured bytes/s of specific ATen kernels whose speed is not set by bandwidth alone
    #: (pooling, batch norm, softmax, loss); empty for published profiles
    kernel_rates: dict[str, float] = field(default_factory=dict)

    def matmul_rate(self, dtype: str, flops: float) -> float:
        curve = self.matmul.get(dtype) or self.matmul["float32"]
        return _interp(curve, flops)

    def bandwidth_at(self, nbytes: float) -> float:
        return _interp(self.bandwidth, nbytes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "DeviceProfile":
        return DeviceProfile(
            name=d["name"], kind=d["kind"],
            matmul={k: tuple(tuple(p) for p in v) for k, v in d["matmul"].items()},
            vector_flops=d["vector_flops"], bandwidth=tuple(tuple(p) for p in d["bandwidth"]),
            op_overhead_s=d["op_overhead_s"], kernel_overhead_s=d["kernel_overhead_s"],
            source=d["source"], kernel_rates=dict(d.get("kernel_rates", {})))


def _interp(curve: Iterable[tuple[float, float]], x: float) -> float:
    """Piecewise-linear in log(size); flat beyond the measured range."""
    pts = list(curve)
    if len(pts) == 1 or x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    lx = math.log(max(x, 1.0))
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            f = (lx - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + f * (y1 - y0)
    return pts[-1][1]


def _published(name: str, fp32: float, tf32: float | None, bf16: float | None,
               fp16: float | None, bw: float, kind: str, source: str,
               mm_eff: float = 0.7, bw_eff: float = 0.8, op_overhead: float = 8e-6,
               kernel_overhead: float = 4e-6) -> DeviceProfile:
    mm = {"float32": ((1.0, fp32 * mm_eff),)}
    if bf16:
        mm["bfloat16"] = ((1.0, bf16 * mm_eff),)
    if fp16:
        mm["float16"] = ((1.0, fp16 * mm_eff),)
    del tf32  # torch's default fp32 matmul precision is "highest": no TF32
    return DeviceProfile(name, kind, mm, fp32 * mm_eff, ((1.0, bw * bw_eff),), op_overhead,
                         kernel_overhead,
                         f"{source}; model efficiency {mm_eff:.0%} of peak FLOP/s, "
                         f"{bw_eff:.0%} of peak bandwidth")


#: Built-in profiles from vendors' published (dense, no sparsity) figures.
BUILTIN: dict[str, DeviceProfile] = {
    "h100": _published("NVIDIA H100 SXM5", 67e12, 495e12, 989e12, 989e12, 3.35e12, "cuda",
                       "NVIDIA H100 datasheet"),
    "h200": _published("NVIDIA H200 SXM", 67e12, 495e12, 989e12, 989e12, 4.8e12, "cuda",
                       "NVIDIA H200 datasheet"),
    "a100": _published("NVIDIA A100 SXM4 80GB", 19.5e12, 156e12, 312e12, 312e12, 2.039e12,
                       "cuda", "NVIDIA A100 datasheet"),
    # Kunpeng 920-7260: 64 TaiShan v110 cores at 2.6 GHz, 2x128-bit NEON FMA pipes (16 fp32
    # FLOP/cycle, 32 fp16 with ARMv8.2-FP16), no BF16 instructions, 8x DDR4-2933 channels.
    "kunpeng920": _published("Huawei Kunpeng 920-7260 (64 cores)", 64 * 2.6e9 * 16, None, None,
                             64 * 2.6e9 * 32, 8 * 23.47e9, "cpu",
                             "Huawei Kunpeng 920 product brief", mm_eff=0.6, bw_eff=0.7,
                             op_overhead=6e-6, kernel_overhead=3e-6),
}


def cache_dir() -> Path:
    return Path(os.environ.get("GLMC_CACHE_DIR", Path.home() / ".cache" / "glmc"))


CALIBRATION_VERSION = 4  #: bump when calibrate() measures differently; old caches are ignored


def _machine_key() -> str:
    ident = "|".join([str(CALIBRATION_VERSION), platform.node(), platform.machine(),
                      platform.processor(),
                      str(os.cpu_count()), str(torch.get_num_threads()), torch.__version__])
    return hashlib.sha1(ident.encode()).hexdigest()[:12]


def host_profile(recalibrate: bool = False) -> DeviceProfile:
    """The calibrated profile of this machine's CPU (measured once, then read from the cache)."""
    path = cache_dir() / f"cpu-profile-{_machine_key()}.json"
    if path.exists() and not recalibrate:
        try:
            return DeviceProfile.from_dict(json.loads(path.read_text()))
        except (KeyError, ValueError, TypeError):
            pass  # a stale or corrupt cache: measure again
    prof = calibrate()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(prof.to_dict(), indent=2))
    return prof


def _timeit(fn: Any, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def calibrate() -> DeviceProfile:
    """Measure the host CPU: matmul FLOP/s over sizes, copy bandwidth over sizes, dispatch
    overhead. Takes a few seconds."""
    with torch.no_grad():
        curves: dict[str, tuple[tuple[float, float], ...]] = {}
        for dtype in (torch.float32, torch.bfloat16, torch.float16):  # AMX/AVX512 differ a lot
            mm_curve = []
            for n in (32, 64, 128, 256, 512, 1024):
                a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
                reps = max(3, min(200, int(2e8 / n ** 3)))
                t = _timeit(lambda: torch.mm(a, b), reps)
                mm_curve.append((2.0 * n ** 3, 2.0 * n ** 3 / t))
            curves[str(dtype).replace("torch.", "")] = tuple(_monotone(mm_curve))
        bw_curve = []
        bw_curve = [(2.0 * nbytes, _write_bandwidth(nbytes))
                    for nbytes in (1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26)]
        x = torch.randn(1 << 22)
        t = _timeit(lambda: torch.exp(x), 5)
        vector = 8 * x.numel() / t  # exp counts 8 FLOP/element in this model
        # dispatch cost of the small scalar ops optimizer updates are full of
        one, f64 = torch.ones(()), torch.float64
        small = [lambda: aten.add.Tensor(one, one), lambda: aten.mul.Tensor(one, one),
                 lambda: aten._to_copy.default(one, dtype=f64), lambda: aten.sqrt.default(one),
                 lambda: aten.div.Tensor(one, one)]
        overhead = _timeit(lambda: [f() for _ in range(40) for f in small], 20) / 200
        rates = _kernel_rates()
    return DeviceProfile(
        name=f"host CPU: {platform.processor() or platform.machine()}, "
             f"{torch.get_num_threads()} threads",
        kind="cpu", matmul=curves, vector_flops=vector,
        bandwidth=tuple(bw_curve), op_overhead_s=overhead, kernel_overhead_s=overhead / 2,
        source=f"calibrated {time.strftime('%Y-%m-%d')} by glmc.cost.calibrate()",
        kernel_rates=rates)


def _write_bandwidth(nbytes: int) -> float:
    """Bytes/s of an elementwise op producing `nbytes` from a cold input into fresh memory."""
    # cycle through a pool larger than the last-level cache: in a training step most operands
    # were written long before they are read again, so they come from DRAM
    pool = [torch.randn(nbytes // 4) for _ in range(max(2, (1 << 28) // nbytes))]
    it = iter(range(1 << 62))
    kept: list[torch.Tensor] = []

    def op() -> None:
        # results stay alive for a while, as activations do, so each op writes memory fresh
        # from the allocator (page faults included), as in a real step
        kept.append(pool[next(it) % len(pool)].mul(1.0001))
        if len(kept) > 16:
            kept.pop(0)
    reps = max(3, min(100, int(4e9 / nbytes)))
    return 2.0 * nbytes / _timeit(op, reps)


def _kernel_rates() -> dict[str, float]:
    """Bytes/s of kernels that run far below memory bandwidth on CPUs, on a typical 4 MiB
    activation (NCHW 32x32x32x32, or 1024 tokens x 1024 classes)."""
    x = torch.randn(32, 32, 32, 32)
    w, b, rm, rv = torch.ones(32), torch.zeros(32), torch.zeros(32), torch.ones(32)
    pooled, idx = aten.max_pool2d_with_indices.default(x, [2, 2], [2, 2])
    bn = aten._native_batch_norm_legit_functional.default(x, w, b, rm, rv, True, 0.1, 1e-5)
    logits = torch.randn(1024, 1024)
    target = torch.randint(0, 1024, (1024,))
    logp = aten._log_softmax.default(logits, 1, False)
    nll, total = aten.nll_loss_forward.default(logp, target, None, 1, -100)
    one = torch.ones(())
    cases = {
        "max_pool2d_with_indices": (lambda: aten.max_pool2d_with_indices.default(
            x, [2, 2], [2, 2]), x, (pooled, idx)),
        "max_pool2d_with_indices_backward": (
            lambda: aten.max_pool2d_with_indices_backward.default(
                pooled, x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx), (pooled, x, idx), x),
        "_native_batch_norm_legit_functional": (
            lambda: aten._native_batch_norm_legit_functional.default(
                x, w, b, rm, rv, True, 0.1, 1e-5), x, bn[0]),
        "native_batch_norm_backward": (lambda: aten.native_batch_norm_backward.default(
            x, x, w, rm, rv, bn[1], bn[2], True, 1e-5, [True, True, True]), (x, x), x),
        "_log_softmax": (lambda: aten._log_softmax.default(logits, 1, False), logits, logp),
        "_softmax": (lambda: aten._softmax.default(logits, 1, False), logits, logp),
        "nll_loss_backward": (lambda: aten.nll_loss_backward.default(
            one, logp, target, None, 1, -100, total), target, logp),
        "_log_softmax_backward_data": (lambda: aten._log_softmax_backward_data.default(
            logp, logp, 1, torch.float32), (logp, logp), logp),
    }
    rates = {}
    for name, (fn, ins, outs) in cases.items():
        moved = sum(t.numel() * t.element_size() for t in _flat(ins) + _flat(outs))
        rates[name] = moved / _timeit(fn, 10)
    rates["_softmax_backward_data"] = rates["_log_softmax_backward_data"]
    rates["native_batch_norm"] = rates["_native_batch_norm_legit"] = \
        rates["_native_batch_norm_legit_functional"]
    return rates


def _flat(x: Any) -> list[torch.Tensor]:
    return list(x) if isinstance(x, (tuple, list)) else [x]


def _monotone(curve: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, best = [], 0.0
    for x, y in curve:
        best = max(best, y)
        out.append((x, best))
    return out


def get_profile(spec: Any = None, device: str = "cpu") -> DeviceProfile:
    """A profile by name ('host', 'h100', 'h200', 'a100', 'kunpeng920'), a DeviceProfile, or the
    default for `device` (the calibrated host CPU, or the matching built-in GPU)."""
    from glmc.errors import ConfigError
    if isinstance(spec, DeviceProfile):
        return spec
    if spec in (None, "host", "cpu"):
        if device == "cuda" and spec is None:
            gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
            for key in ("h200", "h100", "a100"):
                if key in gpu.lower():
                    return BUILTIN[key]
            return BUILTIN["h100"]
        return host_profile()
    if isinstance(spec, str) and spec.lower() in BUILTIN:
        return BUILTIN[spec.lower()]
    raise ConfigError(f"cost: unknown device profile {spec!r}; use 'host' or one of "
                      f"{sorted(BUILTIN)}")


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

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "gflops": round(self.flops / 1e9, 3),
                "gbytes": round(self.bytes / 1e9, 3), "kernels": self.kernels,
                "by_kind": {k: round(v, 6) for k, v in self.by_kind.items()},
                "unknown_ops": self.unknown, "profile": self.profile, "fused": self.fused}


def node_time(c: OpCost, prof: DeviceProfile, overhead: float) -> float:
    if c.kind == "matmul":
        compute = c.flops / prof.matmul_rate(c.dtype, c.flops)
    else:
        compute = c.flops / prof.vector_flops
    rate = prof.kernel_rates.get(c.name) if c.name else None
    memory = c.bytes / (rate or prof.bandwidth_at(c.bytes))
    return max(compute, memory) + overhead


def estimate_time(gm_graph: fx.Graph, prof: DeviceProfile, fused: bool,
                  measured: dict[str, float] | None = None) -> CostEstimate:
    """Predicted step time of `gm_graph` (the lowered step) on `prof`.

    `fused`: cost Inductor-style kernels (pointwise ops inlined into consumers). `measured`:
    node name -> seconds from `measure_node_times` (profile-guided mode) overrides formulas.
    """
    from glmc.memory import fusion_groups
    groups = fusion_groups(gm_graph) if fused else None
    overhead = prof.kernel_overhead_s if fused else prof.op_overhead_s
    total = flops = nbytes = 0.0
    kernels = 0
    by_kind: dict[str, float] = {}
    unknown: dict[str, int] = {}
    node_seconds: dict[str, float] = {}
    for n in gm_graph.nodes:
        if n.op != "call_function":
            continue
        c = op_cost(n)
        if c.kind == "unknown":
            unknown[op_name(n)] = unknown.get(op_name(n), 0) + 1
        if c.kind == "view":
            continue
        if groups is not None:
            if groups.inlined(n):
                flops += c.flops
                continue  # its work is counted inside the consumer's kernel
            c = groups.kernel_cost(n, c)
        if measured is not None and n.name in measured:
            t = measured[n.name]
        else:
            t = node_time(c, prof, overhead)
        node_seconds[n.name] = t
        total += t
        flops += c.flops
        nbytes += c.bytes
        kernels += 1
        by_kind[c.kind] = by_kind.get(c.kind, 0.0) + t
    return CostEstimate(total, flops, nbytes, kernels, by_kind, unknown,
                        prof.name + (" (profile-guided)" if measured else ""), fused, node_seconds)


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
