"""glmc's pipeline schedules, predicted against measured (step time, bubble, per-rank peak), and
optionally torch.distributed.pipelining on the same split: 2 gloo processes on this host.

    .venv/bin/python benchmarks/bench_pipeline.py [--config tiny|small]
        [--schedules 1f1b,zbh1,gpipe] [--microbatches 4] [--steps 5] [--torch]

glmc runs `pipeline_trainer` + `PipelineTrainer.measure` as `glmc compile --pp 2` does (its
own cut, predicted on the measured gloo link). With --torch, torch runs the *same stage
modules* (glmc's fx split, as PipelineStage submodules) under Schedule1F1B with eager autograd
and torch.optim. Prints one markdown row per executor.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _glm(config: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location("glm_example", ROOT / "examples" / "glm.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.workload(config)


def _worker(rank: int, port: int, args: argparse.Namespace, blocks: list, out: str,
            schedule: str) -> None:
    """One executor in fresh processes (a link measured after another run in the same
    processes came out 3-4x slower here)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    rows = {}
    try:
        if schedule != "torch":
            name, _, cut = schedule.partition(":")
            rows[f"glmc {name}" + (f" ({cut} split)" if cut else "")] = \
                _run_glmc(rank, args, name, cut or None)
        else:
            try:  # partial: torch's stage-to-stage integer leaves arrive corrupted (see README)
                rows["torch.distributed.pipelining 1f1b"] = _run_torch(rank, args, blocks)
            except Exception as e:  # noqa: BLE001 - reported in the table
                rows["torch.distributed.pipelining 1f1b"] = {
                    "error": f"{type(e).__name__}: {e}"[:300]}
    finally:
        torch.save(rows, Path(out) / f"rank{rank}.pt")
        dist.destroy_process_group()


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _run_glmc(rank: int, args: argparse.Namespace, schedule: str, cut: str | None) -> dict:
    """glmc's trainer as `glmc compile --pp 2` runs it: its own plan (on the measured link),
    warm-up steps, then `measure` (back-to-back steps, one aligned step, one memory step)."""
    from glmc.pipeline_parallel import pipeline_report, pipeline_trainer
    model, batch, loss_fn, opt = _glm(args.config)
    virtual = 2 if schedule == "interleaved" else 1
    trainer = pipeline_trainer(model, opt, loss_fn, batch, args.microbatches, schedule, virtual,
                               cut=cut)
    before = _rss()
    for _ in range(2):
        trainer.step(*batch)
    m = trainer.measure(*batch, steps=args.steps)
    data = pipeline_report(trainer.pipeline.plan, m, trainer.pipeline.program)
    return {"step_s": m.period_s, "rss_growth": _rss() - before, "data": data}


def _run_torch(rank: int, args: argparse.Namespace, blocks: list) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from glmc.pipeline_parallel import split_module, trace_blocks
    model, batch, loss_fn, opt = _glm(args.config)
    gm = trace_blocks(model, [b for bs in blocks for b in bs], loss_fn)
    mods = split_module(gm, blocks)
    sm = mods[rank]
    mb = [t.chunk(args.microbatches)[0] for t in batch]

    class Stage(torch.nn.Module):  # torch's stage: (received..., ids, labels) in a fixed order
        def __init__(self) -> None:
            super().__init__()
            self.inner = sm.module

        def forward(self, *xs):
            # torch gives only stage 0 the batch: stage 0 forwards the leaves with its
            # activations (ids and labels are integer tensors, no gradient)
            if rank == 0:
                out = self.inner(*[xs[a] for a in sm.args])
                return (*(out if isinstance(out, tuple) else (out,)), *xs)
            received, leaves = iter(xs[:-len(batch)]), xs[-len(batch):]
            return self.inner(*[leaves[a] if isinstance(a, int) else next(received)
                                for a in sm.args])

    stage_mod = Stage()
    stage = PipelineStage(stage_mod, rank, 2, torch.device("cpu"))
    # the last stage returns the loss itself; torch's loss_fn is then the identity on it
    sched = Schedule1F1B(stage, args.microbatches, loss_fn=(lambda out, _t: out) if rank else None)
    torch_opt = type(opt)(stage_mod.parameters(), **{k: v for k, v in opt.defaults.items()
                                                     if k != "decoupled_weight_decay"})
    before, times = _rss(), []
    for _ in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        torch_opt.zero_grad()
        if rank == 0:
            sched.step(*batch)
        else:
            sched.step(target=batch[1])
        torch_opt.step()
        times.append(time.perf_counter() - t0)
    del mb
    return {"step_s": statistics.median(times[1:] or times), "rss_growth": _rss() - before,
            "bubble": None}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="tiny")
    p.add_argument("--schedules", default="1f1b,zbh1,gpipe",
                   help="glmc schedules to run, comma-separated; NAME:equal runs NAME on an "
                        "equal split of blocks instead of glmc's cut")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="measured back-to-back steps")
    p.add_argument("--torch", action="store_true",
                   help="also run torch.distributed.pipelining's Schedule1F1B (fails: README)")
    args = p.parse_args()
    import glmc
    from glmc.pipeline_parallel import plan_stages
    model, batch, loss_fn, opt = _glm(args.config)
    plan = plan_stages(model, opt, loss_fn, batch, 2, args.microbatches, "1f1b")
    blocks = [list(s.blocks) for s in plan.stages]
    import tempfile

    from tests.distributed import free_port
    ranks: list[dict] = [{}, {}]
    for schedule in args.schedules.split(",") + (["torch"] if args.torch else []):
        with tempfile.TemporaryDirectory() as out:
            mp.start_processes(_worker, args=(free_port(), args, blocks, out, schedule),
                               nprocs=2, start_method="spawn")
            for r in range(2):
                ranks[r].update(torch.load(Path(out) / f"rank{r}.pt", weights_only=False))
    print(f"# {time.strftime('%Y-%m-%d')} {os.uname().machine} {os.cpu_count()} CPUs, "
          f"GLM {args.config}, 2 stages, {args.microbatches} microbatches, "
          f"glmc {glmc.__version__}, torch {torch.__version__}")
    print("| executor | cut | imbalance predicted / measured | step ms predicted / measured "
          "(back to back) | bubble predicted / "
          "measured aligned / back to back / replayed | peak MiB planned / predicted / "
          "measured (rank 0; rank 1) | measured link |")
    print("|---|---|---|---|---|---|---|")
    for name in ranks[0]:
        if any("error" in r[name] for r in ranks):
            err = " / ".join(f"rank {i}: {r[name]['error']}" for i, r in enumerate(ranks)
                             if "error" in r[name])
            print(f"| {name} | failed: {err} | - | - | - | - | - |")
            continue
        d = ranks[0][name].get("data")
        if d is None:
            print(f"| {name} | same | - | - / {max(r[name]['step_s'] for r in ranks) * 1e3:.1f} "
                  "| - | - | - |")
            continue
        b, t = d["bubble"], d["step_seconds"]
        cut = " \\| ".join(", ".join(s["blocks"]) for s in d["stages"])
        peaks = "; ".join(f"{r['planned_peak_bytes'] / 2**20:.1f} / "
                          f"{r['predicted_peak_bytes'] / 2**20:.1f} / "
                          f"{r['measured_peak_bytes'] / 2**20:.1f}" for r in d["ranks"])
        print(f"| {name} | {cut} | {d['imbalance']:.3f} / {d['measured_imbalance']:.3f} "
              f"| {t['predicted'] * 1e3:.1f} / {t['measured_steady'] * 1e3:.1f}"
              f" | {b['predicted']:.1%} / {b['measured']:.1%} / {b['measured_steady']:.1%} / "
              f"{b['replayed']:.1%} | {peaks} | {d['link']['latency_us']:.0f} us, "
              f"{d['link']['bandwidth_GBps']:.2f} GB/s |")


if __name__ == "__main__":
    main()
