"""`glmc plan FILE --cluster NxG:DEVICE`: rank the parallel plans of FILE's step on a cluster,
and `glmc.plan(...)`, the same from Python (glmc.parallel.planner, glmc.parallel.search)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from glmc.parallel.cluster import DEVICE_KINDS, Cluster
from glmc.parallel.planner import PRECISIONS, parse_spelling, price_precisions
from glmc.parallel.search import PricedPlan, explain, search

GiB = 1024 ** 3


def add_plan_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan", help="rank every data/tensor/pipeline-parallel plan of FILE's step on a cluster "
                     "by predicted step time and memory",
        description="FILE as for `glmc compile`; its model may live on the meta device and its "
                    "example batch is the global batch. Nothing is run: the step is captured "
                    "with fake tensors and priced by glmc's cost model.")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--cluster", required=True, metavar="SPEC",
                   help="NODESxPER_NODE:DEVICE[+...] (devices: " + ", ".join(DEVICE_KINDS) +
                        "), or local (this machine's --nproc processes)")
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="with --cluster local: the processes (default 1)")
    p.add_argument("--fix", default=None, metavar="SPELLING",
                   help="price only the plans matching this partial spelling "
                        "(dp=..,tp=..,pp=..,zero=..,microbatch=..,schedule=..,virtual=..,"
                        "recompute=..,precision=..,compress=..)")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="training precision (default: the planner chooses between bf16 and "
                        "fp16 on GPUs; fp32 on CPUs)")
    p.add_argument("--intra-link", default=None, metavar="LINK",
                   help="link inside a node (as in glmc comm; default per device)")
    p.add_argument("--inter-link", default=None, metavar="LINK",
                   help="link between nodes (default per device)")
    p.add_argument("--no-overlap", action="store_true",
                   help="price the data-parallel gradient synchronisation after the backward "
                        "instead of overlapped with it")
    p.add_argument("--recompute-collectives", action="store_true",
                   help="under full recompute, price a layer's forward tensor-parallel "
                        "all-reduces issued again (Megatron-LM) instead of their outputs "
                        "kept (glmc's recompute pass)")
    p.add_argument("--top", type=int, default=10, metavar="K", help="plans to print (10)")
    p.add_argument("--explain", action="store_true",
                   help="say why the top plan beats the next ones")
    p.add_argument("--json", default=None, metavar="FILE", help="write every priced plan here")
    p.add_argument("--debug", action="store_true")
    return p


def plan(model: Any, example_inputs: Any, cluster: str = "local", loss_fn: Any = None,
         optimizer: Any = None, fix: str | None = None, precision: str | None = None,
         nproc: int | None = None, overlap: bool = True, intra_link: Any = None,
         inter_link: Any = None, recompute_collectives: bool = False) -> list[PricedPlan]:
    """Every plan of the step on `cluster` priced and ranked (those that fit first, by
    predicted step time). `fix`: a partial spelling the plans must match. Each result's
    `point.spelling()` names the plan; `to_dict()` has its predicted figures. `overlap`:
    False prices the gradient synchronisation after the backward, `recompute_collectives`
    a fully recomputed layer's tensor-parallel all-reduces issued again (both as Megatron-LM
    of 2021 ran; glmc overlaps the one and keeps the others' outputs)."""
    return _plan(model, example_inputs, cluster, loss_fn, optimizer, fix, precision, nproc,
                 overlap, intra_link, inter_link, recompute_collectives)[0]


def _plan(model: Any, example_inputs: Any, cluster: str, loss_fn: Any, optimizer: Any,
          fix: str | None, precision: str | None, nproc: int | None, overlap: bool,
          intra_link: Any, inter_link: Any, recompute_collectives: bool = False
          ) -> tuple[list[PricedPlan], Any, Cluster]:
    fixed = parse_spelling(fix) if fix else {}
    cl = Cluster.parse(cluster, intra_link, inter_link, nproc)
    device = cl.groups[0].device
    tps = [t for t in (1, 2, 4, 8, 16) if t <= cl.per_node and cl.devices % t == 0]
    if "tp" in fixed:
        tps = [fixed["tp"]]
    given = precision or fixed.get("precision")
    others = [g.device for g in cl.groups[1:]]
    # the precisions every device kind of the cluster offers, the first kind's order
    choices = [c for c in device.searched if all(c in d.searched for d in others)] or \
        [device.dtype]
    works = price_precisions(model, example_inputs, loss_fn, optimizer, device,
                             [given] if given else choices, tps, others)
    if recompute_collectives:
        works = [w.recomputing_collectives() for w in works]
    return search(works, cl, fixed, overlap), works[0], cl


def run_plan(args: argparse.Namespace) -> int:
    from glmc.frontend.workload import load_workload
    started = time.perf_counter()
    w = load_workload(args.file)
    plans, work, cl = _plan(w.model, w.example_inputs, args.cluster, w.loss_fn, w.optimizer,
                           args.fix, args.precision, args.nproc, not args.no_overlap,
                           args.intra_link, args.inter_link, args.recompute_collectives)
    took = time.perf_counter() - started
    print(f"glmc plan: {cl.spelling()} ({cl.devices} devices), global batch "
          f"{work.sequences} x {work.tokens_per_sequence} tokens, "
          f"{' or '.join(dict.fromkeys(p.point.precision for p in plans))}; "
          f"{len(plans)} plans priced in {took:.1f} s (capture and pricing {work.capture_s:.1f} s)")
    for note in work.notes:
        print(f"  note: {note}")
    for t, why in sorted(work.tp_errors.items()):
        print(f"  tp={t} not priced: {why}")
    print(format_table(plans[:args.top]))
    print(f"  top plan: {plans[0].describe()}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "cluster": cl.spelling(), "search_seconds": took,
            "plans": [p.to_dict() for p in plans]}, indent=1))
    if not plans[0].fits:
        need = min(p.peak_bytes for p in plans)
        print(f"glmc: error: no plan fits in {cl.groups[0].device.memory_bytes / GiB:.1f} GiB "
              f"per device; the smallest needs {need / GiB:.1f} GiB per device")
        return 1
    if cl.heterogeneous and plans[0].point.pp > 1:
        from glmc.parallel.search import evaluate
        even = evaluate(dataclasses.replace(plans[0].point, cut=()), work, cl,
                        not args.no_overlap, cut="equal")
        print(f"  stages on {', '.join(plans[0].stage_devices)}: blocks per stage "
              f"{list(plans[0].stage_parts)} ({plans[0].step_s * 1e3:.1f} ms); an even split "
              f"{list(even.stage_parts)} would take {even.step_s * 1e3:.1f} ms")
    if args.explain:
        for line in explain(plans):
            print(f"  vs {line}")
    return 0


def format_table(plans: list[PricedPlan]) -> str:
    head = ("#", "plan", "step", "tokens/s", "TFLOP/s model/hw", "MFU", "peak GiB", "fits",
            "runtime")
    rows = [head]
    for i, p in enumerate(plans, 1):
        gaps = p.point.runtime_gaps()
        rows.append((str(i), p.point.spelling(), f"{p.step_s * 1e3:.1f} ms",
                     f"{p.tokens_per_s:,.0f}",
                     f"{p.model_tflops:.1f}/{p.hardware_tflops:.1f}", f"{p.mfu:.1%}",
                     f"{p.peak_bytes / GiB:.2f}", "yes" if p.fits else "NO",
                     "runs" if not gaps else "not yet: " + "; ".join(gaps)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


# ---- running a plan: glmc compile FILE --plan SPELLING|auto ------------------------------------

_PLAN_FLAGS = ("tp", "pp", "zero", "microbatches", "schedule", "accumulate", "bucket_mb",
               "compress", "cut")


def apply_plan(args: argparse.Namespace, argv: list[str]) -> list[str]:
    """Set the flags `--plan` stands for on `args` (the launcher and every rank do this) and
    return `argv` with `--plan auto` replaced by the spelling it chose, so ranks do not search
    again. Typed errors: a spelling that does not parse, that does not match --nproc, or that
    the runtime cannot run yet."""
    import os
    from glmc.errors import ConfigError
    from glmc.frontend.workload import load_workload
    from glmc.parallel.planner import PlanPoint, _rows

    launched = "TORCHELASTIC_RUN_ID" in os.environ  # a rank torchrun started
    world = int(os.environ["WORLD_SIZE"]) if launched else args.nproc
    given = [f"--{f}" for f in _PLAN_FLAGS if getattr(args, f, None) is not None]
    if given and not launched:
        raise ConfigError(f"give either --plan or {', '.join(given)}, not both")
    if launched and args.plan_spelling == "auto":
        raise ConfigError("--plan auto chooses once, in glmc's launcher: run glmc compile "
                          "--nproc N --plan auto, or give every rank the same spelling")
    w = load_workload(args.file)
    rows, _ = _rows(w.example_inputs)
    spelling = args.plan_spelling
    if spelling == "auto":
        point = _auto(w, world or 1)
        argv = [point.spelling() if a == "auto" and i and argv[i - 1] == "--plan" else a
                for i, a in enumerate(argv)]
        argv = [f"--plan={point.spelling()}" if a == "--plan=auto" else a for a in argv]
    else:
        fixed = parse_spelling(spelling)
        tp, pp = fixed.get("tp", 1), fixed.get("pp", 1)
        dp = fixed.get("dp", max(1, (world or tp * pp) // (tp * pp)))
        if rows < dp:
            raise ConfigError(f"the global batch of {rows} sequences is smaller than dp={dp}")
        schedule = fixed.get("schedule", "1f1b")
        point = PlanPoint(dp, tp, pp, fixed.get("zero", 0), fixed.get("microbatch", rows // dp),
                          schedule, fixed.get("virtual", 2 if schedule == "interleaved" else 1),
                          fixed.get("recompute", "none"), fixed.get("precision", "fp32"),
                          fixed.get("bucket", PlanPoint.bucket), fixed.get("compress", "none"),
                          fixed.get("cut", ()))
        if point.cut and len(point.cut) != point.pp * point.virtual - 1:
            raise ConfigError(f"the plan {point.spelling()} cuts {len(point.cut) + 1} stages; "
                              f"pp={point.pp} x virtual={point.virtual} needs "
                              f"{point.pp * point.virtual - 1} starts in cut=")
        if world is not None and point.devices != world:
            raise ConfigError(f"the plan {point.spelling()} runs on dp x tp x pp = "
                              f"{point.devices} processes, but --nproc is {world}")
    _set_flags(args, point, rows, launched)
    return argv


#: the environment variable `--plan auto` leaves its choice in for the ranks it launches (their
#: report shows the chosen plan, its rank and the runners-up)
PLAN_CHOICE = "GLMC_PLAN_CHOICE"


def plan_choice(spelling: str | None) -> dict[str, Any] | None:
    """`--plan auto`'s choice (PLAN_CHOICE) when this run runs it: in the launcher's own
    process (`spelling` "auto") or in a rank it launched with the chosen spelling."""
    import os
    text = os.environ.get(PLAN_CHOICE)
    if not spelling or not text:
        return None
    choice = json.loads(text)
    return choice if spelling in ("auto", choice["chosen"]["spelling"]) else None


def _auto(w: Any, world: int) -> Any:
    """The top plan for `world` local processes that fits and that the runtime can run; the
    choice, its rank and the next runnable plans go to PLAN_CHOICE (JSON)."""
    import os

    from glmc.errors import ConfigError
    plans = plan(w.model, w.example_inputs, "local", w.loss_fn, w.optimizer, nproc=world)

    ranked = [(rank, p) for rank, p in enumerate(plans, 1)
              if p.fits and not p.point.runtime_gaps()]
    if not ranked:
        raise ConfigError(f"no plan for {world} local processes fits and runs; see glmc plan "
                          "FILE --cluster local")
    (rank, top), others = ranked[0], ranked[1:4]
    print(f"glmc: --plan auto: plan {rank} of {len(plans)} for {world} local process(es): "
          f"{top.point.spelling()} (predicted {top.step_s * 1e3:.1f} ms, "
          f"{top.peak_bytes / GiB:.2f} GiB per process)", flush=True)
    for r, p in others:
        print(f"  runner-up {r}: {p.point.spelling()} ({p.step_s * 1e3:.1f} ms, "
              f"{p.step_s / top.step_s:.2f}x)", flush=True)

    def row(r: int, p: Any) -> dict[str, Any]:
        return {"rank": r, "spelling": p.point.spelling(), "step_s": p.step_s,
                "peak_bytes": p.peak_bytes}
    os.environ[PLAN_CHOICE] = json.dumps({"of": len(plans), "chosen": row(rank, top),
                                          "runners_up": [row(r, p) for r, p in others]})
    return top.point


def _set_flags(args: argparse.Namespace, point: Any, rows: int, launched: bool) -> None:
    from glmc.errors import ConfigError
    gaps = point.runtime_gaps()
    if rows % (point.dp * point.microbatch):
        raise ConfigError(f"the global batch of {rows} sequences does not split into "
                          f"dp={point.dp} x microbatch={point.microbatch}")
    m = rows // (point.dp * point.microbatch)
    if gaps:
        raise ConfigError(f"glmc cannot run {point.spelling()} yet: {'; '.join(gaps)} "
                          "(glmc plan prices it; pick a plan marked 'runs')")
    if not launched and point.devices > 1:
        args.nproc = point.devices
    args.tp = point.tp if point.tp > 1 else None
    args.pp = point.pp if point.pp > 1 else None
    args.zero = point.zero if point.devices > 1 else None
    if point.pp > 1:
        args.microbatches, args.schedule = m, point.schedule
        args.cut = "/".join(map(str, point.cut)) or None
    elif m > 1:
        args.accumulate = m
    if point.dp > 1 and point.pp == 1:  # the pipeline runtime all-reduces whole stages
        args.bucket_mb = point.bucket
    if point.compress != "none":
        args.compress = point.compress
    if point.recompute != "none" and getattr(args, "memory_budget", None) is None:
        args.memory_budget = point.recompute  # none, selective, full: the pass's rules
    if args.precision not in (None, point.precision) and not launched:
        raise ConfigError(f"the plan trains in {point.precision} but --precision is "
                          f"{args.precision}")
    if point.precision != "fp32":
        args.precision = point.precision
