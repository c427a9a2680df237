"""Side-by-side step time: eager PyTorch, plain torch.compile, and glmc on each backend.

Interleaved on the same machine: after warm-up, each round runs one step of every contender in
turn; we report the median over rounds, compile (first-step) time, and the ratio to
torch.compile. Every contender trains its own copy of the same model from the same weights.

    python benchmarks/bench_step.py --model glm-small --steps 10 --out benchmarks/results
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

ROOT = Path(__file__).resolve().parent.parent


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
}


def _clone(model, optimizer):
    m = copy.deepcopy(model)
    o = type(optimizer)(m.parameters(), **{k: v for k, v in optimizer.defaults.items()
                                          if k != "decoupled_weight_decay"})
    return m, o


def _eager_step(model, loss_fn, optimizer, compile_model: bool):
    wrapper = LossModule(model, loss_fn)
    fwd = torch.compile(wrapper) if compile_model else wrapper

    def step(args, kwargs):
        optimizer.zero_grad(set_to_none=True)
        (loss,) = fwd(*args, **kwargs)
        loss.backward()
        optimizer.step()
        return loss.detach()
    return step


def _glmc_step(model, x, loss_fn, optimizer, backend: str):
    trainer = glmc.optimize(model, x, loss_fn=loss_fn, optimizer=optimizer, backend=backend)
    return lambda args, kwargs: trainer.step(*args, **kwargs)


def run(name: str, steps: int, warmup: int, contenders: list[str]) -> dict:
    model, x, loss_fn, opt = WORKLOADS[name]()
    args, kwargs = split_batch(x)
    builders = {
        "eager": lambda m, o: _eager_step(m, loss_fn, o, False),
        "torch.compile": lambda m, o: _eager_step(m, loss_fn, o, True),
        "glmc-eager": lambda m, o: _glmc_step(m, x, loss_fn, o, "eager"),
        "glmc-inductor": lambda m, o: _glmc_step(m, x, loss_fn, o, "inductor"),
    }
    fns, compile_s, losses = {}, {}, {}
    for c in contenders:
        m, o = _clone(model, opt)
        t0 = time.perf_counter()
        fns[c] = builders[c](m, o)
        torch.manual_seed(0)
        losses[c] = [fns[c](args, kwargs).item()]  # first step includes compilation
        compile_s[c] = time.perf_counter() - t0
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
    med = {c: statistics.median(t) for c, t in times.items()}
    ref = med.get("torch.compile")
    rows = [{"contender": c, "median_step_ms": round(med[c] * 1e3, 2),
             "ratio_to_torch_compile": round(med[c] / ref, 3) if ref else None,
             "first_step_s": round(compile_s[c], 1),
             "final_loss": round(losses[c][-1], 6)} for c in contenders]
    params = sum(p.numel() for p in model.parameters())
    return {"model": name, "params": params, "steps": steps, "warmup": warmup, "rows": rows}


def markdown(result: dict, meta: dict) -> str:
    lines = [f"**{result['model']}** ({result['params'] / 1e6:.1f}M params), median of "
             f"{result['steps']} interleaved steps after {result['warmup']} warm-up; {meta['date']}, "
             f"{meta['machine']}, torch {meta['torch']}",
             "", "| contender | median step (ms) | ratio to torch.compile | first step incl. "
             "compile (s) | loss after all steps |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['contender']} | {r['median_step_ms']} | {r['ratio_to_torch_compile']}"
                     f" | {r['first_step_s']} | {r['final_loss']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="glm-small", choices=sorted(WORKLOADS))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--contenders", default="eager,torch.compile,glmc-eager,glmc-inductor")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    meta = {"date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()} {torch.get_num_threads()} threads, "
                       f"{platform.processor() or platform.platform()}",
            "torch": torch.__version__}
    result = run(a.model, a.steps, a.warmup, a.contenders.split(","))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.model}.json").write_text(json.dumps({**meta, **result}, indent=2))
    md = markdown(result, meta)
    (out / f"{a.model}.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
