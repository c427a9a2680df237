"""Data parallelism side by side on N processes (gloo on CPU, NCCL on CUDA): glmc's ZeRO
stages against the runtime wrappers at equal sharding.

    glmc zero=0   vs  DDP
    glmc zero=2   vs  FSDP2 fully_shard(reshard_after_forward=False)
    glmc zero=3   vs  FSDP2 fully_shard(reshard_after_forward=True)

Every rank trains its own copy of the same model from the same weights on its slice of the
same global batch (AdamW). After warm-up, each round runs one step of every contender in turn
(interleaved); we report, per contender, the median step time of the slowest rank and its
ratio to the wrapper it is paired with, and the per-rank peak: bytes live before the step
(weights, grads, optimizer state, batch — distinct storages, local shards for sharded state) +
the peak the c10 allocator reaches during one profiled (untimed) step. For glmc, its predicted
per-rank peak and step time against the measurement (and the step time the model would predict
if overlapping a collective with compute cost nothing, as it did before the link's measured
`contention`), and its predicted communication cost (waits + compute slowed by collectives in
flight) beside the waits measured.

    python benchmarks/bench_parallel.py                    # GLM small, 2 processes
    python benchmarks/bench_parallel.py --model glm-tiny --steps 5
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from bench_step import WORKLOADS, cpu_name, run_distributed, run_meta, write_result  # noqa: E402

import glmc  # noqa: E402
from glmc.analysis.memory import measure_peak  # noqa: E402
from glmc.trace.capture import LossModule, split_batch  # noqa: E402

MiB = 1024 * 1024
PAIRS = (("glmc-zero0", "ddp"), ("glmc-zero2", "fsdp2-keep"), ("glmc-zero3", "fsdp2-reshard"))


def _slice(batch, rank: int, world: int):
    args, kwargs = split_batch(batch)
    cut = lambda t: t[rank * (t.shape[0] // world):(rank + 1) * (t.shape[0] // world)]  # noqa
    return tuple(cut(t) for t in args), {k: cut(v) for k, v in kwargs.items()}


def _adamw(model, like):
    g = like.param_groups[0]
    return torch.optim.AdamW(model.parameters(), lr=g["lr"], betas=g["betas"], eps=g["eps"],
                             weight_decay=g["weight_decay"])


def _blocks(model) -> list:
    """The repeated blocks of a model: the children of its largest nn.ModuleList."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


class Contender:
    def __init__(self, name: str, model, opt, batch, loss_fn, bucket_mb: float) -> None:
        self.name, self.trainer = name, None
        rank, world = dist.get_rank(), dist.get_world_size()
        self.model = copy.deepcopy(model)
        if name.startswith("glmc-zero"):
            self.opt = _adamw(self.model, opt)
            self.trainer = glmc.optimize(
                self.model, batch, loss_fn=loss_fn, optimizer=self.opt, backend="eager",
                parallel={"zero": int(name[-1]), "bucket_mb": bucket_mb})
            args, kwargs = split_batch(batch)
            self.fn = lambda: self.trainer.step(*args, **kwargs)
            self.leaves = [*args, *kwargs.values()]
            return
        if name == "ddp":
            from torch.nn.parallel import DistributedDataParallel
            wrapped = DistributedDataParallel(self.model, bucket_cap_mb=bucket_mb)
        else:
            from torch.distributed.fsdp import fully_shard
            reshard = name == "fsdp2-reshard"
            for block in _blocks(self.model):  # one FSDP group per transformer block
                fully_shard(block, reshard_after_forward=reshard)
            fully_shard(self.model, reshard_after_forward=reshard)
            wrapped = self.model
        self.opt = _adamw(self.model, opt)
        loss_module = LossModule(wrapped, loss_fn)
        args, kwargs = _slice(batch, rank, world)
        self.leaves = [*args, *kwargs.values()]

        def step():
            self.opt.zero_grad(set_to_none=True)
            (loss,) = loss_module(*args, **kwargs)
            loss.backward()
            self.opt.step()
            out = loss.detach().clone()
            dist.all_reduce(out, op=dist.ReduceOp.AVG)  # the global loss, as glmc reports it
            return out
        self.fn = step

    def state_bytes(self) -> int:
        """Distinct storages live between steps (local shards of sharded tensors)."""
        from torch.distributed.tensor import DTensor

        def local(t):
            return t.to_local() if isinstance(t, DTensor) else t
        tensors = [*self.model.parameters(), *self.model.buffers(), *self.leaves]
        tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        for st in self.opt.state.values():
            tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
        seen = {}
        for t in tensors:
            s = local(t).untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values())


def rank_main(a: argparse.Namespace) -> None:
    from datetime import timedelta
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    model, batch, loss_fn, opt = WORKLOADS[a.model]()
    names = [n for pair in PAIRS for n in pair]
    subjects, losses = {}, {n: [] for n in names}
    for n in names:
        torch.manual_seed(0)
        subjects[n] = Contender(n, model, opt, batch, loss_fn, a.bucket_mb)
    for _ in range(a.warmup):
        for n in names:
            losses[n].append(subjects[n].fn().item())
    peaks = {}
    for n in names:
        before = subjects[n].state_bytes()
        dist.barrier()
        loss, m = measure_peak(subjects[n].fn)
        losses[n].append(loss.item())
        peaks[n] = before + m.peak_bytes
    times = {n: [] for n in names}
    for _ in range(a.steps):
        for n in names:
            dist.barrier()
            t0 = time.perf_counter()
            losses[n].append(subjects[n].fn().item())
            times[n].append(time.perf_counter() - t0)
    mine = {}
    for n in names:
        row = {"median_s": statistics.median(times[n]), "peak": peaks[n],
               "loss": losses[n][-1]}
        tr = subjects[n].trainer
        if tr is not None:
            rec = tr.report.compiles[-1]
            pred = rec.predicted or {}
            row["pred_peak"] = pred.get("memory", {}).get("peak_bytes")
            comm = pred.get("communication") or {}
            # the step's collectives cost what it waits for plus the compute they slow
            row["pred_exposed_s"] = (comm["exposed_seconds"] + comm.get("contention_seconds", 0)
                                     if "exposed_seconds" in comm else None)
            row["pred_step_s"] = comm.get("step_seconds")
            row["pred_free_s"] = (comm["step_seconds"] - comm.get("contention_seconds", 0)
                                  if "step_seconds" in comm else None)  # overlap for free
            row["meas_exposed_s"] = rec.measured.get("exposed_comm_seconds")
        mine[n] = row
    every = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        report(a, every, world, sum(p.numel() for p in model.parameters()))
    dist.destroy_process_group()


def report(a, every: list[dict], world: int, params: int) -> None:
    meta = run_meta("bench_parallel.py")
    cpu = cpu_name()
    rows = []
    for ours, theirs in PAIRS:
        for n in (theirs, ours):
            step = max(r[n]["median_s"] for r in every)  # the slowest rank sets the pace
            peak = max(r[n]["peak"] for r in every)
            row = {"contender": n, "step_ms": round(step * 1e3, 1),
                   "peak_mib_per_rank": round(peak / MiB, 1), "loss": round(every[0][n]["loss"], 5)}
            if n == ours:
                base_step = max(r[theirs]["median_s"] for r in every)
                base_peak = max(r[theirs]["peak"] for r in every)
                row["step_ratio"] = round(step / base_step, 3)
                row["peak_ratio"] = round(peak / base_peak, 3)
                pred = every[0][n].get("pred_peak")
                if pred:
                    row["pred_peak_error"] = round(pred / every[0][n]["peak"] - 1, 3)
                row["pred_exposed_ms"] = _ms(every[0][n].get("pred_exposed_s"))
                row["meas_exposed_ms"] = _ms(every[0][n].get("meas_exposed_s"))
                pred_step = every[0][n].get("pred_step_s")
                if pred_step:
                    row["pred_step_ms"] = _ms(pred_step)
                    row["pred_step_error"] = round(pred_step / step - 1, 3)
                    row["pred_free_error"] = round(every[0][n]["pred_free_s"] / step - 1, 3)
            rows.append(row)
    data = {"meta": meta, "cpu": cpu, "model": a.model, "params": params, "ranks": world,
            "steps": a.steps, "warmup": a.warmup, "bucket_mb": a.bucket_mb, "rows": rows}
    lines = [f"**{a.model}** ({params / 1e6:.2f}M params, AdamW), {world} processes on gloo, "
             f"1 thread each; median of {a.steps} interleaved steps after {a.warmup} warm-up, "
             f"slowest rank; bucket {a.bucket_mb} MiB; {meta['date']}, {cpu}, torch "
             f"{meta['torch']}; `{meta['command']}`", "",
             "| contender | step (ms) | ratio to its pair | peak per rank (MiB) | ratio to its "
             "pair | predicted peak error | predicted step (ms) / error | its error if overlap "
             "were free | exposed comm. predicted (waits + contention) / measured waits (ms) | "
             "loss |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['contender']} | {r['step_ms']} | {r.get('step_ratio', '')} | "
                     f"{r['peak_mib_per_rank']} | {r.get('peak_ratio', '')} | "
                     f"{_pct(r.get('pred_peak_error'))} | "
                     f"{_pair(r.get('pred_step_ms'), _pct(r.get('pred_step_error')))} | "
                     f"{_pct(r.get('pred_free_error'))} | "
                     f"{_pair(r.get('pred_exposed_ms'), r.get('meas_exposed_ms'))} | "
                     f"{r['loss']} |")
    write_result(Path(a.out), f"parallel-{a.model}", data, "\n".join(lines))


def _ms(s):
    return None if s is None else round(s * 1e3, 2)


def _pct(x):
    return "" if x is None else f"{x * 100:+.1f}%"


def _pair(p, m):
    return "" if p is None and m in (None, "") else f"{p} / {m}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="glm-small", choices=sorted(WORKLOADS))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    run_distributed(__file__, a.nproc, rank_main, a)


if __name__ == "__main__":
    main()
