"""Side-by-side training step: eager PyTorch, plain torch.compile, and glmc on each backend.

For every workload, in one process on one machine:
  * every contender trains its own copy of the same model from the same weights;
  * after warm-up, each round runs one step of every contender in turn (interleaved), and
    we report the median step time over rounds, the first-step (compile) time and the ratio
    to torch.compile;
  * one extra step per contender runs under the memory profiler (c10 allocator events): the
    measured peak = bytes live before the step (weights, optimizer state, grads, batch) + the
    peak allocated during it. That step is not timed;
  * for glmc contenders, the cost/memory model's predicted step time and peak, and their
    errors against the measurement.

    python benchmarks/bench_step.py                       # glm-small and cnn, all contenders
    python benchmarks/bench_step.py --models hf-glm --steps 5
"""
from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import glmc
from glmc.capture import LossModule, split_batch
from glmc.memory import measure_peak

ROOT = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024


def _load(file: str, *args):
    spec = importlib.util.spec_from_file_location(Path(file).stem, ROOT / "examples" / file)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod.workload(*args)


WORKLOADS = {
    "glm-small": lambda: _load("glm.py", "small"),
    "glm-tiny": lambda: _load("glm.py", "tiny"),
    "cnn": lambda: _load("cnn.py", 32, 32, 32),
    "hf-glm": lambda: _load("hf_glm.py", 4, 128, 256, 4, 8192),
}
CONTENDERS = ("eager", "torch.compile", "glmc-eager", "glmc-inductor")


def _clone(model, optimizer):
    m = copy.deepcopy(model)
    o = type(optimizer)(m.parameters(), **{k: v for k, v in optimizer.defaults.items()
                                          if k != "decoupled_weight_decay"})
    return m, o


class _Contender:
    def __init__(self, name: str, model, optimizer, x, loss_fn) -> None:
        self.name, self.model, self.optimizer = name, model, optimizer
        self.trainer = None
        if name.startswith("glmc-"):
            # glmc's own measurement is switched off: the harness measures every contender alike
            self.trainer = glmc.optimize(model, x, loss_fn=loss_fn, optimizer=optimizer,
                                         backend=name.removeprefix("glmc-"), measure=False)
            self.fn = lambda a, k: self.trainer.step(*a, **k)
        else:
            wrapper = LossModule(model, loss_fn)
            fwd = torch.compile(wrapper) if name == "torch.compile" else wrapper

            def step(a, k):
                optimizer.zero_grad(set_to_none=True)
                (loss,) = fwd(*a, **k)
                loss.backward()
                optimizer.step()
                return loss.detach()
            self.fn = step

    def state_bytes(self, batch: list[torch.Tensor]) -> int:
        """Bytes of distinct storages live between steps: weights, buffers, grads, optimizer
        state and the batch."""
        tensors = [*self.model.parameters(), *self.model.buffers(), *batch]
        tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        for st in self.optimizer.state.values():
            tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
        seen = {}
        for t in tensors:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values())


def run(name: str, steps: int, warmup: int, contenders: list[str]) -> dict:
    model, x, loss_fn, opt = WORKLOADS[name]()
    args, kwargs = split_batch(x)
    leaves = [*args, *kwargs.values()]
    subjects, compile_s, losses = {}, {}, {}
    for c in contenders:
        m, o = _clone(model, opt)
        t0 = time.perf_counter()
        subjects[c] = _Contender(c, m, o, x, loss_fn)
        torch.manual_seed(0)
        losses[c] = [subjects[c].fn(args, kwargs).item()]  # the first step compiles
        compile_s[c] = time.perf_counter() - t0
    for i in range(1, warmup):
        for c in contenders:
            torch.manual_seed(i)
            losses[c].append(subjects[c].fn(args, kwargs).item())
    peaks = {}
    for c in contenders:  # one profiled (untimed) step each, same seed for all
        before = subjects[c].state_bytes(leaves)
        torch.manual_seed(warmup)
        loss, m = measure_peak(lambda: subjects[c].fn(args, kwargs))
        losses[c].append(loss.item())
        peaks[c] = (before, m)
    times = {c: [] for c in contenders}
    for i in range(steps):
        for c in contenders:  # interleaved: one step of each per round
            torch.manual_seed(warmup + 1 + i)
            t0 = time.perf_counter()
            losses[c].append(subjects[c].fn(args, kwargs).item())
            times[c].append(time.perf_counter() - t0)
    med = {c: statistics.median(t) for c, t in times.items()}
    ref = med.get("torch.compile")
    rows = []
    for c in contenders:
        before, m = peaks[c]
        row = {"contender": c, "median_step_ms": round(med[c] * 1e3, 2),
               "ratio_to_torch_compile": round(med[c] / ref, 3) if ref else None,
               "first_step_s": round(compile_s[c], 1),
               "measured_peak_mib": round((before + m.peak_bytes) / MiB, 1),
               "measured_in_step_mib": round(m.peak_bytes / MiB, 1),
               "final_loss": round(losses[c][-1], 6)}
        tr = subjects[c].trainer
        if tr is not None and tr.report.compiles[-1].predicted:
            pred = tr.report.compiles[-1].predicted
            row["predicted_step_ms"] = round(pred["time"]["seconds"] * 1e3, 2)
            row["predicted_peak_mib"] = round(pred["memory"]["peak_bytes"] / MiB, 1)
            row["step_time_error"] = round(pred["time"]["seconds"] / med[c] - 1, 3)
            row["peak_error"] = round(pred["memory"]["peak_bytes"] / (before + m.peak_bytes)
                                      - 1, 3)
        rows.append(row)
    params = sum(p.numel() for p in model.parameters())
    return {"model": name, "params": params, "steps": steps, "warmup": warmup, "rows": rows}


def run_meta(script: str) -> dict:
    """Date, machine, torch version and the command line of a benchmark run."""
    return {"date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()} {torch.get_num_threads()} threads, "
                       f"{platform.processor() or platform.platform()}",
            "torch": torch.__version__,
            "command": f"python benchmarks/{script} " + " ".join(sys.argv[1:])}


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (benchmarks say which CPU they ran on)."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    return next((line.split(":", 1)[1].strip() for line in lines
                 if line.startswith("model name")), platform.processor() or "unknown CPU")


def run_distributed(script: str, nproc: int, rank_main, args) -> None:
    """Under torchrun (RANK set): `rank_main(args)`; otherwise start `nproc` local processes
    of `script` with the same command line through torchrun and exit with its status."""
    import os
    import subprocess
    if "RANK" in os.environ:
        rank_main(args)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", script, *sys.argv[1:]]
    sys.exit(subprocess.call(cmd))


def write_result(out: Path, stem: str, data: dict, md: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=2))
    (out / f"{stem}.md").write_text(md + "\n")
    print(md + "\n", flush=True)


def markdown(result: dict, meta: dict) -> str:
    lines = [f"**{result['model']}** ({result['params'] / 1e6:.2f}M params), median of "
             f"{result['steps']} interleaved steps after {result['warmup']} warm-up; {meta['date']}, "
             f"{meta['machine']}, torch {meta['torch']}",
             "", "| contender | median step (ms) | ratio to torch.compile | first step incl. "
             "compile (s) | measured peak (MiB) | predicted step (ms) / error | predicted peak "
             "(MiB) / error | loss after all steps |", "|---|---|---|---|---|---|---|---|"]

    def err(r: dict, key: str, val: str) -> str:
        return f"{r[val]} / {r[key] * 100:+.1f}%" if key in r else "-"
    for r in result["rows"]:
        lines.append(f"| {r['contender']} | {r['median_step_ms']} | {r['ratio_to_torch_compile']}"
                     f" | {r['first_step_s']} | {r['measured_peak_mib']} | "
                     f"{err(r, 'step_time_error', 'predicted_step_ms')} | "
                     f"{err(r, 'peak_error', 'predicted_peak_mib')} | {r['final_loss']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="glm-small,cnn",
                    help=f"comma-separated, from {sorted(WORKLOADS)}")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    models = a.models.split(",")
    bad = [m for m in models if m not in WORKLOADS]
    if bad:
        ap.error(f"unknown model(s) {bad}; choose from {sorted(WORKLOADS)}")
    meta = run_meta("bench_step.py")
    for name in models:
        result = run(name, a.steps, a.warmup, a.contenders.split(","))
        write_result(Path(a.out), name, {**meta, **result}, markdown(result, meta))


if __name__ == "__main__":
    main()
