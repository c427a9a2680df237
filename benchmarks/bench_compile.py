"""Compile time: glmc on Inductor against torch.compile of the model plus a compiled optimizer
step (the fair comparison: glmc compiles the update too).

Each measurement runs in a fresh process with an empty Inductor cache directory (cold: the
FX-graph and kernel caches start empty), alternating contenders, `--repeats` times; we report
the median seconds until the first training step has finished, and glmc's split into capture,
passes and backend compile (from its report).

    python benchmarks/bench_compile.py --models glm-tiny,glm-small --repeats 3
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = r"""
import json, sys, time, torch
sys.path.insert(0, {root!r}); sys.path.insert(0, {bench!r})
from bench_step import WORKLOADS
from glmc.trace.capture import LossModule, split_batch
model, x, loss_fn, opt = WORKLOADS[{model!r}]()
args, kwargs = split_batch(x)
t0 = time.perf_counter()
if {who!r} == "glmc":
    import glmc
    trainer = glmc.optimize(model, x, loss_fn=loss_fn, optimizer=opt, backend="inductor",
                            measure=False, predict=False)
    trainer.step(*args, **kwargs)
    rec = trainer.report.compiles[0]
    split = dict(capture=rec.capture_seconds, passes=rec.passes_seconds,
                 backend=rec.backend_seconds)
else:
    step_model = torch.compile(LossModule(model, loss_fn))
    @torch.compile
    def update():
        opt.step()
    (loss,) = step_model(*args, **kwargs)
    loss.backward()
    update()
    opt.zero_grad(set_to_none=True)
    split = {{}}
print(json.dumps(dict(seconds=time.perf_counter() - t0, **split)))
"""


def _run(model: str, who: str) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        code = _CHILD.format(root=str(ROOT), bench=str(ROOT / "benchmarks"), model=model,
                             who=who)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="glm-tiny,glm-small")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compile.json"))
    a = ap.parse_args()
    rows = []
    for model in a.models.split(","):
        runs: dict[str, list[dict]] = {"glmc": [], "torch": []}
        for _ in range(a.repeats):  # alternating, so drift hits both alike
            for who in runs:
                runs[who].append(_run(model, who))
        med = {who: statistics.median(r["seconds"] for r in rs) for who, rs in runs.items()}
        split = {k: round(statistics.median(r[k] for r in runs["glmc"]), 2)
                 for k in ("capture", "passes", "backend")}
        rows.append({"model": model, "glmc_s": round(med["glmc"], 2),
                     "torch_compile_plus_compiled_optimizer_s": round(med["torch"], 2),
                     "ratio": round(med["glmc"] / med["torch"], 3), "glmc_split_s": split,
                     "repeats": a.repeats,
                     "runs_s": {who: [round(r["seconds"], 2) for r in rs]
                                for who, rs in runs.items()}})
        print(json.dumps(rows[-1]))
    meta = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or
            platform.machine(), "threads": __import__("torch").get_num_threads(),
            "torch": __import__("torch").__version__}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
