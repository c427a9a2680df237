"""ONNX Runtime vs eager PyTorch vs glmc-Inductor: training step time and peak RSS.

For every workload (GLM small, the CNN of bench_step.py):
  * step time: every contender trains its own copy of the same model in one process; after
    warm-up, each round runs one step of every contender in turn (interleaved) and we report
    the median over rounds;
  * peak RSS: ONNX Runtime allocates outside torch's allocator, so memory is the process's
    resident set. Each contender runs alone in a fresh subprocess: compile and warm up, reset
    the high-water mark (`/proc/self/clear_refs` = 5), run the steps, read VmHWM. That is the
    steady-state peak of training (weights, optimizer state, activations, runtime buffers),
    without the compile's own peak; the RSS after the warm-up is shown too.

    python benchmarks/bench_backends.py                     # glm-small and cnn
    python benchmarks/bench_backends.py --models cnn --steps 5 --warmup 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from bench_step import (ROOT, WORKLOADS, _clone, cpu_name,  # noqa: I001 (benchmarks folder)
                        run_meta)

import glmc
from glmc.trace.capture import LossModule, split_batch

CONTENDERS = ("eager", "glmc-inductor", "glmc-ort")


def _step_fn(name: str, model, optimizer, x, loss_fn):
    if name.startswith("glmc-"):
        trainer = glmc.optimize(model, x, loss_fn=loss_fn, optimizer=optimizer,
                                backend=name.removeprefix("glmc-"), measure=False,
                                predict=False)
        return lambda a, k: trainer.step(*a, **k)
    wrapper = LossModule(model, loss_fn)

    def step(a, k):
        optimizer.zero_grad(set_to_none=True)
        (loss,) = wrapper(*a, **k)
        loss.backward()
        optimizer.step()
        return loss.detach()
    return step


def time_steps(name: str, steps: int, warmup: int, contenders: list[str]) -> dict:
    model, x, loss_fn, opt = WORKLOADS[name]()
    args, kwargs = split_batch(x)
    fns, first, losses = {}, {}, {}
    for c in contenders:
        m, o = _clone(model, opt)
        t0 = time.perf_counter()
        fns[c] = _step_fn(c, m, o, x, loss_fn)
        torch.manual_seed(0)
        losses[c] = [fns[c](args, kwargs).item()]  # compiles (glmc: at optimize())
        first[c] = time.perf_counter() - t0
        print(f"  {name} {c}: first step {first[c]:.1f} s", file=sys.stderr, flush=True)
    for i in range(1, warmup):
        for c in contenders:
            torch.manual_seed(i)
            losses[c].append(fns[c](args, kwargs).item())
    times = {c: [] for c in contenders}
    for i in range(steps):
        for c in contenders:  # interleaved: one step of each per round
            torch.manual_seed(warmup + i)
            t0 = time.perf_counter()
            losses[c].append(fns[c](args, kwargs).item())
            times[c].append(time.perf_counter() - t0)
    params = sum(p.numel() for p in model.parameters())
    return {"model": name, "params": params,
            "rows": {c: {"median_step_ms": round(statistics.median(times[c]) * 1e3, 2),
                         "first_step_s": round(first[c], 1),
                         "loss_after": round(losses[c][-1], 5)} for c in contenders}}


def _status_mib(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def rss_alone(name: str, contender: str, steps: int, warmup: int) -> dict:
    """Run in a fresh process (see --rss): steady-state peak RSS of `contender` on `name`."""
    model, x, loss_fn, opt = WORKLOADS[name]()
    args, kwargs = split_batch(x)
    fn = _step_fn(contender, model, opt, x, loss_fn)
    for i in range(max(warmup, 1)):
        torch.manual_seed(i)
        fn(args, kwargs)
    after_warmup = _status_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    for i in range(steps):
        fn(args, kwargs)
    return {"peak_rss_mib": round(_status_mib("VmHWM"), 1),
            "rss_after_warmup_mib": round(after_warmup, 1)}


def _rss_subprocess(name: str, contender: str, steps: int, warmup: int) -> dict:
    cmd = [sys.executable, __file__, "--rss", f"{name}:{contender}", "--steps", str(steps),
           "--warmup", str(warmup)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        return {"peak_rss_mib": None, "rss_after_warmup_mib": None,
                "error": r.stderr.strip().splitlines()[-1][:200]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def markdown(results: list[dict], meta: dict, steps: int, warmup: int) -> str:
    lines = ["# Backends: ONNX Runtime vs eager vs Inductor (training step, CPU)", "",
             f"{meta['date']}; {cpu_name()}, {meta['machine']}; torch {meta['torch']}, "
             f"onnxruntime {meta['onnxruntime']}. Median of {steps} interleaved steps after "
             f"{warmup} warm-up; peak RSS of each contender alone in a fresh process after "
             "its warm-up (compile peaks excluded). The CNN has dropout: ORT draws other masks, "
             "so its losses differ from the others'.", "",
             f"Reproduce: `{meta['command']}`", "",
             "| model | contender | median step (ms) | vs eager | first step incl. compile (s) "
             "| peak RSS (MiB) | RSS after warm-up (MiB) | loss after |",
             "|---|---|---|---|---|---|---|---|"]
    for res in results:
        eager = res["rows"].get("eager", {}).get("median_step_ms")
        for c, r in res["rows"].items():
            ratio = f"{r['median_step_ms'] / eager:.2f}x" if eager else "-"
            lines.append(f"| {res['model']} ({res['params'] / 1e6:.1f}M) | {c} | "
                         f"{r['median_step_ms']} | {ratio} | {r['first_step_s']} | "
                         f"{r.get('peak_rss_mib')} | {r.get('rss_after_warmup_mib')} | "
                         f"{r['loss_after']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="glm-small,cnn")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocesses")
    ap.add_argument("--rss", default=None, help=argparse.SUPPRESS)  # MODEL:CONTENDER (child)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    if a.rss:
        name, contender = a.rss.split(":")
        print(json.dumps(rss_alone(name, contender, a.steps, a.warmup)))
        return
    import onnxruntime
    meta = {**run_meta("bench_backends.py"), "onnxruntime": onnxruntime.__version__}
    contenders = a.contenders.split(",")
    results = []
    for name in a.models.split(","):
        res = time_steps(name, a.steps, a.warmup, contenders)
        if not a.no_rss:
            for c in contenders:
                res["rows"][c].update(_rss_subprocess(name, c, a.steps, a.warmup))
        results.append(res)
    md = markdown(results, meta, a.steps, a.warmup)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "backends.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    (out / "backends.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
