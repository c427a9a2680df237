"""Where glmc's TVM training step spends its time, kernel by kernel: with glmc's CPU schedule
rules and without them (TVM's default pipeline), on the host.

Each kernel call of one step is timed by Relax VM's instrumentation hook (wall time around the
call, kernels grouped by name, with the argument shapes of their first call). The step time
beside it is the median of `--steps` whole steps outside the profiler.

    python benchmarks/profile_tvm.py --model glm-small                 # both builds
    python benchmarks/profile_tvm.py --model glm --builds scheduled --top 15
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import platform
import re
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_tvm  # noqa: E402

import glmc  # noqa: E402
from glmc.backends.tvm import backend as tvm_backend  # noqa: E402
from glmc.trace.capture import split_batch  # noqa: E402
from tests.models import twin  # noqa: E402

BUILDS = {"scheduled": True, "default": False}
#: kernel classes for the summary, by the first pattern in a kernel's name (fused kernels are
#: named after their ops, a matmul's first)
CLASSES = (("matmul", "matmul"), ("transpose", "transpose"),
           ("softmax / log-softmax / loss", "softmax|exp|log"),
           ("norms and reductions", "mean|sum|power|rsqrt|variance|max"),
           ("VM (allocation, checks)", r"vm\.builtin"), ("elementwise", ""))


class _Capture:
    """Keeps the built executable and the first step's inputs (to replay under the profiler)."""

    def __init__(self) -> None:
        self.build_s = 0.0
        self.executable: Any = None
        self.inputs: list[torch.Tensor] | None = None
        self._build, self._call = tvm_backend.build, tvm_backend._Runner.__call__

    def __enter__(self) -> _Capture:
        def build(module: Any, target: Any, schedules: bool = True) -> Any:
            t0 = time.perf_counter()
            self.executable = self._build(module, target, schedules)
            self.build_s = time.perf_counter() - t0
            return self.executable

        def call(runner: Any, inputs: list[torch.Tensor]) -> Any:
            if self.inputs is None:
                self.inputs = [t.clone() for t in inputs]
            return self._call(runner, inputs)

        tvm_backend.build, tvm_backend._Runner.__call__ = build, call
        return self

    def __exit__(self, *_exc: Any) -> None:
        tvm_backend.build, tvm_backend._Runner.__call__ = self._build, self._call


def kernels(executable: Any, inputs: list[torch.Tensor]) -> list[dict]:
    """One instrumented run of the step: per kernel name, total ms, calls, first shapes."""
    import tvm
    from tvm import relax
    vm = relax.VirtualMachine(executable, tvm.cpu())
    acc: dict[str, dict] = collections.defaultdict(lambda: {"ms": 0.0, "calls": 0})
    started: dict[str, float] = {}

    def hook(_func: Any, name: str, before: bool, _ret: Any, *args: Any) -> int:
        if before:
            started[name] = time.perf_counter()
            return 0
        row = acc[name]
        row["ms"] += 1e3 * (time.perf_counter() - started[name])
        row["calls"] += 1
        row.setdefault("shapes", [list(a.shape) for a in args if hasattr(a, "shape")])
        return 0

    args = [tvm_backend.to_tvm(t) for t in inputs]
    vm["main"](*args)  # warm: first-call allocations out of the profile
    vm.set_instrument(hook)
    vm["main"](*args)
    return sorted(({"kernel": k, **v} for k, v in acc.items()), key=lambda r: -r["ms"])


def by_class(rows: list[dict]) -> dict[str, float]:
    """Total ms per kernel class (CLASSES), in CLASSES' order."""
    totals = dict.fromkeys((name for name, _ in CLASSES), 0.0)
    for r in rows:
        name = next(n for n, pattern in CLASSES if re.search(pattern, r["kernel"]))
        totals[name] = round(totals[name] + r["ms"], 2)
    return totals


def profile(model: str, schedules: bool, steps: int) -> dict:
    (m, x, loss_fn, opt), _ = twin(bench_tvm.WORKLOADS[model])
    backend = tvm_backend.TvmBackend(schedules=schedules)
    with _Capture() as cap:
        t0 = time.perf_counter()
        trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend=backend,
                                measure=False, predict=False)
        args, kwargs = split_batch(x)
        loss = trainer.step(*args, **kwargs).item()
        compile_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.step(*args, **kwargs).item()
        times.append(time.perf_counter() - t0)
    rows = kernels(cap.executable, cap.inputs)
    return {"model": model, "schedules": schedules, "first_loss": loss,
            "compile_s": round(compile_s, 1), "build_s": round(cap.build_s, 1),
            "step_ms": round(1e3 * statistics.median(times), 2),
            "profiled_ms": round(sum(r["ms"] for r in rows), 2), "classes": by_class(rows),
            "kernels": rows}


def markdown(result: dict, top: int) -> str:
    """Kernel classes before / after side by side, then the scheduled build's top kernels."""
    runs = {("scheduled" if r["schedules"] else "default"): r for r in result["runs"]}
    meta = result["meta"]
    lines = ["# TVM training step, kernel by kernel", "",
             f"{meta['date']}; {meta['cpu']}, {meta['threads']} threads; torch {meta['torch']},"
             f" tvm {meta['tvm']}. Each kernel call of one step timed by Relax VM's "
             "instrumentation (wall time around the call); the step is the median of whole "
             "steps outside the profiler.", "", f"Reproduce: `{meta['command']}`", ""]
    order = [b for b in ("default", "scheduled") if b in runs]
    names = {"default": "TVM default pipeline", "scheduled": "glmc schedules"}
    head = " | ".join(f"{names[b]} (ms)" for b in order)
    lines += [f"| {runs[order[0]]['model']} | {head} |" + (" speed-up |" if len(order) == 2
                                                          else ""),
              "|---|" + "---|" * (len(order) + (len(order) == 2))]
    rows = [("step (median)", "step_ms"), ("profiled step", "profiled_ms")]
    cells = [(label, [runs[b][key] for b in order]) for label, key in rows]
    cells += [(name, [runs[b]["classes"][name] for b in order])
              for name in runs[order[0]]["classes"]]
    for label, values in cells:
        ratio = (f" {values[0] / values[1]:.1f}x |" if len(values) == 2 and values[1]
                 else (" - |" if len(values) == 2 else ""))
        lines.append(f"| {label} | " + " | ".join(f"{v:.1f}" for v in values) + " |" + ratio)
    for b in order:
        lines += ["", f"Top {top} kernels, {names[b]}:", "",
                  "| kernel | calls | ms | argument shapes (first call) |", "|---|---|---|---|"]
        lines += [f"| {r['kernel'][:48]} | {r['calls']} | {r['ms']:.1f} | "
                  f"{' '.join(str(tuple(x)) for x in r['shapes'])} |"
                  for r in runs[b]["kernels"][:top]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="glm-small", choices=list(bench_tvm.WORKLOADS))
    ap.add_argument("--builds", nargs="+", default=list(BUILDS), choices=list(BUILDS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/tvm_ops.json"))
    ap.add_argument("--render", action="store_true",
                    help="only rewrite the markdown next to --out from its JSON")
    a = ap.parse_args()
    out = Path(a.out)
    if a.render:
        out.with_suffix(".md").write_text(markdown(json.loads(out.read_text()), a.top))
        return
    warnings.simplefilter("ignore")
    runs = [profile(a.model, BUILDS[b], a.steps) for b in a.builds]
    import tvm
    meta = {"date": datetime.date.today().isoformat(), "cpu": bench_tvm.cpu_name(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "tvm": tvm.__version__, "command": "python " + " ".join(sys.argv)}
    out.write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    out.with_suffix(".md").write_text(markdown({"meta": meta, "runs": runs}, a.top))
    for run in runs:
        build = "glmc schedules" if run["schedules"] else "TVM default pipeline"
        print(f"\n{run['model']}, {build}: step {run['step_ms']} ms, profiled "
              f"{run['profiled_ms']} ms, build {run['build_s']} s")
        for name, ms in run["classes"].items():
            print(f"{ms:10.2f} ms  {name}")
        for r in run["kernels"][:a.top]:
            print(f"{r['ms']:10.2f} ms {r['calls']:4d}  {r['kernel'][:40]:40s} {r['shapes']}")
    print(json.dumps(meta), platform.machine())


if __name__ == "__main__":
    main()
