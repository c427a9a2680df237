"""Host CPU calibration: measured, checked, cached per machine, and traceable.

`calibrate()` returns the profile of this machine's CPU. It measures matmul FLOP/s (operands
cold, as in a step) and memory bandwidth (fresh memory, and over data just touched) over
problem sizes (caches matter on CPUs), vector FLOP/s, the FLOP/s of flash attention and
convolution over problem size, overheads (an op dispatched by the step, a compiled kernel's
launch, an ATen call from a fused op's Python body, a Python custom op's dispatch) and the
rates of a few kernels that run below bandwidth. Guarantees:

* robust: every figure is the best of many repetitions (load only ever slows a call down),
  and a calibration whose figures are physically implausible for a CPU (`check_plausible`:
  e.g. memory bandwidth below 1 GB/s, fp32 matmul below 1 GFLOP/s) is measured again, keeping
  the best of each figure; if it still fails, `calibrate` warns and returns the `generic-cpu`
  profile instead (never cached);
* cached per machine in `$GLMC_CACHE_DIR` (default `~/.cache/glmc`), with the machine (CPU
  model, cores, threads, torch version) and the date; a cache written on another machine, by
  another calibration version, unreadable or implausible is measured again (the last two with
  a warning);
* visible: the profile's `Provenance` names source, machine, date and cache path;
* optional: `GLMC_CALIBRATE=0` (or `profile="generic-cpu"`) predicts with the built-in
  conservative CPU profile and measures nothing; `calibrate(force=True)` (`glmc calibrate`)
  measures again and rewrites the cache.
"""
from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import platform
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from glmc.analysis.profiles import (ATTENTION_BACKWARD_FACTOR, BUILTIN, Curve, DeviceProfile,
                                    Provenance, attention_flops)

aten = torch.ops.aten

CALIBRATION_VERSION = 7  #: bump when calibration measures differently; old caches are redone
ATTEMPTS = 3  #: measurements of the whole calibration before giving up on plausibility
#: (low, high) plausible for any CPU: bytes/s, FLOP/s, seconds
PLAUSIBLE = {"bandwidth": (1e9, 2e12), "matmul_fp32": (1e9, 1e15),
             "matmul_low": (1e8, 1e15), "vector": (1e8, 1e14), "overhead": (1e-8, 1e-3),
             "kernel_rate": (1e8, 2e12)}
#: machine fields that must match for a cached calibration to be used
IDENTITY = ("cpu", "arch", "cores", "logical_cpus", "threads", "torch")


# ---- machine identity and the cache -----------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """The facts a CPU calibration depends on (and the host name, for the report only)."""
    return {"cpu": _cpu_model(), "arch": platform.machine(), "cores": _physical_cores(),
            "logical_cpus": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "host": platform.node()}


def _cpuinfo() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read().splitlines()
    except OSError:
        return []


def _cpu_model() -> str:
    for line in _cpuinfo():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "cpu model") and value.strip():
            return value.strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def _physical_cores() -> int | None:
    cores, phys = set(), "0"
    for line in _cpuinfo():
        key, _, value = line.partition(":")
        if key.strip() == "physical id":
            phys = value.strip()
        elif key.strip() == "core id":
            cores.add((phys, value.strip()))
    return len(cores) or None


def cache_dir() -> Path:
    return Path(os.environ.get("GLMC_CACHE_DIR", Path.home() / ".cache" / "glmc"))


def cache_path(machine: dict[str, Any] | None = None) -> Path:
    machine = machine or machine_info()
    ident = "|".join([str(CALIBRATION_VERSION)] + [str(machine.get(k)) for k in IDENTITY])
    return cache_dir() / f"cpu-profile-{hashlib.sha1(ident.encode()).hexdigest()[:12]}.json"


def calibration_enabled() -> bool:
    """False when the user turned host calibration off with GLMC_CALIBRATE=0."""
    return os.environ.get("GLMC_CALIBRATE", "1").strip().lower() not in ("0", "off", "false",
                                                                         "no")


def _read_cache(path: Path, machine: dict[str, Any]) -> tuple[DeviceProfile | None, str, bool]:
    """(profile, why it was rejected, whether that deserves a warning)."""
    if not path.exists():
        return None, "", False
    try:
        data = json.loads(path.read_text())
        if data.get("glmc_calibration") != CALIBRATION_VERSION:
            return None, "written by another calibration version", False
        diff = [k for k in IDENTITY if data["machine"].get(k) != machine.get(k)]
        if diff:
            was, now = data["machine"].get(diff[0]), machine.get(diff[0])
            return None, f"measured on another machine ({diff[0]}: {was!r}, here {now!r})", False
        prof = DeviceProfile.from_dict(data["profile"])
    except (OSError, KeyError, ValueError, TypeError, AttributeError) as e:
        return None, f"unreadable ({type(e).__name__}: {e})", True
    problems = check_plausible(prof)
    if problems:
        return None, "implausible for a CPU: " + "; ".join(problems), True
    prov = Provenance("cache", "measured by glmc.analysis.calibration", dict(data["machine"]),
                      data.get("date", ""), str(path), tuple(data.get("notes", ())))
    return prof.with_provenance(prov), "", False


def _write_cache(path: Path, prof: DeviceProfile, machine: dict[str, Any], date: str,
                 notes: list[str]) -> None:
    """Atomically: a concurrent reader sees the old file or the new one, never half of it."""
    data = {"glmc_calibration": CALIBRATION_VERSION, "machine": machine, "date": date,
            "notes": notes, "profile": {**prof.to_dict(), "provenance": None}}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


# ---- the public entry points ------------------------------------------------------------------


def calibrate(force: bool = False) -> DeviceProfile:
    """This machine's CPU profile: from the cache when it is valid for this machine, else (or
    with `force=True`, as `glmc calibrate` does) measured now and cached. Takes a few seconds
    when it measures."""
    machine = machine_info()
    path = cache_path(machine)
    why = "forced (calibrate(force=True))" if force else ""
    if not force:
        cached, why, loud = _read_cache(path, machine)
        if cached is not None:
            return cached
        if loud:
            warnings.warn(f"glmc calibration: the cached host profile {path} is {why}; "
                          "measuring this machine again", stacklevel=2)
    return _measure_and_cache(path, machine, why)


def host_profile(recalibrate: bool = False) -> DeviceProfile:
    """The calibrated profile of this machine's CPU (same as `calibrate(force=recalibrate)`)."""
    return calibrate(force=recalibrate)


def default_cpu_profile() -> DeviceProfile:
    """The profile used for CPU steps when the user names none: the calibrated host, or
    `generic-cpu` when GLMC_CALIBRATE=0 turned calibration off."""
    if calibration_enabled():
        return calibrate()
    prov = Provenance("builtin", BUILTIN["generic-cpu"].source,
                      notes=("host calibration turned off by GLMC_CALIBRATE=0",))
    return BUILTIN["generic-cpu"].with_provenance(prov)


def _measure_and_cache(path: Path, machine: dict[str, Any], why: str) -> DeviceProfile:
    prof, notes = measure_host()
    if why:
        notes.insert(0, f"re-measured: previous cache {why}")
    problems = check_plausible(prof)
    if problems:
        warnings.warn("glmc calibration: this machine's measured figures stay implausible for a "
                      f"CPU after {ATTEMPTS} attempts ({'; '.join(problems)}) — is it heavily "
                      "loaded? Predicting with the built-in 'generic-cpu' profile; run "
                      "`glmc calibrate` when the machine is idle", stacklevel=3)
        prov = Provenance("fallback", BUILTIN["generic-cpu"].source, machine,
                          notes=tuple(notes + problems))
        return BUILTIN["generic-cpu"].with_provenance(prov)
    date = datetime.datetime.now().isoformat(timespec="seconds")
    _write_cache(path, prof, machine, date, notes)
    return prof.with_provenance(Provenance("calibrated", "measured by glmc.analysis.calibration",
                                           machine, date, str(path), tuple(notes)))


# ---- plausibility -----------------------------------------------------------------------------


def check_plausible(prof: DeviceProfile) -> list[str]:
    """What in a CPU profile no real CPU would show (empty when all is plausible)."""
    problems: list[str] = []

    def check(what: str, value: float, bounds: str) -> None:
        lo, hi = PLAUSIBLE[bounds]
        if not (lo <= value <= hi):  # also catches NaN
            problems.append(f"{what} {value:.3g} outside [{lo:.0e}, {hi:.0e}]")
    for size, rate in prof.bandwidth + prof.reuse_bandwidth:
        check(f"bandwidth at {size:.0f} B (B/s)", rate, "bandwidth")
    for dtype, curve in prof.matmul.items():
        bounds = "matmul_fp32" if dtype == "float32" else "matmul_low"
        check(f"{dtype} matmul peak (FLOP/s)", max(r for _, r in curve), bounds)
        # a stalled thread pool (another job spinning on the same cores) can slow every call
        # of the smallest size 1000-fold while the peak still looks right
        check(f"{dtype} matmul at {curve[0][0]:.0f} FLOPs (FLOP/s)", curve[0][1], "matmul_low")
    check("vector FLOP/s", prof.vector_flops, "vector")
    check("op overhead (s)", prof.op_overhead_s, "overhead")
    check("kernel launch overhead (s)", prof.kernel_overhead_s, "overhead")
    check("call overhead (s)", prof.call_overhead_s, "overhead")
    check("custom op overhead (s)", prof.custom_op_overhead_s, "overhead")
    for name, rate in prof.kernel_rates.items():
        check(f"{name} rate (B/s)", rate, "kernel_rate")
    for name, curve in prof.kernel_flops.items():
        check(f"{name} peak (FLOP/s)", max(r for _, r in curve), "matmul_low")
    return problems


# ---- measurement ------------------------------------------------------------------------------


def measure_host(attempts: int = ATTEMPTS) -> tuple[DeviceProfile, list[str]]:
    """Measure up to `attempts` times until the figures are plausible, keeping the best value
    of every figure over the attempts. Returns the profile and notes on the retries."""
    prof: DeviceProfile | None = None
    notes: list[str] = []
    for i in range(attempts):
        fresh = measure_once()
        prof = fresh if prof is None else _best_of(prof, fresh)
        problems = check_plausible(prof)
        if not problems:
            break
        notes.append(f"attempt {i + 1} implausible ({'; '.join(problems)}); measured again")
    assert prof is not None
    return prof, notes


def _best_of(a: DeviceProfile, b: DeviceProfile) -> DeviceProfile:
    """Figure by figure, the faster of two measurements of the same machine."""
    def curve(x: Curve, y: Curve) -> Curve:
        return tuple((s, max(r1, r2)) for (s, r1), (_, r2) in zip(x, y))

    def least(x: float, y: float) -> float:  # 0 is a failed measurement, not a fast one
        return min(x, y) if x > 0 and y > 0 else max(x, y)
    return DeviceProfile(
        a.name, a.kind, {k: curve(v, b.matmul[k]) for k, v in a.matmul.items()},
        max(a.vector_flops, b.vector_flops), curve(a.bandwidth, b.bandwidth),
        least(a.op_overhead_s, b.op_overhead_s), least(a.kernel_overhead_s, b.kernel_overhead_s),
        a.source, {k: max(v, b.kernel_rates.get(k, v)) for k, v in a.kernel_rates.items()},
        {k: curve(v, b.kernel_flops.get(k, v)) for k, v in a.kernel_flops.items()},
        least(a.call_overhead_s, b.call_overhead_s),
        least(a.custom_op_overhead_s, b.custom_op_overhead_s),
        curve(a.reuse_bandwidth, b.reuse_bandwidth))


def _best(fn: Callable[[], Any], reps: int) -> float:
    """Seconds per call: the fastest of `reps` timed calls after one warm-up. Contention only
    ever slows a call down, and on a shared machine it delays most calls (2 busy cores: the
    median of a 256 KiB elementwise op measured 40x its minimum), so the minimum is the one
    statistic that does not drift with load."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_once() -> DeviceProfile:
    """One measurement of the host CPU (a few seconds)."""
    with torch.no_grad():
        curves = {str(dt).replace("torch.", ""): _matmul_curve(dt)
                  for dt in (torch.float32, torch.bfloat16, torch.float16)}  # AMX/AVX512 differ
        sizes = (1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26)
        bandwidth = tuple((2.0 * nbytes, _write_bandwidth(nbytes)) for nbytes in sizes)
        reuse = tuple((2.0 * nbytes, _reuse_bandwidth(nbytes)) for nbytes in sizes)
        x = torch.randn(1 << 22)
        vector = 8 * x.numel() / _best(lambda: torch.exp(x), 5)  # exp: 8 FLOP/element here
        rates = _kernel_rates()
        matmul_like = _kernel_flop_curves()
    return DeviceProfile(
        name=f"host CPU: {_cpu_model()}, {torch.get_num_threads()} threads", kind="cpu",
        matmul=curves, vector_flops=vector, bandwidth=bandwidth,
        op_overhead_s=_dispatch_overhead(), kernel_overhead_s=_launch_overhead(),
        source="glmc.analysis.calibration (best of repeated timings)", kernel_rates=rates,
        kernel_flops=matmul_like, call_overhead_s=_call_overhead(),
        custom_op_overhead_s=_custom_op_overhead(), reuse_bandwidth=reuse)


def _matmul_curve(dtype: torch.dtype) -> Curve:
    """FLOP/s of square matmuls over size, with operands cycled through a pool larger than
    the caches: in a step a matmul's operands were written by other kernels or are weights last
    read long before (cache-hot operands measured 15-25% faster below 256x256)."""
    points = []
    for n in (32, 64, 128, 256, 512, 1024):
        count = max(2, _POOL_BYTES // (2 * n * n * 4))
        a = torch.full((count, n, n), 0.5, dtype=dtype)
        b = torch.full((count, n, n), 0.25, dtype=dtype)
        it = iter(range(1 << 62))

        def mm(a: torch.Tensor = a, b: torch.Tensor = b, count: int = count) -> None:
            i = next(it) % count
            torch.mm(a[i], b[i])
        reps = max(3, min(200, int(2e8 / n ** 3)))
        points.append((2.0 * n ** 3, 2.0 * n ** 3 / _best(mm, reps)))
    return _monotone(points)


_POOL_BYTES = 32 << 20  #: operand pool of the matmul curve: beyond a server CPU's L2 and most L3


def _dispatch_overhead() -> float:
    """Seconds per small scalar op, the kind optimizer updates are full of."""
    one, f64 = torch.ones(()), torch.float64
    small = [lambda: aten.add.Tensor(one, one), lambda: aten.mul.Tensor(one, one),
             lambda: aten._to_copy.default(one, dtype=f64), lambda: aten.sqrt.default(one),
             lambda: aten.div.Tensor(one, one)]
    return _best(lambda: [f() for _ in range(40) for f in small], 20) / 200


def _launch_overhead() -> float:
    """Seconds per compiled kernel beyond its work: the generated wrapper allocates the output
    buffer and calls the kernel on it (measured as empty_strided + one out= call on 64
    elements: 2.4 us on a 2-core EPYC VM, where Inductor's CPU kernels measured 2.0 us more
    than their work in a chain of 20)."""
    a = torch.ones(64)

    def launch() -> None:
        torch.add(a, a, out=torch.empty_strided((64,), (1,)))
    return _best(lambda: [launch() for _ in range(40)], 20) / 40


def _call_overhead() -> float:
    """Seconds per ATen call made from the Python body of a fused op, on tensors small enough
    that the work is nothing: the statements of a chunked loss (slices, a fp32 copy,
    logsumexp, gather, masks, reductions; 16 calls), as glmc's kernels make them."""
    logits, target = torch.randn(8, 16), torch.randint(0, 16, (8,))

    def body() -> None:
        c = logits[0:8].float()
        lse = torch.logsumexp(c, dim=-1)
        t = target[0:8].clamp(min=0)
        picked = c.gather(1, t.unsqueeze(1)).squeeze(1)
        valid = target != -100
        nll = torch.where(valid, lse - picked, torch.zeros_like(lse))
        nll.sum() / valid.sum().to(torch.float32)
    return _best(lambda: [body() for _ in range(10)], 20) / 160


@functools.cache
def _probe_op() -> Callable[[torch.Tensor], torch.Tensor]:
    """A Python custom op whose body is one clone (registered on first use)."""
    @torch.library.custom_op("glmc_calibration::clone", mutates_args=())
    def probe(x: torch.Tensor) -> torch.Tensor:
        return x.clone()
    return torch.ops.glmc_calibration.clone.default


def _custom_op_overhead() -> float:
    """Seconds a Python custom op (torch.library) adds to its body: the op called as the step
    calls it, minus its body called directly (11-15 us on a 2-core EPYC VM)."""
    op, x = _probe_op(), torch.ones(64)
    call = _best(lambda: [op(x) for _ in range(20)], 20) / 20
    body = _best(lambda: [x.clone() for _ in range(20)], 20) / 20
    return max(call - body, 0.0)  # 0 (noise) is implausible and measured again


def _kernel_flop_curves() -> dict[str, Curve]:
    """FLOP/s over problem size of matmul-like kernels that are not one BLAS call, and run
    well below the matmul rate at the same FLOPs: CPU flash attention (blocked GEMMs with
    softmax between; causal, as decoders use it) and convolution (oneDNN), forward and
    backward (1 thread here: attention 23 GFLOP/s at 1 MFLOP and 56 at 200 MFLOP, 3x3
    convolution 30 and 55, against the matmul's 75 and 100)."""
    fwd = aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    points: dict[str, list[tuple[float, float]]] = {}

    def add(name: str, flops: float, call: Callable[[], Any]) -> None:
        reps = max(3, min(50, int(2e8 / flops)))
        points.setdefault(name, []).append((flops, flops / _best(call, reps)))
    for b, h, s, d in ((2, 4, 32, 16), (2, 8, 128, 64), (2, 8, 512, 64)):
        q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
        out, lse = fwd(q, k, v, 0.0, True)
        flops = attention_flops(b, h, s, s, d, d, True)
        add(fwd.__name__.split(".")[0], flops, lambda q=q, k=k, v=v: fwd(q, k, v, 0.0, True))
        add(bwd.__name__.split(".")[0], ATTENTION_BACKWARD_FACTOR * flops,
            lambda q=q, k=k, v=v, o=out, m=lse: bwd(o, q, k, v, o, m, 0.0, True))
    for n, c_in, c_out, hw in ((8, 3, 16, 16), (8, 16, 32, 16), (16, 32, 64, 32)):
        x, w = torch.randn(n, c_in, hw, hw), torch.randn(c_out, c_in, 3, 3)
        grad = torch.randn(n, c_out, hw, hw)
        flops = 2.0 * n * c_out * hw * hw * c_in * 9  # torch.utils.flop_counter's count
        add("convolution", flops, lambda x=x, w=w: aten.convolution.default(
            x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1))
        add("convolution_backward", 2 * flops, lambda g=grad, x=x, w=w:
            aten.convolution_backward.default(g, x, w, [0], [1, 1], [1, 1], [1, 1], False,
                                              [0, 0], 1, [True, True, False]))
    return {name: _monotone(pts) for name, pts in points.items()}


def _monotone(points: list[tuple[float, float]]) -> Curve:
    """A larger problem is never slower per FLOP (the best rate so far)."""
    out, best = [], 0.0
    for size, rate in points:
        best = max(best, rate)
        out.append((size, best))
    return tuple(out)


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
    return 2.0 * nbytes / _best(op, reps)


def _reuse_bandwidth(nbytes: int) -> float:
    """Bytes/s of an elementwise op over data it touched just before, into a buffer it wrote
    just before: the passes inside a fused op's body (cache speed up to the cache's size)."""
    x = torch.randn(nbytes // 4)
    out = torch.empty_like(x)
    reps = max(3, min(100, int(4e9 / nbytes)))
    return 2.0 * nbytes / _best(lambda: torch.mul(x, 1.0001, out=out), reps)


def _kernel_cases() -> dict[str, tuple[Callable[[], Any], Any, Any]]:
    """name -> (call, inputs, outputs) on a typical 4 MiB activation (NCHW 32x32x32x32, or
    1024 tokens x 1024 classes)."""
    x = torch.randn(32, 32, 32, 32)
    w, b, rm, rv = torch.ones(32), torch.zeros(32), torch.zeros(32), torch.ones(32)
    pooled, idx = aten.max_pool2d_with_indices.default(x, [2, 2], [2, 2])
    bn = aten._native_batch_norm_legit_functional.default(x, w, b, rm, rv, True, 0.1, 1e-5)
    logits, target = torch.randn(1024, 1024), torch.randint(0, 1024, (1024,))
    logp = aten._log_softmax.default(logits, 1, False)
    _, total = aten.nll_loss_forward.default(logp, target, None, 1, -100)
    one = torch.ones(())
    return {
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


def _kernel_rates() -> dict[str, float]:
    """Bytes/s of kernels that run far below memory bandwidth on CPUs."""
    rates = {}
    for name, (fn, ins, outs) in _kernel_cases().items():
        moved = sum(t.numel() * t.element_size() for t in _flat(ins) + _flat(outs))
        rates[name] = moved / _best(fn, 10)
    rates["_softmax_backward_data"] = rates["_log_softmax_backward_data"]
    rates["native_batch_norm"] = rates["_native_batch_norm_legit"] = \
        rates["_native_batch_norm_legit_functional"]
    return rates


def _flat(x: Any) -> list[torch.Tensor]:
    return list(x) if isinstance(x, (tuple, list)) else [x]
