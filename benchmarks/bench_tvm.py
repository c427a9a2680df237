"""glmc's TVM backend vs eager PyTorch (and optionally glmc-Inductor / glmc-ORT): compile time
and median training-step time on the host CPU.

Every contender trains its own copy of the same model in one process; after warm-up, each
round runs one step of every contender in turn (interleaved, so machine noise hits all alike)
and the median over rounds is reported, with its ratio to eager. TVM builds with glmc's CPU
schedule rules (backends/tvm/schedules.py; no tuner); `glmc-tvm-default` is the same step
built with TVM's default pipeline (one thread, no tiling), for comparison on small models.
Kernel-by-kernel: benchmarks/profile_tvm.py.

    python benchmarks/bench_tvm.py                                  # mlp, glm (examples)
    python benchmarks/bench_tvm.py --models mlp cnn --contenders eager glmc-tvm glmc-inductor
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import glmc  # noqa: E402
from glmc.trace.capture import LossModule, split_batch  # noqa: E402
from tests.models import CASES, no_dropout, twin  # noqa: E402


sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_step import WORKLOADS as STEP_WORKLOADS  # noqa: E402
from bench_step import cpu_name  # noqa: E402


def _glm_small():
    return STEP_WORKLOADS["glm-small"]()


WORKLOADS = {"mlp": CASES["mlp"].make, "glm": CASES["glm"].make,
             "cnn": no_dropout(CASES["cnn"].make), "glm-small": _glm_small}


def _step_fn(name: str, model, opt, x, loss_fn):
    if name.startswith("glmc-"):
        backend = name.removeprefix("glmc-")
        if backend == "tvm-default":
            from glmc.backends.tvm.backend import TvmBackend
            backend = TvmBackend(schedules=False)
        trainer = glmc.optimize(model, x, loss_fn=loss_fn, optimizer=opt, backend=backend,
                                measure=False, predict=False)
        return lambda a, k: trainer.step(*a, **k)
    wrapper = LossModule(model, loss_fn)

    def step(a, k):
        opt.zero_grad(set_to_none=True)
        (loss,) = wrapper(*a, **k)
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def bench(name: str, contenders: list[str], steps: int, warmup: int) -> list[dict]:
    fns, compile_s, first = {}, {}, {}
    for c in contenders:
        (m, x, loss_fn, opt), _ = twin(WORKLOADS[name])
        t0 = time.perf_counter()
        fns[c] = _step_fn(c, m, opt, x, loss_fn)
        args, kwargs = split_batch(x)
        first[c] = fns[c](args, kwargs).item()
        compile_s[c] = time.perf_counter() - t0
    for _ in range(warmup):
        for c in contenders:
            fns[c](args, kwargs)
    times: dict[str, list[float]] = {c: [] for c in contenders}
    for _ in range(steps):
        for c in contenders:
            t0 = time.perf_counter()
            fns[c](args, kwargs).item()
            times[c].append(time.perf_counter() - t0)
    eager = statistics.median(times[contenders[0]])
    return [{"model": name, "contender": c, "compile_s": round(compile_s[c], 2),
             "step_ms": round(1e3 * statistics.median(times[c]), 3),
             f"vs_{contenders[0]}": round(statistics.median(times[c]) / eager, 3),
             "first_loss": first[c]} for c in contenders]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["mlp", "glm"], choices=list(WORKLOADS))
    ap.add_argument("--contenders", nargs="+", default=["eager", "glmc-tvm"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/tvm.json"))
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    rows = [r for m in a.models for r in bench(m, a.contenders, a.steps, a.warmup)]
    meta = {"date": datetime.date.today().isoformat(), "cpu": cpu_name(),
            "machine": platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "command": "python " + " ".join(sys.argv)}
    import tvm
    meta["tvm"] = tvm.__version__
    Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    first = a.contenders[0]
    print(f"| model | contender | compile s | step ms (median of {a.steps}) | vs {first} |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['contender']} | {r['compile_s']} | {r['step_ms']} | "
              f"{r[f'vs_{first}']} |")
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
