"""How good is the cost/memory model? Predicted vs measured step time and peak memory.

For each workload and glmc backend: compile, run one warm-up step, one step under the memory
profiler (c10 allocator events) and N timed steps; compare with the analytic prediction on the
calibrated host profile and with the profile-guided prediction (every node timed once on real
tensors). Errors are predicted / measured - 1.

    python benchmarks/model_accuracy.py                  # glm-small, cnn, hf-glm x eager, inductor
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import ROOT, WORKLOADS, MiB, run_meta, write_result  # noqa: E402
from glmc.backends import get_backend  # noqa: E402

import glmc  # noqa: E402
from glmc.analysis.cost import get_profile, measure_node_times  # noqa: E402
from glmc.analysis.predict import predict  # noqa: E402
from glmc.runtime.trainer import _leaves  # noqa: E402
from glmc.trace.capture import split_batch  # noqa: E402


def measure(name: str, backend: str, steps: int) -> dict:
    model, x, loss_fn, opt = WORKLOADS[name]()
    args, kwargs = split_batch(x)
    trainer = glmc.optimize(model, x, loss_fn=loss_fn, optimizer=opt, backend=backend)
    for _ in range(2 + steps):  # step 2 is the profiled one (trainer option measure=True)
        trainer.step(*args, **kwargs)
    rec = trainer.report.compiles[-1].to_dict()
    entry = next(reversed(trainer._cache.values()))
    inputs = [get(_leaves(trainer.example)) for get in entry.getters]
    t0 = time.perf_counter()
    guided = predict(trainer.graph, get_backend(backend).traits(), get_profile(),
                     measure_node_times(trainer.graph.gm, inputs))
    guided_s = time.perf_counter() - t0
    measured_step = rec["measured_step_seconds"]
    measured_peak = rec["measured_peak_bytes"]
    return {
        "model": name, "backend": backend,
        "measured_step_ms": round(measured_step * 1e3, 2),
        "predicted_step_ms": round(rec["predicted"]["time"]["seconds"] * 1e3, 2),
        "step_error": round(rec["errors"]["step_time"], 3),
        "guided_step_ms": round(guided.time.seconds * 1e3, 2),
        "guided_step_error": round(guided.time.seconds / measured_step - 1, 3),
        "guided_seconds": round(guided_s, 1),
        "measured_peak_mib": round(measured_peak / MiB, 2),
        "predicted_peak_mib": round(rec["predicted"]["memory"]["peak_bytes"] / MiB, 2),
        "peak_error": round(rec["errors"]["peak_memory"], 4),
        "measured_in_step_mib": round(rec["measured"]["peak_bytes"] / MiB, 2),
        "predicted_in_step_mib": round(rec["predicted"]["memory"]["transient_bytes"] / MiB, 2),
        "in_step_error": round(rec["errors"]["transient_memory"], 4),
        "state_error": rec["errors"].get("persistent_memory"),
        "unknown_ops": rec["predicted"]["time"]["unknown_ops"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="glm-small,cnn,hf-glm")
    ap.add_argument("--backends", default="eager,inductor")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    prof = get_profile()
    meta = {**run_meta("model_accuracy.py"), "profile": prof.name,
            "profile_source": prof.source}
    rows = []
    for name in a.models.split(","):
        for backend in a.backends.split(","):
            rows.append(measure(name, backend, a.steps))
            print(json.dumps(rows[-1]), flush=True)
    lines = [f"Cost/memory model accuracy, {meta['date']}, {meta['machine']}, torch "
             f"{meta['torch']}; profile: {meta['profile']} ({meta['profile_source']}). "
             f"Step time: median of {a.steps - 1} steps.", "",
             "| model | backend | measured step (ms) | predicted (error) | profile-guided (error) "
             "| measured peak (MiB) | predicted peak (error) | in-step measured / predicted (MiB) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['backend']} | {r['measured_step_ms']} | "
                     f"{r['predicted_step_ms']} ({r['step_error'] * 100:+.1f}%) | "
                     f"{r['guided_step_ms']} ({r['guided_step_error'] * 100:+.1f}%) | "
                     f"{r['measured_peak_mib']} | {r['predicted_peak_mib']} "
                     f"({r['peak_error'] * 100:+.1f}%) | {r['measured_in_step_mib']} / "
                     f"{r['predicted_in_step_mib']} |")
    write_result(Path(a.out), "model_accuracy", {**meta, "rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    main()
