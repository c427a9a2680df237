"""Warm start: wall time of a fresh process that trains one step, cold (empty caches) and warm
(the same caches again), glmc against torch.compile, interleaved.

* `glmc cold` / `glmc warm`: `glmc.optimize` of the example (default pipeline, Inductor) and
  one step, with an empty (then the filled) glmc step cache and Inductor cache
  (`step_cache=`, `TORCHINDUCTOR_CACHE_DIR`);
* `torch.compile cold` / `warm`: the same model and batch, `torch.compile` of model + loss, one
  forward, backward and `optimizer.step()`, with an empty (then the filled) Inductor cache (its
  FX graph and AOTAutograd caches).

`first step` is measured inside each fresh process from the script's start (Python and torch
imports included) to the end of its first step; `process` is the whole process.

    python benchmarks/bench_warmstart.py --repeats 2
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import ROOT, run_meta, write_result  # noqa: E402

GLMC_SCRIPT = r"""
import time, sys
t0 = time.perf_counter()
import torch, glmc
from glmc.frontend.workload import load_workload
w = load_workload(sys.argv[1])
trainer = glmc.optimize(w.model, w.example_inputs, optimizer=w.optimizer, step_cache=sys.argv[3])
trainer.step(*w.example_inputs)
print(f"first step {time.perf_counter() - t0:.3f}", flush=True)
print(trainer.report.compiles[-1].step_cache, flush=True)
"""

TORCH_SCRIPT = r"""
import time, sys, importlib.util
t0 = time.perf_counter()
import torch
spec = importlib.util.spec_from_file_location("glm", sys.argv[1])
glm = importlib.util.module_from_spec(spec); sys.modules["glm"] = glm; spec.loader.exec_module(glm)
model, (ids, labels), _, opt = glm.workload(sys.argv[2])
step = torch.compile(lambda a, b: model(a, b))
loss = step(ids, labels); loss.backward(); opt.step(); opt.zero_grad()
print(f"first step {time.perf_counter() - t0:.3f}", flush=True)
"""


def _run(cmd: list[str], env: dict[str, str]) -> tuple[float, float | None]:
    start = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    wall = time.perf_counter() - start
    if r.returncode:
        raise RuntimeError(f"{cmd} failed:\n{r.stderr[-2000:]}")
    m = re.search(r"first step ([\d.]+)", r.stdout + r.stderr)
    return wall, float(m.group(1)) if m else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    times: dict[str, list[float]] = {k: [] for k in
                                     ("glmc cold", "glmc warm", "torch.compile cold",
                                      "torch.compile warm")}
    first: dict[str, list[float]] = {k: [] for k in times}
    glm = str(ROOT / "examples" / "glm.py")
    with tempfile.TemporaryDirectory() as tmp:
        scripts = {"glmc": Path(tmp) / "g.py", "torch.compile": Path(tmp) / "tc.py"}
        scripts["glmc"].write_text(GLMC_SCRIPT)
        scripts["torch.compile"].write_text(TORCH_SCRIPT)
        for rep in range(a.repeats):
            for who in ("glmc", "torch.compile"):
                env = dict(os.environ, GLM_CONFIG=a.config,
                           TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / f"inductor-{who}-{rep}"))
                for state in ("cold", "warm"):
                    label = f"{who} {state}"
                    wall, step = _run([sys.executable, str(scripts[who]), glm, a.config,
                                       str(Path(tmp) / f"steps-{rep}")], env)
                    times[label].append(wall)
                    first[label].append(step)
                    print(f"  {label}: process {wall:.1f} s, first step at {step:.1f} s",
                          flush=True)
    rows = [{"contender": k, "first_step_s": round(statistics.median(first[k]), 2),
             "process_s": round(statistics.median(v), 2),
             "runs_first_step_s": [round(x, 2) for x in first[k]]} for k, v in times.items()]
    med = {r["contender"]: r["first_step_s"] for r in rows}
    ratios = {"glmc warm / glmc cold": round(med["glmc warm"] / med["glmc cold"], 3),
              "glmc warm / torch.compile warm": round(med["glmc warm"]
                                                      / med["torch.compile warm"], 3)}
    meta = run_meta("bench_warmstart.py")
    md = [f"GLM example ({a.config}), Inductor, one training step in a fresh process, median "
          f"of {a.repeats}: time from the script's start (imports included) to the end of the "
          f"first step, and the whole process; {meta['date']}, {meta['machine']}, torch "
          f"{meta['torch']}", "", "| contender | first step (s) | process (s) | runs, first step (s) |",
          "|---|---|---|---|"]
    md += [f"| {r['contender']} | {r['first_step_s']} | {r['process_s']} | "
           f"{r['runs_first_step_s']} |" for r in rows]
    md += ["", " · ".join(f"{k}: {v}" for k, v in ratios.items())]
    write_result(Path(a.out), "warmstart", {**meta, "config": a.config, "rows": rows,
                                            "ratios": ratios}, "\n".join(md))


if __name__ == "__main__":
    main()
