"""Precision: glmc's bf16 / fp16 against an fp64 reference and torch.autocast, and the memory
and time of bf16 against fp32.

Numerics (GLM `tiny`, 100 steps, a fresh batch each step, AdamW): every contender trains its
own copy from the same weights on the same batches; we report the loss curve's deviation from
the fp64 run (max and mean |loss - loss64|) and the final parameters' relative error
||p - p64|| / ||p64|| over all parameters.
    fp32 eager | torch.autocast(bf16) | glmc bf16 (eager, inductor backends)
    torch.autocast(fp16) + GradScaler | glmc fp16 (in-graph loss scaling)

Memory/time (GLM `small`): fp32 vs bf16 on glmc's eager and Inductor backends, plus eager
PyTorch fp32 and autocast(bf16) for reference; interleaved steps after warm-up, median step
time; measured peak from the c10 allocator; activation peak = peak - (weights, buffers,
optimizer state, batch).

    python benchmarks/bench_precision.py                 # both parts
    python benchmarks/bench_precision.py --part numerics --steps 100
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch
from bench_recompute import _persistent
from bench_step import ROOT, MiB, _clone, _load, run_meta, write_result

import glmc
from glmc.analysis.memory import measure_peak


def _batches(cfg_mod, cfg, n: int):
    return [cfg_mod.make_batch(cfg, seed=1000 + i) for i in range(n)]


class _Eager:
    """Eager PyTorch, optionally under autocast (+ GradScaler for fp16)."""

    def __init__(self, model, opt, dtype=None, scaler=False):
        self.model, self.opt, self.dtype = model, opt, dtype
        self.scaler = torch.amp.GradScaler("cpu") if scaler else None

    def step(self, ids, labels):
        self.opt.zero_grad(set_to_none=True)
        if self.dtype is None:
            loss = self.model(ids, labels)
        else:
            with torch.autocast("cpu", dtype=self.dtype):
                loss = self.model(ids, labels)
        if self.scaler is None:
            loss.backward()
            self.opt.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        return loss.detach().double()


class _Glmc:
    def __init__(self, model, opt, batch, precision, backend):
        """`precision`: a policy name, or a whole pipeline string."""
        self.model = model
        spec = {"passes": precision} if "{" in precision else {"precision": precision}
        self.trainer = glmc.optimize(model, batch, optimizer=opt, backend=backend,
                                     measure=False, **spec)

    def step(self, ids, labels):
        return self.trainer.step(ids, labels).double()


def numerics(steps: int, inductor: bool, seeds: int) -> dict:
    """Per seed: fresh weights and batches; every contender trains its own copy."""
    per_seed = []
    for seed in range(seeds):
        print(f" seed {seed}", flush=True)
        per_seed.append(_numerics_one(steps, inductor, seed))
    rows = []
    for i, row in enumerate(per_seed[0]):
        name = row["contender"]
        runs = [rs[i] for rs in per_seed]
        rows.append({"contender": name, **{k: statistics.fmean(r[k] for r in runs) for k in
                                            ("max_loss_dev", "mean_loss_dev", "param_rel_err",
                                             "param_rel_err_nz")},
                     "per_seed_mean_loss_dev": [r["mean_loss_dev"] for r in runs],
                     "per_seed_param_rel_err_nz": [r["param_rel_err_nz"] for r in runs]})
    return {"workload": "glm-tiny", "steps": steps, "seeds": seeds, "rows": rows}


def _numerics_one(steps: int, inductor: bool, seed: int) -> list[dict]:
    _, _, _, opt = _load("glm.py", "tiny")
    import glm as glm_mod  # loaded by _load
    cfg = glm_mod.CONFIGS["tiny"]
    torch.manual_seed(seed)
    model = glm_mod.GLM(cfg)
    opt = type(opt)(model.parameters(), **{k: v for k, v in opt.defaults.items()
                                           if k != "decoupled_weight_decay"})
    batches = [glm_mod.make_batch(cfg, seed=1000 * (seed + 1) + i) for i in range(steps)]
    batch = batches[0]
    ref_model = copy.deepcopy(model).double()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), **{k: v for k, v in opt.defaults.items()
                                                          if k != "decoupled_weight_decay"})
    contenders = {"fp64 (reference)": _Eager(ref_model, ref_opt)}

    def add(name, make):
        m, o = _clone(model, opt)
        contenders[name] = make(m, o)

    add("fp32 eager", lambda m, o: _Eager(m, o))
    add("torch.autocast(bf16)", lambda m, o: _Eager(m, o, torch.bfloat16))
    add("glmc bf16 (eager backend)", lambda m, o: _Glmc(m, o, batch, "bf16", "eager"))
    if inductor:
        add("glmc bf16 (inductor backend)", lambda m, o: _Glmc(m, o, batch, "bf16", "inductor"))
    add("glmc bf16 head=low (eager backend)",
        lambda m, o: _Glmc(m, o, batch, "precision{policy=bf16,head=low},cleanup", "eager"))
    add("torch.autocast(fp16) + GradScaler", lambda m, o: _Eager(m, o, torch.float16, True))
    add("glmc fp16 + in-graph loss scaling", lambda m, o: _Glmc(m, o, batch, "fp16", "eager"))
    losses = {k: [] for k in contenders}
    for ids, labels in batches:
        for name, c in contenders.items():
            losses[name].append(float(c.step(ids, labels)))
    ref = losses["fp64 (reference)"]
    ref_params = dict(contenders["fp64 (reference)"].model.named_parameters())

    def rel_err(c, keep) -> float:
        num = sum(float((p.detach().double() - ref_params[k].detach()).norm() ** 2)
                  for k, p in c.model.named_parameters() if keep(k))
        den = sum(float(p.detach().norm() ** 2) for k, p in ref_params.items() if keep(k))
        return (num / den) ** 0.5

    rows = []
    for name, c in contenders.items():
        dev = [abs(a - b) for a, b in zip(losses[name], ref)]
        rows.append({"contender": name, "max_loss_dev": max(dev),
                     "mean_loss_dev": statistics.fmean(dev), "final_loss": losses[name][-1],
                     "param_rel_err": rel_err(c, lambda k: True),
                     # the key bias has an exact gradient of zero (softmax is invariant to it):
                     # any reduced precision turns its rounding noise into lr-sized Adam steps
                     "param_rel_err_nz": rel_err(c, lambda k: "wk.bias" not in k)})
        print(f"  {rows[-1]}", flush=True)
    return rows


def memory(steps: int, warmup: int) -> dict:
    model, batch, _, opt = _load("glm.py", "small")
    ids, labels = batch
    leaves = [ids, labels]
    subjects = {}

    def add(name, make):
        m, o = _clone(model, opt)
        t0 = time.perf_counter()
        subjects[name] = make(m, o)
        for _ in range(warmup):
            subjects[name].step(ids, labels)
        print(f"  {name}: ready in {time.perf_counter() - t0:.1f}s", flush=True)

    add("eager fp32", lambda m, o: _Eager(m, o))
    add("eager autocast(bf16)", lambda m, o: _Eager(m, o, torch.bfloat16))
    for backend in ("eager", "inductor"):
        for prec in ("fp32", "bf16", "precision{policy=bf16,head=low},cleanup"):
            label = "bf16 head=low" if "{" in prec else prec
            add(f"glmc-{backend} {label}",
                lambda m, o, p=prec, b=backend: _Glmc(m, o, batch, p, b))
    rows = {}
    for name, s in subjects.items():
        before = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                      for t in [*s.model.parameters(), *s.model.buffers(), *leaves,
                                *[g for g in (p.grad for p in s.model.parameters())
                                  if g is not None]]}.values())
        before += sum(v.untyped_storage().nbytes() for st in _opt(s).state.values()
                      for v in st.values() if isinstance(v, torch.Tensor))
        _, m = measure_peak(lambda: s.step(ids, labels))
        peak = before + m.peak_bytes
        holder = type("C", (), {"model": s.model, "optimizer": _opt(s)})
        rows[name] = {"contender": name, "peak": peak,
                      "activation_peak": peak - _persistent(holder, leaves), "times": []}
    for _ in range(steps):
        for name, s in subjects.items():
            t0 = time.perf_counter()
            s.step(ids, labels)
            rows[name]["times"].append(time.perf_counter() - t0)
    out = []
    for name, r in rows.items():
        out.append({"contender": name, "peak_mib": round(r["peak"] / MiB, 1),
                    "activation_peak_mib": round(r["activation_peak"] / MiB, 1),
                    "median_step_ms": round(statistics.median(r["times"]) * 1e3, 1)})
    for backend in ("eager", "inductor"):
        base = next(r for r in out if r["contender"] == f"glmc-{backend} fp32")
        for r in out:
            if r["contender"].startswith(f"glmc-{backend}"):
                r["activation_reduction"] = round(1 - r["activation_peak_mib"]
                                                  / base["activation_peak_mib"], 3)
                r["speedup_vs_fp32"] = round(base["median_step_ms"] / r["median_step_ms"], 2)
    for r in out:
        print(f"  {r}", flush=True)
    return {"workload": "glm-small", "steps": steps, "rows": out}


def _opt(s):
    return s.trainer.optimizer if isinstance(s, _Glmc) else s.opt


def markdown(result: dict) -> str:
    meta = result["meta"]
    head = f"{meta['date']}, {meta['machine']}, torch {meta['torch']}; `{meta['command']}`"
    lines = []
    if "numerics" in result:
        n = result["numerics"]
        lines += [f"**Numerics vs fp64**, GLM tiny, {n['steps']} steps (fresh batch each step, "
                  f"AdamW), mean over {n['seeds']} seeds (weights and data); {head}", "",
                  "| contender | max \\|loss - fp64\\| | mean \\|loss - fp64\\| | final params "
                  "rel. error | same, without `wk.bias` | mean \\|loss - fp64\\| per seed |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['contender']} | {r['max_loss_dev']:.2e} | {r['mean_loss_dev']:.2e} | "
                  f"{r['param_rel_err']:.2e} | {r['param_rel_err_nz']:.2e} | "
                  + " ".join(f"{x:.1e}" for x in r["per_seed_mean_loss_dev"]) + " |"
                  for r in n["rows"]]
        lines.append("")
    if "memory" in result:
        m = result["memory"]
        lines += [f"**Memory and time**, GLM small, median of {m['steps']} interleaved steps "
                  f"after 2 warm-up; {head}", "",
                  "| contender | measured peak (MiB) | activation peak (MiB) | activation "
                  "reduction vs fp32 | median step (ms) | speed-up vs fp32 |",
                  "|---|---|---|---|---|---|"]
        for r in m["rows"]:
            red = r.get("activation_reduction")
            sp = r.get("speedup_vs_fp32")
            lines.append(f"| {r['contender']} | {r['peak_mib']} | {r['activation_peak_mib']} | "
                         f"{'' if red is None else f'{red * 100:.1f}%'} | "
                         f"{r['median_step_ms']} | {'' if sp is None else f'{sp}x'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["numerics", "memory", "both"], default="both")
    ap.add_argument("--steps", type=int, default=100, help="numerics: training steps")
    ap.add_argument("--timed-steps", type=int, default=8, help="memory: timed steps")
    ap.add_argument("--seeds", type=int, default=5, help="numerics: weight/data seeds")
    ap.add_argument("--no-inductor", action="store_true", help="numerics: skip glmc-inductor")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    result: dict = {"meta": run_meta("bench_precision.py")}
    if args.part in ("numerics", "both"):
        result["numerics"] = numerics(args.steps, not args.no_inductor, args.seeds)
    if args.part in ("memory", "both"):
        result["memory"] = memory(args.timed_steps, 2)
    write_result(Path(args.out), f"precision-{args.part}", result, markdown(result))


if __name__ == "__main__":
    main()
