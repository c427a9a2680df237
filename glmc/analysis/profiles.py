"""Device profiles: the throughput figures the cost model predicts with, and where they came from.

A `DeviceProfile` holds rates (matmul FLOP/s per dtype and size, memory bandwidth per size,
the FLOP/s of a few kernels with a speed of their own such as CPU flash attention) and
overheads (an op dispatched from the step, a compiled kernel's launch, an ATen call made from
Python inside a fused op, a call of a Python custom op). Every profile carries a
`Provenance` — built-in published figures, a measurement of this machine (`glmc.analysis.calibration`),
a cache file, or a fallback chosen because nothing better was known — and the report shows it
next to every prediction.

Built-in profiles (`BUILTIN`): vendors' published peak figures times a stated efficiency
(h100, h200, a100, kunpeng920), and `generic-cpu`, conservative figures for a small server CPU
that need no measurement (use it to turn host calibration off, e.g. in CI).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable

Curve = tuple[tuple[float, float], ...]  #: ((size, rate), ...) sorted by size


@dataclass(frozen=True)
class Provenance:
    """Where a profile's figures come from.

    `source`: "builtin" (published or glmc's own conservative figures), "calibrated" (measured
    on this machine just now), "cache" (measured earlier on this machine, read from
    `cache_path`) or "fallback" (a stand-in; `notes` say why). `machine` and `date` describe
    the measurement, for calibrated and cached profiles.
    """

    source: str
    detail: str = ""
    machine: dict[str, Any] = field(default_factory=dict)
    date: str = ""
    cache_path: str = ""
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for the terminal summary and the report."""
        parts = [self.source]
        if self.detail:
            parts.append(self.detail)
        if self.date:
            parts.append(f"measured {self.date}")
        if self.machine.get("cpu"):
            parts.append(f"on {self.machine['cpu']}, {self.machine.get('threads')} threads, "
                         f"torch {self.machine.get('torch')}")
        if self.cache_path:
            parts.append(f"cache {self.cache_path}")
        return "; ".join(parts) + "".join(f" [{n}]" for n in self.notes)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "notes": list(self.notes)}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Provenance":
        return Provenance(d["source"], d.get("detail", ""), dict(d.get("machine") or {}),
                          d.get("date", ""), d.get("cache_path", ""), tuple(d.get("notes", ())))


@dataclass(frozen=True)
class DeviceProfile:
    """Throughput of one device. Curves are ((size, rate), ...) sorted by size; a single point
    is a flat rate. Sizes: FLOPs of one matmul / bytes moved by one op."""

    name: str
    kind: str  #: "cpu" | "cuda"
    matmul: dict[str, Curve]  #: dtype -> curve of FLOP/s
    vector_flops: float  #: FLOP/s of elementwise arithmetic
    bandwidth: Curve  #: curve of bytes/s
    op_overhead_s: float  #: per op dispatched one by one (eager)
    kernel_overhead_s: float  #: per fused kernel (compiled backends)
    source: str  #: where the figures come from
    #: measured bytes/s of specific ATen kernels whose speed is not set by bandwidth alone
    #: (pooling, batch norm, softmax, loss); empty for published profiles
    kernel_rates: dict[str, float] = field(default_factory=dict)
    #: measured FLOP/s over problem size (FLOPs of one call: `attention_flops`, or
    #: torch.utils.flop_counter's for convolutions) of matmul-like kernels that are not one
    #: BLAS call (CPU flash attention, convolution; forward and backward); others run at the
    #: matmul rate
    kernel_flops: dict[str, Curve] = field(default_factory=dict)
    #: per ATen call made from Python inside a fused op (glmc's chunked loss: Tensor methods,
    #: a cheaper path than the step's `torch.ops` calls)
    call_overhead_s: float = 0.0
    #: per call of a Python custom op (torch.library), beyond the ATen calls in its body
    custom_op_overhead_s: float = 0.0
    #: curve of bytes/s of passes over data just touched, over working-set size (the cache
    #: hierarchy: fast while it fits, memory speed beyond); empty: `bandwidth`
    reuse_bandwidth: Curve = ()
    #: the datasheet's dense matmul peak FLOP/s per dtype (what MFU is relative to); empty
    #: for measured profiles, whose best measured matmul rate stands in
    peak_matmul: dict[str, float] = field(default_factory=dict)
    #: how the figures were obtained; not part of equality (the same figures are the same
    #: profile whether measured now or read from the cache)
    provenance: Provenance | None = field(default=None, compare=False)

    def matmul_rate(self, dtype: str, flops: float) -> float:
        curve = self.matmul.get(dtype) or self.matmul["float32"]
        return _interp(curve, flops)

    def peak(self, dtype: str) -> float:
        """The peak matmul FLOP/s at `dtype`: the datasheet's, else the best rate known."""
        if dtype in self.peak_matmul:
            return self.peak_matmul[dtype]
        curve = self.matmul.get(dtype) or self.matmul["float32"]
        return max(r for _, r in curve)

    def bandwidth_at(self, nbytes: float) -> float:
        return _interp(self.bandwidth, nbytes)

    def reuse_bandwidth_at(self, nbytes: float) -> float:
        return _interp(self.reuse_bandwidth or self.bandwidth, nbytes)

    def with_provenance(self, provenance: Provenance) -> "DeviceProfile":
        return replace(self, provenance=provenance)

    def describe_provenance(self) -> str:
        if self.provenance is None:
            return f"user-supplied profile ({self.source})"
        return self.provenance.describe()

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["provenance"] = self.provenance.to_dict() if self.provenance else None
        return out

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "DeviceProfile":
        prov = d.get("provenance")
        return DeviceProfile(
            name=d["name"], kind=d["kind"],
            matmul={k: tuple(tuple(p) for p in v) for k, v in d["matmul"].items()},
            vector_flops=d["vector_flops"], bandwidth=tuple(tuple(p) for p in d["bandwidth"]),
            op_overhead_s=d["op_overhead_s"], kernel_overhead_s=d["kernel_overhead_s"],
            source=d["source"], kernel_rates=dict(d.get("kernel_rates", {})),
            kernel_flops={k: tuple(tuple(p) for p in v)
                          for k, v in d.get("kernel_flops", {}).items()},
            call_overhead_s=d.get("call_overhead_s", 0.0),
            custom_op_overhead_s=d.get("custom_op_overhead_s", 0.0),
            reuse_bandwidth=tuple(tuple(p) for p in d.get("reuse_bandwidth", ())),
            peak_matmul=dict(d.get("peak_matmul", {})),
            provenance=Provenance.from_dict(prov) if prov else None)


def describe_profile(prof: DeviceProfile) -> str:
    """A few lines for `glmc calibrate`: the figures that matter most and their provenance."""
    mm = ", ".join(f"{dt} {max(r for _, r in c) / 1e9:,.0f}" for dt, c in prof.matmul.items())
    bw = [r / 1e9 for _, r in prof.bandwidth]
    us = {k: f"{getattr(prof, k) * 1e6:.1f} us" for k in (
        "op_overhead_s", "kernel_overhead_s", "call_overhead_s", "custom_op_overhead_s")}
    return (f"{prof.name}\n  matmul peak GFLOP/s: {mm}\n  memory bandwidth GB/s: "
            f"{min(bw):,.1f} .. {max(bw):,.1f}\n  per-op overhead: {us['op_overhead_s']}, per "
            f"compiled kernel: {us['kernel_overhead_s']}, per call from a fused op's body: "
            f"{us['call_overhead_s']}, per Python custom op: {us['custom_op_overhead_s']}"
            f"\n  provenance: {prof.describe_provenance()}")


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


def attention_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int,
                    value_dim: int, causal: bool) -> float:
    """FLOPs of one flash-attention forward (QKᵀ and PV: 2·B·H·Sq·Skv·(D + Dv)). Causal
    attention skips the key blocks above the diagonal, per query block as PyTorch's CPU flash
    kernel splits queries (32 rows below 192, 64 below 768, else 256): the work is
    (Sq + block) / 2Sq of the full product. The backward is 2.5x this (five products)."""
    full = 2.0 * batch * heads * q_len * kv_len * (head_dim + value_dim)
    if not causal:
        return full
    block = 256 if q_len >= 768 else 64 if q_len >= 192 else 32
    return full * min(1.0, (q_len + block) / (2.0 * q_len))


#: backward / forward FLOPs of attention (forward products recomputed, dQ, dK, dV)
ATTENTION_BACKWARD_FACTOR = 2.5


def _published(name: str, fp32: float, bf16: float | None, fp16: float | None, bw: float,
               kind: str, source: str, mm_eff: float = 0.7, bw_eff: float = 0.8,
               op_overhead: float = 8e-6, kernel_overhead: float = 4e-6) -> DeviceProfile:
    """A flat profile from peak figures (torch's default fp32 matmul precision is "highest":
    no TF32, so TF32 peaks are not used). A Python custom op's inner calls each launch a
    kernel (one op's overhead); its own Python dispatch is taken as 3 ops' (CPU measurement)."""
    peaks = {k: v for k, v in (("float32", fp32), ("bfloat16", bf16), ("float16", fp16)) if v}
    mm = {k: ((1.0, v * mm_eff),) for k, v in peaks.items()}
    detail = f"{source}; model efficiency {mm_eff:.0%} of peak FLOP/s, {bw_eff:.0%} of peak " \
             "bandwidth"
    return DeviceProfile(name, kind, mm, fp32 * mm_eff, ((1.0, bw * bw_eff),), op_overhead,
                         kernel_overhead, detail, call_overhead_s=op_overhead,
                         custom_op_overhead_s=3 * op_overhead,
                         provenance=Provenance("builtin", detail), peak_matmul=peaks)


def _generic_cpu() -> DeviceProfile:
    """Deliberately modest figures (a 4-8 core AVX2 server slice under some load): predictions
    err towards too slow, never towards a machine faster than the user's."""
    detail = ("glmc's conservative built-in CPU figures (no measurement): 50 GFLOP/s fp32 "
              "matmul, 10 GB/s memory bandwidth, 10 us per op")
    mm = {"float32": ((1.0, 50e9),), "bfloat16": ((1.0, 25e9),), "float16": ((1.0, 10e9),)}
    return DeviceProfile("generic CPU (uncalibrated)", "cpu", mm, 5e9, ((1.0, 10e9),), 10e-6,
                         5e-6, detail, call_overhead_s=5e-6, custom_op_overhead_s=30e-6,
                         provenance=Provenance("builtin", detail))


#: Built-in profiles from vendors' published (dense, no sparsity) figures, and generic-cpu.
BUILTIN: dict[str, DeviceProfile] = {
    "h100": _published("NVIDIA H100 SXM5", 67e12, 989e12, 989e12, 3.35e12, "cuda",
                       "NVIDIA H100 datasheet"),
    "h200": _published("NVIDIA H200 SXM", 67e12, 989e12, 989e12, 4.8e12, "cuda",
                       "NVIDIA H200 datasheet"),
    "a100": _published("NVIDIA A100 SXM4 80GB", 19.5e12, 312e12, 312e12, 2.039e12, "cuda",
                       "NVIDIA A100 datasheet"),
    "a100-40g": _published("NVIDIA A100 SXM4 40GB", 19.5e12, 312e12, 312e12, 1.555e12, "cuda",
                           "NVIDIA A100 datasheet (40GB: 1,555 GB/s HBM2)"),
    # Kunpeng 920-6426 (Hi1620): 64 TaiShan v110 cores (ARMv8.2-A, NEON, no SVE) at 2.6 GHz
    # [WikiChip: hisilicon/kunpeng/920-6426]; two 128-bit ASIMD pipes, each an FMA per cycle
    # ("double SP vector throughput, 2 inst/cycle", WikiChip: TaiShan v110): 2 x 4 lanes x 2 =
    # 16 fp32 FLOP/cycle/core, 32 fp16 (ARMv8.2 FP16 arithmetic, `asimdhp`), no BF16
    # instructions; 8 DDR4-2933 channels x 8 B = 187.7 GB/s peak [WikiChip]; 64 KiB L1D,
    # 512 KiB L2 per core, 1 MiB L3 per core shared [WikiChip]. The efficiencies (60% of peak
    # FLOP/s for matmuls, 70% of peak bandwidth) and overheads are glmc's assumptions for a
    # NEON GEMM library (OpenBLAS / KML / ACL), not measured on a Kunpeng.
    "kunpeng920": _published("Huawei Kunpeng 920-6426 (64 cores)", 64 * 2.6e9 * 16, None,
                             64 * 2.6e9 * 32, 8 * 2.933e9 * 8, "cpu",
                             "WikiChip (Kunpeng 920-6426, TaiShan v110); efficiencies assumed",
                             mm_eff=0.6, bw_eff=0.7, op_overhead=6e-6, kernel_overhead=3e-6),
    "generic-cpu": _generic_cpu(),
}

#: the GPU profiles `get_profile` matches against torch.cuda.get_device_name()
GPU_KEYS = ("h200", "h100", "a100")
#: what an unrecognised CUDA GPU is predicted with (with a warning)
GPU_FALLBACK = "h100"
