"""Recompute under a memory budget, side by side: measured peak and median step time.

Contenders, each training its own copy of the same model from the same weights, in one
process, interleaved after warm-up (one step of each per round):

* `torch.compile`                      no recompute
* `torch.compile + checkpoint/block`   torch.utils.checkpoint (non-reentrant) on every block
* `torch.compile amb=B`                torch._functorch.config.activation_memory_budget = B
* `glmc budget=<peak of X>`            glmc on Inductor with the budget set to the measured
                                       peak of torch contender X (matched memory)
* `glmc min`                           glmc's smallest reachable peak

Measured peak = bytes live before the step (weights, buffers, grads, optimizer state, batch)
+ the c10 allocator's peak during one untimed profiled step. Activation peak = measured peak
minus weights, optimizer state and batch.

    python benchmarks/bench_recompute.py --models glm-small,cnn
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import ROOT, WORKLOADS, MiB, _clone, _Contender, run_meta, write_result  # noqa: E402

import glmc  # noqa: E402
from glmc.analysis.memory import measure_peak  # noqa: E402
from glmc.trace.capture import LossModule, split_batch  # noqa: E402


def _checkpoint_blocks(name: str, model: torch.nn.Module) -> None:
    """Wrap every block in torch.utils.checkpoint (the GLM's decoder layers, the CNN's two
    conv stages). Note: recomputing the CNN's BatchNorm in checkpoint updates its running
    statistics twice per step — a known property of torch's checkpointing."""
    cp = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    if hasattr(model, "gradient_checkpointing_enable"):  # a transformers model: its own switch
        model.gradient_checkpointing_enable({"use_reentrant": False})
        return
    if name.startswith("glm"):
        for block in model.blocks:
            block.forward = functools.partial(cp, block.forward)
        return
    m = model

    def forward(x):
        x = cp(lambda t: F.max_pool2d(F.relu(m.bn1(m.conv1(t))), 2), x)
        x = cp(lambda t: F.relu(m.bn2(m.conv2(t))), x)
        return m.fc(m.dropout(x.mean(dim=(2, 3))))
    model.forward = forward


def _fresh_wrapper(inner: torch.nn.Module) -> torch.nn.Module:
    """A module whose forward is a new code object: Dynamo caches compiled code per code
    object and does not guard on functorch's activation_memory_budget, so contenders sharing
    LossModule.forward would silently share one compiled graph (and one budget)."""
    ns: dict = {}
    exec("def forward(self, *a, **k):\n    return self.inner(*a, **k)\n", ns)
    cls = type("Contender", (torch.nn.Module,), {"forward": ns["forward"]})
    wrapper = cls()
    wrapper.inner = inner
    return wrapper


class _TorchContender(_Contender):
    def __init__(self, name, model, optimizer, x, loss_fn, checkpoint=False, budget=None,
                 workload=""):
        self.name, self.model, self.optimizer, self.trainer = name, model, optimizer, None
        if checkpoint:
            _checkpoint_blocks(workload, model)
        fwd = torch.compile(_fresh_wrapper(LossModule(model, loss_fn)))
        self.budget = budget

        def step(a, k):
            optimizer.zero_grad(set_to_none=True)
            with torch._functorch.config.patch(activation_memory_budget=budget or 1.0):
                (loss,) = fwd(*a, **k)
            loss.backward()
            optimizer.step()
            return loss.detach()
        self.fn = step


class _GlmcContender(_Contender):
    def __init__(self, name, model, optimizer, x, loss_fn, budget):
        self.name, self.model, self.optimizer = name, model, optimizer
        self.trainer = glmc.optimize(model, x, loss_fn=loss_fn, optimizer=optimizer,
                                     backend="inductor", memory_budget=budget)
        self.fn = lambda a, k: self.trainer.step(*a, **k)


def _persistent(c: _Contender, leaves) -> int:
    """Weights, buffers, optimizer state and batch (not grads)."""
    tensors = [*c.model.parameters(), *c.model.buffers(), *leaves]
    for st in c.optimizer.state.values():
        tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors}.values())


def _measure(c: _Contender, args, kwargs, leaves, seed: int) -> dict:
    before = c.state_bytes(leaves)
    torch.manual_seed(seed)
    _, m = measure_peak(lambda: c.fn(args, kwargs))
    peak = before + m.peak_bytes
    return {"peak": peak, "activation_peak": peak - _persistent(c, leaves)}


def run(name: str, steps: int, warmup: int, budgets: list[float]) -> dict:
    model, x, loss_fn, opt = WORKLOADS[name]()
    args, kwargs = split_batch(x)
    leaves = [*args, *kwargs.values()]
    rows: dict[str, dict] = {}
    subjects: dict[str, _Contender] = {}

    def add(label: str, make) -> None:
        m, o = _clone(model, opt)
        t0 = time.perf_counter()
        subjects[label] = make(m, o)
        for i in range(warmup):
            torch.manual_seed(i)
            subjects[label].fn(args, kwargs)
        rows[label] = {"contender": label, "first_steps_s": round(time.perf_counter() - t0, 1)}
        rows[label].update(_measure(subjects[label], args, kwargs, leaves, warmup))
        print(f"  {label}: {rows[label]}", flush=True)

    add("torch.compile", lambda m, o: _TorchContender("tc", m, o, x, loss_fn))
    add("torch.compile + checkpoint/block",
        lambda m, o: _TorchContender("ck", m, o, x, loss_fn, checkpoint=True, workload=name))
    for b in budgets:
        add(f"torch.compile amb={b}",
            lambda m, o, b=b: _TorchContender("amb", m, o, x, loss_fn, budget=b))
    torch_rows = [k for k in rows if k != "torch.compile"]
    for k in torch_rows:
        target = rows[k]["peak"]
        try:
            add(f"glmc budget=peak of [{k}]",
                lambda m, o, t=target: _GlmcContender("g", m, o, x, loss_fn, int(t)))
        except glmc.BudgetError as e:
            rows[f"glmc budget=peak of [{k}]"] = {"contender": f"glmc budget=peak of [{k}]",
                                                  "error": str(e).split(";")[0]}
    add("glmc min", lambda m, o: _GlmcContender("g", m, o, x, loss_fn, "min"))
    times = {k: [] for k in subjects}
    for i in range(steps):
        for k, c in subjects.items():
            torch.manual_seed(warmup + 1 + i)
            t0 = time.perf_counter()
            c.fn(args, kwargs)
            times[k].append(time.perf_counter() - t0)
    ref = statistics.median(times["torch.compile"])
    ref_act = rows["torch.compile"]["activation_peak"]
    for k, ts in times.items():
        med = statistics.median(ts)
        r = rows[k]
        r["median_step_ms"] = round(med * 1e3, 1)
        r["overhead"] = round(med / ref - 1, 3)
        r["peak_mib"] = round(r.pop("peak") / MiB, 1)
        r["activation_peak_mib"] = round(r["activation_peak"] / MiB, 1)
        r["activation_reduction"] = round(1 - r.pop("activation_peak") / ref_act, 3)
        tr = getattr(subjects[k], "trainer", None)
        if tr is not None:
            st = next(p.stats for p in tr.report.compiles[-1].history if p.name == "recompute")
            r["solver"] = f"{st.solver} {st.solve_seconds:.1f}s"
            r["compile_s"] = round(tr.report.compiles[-1].backend_seconds, 1)
            r["warnings"] = tr.report.compiles[-1].warnings
    # matched comparisons
    for k in torch_rows:
        g = rows.get(f"glmc budget=peak of [{k}]")
        if g and "median_step_ms" in g:
            g["time_ratio_to_matched_torch"] = round(g["median_step_ms"]
                                                     / rows[k]["median_step_ms"], 3)
    params = sum(p.numel() for p in model.parameters())
    return {"model": name, "params": params, "steps": steps, "warmup": warmup,
            "rows": list(rows.values())}


def markdown(result: dict, meta: dict) -> str:
    lines = [f"**{result['model']}** ({result['params'] / 1e6:.2f}M params), median of "
             f"{result['steps']} interleaved steps after {result['warmup']} warm-up; "
             f"{meta['date']}, {meta['machine']}, torch {meta['torch']}", "",
             "| contender | measured peak (MiB) | activation peak (MiB) | activation reduction "
             "| median step (ms) | overhead vs torch.compile | vs matched torch | glmc solver |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['contender']} | {r['error']} | | | | | | |")
            continue
        lines.append(f"| {r['contender']} | {r['peak_mib']} | {r['activation_peak_mib']} | "
                     f"{r['activation_reduction'] * 100:.1f}% | {r['median_step_ms']} | "
                     f"{r['overhead'] * 100:+.1f}% | "
                     f"{r.get('time_ratio_to_matched_torch', '')} | {r.get('solver', '')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="glm-small,cnn")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budgets", default="0.75,0.5,0.25")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    meta = run_meta("bench_recompute.py")
    # one result file for the benchmark: each model's latest run (with its own date and
    # machine) replaces that model's entry; the others are kept
    path = Path(a.out) / "recompute.json"
    merged = json.loads(path.read_text()) if path.exists() else {"models": {}}
    for name in a.models.split(","):
        result = run(name, a.steps, a.warmup, [float(b) for b in a.budgets.split(",")])
        merged["models"][name] = {**meta, **result}
        write_result(Path(a.out), "recompute", merged,
                     "\n\n".join(markdown(r, r) for r in merged["models"].values()))


if __name__ == "__main__":
    main()
