"""Cost model: FLOPs and bytes moved per ATen op, and the predicted step time on a device.

The model (stated once, used by every pass):

    time(kernel) = max(flops / F(kind, dtype, size), bytes / B(bytes)) + overhead

summed over the kernels of the step in execution order (one device stream, no overlap).

* A *kernel* is one ATen op on a backend that runs ops one by one (`eager`), or one fused group
  on a backend that fuses (`BackendTraits.fusion`, e.g. Inductor's pointwise inlining): ops
  inlined into their consumer move no bytes of their own.
* F is the matmul rate for matmul-like ops (mm, bmm, addmm, convolution, attention; FLOPs from
  `torch.utils.flop_counter`), the vector rate for the rest, from a `DeviceProfile`
  (`glmc.analysis.profiles`): on the host CPU measured by `glmc.analysis.calibration` as curves over problem size
  and cached per machine; the GPU and Kunpeng profiles use published peak figures times a
  stated efficiency. `get_profile` picks one; every profile says where it came from.
* overhead is the per-op dispatch cost (Python + ATen dispatcher) for `eager`, the per-kernel
  launch cost for fused backends.
* What each op costs (kind, FLOPs, bytes, overheads) is `glmc.analysis.opcost`'s rules. Fused ops have
  rules of their own there: flash attention (FLOPs from the shapes, at the attention rate the
  profile measured) and glmc's kernels, which run as Python custom ops: the ATen kernels their
  bodies run (chunk by chunk for the losses; passes over data just touched at the cache's
  speed), plus the profile's overhead per ATen call they make and per custom-op dispatch. On
  Inductor the elementwise ones are one generated kernel instead, and generated kernels
  between two extern calls share a launch (`glmc.backends.inductor.model`).
* On a backend that dispatches op by op, a view moves nothing but is still one dispatch.

Ops the model has no rule for are costed by the generic bytes rule, counted and reported as
`unknown` — never silently zero. A profile-guided mode (`measure_node_times`) times every node
on real tensors and replaces the formulas.
"""
from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from glmc.analysis.calibration import calibrate, default_cpu_profile, host_profile
from glmc.analysis.opcost import OpCost, is_view, kind_of, op_cost, value_bytes
from glmc.analysis.profiles import (BUILTIN, GPU_FALLBACK, GPU_KEYS, DeviceProfile, Provenance,
                                    _interp)
from glmc.errors import ConfigError
from glmc.ir.target import EAGER, BackendTraits

__all__ = ["BUILTIN", "DeviceProfile", "Provenance", "calibrate", "host_profile", "_interp",
           "get_profile", "estimate_time", "op_cost", "kind_of", "is_view", "node_time",
           "memory_time", "OpCost", "value_bytes"]

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
                      f"{sorted(BUILTIN)}, or pass a glmc.analysis.profiles.DeviceProfile")


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
        "glmc.analysis.profiles.DeviceProfile with your GPU's figures", stacklevel=3)
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


def roofline_time(c: OpCost, prof: DeviceProfile) -> float:
    """Seconds of one op's work (its roofline, or its parts'), without any overhead."""
    return sum(k * _roofline(p, prof) for p, k in c.parts) if c.parts else _roofline(c, prof)


def node_time(c: OpCost, prof: DeviceProfile, overhead: float) -> float:
    """Seconds of one op or kernel: its roofline (or its parts'), plus `overhead` per launch,
    the custom-op dispatch of a Python op and the profile's call overhead per ATen call."""
    body = roofline_time(c, prof)
    own = prof.custom_op_overhead_s if c.python_op else overhead * c.launches
    return body + own + c.calls * prof.call_overhead_s


def memory_time(c: OpCost, prof: DeviceProfile) -> float:
    """Of `roofline_time`, the seconds its memory traffic sets (all of a memory-bound op's,
    the traffic's own time hidden under a compute-bound one's): what memory bandwidth
    shared with other processes slows."""
    parts = c.parts or ((c, 1),)
    return sum(k * _bounds(p, prof)[1] for p, k in parts)


def _roofline(c: OpCost, prof: DeviceProfile) -> float:
    return max(_bounds(c, prof))


def _bounds(c: OpCost, prof: DeviceProfile) -> tuple[float, float]:
    """(compute, memory) seconds of one op's work."""
    if c.name in prof.kernel_flops:
        compute = c.flops / _interp(prof.kernel_flops[c.name], c.flops)
    elif c.kind == "matmul":
        compute = c.flops / prof.matmul_rate(c.dtype, c.flops)
    else:
        compute = c.flops / prof.vector_flops
    rate = prof.kernel_rates.get(c.name) if c.name else None
    memory = c.bytes / (rate or prof.bandwidth_at(c.bytes)) if c.bytes else 0.0
    if c.reused:
        memory += c.reused / prof.reuse_bandwidth_at(c.working_set or c.reused)
    return compute, memory


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
        self.kernels += c.launches  # a kernel fused into another's launch is not one more
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
            if fusion is None and isinstance(n.target, torch._ops.OpOverload):
                tot.add(n.name, c, overhead)  # moves nothing, but is dispatched like any op
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
