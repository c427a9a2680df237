"""Which real architectures train data-parallel through glmc: ZeRO stages and gradient
compression on the model zoo, 2 processes on gloo.

Every case of tests/zoo.py (transformers models from tiny configs, random weights) trains for
three steps on 2 processes (each rank half the case's batch), eager backend, under each column
of `tests.zoo.PARALLEL` — ZeRO stages 0-3 and each compression method on a stage it fits — and
once in plain PyTorch on the whole batch. `tests.zoo.judge_parallel` says what "works" means:

    works    ZeRO: losses equal one process's at rtol 1e-4 — or, where a data-parallel step
             cannot equal it (dropout masks drawn per rank; BatchNorm normalising each rank's
             half), stage 0's at rtol 1e-5 (the cell says which), and it trains;
             bf16 transfer: stage 0's at rtol 1e-3; sign / top-k / PowerSGD: it trains,
             at the wire ratio the cell gives. "It trains": the last loss is below that of
             the same steps at learning rate 0 (the same dropout masks, no update)
    partial  it trains, but a check fails (the cell says which)
    no       glmc raised (the cell gives the exception)

Writes benchmarks/results/zoo-parallel.md and .json.

    python benchmarks/zoo_parallel.py                     # every case (~10 min on 2 cores)
    python benchmarks/zoo_parallel.py --models gpt2,resnet
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def rank_main(rank: int, port: int, names: list[str], out: str) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from tests.zoo import ZOO, parallel_cells
    found: dict = {}
    for name in names:
        t0 = time.perf_counter()
        cells = parallel_cells(ZOO[name])
        found[name] = {"cells": cells, "seconds": round(time.perf_counter() - t0, 1)}
        if rank == 0:
            print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(found))
    dist.destroy_process_group()


def table(found: dict) -> tuple[list[str], dict]:
    from tests.zoo import PARALLEL, ZOO, comparable_to_one_process, judge_parallel, param_count
    head = ["case", "params", *PARALLEL]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    statuses: dict = {}
    for name, r in found.items():
        case = ZOO[name]
        cells = {k: tuple(v) if isinstance(v, list) else v for k, v in r["cells"].items()}
        exact = comparable_to_one_process(case)
        row = [name + ("" if exact else " (vs zero 0)"), f"{param_count(case.make()[0]):,}"]
        for column in PARALLEL:
            status, note = judge_parallel(column, cells, exact)
            statuses[f"{name}/{column}"] = status
            row.append(f"{status} ({note})")
        lines.append("| " + " | ".join(row) + " |")
    return lines, statuses


def main() -> None:
    import torch.multiprocessing as mp
    from bench_step import cpu_name, run_meta

    from tests.distributed import free_port
    from tests.zoo import STEPS, ZOO
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="", help="comma-separated zoo cases (default: all)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    names = a.models.split(",") if a.models else list(ZOO)
    raw = Path(a.out) / "zoo-parallel.raw.json"
    mp.spawn(rank_main, args=(free_port(), names, str(raw)), nprocs=2)
    found = json.loads(raw.read_text())
    raw.unlink()
    meta = run_meta("zoo_parallel.py")
    lines, statuses = table(found)
    counts = {s: list(statuses.values()).count(s) for s in ("works", "partial", "no")}
    text = [f"Model zoo, data-parallel: 2 processes (gloo), eager backend, {STEPS} steps per "
            f"cell; {meta['date']}, {cpu_name()}, torch {meta['torch']}; "
            f"`{meta['command']}`. Cells: status (check; for compression the wire ratio); "
            f"{counts['works']} works, {counts['partial']} partial, {counts['no']} no. Cases "
            "marked (vs zero 0) draw dropout masks per rank or normalise each rank's half by "
            "BatchNorm, so their stages are compared to stage 0, not to one process.", "",
            *lines]
    Path(a.out, "zoo-parallel.md").write_text("\n".join(text) + "\n")
    Path(a.out, "zoo-parallel.json").write_text(json.dumps(
        {"meta": meta, "cells": found, "status": statuses}, indent=1))
    print("\n".join(text))


if __name__ == "__main__":
    main()
