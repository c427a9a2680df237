"""Fusion: GLM `small` step time and measured peak with and without the `fusion` pass, on the
eager and Inductor backends (and with bf16), plus how often each pattern fired on GLM `small`
and on transformers' GLM.

Every contender trains its own copy of the same model from the same weights; after warm-up the
contenders' steps are interleaved, one per round; we report the median. The measured peak is
bytes live before the step plus the c10 allocator's peak during one extra, profiled step.

    python benchmarks/bench_fusion.py                  # writes benchmarks/results/fusion.{json,md}
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from bench_step import ROOT, MiB, _clone, _load, run_meta, write_result

import glmc
from glmc.analysis.memory import measure_peak
from glmc.backends import get_backend
from glmc.compiler.passmanager import PassContext, PassManager
from glmc.trace.capture import capture

CONTENDERS = {
    "eager": "cleanup",
    "eager + fusion": "fusion,cleanup",
    "inductor": "cleanup",
    "inductor + fusion": "fusion,cleanup",
    "inductor + bf16": "precision{policy=bf16},cleanup",
    "inductor + fusion + bf16": "fusion,precision{policy=bf16},cleanup",
    "inductor + fusion(auto) + bf16": "fusion=True, precision='bf16'",
}


def pattern_counts() -> dict:
    from glmc.passes.fusion import FusionPass

    out = {}
    for name, make in (("glm-small", lambda: _load("glm.py", "small")),
                       ("hf-glm", lambda: _load("hf_glm.py", 4, 128, 256, 4, 8192))):
        model, x, loss_fn, opt = make()
        g = capture(model, x, loss_fn, opt)
        manager = PassManager([FusionPass()])
        manager.run(g, PassContext(get_backend("inductor").traits()))
        out[name] = manager.history[0].stats.counts
        print(f"  {name}: {out[name]}", flush=True)
    return out


def contenders(each: bool) -> dict[str, str]:
    """The default table, or (`each`) every pattern alone on both backends."""
    if not each:
        return dict(CONTENDERS)
    from glmc.passes.fusion import PATTERNS
    out = {}
    for backend in ("eager", "inductor"):
        out[backend] = "cleanup"
        for p in PATTERNS:
            out[f"{backend} + {p}"] = f"fusion{{patterns={p}}},cleanup"
    return out


def run(steps: int, warmup: int, table: dict[str, str]) -> dict:
    model, batch, _, opt = _load("glm.py", "small")
    ids, labels = batch
    subjects = {}
    for name, passes in table.items():
        m, o = _clone(model, opt)
        t0 = time.perf_counter()
        spec = {"fusion": True, "precision": "bf16"} if passes.startswith("fusion=") \
            else {"passes": passes}
        trainer = glmc.optimize(m, batch, optimizer=o, measure=False, backend=name.split()[0],
                                **spec)
        for _ in range(warmup):
            trainer.step(ids, labels)
        subjects[name] = (m, o, trainer, time.perf_counter() - t0)
        print(f"  {name}: ready in {subjects[name][3]:.1f}s", flush=True)
    rows = {}
    for name, (m, o, trainer, first) in subjects.items():
        before = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                      for t in [*m.parameters(), *m.buffers(), ids, labels,
                                *(v for st in o.state.values() for v in st.values()
                                  if isinstance(v, torch.Tensor))]}.values())
        loss, meas = measure_peak(lambda: trainer.step(ids, labels))
        rows[name] = {"contender": name, "passes": table[name],
                      "first_steps_s": round(first, 1),
                      "peak_mib": round((before + meas.peak_bytes) / MiB, 1),
                      "in_step_peak_mib": round(meas.peak_bytes / MiB, 1), "times": []}
    for _ in range(steps):
        for name, (_, _, trainer, _) in subjects.items():
            t0 = time.perf_counter()
            trainer.step(ids, labels)
            rows[name]["times"].append(time.perf_counter() - t0)
    out = []
    for name, r in rows.items():
        r["median_step_ms"] = round(statistics.median(r.pop("times")) * 1e3, 1)
        out.append(r)
    for r in out:
        base = rows[r["contender"].split(" + ")[0].split("(")[0]]
        r["time_vs_unfused"] = round(r["median_step_ms"] / base["median_step_ms"], 3)
        r["in_step_peak_vs_unfused"] = round(r["in_step_peak_mib"] / base["in_step_peak_mib"], 3)
        print(f"  {r}", flush=True)
    return {"workload": "glm-small", "steps": steps, "warmup": warmup, "rows": out}


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [f"**Fusion**, GLM small, median of {result['run']['steps']} interleaved steps after "
             f"{result['run']['warmup']} warm-up; {meta['date']}, {meta['machine']}, torch "
             f"{meta['torch']}; `{meta['command']}`", "",
             "| contender | passes | median step (ms) | time vs backend alone | measured peak "
             "(MiB) | in-step peak (MiB) | in-step peak vs backend alone | first steps incl. "
             "compile (s) |", "|---|---|---|---|---|---|---|---|"]
    for r in result["run"]["rows"]:
        lines.append(f"| {r['contender']} | `{r['passes']}` | {r['median_step_ms']} | "
                     f"{r['time_vs_unfused']} | {r['peak_mib']} | {r['in_step_peak_mib']} | "
                     f"{r['in_step_peak_vs_unfused']} | {r['first_steps_s']} |")
    lines += ["", "Patterns fired (regions per pattern):", ""]
    lines += [f"- {k}: {v}" for k, v in result["counts"].items()]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--each", action="store_true", help="every pattern alone on both backends")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    result = {"meta": run_meta("bench_fusion.py"), "counts": pattern_counts(),
              "run": run(args.steps, args.warmup, contenders(args.each))}
    write_result(Path(args.out), "fusion-each" if args.each else "fusion", result,
                 markdown(result))


if __name__ == "__main__":
    main()
