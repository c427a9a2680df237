"""The planner against measured runs: every plan of a stated space, predicted and run.

For each case (a transformers model, a number of local processes), `glmc plan --cluster local`
prices the plans; every plan of the space below that the runtime runs is then launched with
`glmc compile FILE --plan SPELLING --nproc N --backend eager --steps S --report-dir D`, in
rounds (each round runs every plan once, the order reversed every other round: interleaved),
and the median over rounds of each run's measured median step and peak per rank is compared
with the prediction. Reported per case: Spearman rank correlation of predicted and measured
step time and peak, median absolute errors, and how far glmc's top plan is from the measured
best.

    python benchmarks/bench_planner.py                      # both models, 2 and 4 processes
    python benchmarks/bench_planner.py --cases glm:2 --rounds 1 --steps 6
    python benchmarks/bench_planner.py --cases llama:4 --rounds 2 --extra 2   # contenders

`--extra K`: after the rounds, glmc's pick and every plan measured within 10% of the best
run K more interleaved rounds, so that the pick's comparison rests on more runs where the
host's drift between runs (up to 1.5x here) is as large as the differences it compares.

The space: dp/tp/pp splits x ZeRO 0/1 (0-3 without pipelining) x micro-batches (pipelines
only: one process's gradient accumulation reports per-micro-batch times) x schedule (1F1B,
ZB-H1) x recompute none / selective / full (full runs as the recompute pass at budget `min`,
selective at `selective`), and two plans outside the search at a recompute budget (a share
of the activations: the pass chooses what to make again).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

MODEL = """
import torch, transformers
cfg = transformers.{cfg}(vocab_size=4096, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                         head_dim=64, max_position_embeddings=256, attention_dropout=0.0,
                         pad_token_id=0, use_cache=False)
torch.manual_seed(0)
model = transformers.{cls}(cfg)
ids = torch.randint(0, 4096, (8, 256), generator=torch.Generator().manual_seed(0))
example_inputs = {{"input_ids": ids, "labels": ids.clone()}}
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
"""
CASES = {"glm": ("GlmConfig", "GlmForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM")}


def _runnable(p: object) -> bool:
    """Fits, the runtime runs it, and without pipelining no gradient accumulation (one
    process's accumulation reports per-micro-batch times)."""
    return p.fits and not p.point.runtime_gaps() and \
        (p.point.pp > 1 or p.point.microbatch * p.point.dp == 8)


def _space(plans: list, limit: int) -> list:
    """Runnable plans that fit, at most `limit`: glmc's pick (the best-ranked runnable plan)
    first, the rest spread over the dp/tp/pp splits."""
    ok = [p for p in plans if _runnable(p)]
    by_split: dict = {}
    for p in ok[1:]:
        by_split.setdefault((p.point.dp, p.point.tp, p.point.pp), []).append(p)
    out = ok[:1]
    while len(out) < limit and any(by_split.values()):
        for key in list(by_split):
            if by_split[key] and len(out) < limit:
                out.append(by_split[key].pop(0 if len(out) % 2 else -1))
    return out


def _budget_plans(plans: list, work: object, cluster: object) -> list:
    """The fastest runnable data-parallel and pipelined plans without recompute, priced again
    at a recompute budget (`recompute=<share>`): the share of the activations above the
    state that puts the busiest rank's peak halfway between full recompute's and none's, so
    the recompute pass has to choose what to make again."""
    from glmc.parallel.search import evaluate, persistent_bytes
    out = []
    for want in (lambda q: q.pp == q.tp == 1, lambda q: q.pp > 1 and q.tp == 1):
        base = next((p for p in plans if _runnable(p) and want(p.point)
                     and p.point.recompute == "none"), None)
        if base is None:
            continue
        full = evaluate(dataclasses.replace(base.point, recompute="full"), work, cluster)
        state = persistent_bytes(base.memory)
        if full.peak_bytes >= base.peak_bytes:  # recompute frees nothing there
            continue
        share = ((base.peak_bytes + full.peak_bytes) / 2 - state) / (base.peak_bytes - state)
        point = dataclasses.replace(base.point, recompute=f"{max(0.01, share):.2f}")
        out.append(evaluate(point, work, cluster))
    return out


def _run(file: Path, spelling: str, nproc: int, steps: int, out: Path) -> dict | None:
    cmd = [sys.executable, "-m", "glmc", "compile", str(file), "--plan", spelling,
           "--nproc", str(nproc), "--backend", "eager", "--steps", str(steps),
           "--report-dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode:
        print(f"  {spelling}: failed\n{proc.stderr[-2000:]}", flush=True)
        return None
    rep = json.loads((out / "report.json").read_text())
    if "compiles" in rep:  # one process or data/tensor parallel: rank 0's figures
        c = rep["compiles"][-1]
        return {"step_s": c["median_step_seconds"],
                "peak_bytes": c["measured"]["total_peak_bytes"],
                "exposed_comm_s": c["measured"].get("exposed_comm_seconds")}
    return {"step_s": rep["step_seconds"]["measured_steady"],  # pipelined: the busiest rank
            "peak_bytes": max(r["measured_peak_bytes"] for r in rep["ranks"]),
            "rank_peak_bytes": [r["measured_peak_bytes"] for r in rep["ranks"]],
            "exposed_comm_s": None}


def _spearman(a: list[float], b: list[float]) -> float:
    from scipy.stats import spearmanr
    return float(spearmanr(a, b).statistic) if len(a) > 2 else float("nan")


#: a plan measured within this share of the measured best contends for it (`--extra`)
NEAR = 0.10


def run_case(name: str, nproc: int, rounds: int, steps: int, limit: int, extra: int = 0
             ) -> dict:
    from glmc.frontend.planning import _plan
    from glmc.frontend.workload import load_workload
    work_dir = Path(tempfile.mkdtemp(prefix=f"glmc-planner-{name}-"))
    file = work_dir / f"{name}.py"
    cfg, cls = CASES[name]
    file.write_text(MODEL.format(cfg=cfg, cls=cls))
    calibrated = _calibrate(work_dir, file, nproc)
    w = load_workload(str(file))
    plans, work, cluster = _plan(w.model, w.example_inputs, "local", None, w.optimizer, None,
                                 None, nproc, True, None, None)
    chosen = _space(plans, limit)
    chosen += _budget_plans(plans, work, cluster)
    print(f"{name} on {nproc} processes: {len(plans)} plans priced, {len(chosen)} run "
          "(the last at a recompute budget, outside the search)", flush=True)
    measured: dict[str, list[dict]] = {p.point.spelling(): [] for p in chosen}
    _rounds(file, chosen, range(rounds), measured, nproc, steps, work_dir)
    if extra:  # the pick's comparison rests on more runs than the host's drift
        near = _contenders(chosen, plans, measured)
        print(f"  {len(near)} contenders (glmc's pick, plans within {NEAR:.0%} of the measured "
              f"best): {extra} more rounds", flush=True)
        _rounds(file, near, range(rounds, rounds + extra), measured, nproc, steps, work_dir)
    rows = []
    for rank, p in enumerate(chosen):
        runs = measured[p.point.spelling()]
        if not runs:
            continue
        rows.append({"spelling": p.point.spelling(),
                     "glmc_rank": plans.index(p) + 1 if p in plans else None,
                     "predicted_step_s": p.step_s, "predicted_peak_bytes": p.peak_bytes,
                     "predicted_rank_peak_bytes": list(p.rank_peaks),
                     "predicted_exposed_comm_s": _exposed(p),
                     "measured_step_s": statistics.median(x["step_s"] for x in runs),
                     "measured_peak_bytes": statistics.median(x["peak_bytes"] for x in runs),
                     "measured_exposed_comm_s": statistics.median(
                         x["exposed_comm_s"] for x in runs)
                     if all(x["exposed_comm_s"] is not None for x in runs) else None,
                     "runs": runs})  # each round's figures: the spread between rounds
    return {**_summary(name, nproc, rows, len(plans)), "calibrated": calibrated,
            "extra_rounds": extra}


def _rounds(file: Path, plans: list, rounds: range, measured: dict[str, list[dict]],
            nproc: int, steps: int, work_dir: Path) -> None:
    """Run every plan once per round (the order reversed every other round: interleaved),
    appending each run's figures to `measured`."""
    for r in rounds:
        order = plans if r % 2 == 0 else plans[::-1]
        for p in order:
            s = p.point.spelling()
            got = _run(file, s, nproc, steps, work_dir / f"r{r}-{len(measured[s])}-{hash(s)}")
            if got:
                measured[s].append(got)
                print(f"  {s}: measured {got['step_s'] * 1e3:.1f} ms, predicted "
                      f"{p.step_s * 1e3:.1f} ms; peak {got['peak_bytes'] / 2**20:.1f} / "
                      f"{p.peak_bytes / 2**20:.1f} MiB", flush=True)


def _contenders(chosen: list, plans: list, measured: dict[str, list[dict]]) -> list:
    """glmc's pick (its best-ranked plan run) and every plan whose median step so far is
    within NEAR of the measured best: the plans the pick's comparison depends on."""
    step = {s: statistics.median(x["step_s"] for x in runs)
            for s, runs in measured.items() if runs}
    best = min(step.values())
    pick = min((p for p in chosen if p in plans), key=plans.index)
    return [p for p in chosen if p is pick or step.get(p.point.spelling(), float("inf"))
            <= best * (1 + NEAR)]


def _calibrate(work_dir: Path, file: Path, nproc: int) -> str:
    """Calibrate this host right before the case's runs, in a cache of the case's own
    (`GLMC_CACHE_DIR`; the runs it launches read it too): the compute profile at one thread
    per process (as torchrun runs them) on the quiet host, then the gloo link of `nproc`
    processes, measured by a short data-parallel run. The host's speed drifts (7-15% within
    an hour on the shared VMs this ran on), so a calibration from another hour mis-prices
    every plan alike. Returns when."""
    import torch

    from glmc.analysis.calibration import calibrate
    os.environ["GLMC_CACHE_DIR"] = str(work_dir / "cache")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        calibrate(force=True)
    finally:
        torch.set_num_threads(threads)
    if nproc > 1:
        cmd = [sys.executable, "-m", "glmc", "compile", str(file), "--plan",
               f"dp={nproc},microbatch={8 // nproc}", "--nproc", str(nproc), "--backend",
               "eager", "--steps", "2", "--report-dir", str(work_dir / "link")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
        if proc.returncode:
            raise SystemExit(f"bench_planner: the run that measures the link failed\n"
                             f"{proc.stderr[-2000:]}")
    return datetime.datetime.now().isoformat(timespec="seconds")


def _exposed(p: object) -> float:
    """The communication plan `p` waits for: its data-parallel collectives' exposed part and
    its tensor-parallel all-reduces (what the run's profiler counts as waits)."""
    return sum(v for k, v in p.breakdown.items() if k.startswith("dp_") or k == "tp_comm")


def _data_parallel_only(spelling: str) -> bool:
    from glmc.parallel.planner import parse_spelling
    p = parse_spelling(spelling)
    return p["tp"] == p["pp"] == 1 < p["dp"]


def _rank_peaks(rows: list[dict]) -> list[tuple[float, float]]:
    """(predicted, measured) peak of every rank of every run plan: a pipeline's ranks each
    (the median over rounds), a data- or tensor-parallel plan's rank 0 (its ranks are
    alike). Empty where a pipeline's runs did not record their ranks (runs before 12-07)."""
    from glmc.parallel.planner import parse_spelling
    out = []
    for r in rows:
        runs = [x["rank_peak_bytes"] for x in r["runs"] if x.get("rank_peak_bytes")]
        pred = r.get("predicted_rank_peak_bytes") or []
        if runs and len(pred) == len(runs[0]):
            out += [(p, statistics.median(x[i] for x in runs)) for i, p in enumerate(pred)]
        elif parse_spelling(r["spelling"])["pp"] > 1:
            return []
        else:
            out.append((r["predicted_peak_bytes"], r["measured_peak_bytes"]))
    return out


def _summary(name: str, nproc: int, rows: list[dict], priced: int) -> dict:
    ps = [r["predicted_step_s"] for r in rows]
    ms = [r["measured_step_s"] for r in rows]
    pp = [r["predicted_peak_bytes"] for r in rows]
    mp = [r["measured_peak_bytes"] for r in rows]
    # exposed data-parallel communication: runs without pipelining whose report measured it
    comm = [(r["predicted_exposed_comm_s"], r["measured_exposed_comm_s"]) for r in rows
            if r.get("measured_exposed_comm_s") and _data_parallel_only(r["spelling"])]
    rank_pairs = _rank_peaks(rows)
    best = min(rows, key=lambda r: r["measured_step_s"])
    pick = min((r for r in rows if r["glmc_rank"]), key=lambda r: r["glmc_rank"])
    return {"case": name, "nproc": nproc, "priced": priced, "rows": rows,
            "spearman_step": _spearman(ps, ms), "spearman_peak": _spearman(pp, mp),
            "spearman_rank_peak": _spearman(*zip(*rank_pairs)) if rank_pairs else None,
            "rank_peak_pairs": len(rank_pairs),
            "median_abs_step_error": statistics.median(abs(p / m - 1) for p, m in zip(ps, ms)),
            "median_abs_peak_error": statistics.median(abs(p / m - 1) for p, m in zip(pp, mp)),
            "median_abs_comm_error": statistics.median(abs(p / m - 1) for p, m in comm)
            if comm else None, "comm_rows": len(comm),
            "pick": pick["spelling"], "measured_best": best["spelling"],
            "pick_vs_best": pick["measured_step_s"] / best["measured_step_s"]}


def _markdown(results: list[dict], meta: dict) -> str:
    out = [f"# Planner: predicted vs measured ({meta['date']})", "",
           f"This run: {meta['machine']}; `python benchmarks/bench_planner.py {meta['argv']}` "
           "(each case's date and CPU in its row; compute and link calibrated right before "
           "each case's runs, in a cache of its own); eager "
           "backend; median over rounds of each run's median step (`--extra K`: glmc's pick and "
           "the plans within 10% of the measured best ran K more rounds); peak: c10 "
           "allocator, the "
           "busiest rank; exposed communication: the waits rank 0's profiler counts, scored "
           "over the data-parallel runs (tensor-parallel rows: their all-reduces, shown).", "",
           "| case | plans run | Spearman step | Spearman peak, busiest rank / every rank "
           "(ranks) | median step error | "
           "median peak error | median exposed-comm error (runs) | glmc's pick / measured best |",
           "|---|---|---|---|---|---|---|---|"]
    for r in results:
        out.append(f"| {r['case']} x{r['nproc']} (run {r.get('date', meta['date'])}, "
                   f"{r.get('machine', 'AMD EPYC').split(',')[0]}) | "
                   f"{len(r['rows'])} of {r['priced']} | "
                   f"{r['spearman_step']:.2f} | {r['spearman_peak']:.2f} / "
                   + (f"{r['spearman_rank_peak']:.2f} ({r['rank_peak_pairs']})"
                      if r.get("spearman_rank_peak") is not None else "-") + " | "
                   f"{r['median_abs_step_error']:.1%} | {r['median_abs_peak_error']:.1%} | "
                   + (f"{r['median_abs_comm_error']:.0%} ({r['comm_rows']})"
                      if r.get("median_abs_comm_error") is not None else "-")
                   + f" | {r['pick_vs_best']:.3f}x |")
    for r in results:
        out += ["", f"## {r['case']} on {r['nproc']} processes", "",
                "| plan | glmc rank | predicted ms | measured ms | predicted MiB | measured MiB "
                "| exposed comm ms, predicted / measured |", "|---|---|---|---|---|---|---|"]
        for row in sorted(r["rows"], key=lambda x: x["measured_step_s"]):
            out.append(f"| `{row['spelling']}` | {row['glmc_rank'] or 'fixed'} | "
                       f"{row['predicted_step_s'] * 1e3:.1f} | {row['measured_step_s'] * 1e3:.1f} "
                       f"| {row['predicted_peak_bytes'] / 2**20:.1f} | "
                       f"{row['measured_peak_bytes'] / 2**20:.1f} | "
                       + (f"{row['predicted_exposed_comm_s'] * 1e3:.1f} / "
                          f"{row['measured_exposed_comm_s'] * 1e3:.1f} |"
                          if row.get("measured_exposed_comm_s") else "- |"))
    return "\n".join(out) + "\n"


def _plot(results: list[dict], path: Path) -> None:
    """Predicted against measured step time and per-rank peak, one marker per case."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, key, unit, scale in ((axes[0], "step_s", "ms", 1e3),
                                 (axes[1], "peak_bytes", "MiB", 2**-20)):
        lo, hi = float("inf"), 0.0
        for r, marker in zip(results, "os^Dvx"):
            xs = [row[f"measured_{key}"] * scale for row in r["rows"]]
            ys = [row[f"predicted_{key}"] * scale for row in r["rows"]]
            ax.scatter(xs, ys, marker=marker, s=22, label=f"{r['case']} x{r['nproc']}")
            lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
        ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
        ax.set_xlabel(f"measured {'step' if key == 'step_s' else 'peak per rank'} ({unit})")
        ax.set_ylabel(f"predicted ({unit})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def repredict(path: Path, machine: str, peaks_only: bool = False) -> list[dict]:
    """The measured rows of `path` (a planner.json) with the current model's predictions:
    the runs do not depend on the planner, so a model change is checked without rerunning.
    Only the cases run on this `machine` (the predictions use its calibration and links);
    the others are kept as they are. `peaks_only`: every case, only the predicted peaks
    (memory depends on no host's speed; the step figures stay those of the run's host)."""
    from glmc.frontend.planning import _plan
    from glmc.frontend.workload import load_workload
    from glmc.parallel.planner import PlanPoint, parse_spelling
    from glmc.parallel.search import evaluate
    results = []
    data = json.loads(path.read_text())
    for case in data["cases"]:
        case.setdefault("date", data["date"])  # files before per-case dates: the run's
        if case.get("machine", data.get("machine")) != machine and not peaks_only:
            results.append(case)
            continue
        file = Path(tempfile.mkdtemp(prefix="glmc-planner-")) / f"{case['case']}.py"
        cfg, cls = CASES[case["case"]]
        file.write_text(MODEL.format(cfg=cfg, cls=cls))
        w = load_workload(str(file))
        # the runs used the runtime's default bucket (spellings before the bucket key omit it)
        plans, work, cluster = _plan(w.model, w.example_inputs, "local", None, w.optimizer,
                                     "bucket=25", None, case["nproc"], True, None, None)
        def key(spelling: str) -> str:  # spellings from before the compress/bucket/cut keys
            return re.sub(r",cut=[\d/]+", "", spelling.replace(",bucket=25", "")
                          .replace(",compress=none", ""))
        by = {key(p.point.spelling()): (i + 1, p) for i, p in enumerate(plans)}
        rows = []
        for row in case["rows"]:
            rank, p = by.get(key(row["spelling"])) or (None, None)  # None: a budget, fixed
            if p is None or ",cut=" in row["spelling"] and p.point.spelling() != row["spelling"]:
                p = evaluate(PlanPoint(**parse_spelling(row["spelling"])), work, cluster)
            peaks = {"predicted_peak_bytes": p.peak_bytes,  # the cut the run ran
                     "predicted_rank_peak_bytes": list(p.rank_peaks)}
            rows.append({**row, **peaks} if peaks_only else
                        {**row, **peaks, "glmc_rank": rank, "predicted_step_s": p.step_s,
                         "predicted_exposed_comm_s": _exposed(p)})
        results.append({**_summary(case["case"], case["nproc"], rows,
                                   case["priced"] if peaks_only else len(plans)),
                        **{k: case[k] for k in ("date", "argv", "machine", "calibrated")
                           if k in case}})
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repredict", action="store_true",
                    help="keep results/planner.json's measurements, predict them again")
    ap.add_argument("--peaks-only", action="store_true",
                    help="with --repredict: only the peaks, for every case (memory does not "
                         "depend on the host's speed)")
    ap.add_argument("--cases", default="glm:2,llama:2,glm:4,llama:4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--limit", type=int, default=12, help="plans run per case")
    ap.add_argument("--extra", type=int, default=0,
                    help="more rounds for glmc's pick and the plans measured within 10%% of "
                         "the best after --rounds")
    a = ap.parse_args()
    from glmc.analysis.calibration import machine_info
    m = machine_info()
    machine = (f"{m['cpu']}, {m['logical_cpus']} logical CPUs, {platform.machine()}, "
               f"torch {m['torch']}")
    results = []
    if a.repredict:
        old = json.loads((RESULTS / "planner.json").read_text())
        results = repredict(RESULTS / "planner.json", machine, a.peaks_only)
    else:
        for case in a.cases.split(","):
            name, n = case.split(":")
            results.append({**run_case(name, int(n), a.rounds, a.steps, a.limit, a.extra),
                            "date": datetime.date.today().isoformat(),
                            "machine": machine, "argv": " ".join(sys.argv[1:])})
        # one result file: the cases not run now keep their last run (each with its date)
        path = RESULTS / "planner.json"
        done = {(r["case"], r["nproc"]) for r in results}
        old_data = json.loads(path.read_text()) if path.exists() else {"cases": []}
        kept = [{"date": old_data.get("date"), "machine": old_data.get("machine"), **c}
                for c in old_data["cases"]]
        results = [c for c in kept if (c["case"], c["nproc"]) not in done] + results
    again = "peaks: --repredict --peaks-only" if a.peaks_only else "predictions: --repredict"
    argv = old["argv"].split(" (predictions")[0].split(" (peaks")[0] + f" ({again})" \
        if a.repredict else " ".join(sys.argv[1:])
    meta = {"date": datetime.date.today().isoformat(), "argv": argv, "machine": machine}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "planner.json").write_text(json.dumps({**meta, "cases": results}, indent=1))
    (RESULTS / "planner.md").write_text(_markdown(results, meta))
    _plot(results, RESULTS / "planner.svg")
    print(_markdown(results, meta))


if __name__ == "__main__":
    main()
