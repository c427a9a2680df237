"""The communication model checked per collective kind, size and process count (issue 38).

On `--ranks` local processes (gloo, one thread each), after glmc calibrates the link as a run
does (`glmc.analysis.comm.measure_link`: each kind timed at 4 KiB, 64 KiB, 1, 4, 16, 32 MiB),
every collective kind is timed at other sizes (16 KiB-48 MiB, median of `--reps`, with the
quartiles: the noise of 2-core hosts) and compared with:

* `all-reduce fit`  the model before per-kind calibration: one latency/bandwidth pair from
                    two all-reduces (1 KiB and 8 MiB), every kind priced by its ring formula
* `per-kind fit`    each kind's own fitted latency and bandwidth (glmc's model on other rank
                    counts than the calibrated one)
* `timed points`    what glmc uses at the calibrated rank count: the calibration's own points,
                    interpolated log-log (past the largest: plus the per-kind bandwidth)

and the overlap: a matmul loop about as long as a 32 MiB all-reduce, timed alone and with the
all-reduce in flight (`contention`: compute seconds lost per second of overlap).

    python benchmarks/bench_comm.py --ranks 2   # and --ranks 4; each updates its own rows
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import ROOT, cpu_name, run_distributed, run_meta, write_result  # noqa: E402

SIZES = (16 << 10, 256 << 10, 2 << 20, 8 << 20, 24 << 20, 48 << 20)


def _old_link(n: int, reps: int):
    """The previous calibration: two all-reduces fitted to the all-reduce ring formula."""
    from glmc.analysis.comm import _FACTORS, LinkProfile, _timed
    small, large = 1024, 8 << 20
    t_small, t_large = (_timed("all_reduce", b, n, None, "cpu", reps) for b in (small, large))
    steps, share = _FACTORS["all_reduce"]
    return LinkProfile("all-reduce fit", max(t_small / steps(n), 1e-7),
                       share(n) * (large - small) / max(t_large - t_small, 1e-9), "")


def rank_main(a: argparse.Namespace) -> None:
    import torch.distributed as dist

    from glmc.analysis.comm import _KINDS, collective_seconds, measure_link, timed_collective
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    n = dist.get_world_size()
    link = measure_link(reps=a.reps, fresh_s=0)  # timed now, not reused
    old = _old_link(n, a.reps)
    fit = dataclasses.replace(link, points=())  # the per-kind figures alone
    rows = []
    for kind in _KINDS:
        for nbytes in SIZES:
            times = sorted(timed_collective(kind, nbytes, n, None, "cpu", a.reps))
            got = statistics.median(times)
            rows.append({"kind": kind, "bytes": nbytes, "measured_ms": got * 1e3,
                         "quartiles_ms": [times[len(times) // 4] * 1e3,
                                          times[(3 * len(times)) // 4] * 1e3],
                         "all_reduce_fit_ms": collective_seconds(kind, nbytes, n, old) * 1e3,
                         "per_kind_fit_ms": collective_seconds(kind, nbytes, n, fit) * 1e3,
                         "timed_points_ms": collective_seconds(kind, nbytes, n, link) * 1e3})
    if dist.get_rank() == 0:
        _write(a, n, link, rows)
    dist.destroy_process_group()


def _error(pred: float, got: float) -> float:
    return pred / got - 1


def _summary(rows: list[dict]) -> dict:
    out = {}
    for kind in sorted({r["kind"] for r in rows}):
        mine = [r for r in rows if r["kind"] == kind]
        out[kind] = {m: statistics.median(abs(_error(r[f"{m}_ms"], r["measured_ms"]))
                                          for r in mine)
                     for m in ("all_reduce_fit", "per_kind_fit", "timed_points")}
    return out


def _write(a: argparse.Namespace, n: int, link, rows: list[dict]) -> None:
    path = Path(a.out) / "comm.json"
    merged = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    merged["runs"][str(n)] = {**run_meta("bench_comm.py"), "cpu": cpu_name(), "nproc": n,
                              "reps": a.reps, "link": link.to_dict(), "rows": rows,
                              "median_abs_error": _summary(rows)}
    write_result(Path(a.out), "comm", merged,
                 "\n\n".join(_markdown(r) for _, r in sorted(merged["runs"].items())))


def _markdown(run: dict) -> str:
    lines = [f"**{run['nproc']} processes** (gloo, 1 thread each), median of {run['reps']} per "
             f"point; {run['date']}, {run['cpu']}, torch {run['torch']}; `{run['command']}`. "
             f"Contention measured: {run['link']['contention']:.2f} (compute seconds lost per "
             "second of overlapped all-reduce; 1 = overlap hides nothing)", "",
             "| collective | full buffer | measured (ms) | its quartiles (ms) | all-reduce fit "
             "(ms) / error | per-kind fit (ms) / error | timed points (ms) / error |",
             "|---|---|---|---|---|---|---|"]
    for r in run["rows"]:
        size = f"{r['bytes'] >> 10} KiB" if r["bytes"] < 1 << 20 else f"{r['bytes'] >> 20} MiB"
        lines.append(
            f"| {r['kind']} | {size} | {r['measured_ms']:.2f} | "
            f"{r['quartiles_ms'][0]:.2f}-{r['quartiles_ms'][1]:.2f} | "
            f"{r['all_reduce_fit_ms']:.2f} / {_error(r['all_reduce_fit_ms'], r['measured_ms']):+.0%} | "
            f"{r['per_kind_fit_ms']:.2f} / {_error(r['per_kind_fit_ms'], r['measured_ms']):+.0%} | "
            f"{r['timed_points_ms']:.2f} / {_error(r['timed_points_ms'], r['measured_ms']):+.0%} |")
    lines += ["", "| collective | median abs. error, all-reduce fit | per-kind fit | timed points |",
              "|---|---|---|---|"]
    for kind, e in run["median_abs_error"].items():
        lines.append(f"| {kind} | {e['all_reduce_fit']:.0%} | {e['per_kind_fit']:.0%} | "
                     f"{e['timed_points']:.0%} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    # not `--nproc`: torchrun reads that as an abbreviation of its own --nproc-per-node
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    run_distributed(__file__, a.ranks, rank_main, a)


if __name__ == "__main__":
    main()
