"""Tensor parallelism side by side on N processes (gloo on CPU): glmc's `tensor_parallel` pass
(the Megatron layout found from the step's graph) against torch's hand-written plan
(`parallelize_module` with ColwiseParallel q/k/v/gate/up and RowwiseParallel o/down on every
decoder layer), torch's plan with sequence parallelism (`torch-tp-sp`: SequenceParallel norms,
the residual stream sharded over the sequence, the embedding row- and the LM head
column-parallel, as torchtitan writes it), glmc's pass with sequence parallelism
(`glmc-tp-sp`), and glmc data parallel (ZeRO-0) on the same global batch for reference.

Every rank builds the same model from the same weights (AdamW). Tensor-parallel ranks each run
the whole batch; data-parallel ranks half of it each. After warm-up, each round runs one step
of every contender in turn (interleaved); per contender: the median step time of the slowest
rank, the per-rank peak (bytes live before the step — distinct storages, local blocks of
sharded tensors — plus the peak the c10 allocator reaches during one profiled, untimed step)
with glmc's prediction of it, and the loss after the last step.

    python benchmarks/bench_tensor_parallel.py                       # llama 2x384, 2 processes
    python benchmarks/bench_tensor_parallel.py --model glm-tiny --steps 5
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

from bench_parallel import Contender as DataParallelContender  # noqa: E402
from bench_parallel import _adamw  # noqa: E402
from bench_step import WORKLOADS, cpu_name, run_distributed, run_meta, write_result

import glmc
from glmc.analysis.memory import measure_peak
from glmc.trace.capture import LossModule, split_batch

MiB = 1024 * 1024
CONTENDERS = ("torch-tp", "torch-tp-sp", "glmc-tp", "glmc-tp-sp", "glmc-tp-inductor",
              "glmc-dp")
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")


def _torch_tp(model: torch.nn.Module, sequence: bool = False) -> torch.nn.Module:
    """torch's hand-written Megatron plan on every decoder layer (transformers' names); with
    `sequence`, torchtitan's sequence-parallel plan: the norms `SequenceParallel`, each
    block's input all-gathered (`PrepareModuleInput`) and its output reduce-scattered
    (`RowwiseParallel(output_layouts=Shard(1))`), the embedding row-parallel into the
    sequence-sharded residual stream, the LM head column-parallel from it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    layers = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    seq = {"output_layouts": Shard(1), "use_local_output": False} if sequence else {}
    for layer in max(layers, key=len):
        plan = {}
        for name, _ in layer.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in COLWISE:
                plan[name] = ColwiseParallel()
            elif leaf in ROWWISE:
                plan[name] = RowwiseParallel(**seq)
            elif sequence and leaf.endswith("layernorm"):
                plan[name] = SequenceParallel()
            elif sequence and leaf == "self_attn":
                plan[name] = PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()})
            elif sequence and leaf == "mlp":
                plan[name] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                desired_input_layouts=(Replicate(),))
        parallelize_module(layer, mesh, plan)
    if sequence:  # the residual stream between the layers stays a sequence-sharded DTensor
        parallelize_module(model, mesh, {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                                  output_layouts=Shard(1),
                                                  use_local_output=False),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    return model


class Contender:
    def __init__(self, name: str, model, opt, batch, loss_fn) -> None:
        self.name, self.trainer = name, None
        self.model = copy.deepcopy(model)
        self.opt = _adamw(self.model, opt)
        if name.startswith("glmc-"):
            parallel = {"zero": 0} if name == "glmc-dp" else {
                "tp": dist.get_world_size(), "tp_sequence": name == "glmc-tp-sp"}
            self.trainer = glmc.optimize(
                self.model, batch, loss_fn=loss_fn, optimizer=self.opt, predict=True,
                backend="inductor" if name.endswith("inductor") else "eager",
                parallel=parallel)
            args, kwargs = split_batch(batch)
            self.fn = lambda: self.trainer.step(*args, **kwargs)
            self.leaves = [*args, *kwargs.values()]
            return
        _torch_tp(self.model, sequence=name == "torch-tp-sp")
        self.opt = _adamw(self.model, opt)
        loss_module = LossModule(self.model, loss_fn)
        args, kwargs = split_batch(batch)
        self.leaves = [*args, *kwargs.values()]

        def step():
            self.opt.zero_grad(set_to_none=True)
            (loss,) = loss_module(*args, **kwargs)
            loss.backward()
            self.opt.step()
            return loss.detach()
        self.fn = step

    state_bytes = DataParallelContender.state_bytes  #: the same census as bench_parallel's


def rank_main(a: argparse.Namespace) -> None:
    from datetime import timedelta
    dist.init_process_group("gloo", timeout=timedelta(seconds=900))
    rank, world = dist.get_rank(), dist.get_world_size()
    model, batch, loss_fn, opt = WORKLOADS[a.model]()
    subjects, losses = {}, {n: [] for n in CONTENDERS}
    for n in CONTENDERS:
        torch.manual_seed(0)
        subjects[n] = Contender(n, model, opt, batch, loss_fn)
    for _ in range(a.warmup):
        for n in CONTENDERS:
            losses[n].append(subjects[n].fn().item())
    peaks = {}
    for n in CONTENDERS:
        before = subjects[n].state_bytes()
        dist.barrier()
        loss, m = measure_peak(subjects[n].fn)
        losses[n].append(loss.item())
        peaks[n] = before + m.peak_bytes
    times = {n: [] for n in CONTENDERS}
    for _ in range(a.steps):
        for n in CONTENDERS:
            dist.barrier()
            t0 = time.perf_counter()
            losses[n].append(subjects[n].fn().item())
            times[n].append(time.perf_counter() - t0)
    mine = {n: {"median_s": statistics.median(times[n]), "peak": peaks[n],
                "loss": losses[n][-1], "first_loss": losses[n][0]} for n in CONTENDERS}
    for n in CONTENDERS:
        tr = subjects[n].trainer
        if tr is not None and n != "glmc-dp":
            (stats,) = [h.stats for h in tr.report.compiles[-1].history
                        if h.name == "tensor_parallel"]
            mine[n]["collectives"] = stats.collectives
        if tr is not None:  # glmc's prediction of this rank's peak (state + the step's)
            pred = tr.report.compiles[-1].predicted or {}
            mine[n]["pred_peak"] = (pred.get("memory") or {}).get("peak_bytes")
    every = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        report(a, every, world, sum(p.numel() for p in model.parameters()))
    dist.destroy_process_group()


def report(a, every: list[dict], world: int, params: int) -> None:
    meta = run_meta("bench_tensor_parallel.py")
    cpu = cpu_name()
    base_step = max(r["torch-tp"]["median_s"] for r in every)
    base_peak = max(r["torch-tp"]["peak"] for r in every)
    rows = []
    for n in CONTENDERS:
        step = max(r[n]["median_s"] for r in every)
        peak = max(r[n]["peak"] for r in every)
        rows.append({"contender": n, "step_ms": round(step * 1e3, 1),
                     "step_ratio": round(step / base_step, 3),
                     "peak_mib_per_rank": round(peak / MiB, 1),
                     "peak_ratio": round(peak / base_peak, 3),
                     "first_loss": round(every[0][n]["first_loss"], 5),
                     "loss": round(every[0][n]["loss"], 5),
                     "collectives": every[0][n].get("collectives"),
                     "pred_peak_mib_per_rank": round(max(r[n]["pred_peak"] for r in every) / MiB,
                                                     1) if every[0][n].get("pred_peak") else
                     None})
        if rows[-1]["pred_peak_mib_per_rank"]:
            rows[-1]["pred_peak_error"] = round(rows[-1]["pred_peak_mib_per_rank"] /
                                                rows[-1]["peak_mib_per_rank"] - 1, 3)
    data = {"meta": meta, "cpu": cpu, "model": a.model, "params": params, "ranks": world,
            "steps": a.steps, "warmup": a.warmup, "rows": rows}
    lines = [f"**{a.model}** ({params / 1e6:.2f}M params, AdamW), {world} processes on gloo, "
             f"1 thread each; median of {a.steps} interleaved steps after {a.warmup} warm-up, "
             f"slowest rank; {meta['date']}, {cpu}, torch {meta['torch']}; "
             f"`{meta['command']}`", "",
             "| contender | step (ms) | ratio to torch-tp | peak per rank (MiB) | ratio to "
             "torch-tp | predicted peak (error) | first loss | last loss | collectives per "
             "step |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pred = (f"{r['pred_peak_mib_per_rank']} ({r['pred_peak_error']:+.1%})"
                if r.get("pred_peak_mib_per_rank") else "")
        lines.append(f"| {r['contender']} | {r['step_ms']} | {r['step_ratio']} | "
                     f"{r['peak_mib_per_rank']} | {r['peak_ratio']} | {pred} | "
                     f"{r['first_loss']} | {r['loss']} | {r['collectives'] or ''} |")
    write_result(Path(a.out), f"tensor-parallel-{a.model}", data, "\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-2x384-4x256", choices=sorted(WORKLOADS))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    run_distributed(__file__, a.nproc, rank_main, a)


if __name__ == "__main__":
    main()
