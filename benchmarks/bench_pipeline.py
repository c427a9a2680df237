"""glmc's pipeline schedules, predicted against measured (step time, bubble, per-rank peak), and
optionally torch.distributed.pipelining on the same split: 2 gloo processes on this host.

    .venv/bin/python benchmarks/bench_pipeline.py [--config tiny|small]
        [--schedules 1f1b,zbh1,gpipe,1f1b/inductor,1f1b+fused] [--microbatches 4] [--steps 5]
        [--torch]

glmc runs `pipeline_trainer` + `PipelineTrainer.measure` as `glmc compile --pp 2` does (its
own cut, predicted on the measured gloo link). With --torch, torch runs the *same stage
modules* (glmc's fx split, as PipelineStage submodules) under Schedule1F1B with eager autograd
and torch.optim. Prints one markdown row per executor.
"""
from __future__ import annotations

import argparse
import os
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
        if schedule == "pair":
            try:
                rows["pair"] = _run_pair(rank, args, blocks)
            except Exception as e:  # noqa: BLE001 - reported below the table
                rows["pair"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        elif schedule != "torch":
            fusion = "+fused" in schedule
            spec, _, backend = schedule.replace("+fused", "").partition("/")
            spec, _, budget = spec.partition("@")
            name, _, cut = spec.partition(":")
            label = f"glmc {name}" + (f" ({cut} split)" if cut else "") + \
                (f" (memory budget {budget})" if budget else "") + \
                (f" on {backend}" if backend else "") + (", fused" if fusion else "")
            rows[label] = _run_glmc(rank, args, name, cut or None, budget or None,
                                    backend or "eager", fusion)
        else:
            try:
                rows["torch.distributed.pipelining 1f1b"] = _run_torch(rank, args, blocks)
            except Exception as e:  # noqa: BLE001 - reported in the table
                rows["torch.distributed.pipelining 1f1b"] = {
                    "error": f"{type(e).__name__}: {e}"[:300]}
    finally:
        torch.save(rows, Path(out) / f"rank{rank}.pt")
        dist.destroy_process_group()


def _run_glmc(rank: int, args: argparse.Namespace, schedule: str, cut: str | None,
              budget: str | None, backend: str = "eager", fusion: bool = False) -> dict:
    """glmc's trainer as `glmc compile --pp 2` runs it: its own plan (on the measured link),
    warm-up steps, then `measure` (back-to-back steps, one aligned step, one memory step)."""
    from glmc.parallel.pipeline_report import pipeline_report
    from glmc.parallel.pipeline import pipeline_trainer
    model, batch, loss_fn, opt = _glm(args.config)
    virtual = 2 if schedule == "interleaved" else 1
    trainer = pipeline_trainer(model, opt, loss_fn, batch, args.microbatches, schedule, virtual,
                               cut=cut, memory_budget=budget, backend=backend,
                               fusion=fusion)
    losses = [trainer.step(*batch) for _ in range(2)]
    m = trainer.measure(*batch, steps=args.steps)
    data = pipeline_report(trainer.pipeline.plan, m, trainer.pipeline)
    return {"step_s": m.period_s, "data": data,
            "losses": [None if x is None else x.item() for x in losses]}


def _run_torch(rank: int, args: argparse.Namespace, blocks: list) -> dict:
    """torch.distributed.pipelining's Schedule1F1B on the same stage modules (glmc's fx
    split), eager autograd and torch.optim: back-to-back steps timed as glmc's are, one step's
    peak measured as glmc's is (c10 allocator events above the stage's parameters and
    optimizer state, plus that state), the mean microbatch loss for a parity check."""
    from glmc.analysis.memory import measure_peak
    step, state = _torch_pipeline(rank, args, blocks)
    warm = [step() for _ in range(3)]  # 2 warm-up steps as glmc's, then one more
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    period = (time.perf_counter() - t0) / args.steps
    _, mem = measure_peak(step, state=state())
    return {"step_s": period, "peak": (mem.persistent_bytes or 0) + mem.peak_bytes,
            "losses": warm}


def _run_pair(rank: int, args: argparse.Namespace, blocks: list) -> dict:
    """glmc's 1F1B (its own plan, as `glmc compile --pp 2`) and torch's Schedule1F1B on
    glmc's split in the same two processes, one step of each per round after warm-up, the
    order swapped every round: each step starts at a barrier and lasts until the slower rank
    ends it (MAX over the ranks) — one isolated step, not `measure`'s back-to-back period."""
    from glmc.parallel.pipeline import pipeline_trainer
    model, batch, loss_fn, opt = _glm(args.config)
    trainer = pipeline_trainer(model, opt, loss_fn, batch, args.microbatches, "1f1b",
                               backend=args.pair_backend, memory_budget=args.pair_budget,
                               fusion=args.pair_fusion)
    if [list(s.blocks) for s in trainer.pipeline.plan.stages] != blocks:
        raise RuntimeError("glmc planned another cut in these processes than in the parent's")
    torch_step, _ = _torch_pipeline(rank, args, blocks)
    steps = {"glmc 1f1b": lambda: trainer.step(*batch), "torch.distributed.pipelining 1f1b":
             torch_step}  # glmc's stages on --pair-backend; torch's eager
    for _ in range(2):
        for fn in steps.values():
            fn()
    times: dict[str, list[float]] = {n: [] for n in steps}
    for i in range(args.interleave):
        order = list(steps.items())
        for n, fn in order if i % 2 == 0 else order[::-1]:  # each goes first every other round
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            times[n].append(took.item())
    return {"times": times}


def _torch_pipeline(rank: int, args: argparse.Namespace, blocks: list):
    """(step, state): one training step of torch's Schedule1F1B on this rank's stage, and
    the tensors it keeps between steps (parameters, optimizer state)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from glmc.parallel.stage_modules import split_module, trace_blocks
    model, batch, loss_fn, opt = _glm(args.config)
    gm = trace_blocks(model, [b for bs in blocks for b in bs], loss_fn)
    stages = split_module(gm, blocks)
    sm = stages[rank]
    chunks = [t.chunk(args.microbatches) for t in batch]
    with torch.no_grad():  # each stage's input and output on one microbatch, given to torch
        first = stages[0].module(*[chunks[a][0] for a in stages[0].args])
        first = first if isinstance(first, tuple) else (first,)
        last = stages[1].module(*[chunks[a][0] if isinstance(a, int)
                                  else first[stages[0].send.index(a)] for a in stages[1].args])
    # a received activation requires grad (torch's receive buffers copy this metadata)
    example_in = tuple(c[0] for c in chunks) if rank == 0 else \
        tuple(t.detach().requires_grad_(t.is_floating_point()) for t in first)
    example_out = first if rank == 0 else last

    class Stage(torch.nn.Module):
        """Only activations travel between torch's stages, as between glmc's: stage 0 gets
        the batch from the schedule; a later stage reads the batch leaves it needs (labels)
        itself, microbatch by microbatch — torch's schedules run a stage's forwards in
        microbatch order. (Forwarding the integer leaves through stage 0 corrupted them.)"""

        def __init__(self) -> None:
            super().__init__()
            self.inner = sm.module
            self.microbatch = iter(())

        def forward(self, *xs: torch.Tensor):
            if rank == 0:
                return self.inner(*[xs[a] for a in sm.args])
            received, i = dict(zip(stages[0].send, xs)), next(self.microbatch)
            return self.inner(*[chunks[a][i] if isinstance(a, int) else received[a]
                                for a in sm.args])

    stage_mod = Stage()
    # static shapes: torch's runtime shape inference deadlocked on gloo (both ranks waiting
    # on a send) with this module
    grads = tuple(torch.zeros_like(t) for t in first)  # of the activations that travel
    stage = PipelineStage(stage_mod, rank, 2, torch.device("cpu"), input_args=example_in,
                          output_args=example_out,
                          input_grads=(None,) * len(example_in) if rank == 0 else grads,
                          output_grads=grads if rank == 0 else None)
    # the last stage returns the loss itself; torch's loss_fn is then the identity on it.
    # Every rank passes it: without a loss_fn a rank's schedule runs no backward at all
    sched = Schedule1F1B(stage, args.microbatches, loss_fn=lambda out, _t: out)
    torch_opt = type(opt)(stage_mod.parameters(), **{k: v for k, v in opt.defaults.items()
                                                     if k != "decoupled_weight_decay"})

    def step() -> float | None:
        torch_opt.zero_grad()
        stage_mod.microbatch = iter(range(args.microbatches))
        losses: list[torch.Tensor] = []
        if rank == 0:
            sched.step(*batch, return_outputs=False)
        else:
            sched.step(target=batch[1], losses=losses, return_outputs=False)
        if any(p.grad is None for p in stage_mod.parameters()):
            raise RuntimeError(f"torch.distributed.pipelining left stage {rank}'s parameters "
                               "without gradients")
        torch_opt.step()
        return torch.stack(losses).mean().item() if losses else None

    def state() -> list[torch.Tensor]:
        return list(stage_mod.parameters()) + [v for st in torch_opt.state.values()
                                               for v in st.values()
                                               if isinstance(v, torch.Tensor)]
    return step, state


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="tiny")
    p.add_argument("--schedules", default="1f1b,zbh1,gpipe",
                   help="glmc schedules to run, comma-separated; NAME:equal runs NAME on an "
                        "equal split of blocks instead of glmc's cut; NAME@BUDGET under a "
                        "per-rank memory budget (a size, a fraction of the activations, min); "
                        "NAME/BACKEND with the stages compiled by BACKEND (default eager); "
                        "NAME+fused with the stages' forwards fused (`--fusion`)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="measured back-to-back steps")
    p.add_argument("--torch", action="store_true",
                   help="also run torch.distributed.pipelining's Schedule1F1B on glmc's split")
    p.add_argument("--interleave", type=int, default=0, metavar="N",
                   help="also time glmc's 1F1B and torch's Schedule1F1B in the same two "
                        "processes, one step of each per round, N rounds (medians, ratio)")
    p.add_argument("--pair-backend", default="eager",
                   help="what runs glmc's stages in the --interleave run (eager, inductor)")
    p.add_argument("--pair-budget", default=None,
                   help="glmc's per-rank memory budget in the --interleave run (as NAME@BUDGET)")
    p.add_argument("--pair-fusion", action="store_true",
                   help="glmc's stages fused in the --interleave run (as NAME+fused)")
    args = p.parse_args()
    import glmc
    from glmc.parallel.pipeline import plan_stages
    model, batch, loss_fn, opt = _glm(args.config)
    plan = plan_stages(model, opt, loss_fn, batch, 2, args.microbatches, "1f1b")
    blocks = [list(s.blocks) for s in plan.stages]
    import tempfile

    from tests.distributed import free_port
    ranks: list[dict] = [{}, {}]
    runs = [x for x in args.schedules.split(",") if x] + (["torch"] if args.torch else [])
    for schedule in runs + (["pair"] if args.interleave else []):
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
        if name == "pair":
            continue
        if any("error" in r[name] for r in ranks):
            err = " / ".join(f"rank {i}: {r[name]['error']}" for i, r in enumerate(ranks)
                             if "error" in r[name])
            print(f"| {name} | failed: {err} | - | - | - | - | - |")
            continue
        d = ranks[0][name].get("data")
        if d is None:
            peaks = "; ".join(f"- / - / {r[name]['peak'] / 2**20:.1f}" for r in ranks)
            print(f"| {name} | same as glmc's | - | - / "
                  f"{max(r[name]['step_s'] for r in ranks) * 1e3:.1f} | - | {peaks} | - |")
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
    _compare(ranks, blocks)
    if "pair" in ranks[0]:
        _interleaved(ranks[0]["pair"], args)


def _interleaved(pair: dict, args: argparse.Namespace) -> None:
    if "error" in pair:
        print(f"\ninterleaved run failed: {pair['error']}")
        return
    med = {n: statistics.median(t) for n, t in pair["times"].items()}
    mine, theirs = med["glmc 1f1b"], med["torch.distributed.pipelining 1f1b"]
    how = f"{args.pair_backend} stages" + (", fused" if args.pair_fusion else "") + \
        (f", memory budget {args.pair_budget}" if args.pair_budget else "")
    print(f"\ninterleaved in the same two processes, {args.interleave} rounds (one step of "
          f"each per round, median): glmc 1f1b ({how}) {mine * 1e3:.1f} ms, "
          f"torch.distributed.pipelining "
          f"1f1b {theirs * 1e3:.1f} ms, ratio {mine / theirs:.3f}")


def _compare(ranks: list[dict], blocks: list) -> None:
    """Each glmc 1F1B row against torch's 1F1B on the same split: ratios, and the losses."""
    theirs = "torch.distributed.pipelining 1f1b"
    if any(theirs not in r or "error" in r[theirs] for r in ranks):
        return
    for mine in ranks[0]:
        if not mine.startswith("glmc 1f1b") or "split)" in mine or \
                any("error" in r[mine] for r in ranks):
            continue
        step = max(r[mine]["step_s"] for r in ranks) / max(r[theirs]["step_s"] for r in ranks)
        peaks = [r[mine]["data"]["ranks"][i]["measured_peak_bytes"] / r[theirs]["peak"]
                 for i, r in enumerate(ranks)]
        a, b = ranks[-1][mine]["losses"], ranks[-1][theirs]["losses"][:2]
        diff = max(abs(x - y) / abs(y) for x, y in zip(a, b))
        cut = [s["blocks"] for s in ranks[0][mine]["data"]["stages"]]
        split = "same split" if cut == blocks else "glmc's own cut (" + " | ".join(
            ", ".join(bs) for bs in cut) + "), torch on the eager-priced cut"
        print(f"\n{mine} / {theirs}, {split}, same microbatches: step time {step:.3f}, peak "
              f"per rank {', '.join(f'{p:.3f}' for p in peaks)}; first two losses glmc "
              f"{', '.join(f'{x:.6f}' for x in a)}, torch {', '.join(f'{x:.6f}' for x in b)} "
              f"(max relative difference {diff:.1e})")


if __name__ == "__main__":
    main()
