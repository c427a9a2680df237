"""Pipeline-parallel training: apply a partition plan to a model and run its stages.

    plan = partition pass on the captured step          (passes/partition.py: the cut)
    stage modules = the model's fx graph cut at the plan's blocks   (`split_module`)
    StagedProgram = capture_stage per stage + link + schedule       (`build_program`)
    PipelineTrainer.step(batch): this rank's stages run the schedule (glmc.schedule.run_rank)

The model is traced with torch.fx, its blocks (`embed`, `blocks.0`, ...) kept as leaf calls.
Every other node (glue: residual adds, the loss) runs on the stage of the latest block it
depends on; nodes that depend on no block (shapes, slices of constant buffers) are copied into
every stage that reads them. A value crossing a cut is sent once per microbatch; the batch
leaves (input ids, labels) are given to every stage that reads them. The stage modules share
the model's parameter tensors, so the model and `state_dict()` stay the source of truth.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from glmc.capture import split_batch
from glmc.errors import ConfigError, InputError
from glmc.program import StagedProgram, capture_stage, link, split_backward
from glmc.schedule import COMPUTE, Timeline, from_torch, run_rank


# ---- splitting a module into stage modules -----------------------------------------------------

class _BlockTracer(fx.Tracer):
    def __init__(self, blocks: set[str]) -> None:
        super().__init__()
        self.blocks = blocks
        self.proxy_buffer_attributes = True  # `self.cos[:s]` with a traced `s`

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.blocks or (not self.blocks and super().is_leaf_module(m, qualname))


@dataclass
class StageModule:
    """One stage: `module(*[leaf or received value for each arg])` -> sent values or loss."""

    index: int
    module: fx.GraphModule
    args: list[int | str]  #: batch leaf index, or the name of a received value
    send: list[str]


def trace_blocks(model: nn.Module, blocks: Sequence[str], loss_fn: Any = None) -> fx.GraphModule:
    """`model`'s forward (then `loss_fn(output, target)`) as an fx graph over `blocks`."""
    try:
        graph = _BlockTracer(set(blocks)).trace(model)
    except Exception as e:
        raise ConfigError(f"pipeline: the model's forward cannot be traced by torch.fx to split "
                          f"it into stages ({type(e).__name__}: {e})") from None
    if loss_fn is not None:
        out = next(n for n in graph.nodes if n.op == "output")
        last_ph = [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(last_ph):
            target = graph.placeholder("target")
        with graph.inserting_before(out):
            loss = graph.call_function(loss_fn, (out.args[0], target))
        out.args = (loss,)
    return fx.GraphModule(model, graph)


def split_module(gm: fx.GraphModule, stage_blocks: Sequence[Sequence[str]]) -> list[StageModule]:
    """Cut `gm` (from `trace_blocks`) into one module per stage (see the module docstring)."""
    where = {b: s for s, bs in enumerate(stage_blocks) for b in bs}
    stage: dict[fx.Node, int | None] = {}  # None: depends on no block (copied where read)
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        deps = [stage[a] for a in n.all_input_nodes if stage[a] is not None]
        if n.op == "call_module" and n.target in where:
            if deps and max(deps) > where[n.target]:
                raise ConfigError(f"pipeline: block {n.target!r} (stage {where[n.target]}) reads "
                                  f"a value of stage {max(deps)}; cut in forward order")
            stage[n] = where[n.target]
        else:
            stage[n] = max(deps) if deps else None
    leaves = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    if stage[out.args[0]] != len(stage_blocks) - 1:
        raise ConfigError("pipeline: the loss must be computed on the last stage")
    return [_stage_module(gm, stage, leaves, s, len(stage_blocks), out.args[0])
            for s in range(len(stage_blocks))]


def _stage_module(gm: fx.GraphModule, stage: dict, leaves: list[fx.Node], s: int, n: int,
                  loss: fx.Node) -> StageModule:
    own = [x for x in gm.graph.nodes if stage.get(x) == s and x.op != "placeholder"]
    recv = sorted({a for x in own for a in x.all_input_nodes
                   if stage[a] is not None and stage[a] != s}, key=list(gm.graph.nodes).index)
    for a in recv:
        if stage[a] != s - 1:
            raise ConfigError(f"pipeline: {a.name!r} goes from stage {stage[a]} to stage {s}; "
                              "only neighbouring stages exchange values")
    send = [x for x in own if any(stage.get(u) is not None and stage[u] > s for u in x.users)]
    g, env = fx.Graph(), {}
    args: list[int | str] = []
    needed = _free_closure(own, stage)
    for i, ph in enumerate(leaves):
        if ph in needed:
            env[ph] = g.placeholder(ph.name)
            args.append(i)
    for a in recv:
        env[a] = g.placeholder(a.name)
        args.append(a.name)
    for x in gm.graph.nodes:
        if x.op != "placeholder" and (x in own or x in needed):
            env[x] = g.node_copy(x, lambda a: env[a])
    g.output(env[loss] if s == n - 1 else tuple(env[x] for x in send))
    return StageModule(s, fx.GraphModule(gm, g), args, [x.name for x in send])


def _free_closure(own: list[fx.Node], stage: dict) -> set[fx.Node]:
    """The block-free nodes (and batch leaves) `own` reads, transitively."""
    seen: set[fx.Node] = set()
    todo = [a for x in own for a in x.all_input_nodes if stage[a] is None]
    while todo:
        a = todo.pop()
        if a not in seen:
            seen.add(a)
            todo += [b for b in a.all_input_nodes if stage[b] is None]
    return seen


# ---- a staged program for a model --------------------------------------------------------------

def stage_optimizer(optimizer: torch.optim.Optimizer, module: nn.Module
                    ) -> torch.optim.Optimizer:
    """`optimizer`'s class and per-group hyperparameters over `module`'s parameters."""
    mine = {id(p) for p in module.parameters()}
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [p for p in g["params"] if id(p) in mine]}
              for g in optimizer.param_groups]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ConfigError("pipeline: a stage holds no parameters; use fewer stages")
    return type(optimizer)(groups)  # every group carries all its hyperparameters


@dataclass
class Pipeline:
    """A StagedProgram with the stage modules and optimizers it runs against."""

    program: StagedProgram
    stages: list[StageModule]
    optimizers: list[torch.optim.Optimizer]
    plan: Any = None


def build_program(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any,
                  example_inputs: Any, stage_blocks: Sequence[Sequence[str]], microbatches: int,
                  schedule: str = "1f1b", virtual: int = 1) -> Pipeline:
    """Capture every stage of `model` cut at `stage_blocks` on one microbatch of
    `example_inputs`, link them and attach the schedule (torch's generator for `schedule`)."""
    leaves = microbatch_leaves(example_inputs, microbatches)[0]
    blocks = [b for bs in stage_blocks for b in bs]
    gm = trace_blocks(model, blocks, loss_fn)
    mods = split_module(gm, stage_blocks)
    values = _values(gm, leaves)
    stages, opts = [], []
    for sm in mods:
        opt = stage_optimizer(optimizer, sm.module)
        args = [(a, leaves[a] if isinstance(a, int) else values[a].detach()) for a in sm.args]
        stage = capture_stage(sm.index, sm.module, opt, args, send=sm.send)
        if schedule == "zbh1":
            stage = split_backward(stage)
        stages.append(stage)
        opts.append(opt)
    stages_t = tuple(stages)
    sched = from_torch(schedule, len(stages) // virtual, microbatches, virtual)
    program = StagedProgram(stages_t, link(stages_t), sched)
    program.verify()
    return Pipeline(program, mods, opts)


def _values(gm: fx.GraphModule, leaves: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Every node's value on one microbatch, by name (the examples of received values)."""
    env: dict[str, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            env[n.name] = super().run_node(n)
            return env[n.name]

    with torch.no_grad():
        Recorder(gm).run(*leaves)
    return env


def microbatch_leaves(batch: Any, microbatches: int) -> list[list[torch.Tensor]]:
    """The batch's leaves cut into `microbatches` equal parts along dim 0."""
    args, kwargs = split_batch(batch)
    if kwargs:
        raise InputError("pipeline: keyword batches are not supported yet; pass a tuple")
    rows = args[0].shape[0]
    if microbatches < 1 or rows % microbatches:
        raise InputError(f"pipeline: {microbatches} microbatches do not divide the batch of "
                         f"{rows} rows; use a divisor of {rows}")
    parts = [t.chunk(microbatches) for t in args]
    return [[p[m] for p in parts] for m in range(microbatches)]


# ---- the trainer -------------------------------------------------------------------------------

@dataclass
class StepTrace:
    """What one rank ran in one step: (action, start, end) in wall-clock seconds."""

    rank: int
    spans: list = field(default_factory=list)

    def busy(self) -> float:
        return sum(e - s for a, s, e in self.spans if a.kind in COMPUTE)


def measured_timeline(traces: Sequence[StepTrace], num_ranks: int) -> Timeline:
    return Timeline({a: (t.rank, s, e) for t in traces for a, s, e in t.spans}, num_ranks)


class PipelineTrainer:
    """Trains `model` pipelined over the default process group: pipeline rank r holds stages
    r, r + S, ... of `pipeline` (S = ranks). `step(*batch)` runs one step on the global batch
    (every rank passes the same batch; each reads what its stages need) and returns the mean
    loss on the rank holding the last stage, None elsewhere."""

    def __init__(self, pipeline: Pipeline, timeout_s: float = 300.0) -> None:
        from glmc.parallel import init_distributed
        init_distributed("cpu", timeout_s)
        self.pipeline = pipeline
        sched = pipeline.program.schedule
        self.rank, world = dist.get_rank(), dist.get_world_size()
        if world != sched.num_ranks:
            raise ConfigError(f"pipeline: {sched.num_ranks} pipeline ranks need as many "
                              f"processes, got {world} (pp x dp is not supported yet)")
        self.local = [s for s in range(sched.num_stages) if sched.rank_of(s) == self.rank]
        self.last = (sched.num_stages - 1) in self.local
        self.traces: list[StepTrace] = []

    def step(self, *batch: torch.Tensor) -> torch.Tensor | None:
        p = self.pipeline
        mbs = microbatch_leaves(tuple(batch), p.program.schedule.num_microbatches)
        trace = StepTrace(self.rank)
        losses = run_rank(p.program, {s: p.stages[s].module for s in self.local},
                          {s: p.optimizers[s] for s in self.local}, mbs, spans=trace.spans)
        self.traces.append(trace)
        return torch.stack(losses).mean() if self.last else None


def from_env_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


# ---- end to end: plan, build, train ------------------------------------------------------------

def plan_stages(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any,
                example_inputs: Any, stages: int, microbatches: int, schedule: str,
                virtual: int = 1, profile: Any = None) -> Any:
    """The partition pass's plan for the whole step (captured once, on this process)."""
    import glmc
    from glmc.passes.partition import PartitionPass
    from glmc.passmanager import PassContext

    graph = glmc.capture(model, example_inputs, loss_fn, optimizer)
    ps = PartitionPass(stages=stages, microbatches=microbatches, schedule=schedule,
                       virtual=virtual)
    return ps.run(graph, PassContext(profile=profile)).stats


def pipeline_trainer(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any,
                     example_inputs: Any, microbatches: int, schedule: str = "1f1b",
                     virtual: int = 1, timeout_s: float = 300.0) -> PipelineTrainer:
    """A PipelineTrainer over every process of the default group (from torchrun's env):
    rank 0 plans the cut (the cost model may be calibrated differently per process, so one
    process decides) and broadcasts it; every rank captures its program."""
    from glmc.parallel import init_distributed
    init_distributed("cpu", timeout_s)
    stages = dist.get_world_size() * virtual
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        box[0] = plan_stages(model, optimizer, loss_fn, example_inputs, stages, microbatches,
                             schedule, virtual)
    dist.broadcast_object_list(box, src=0)
    plan = box[0]
    pipe = build_program(model, optimizer, loss_fn, example_inputs,
                         [s.blocks for s in plan.stages], microbatches, schedule, virtual)
    pipe.plan = plan
    return PipelineTrainer(pipe, timeout_s)


def train_cli(work: Any, steps: int, microbatches: int, schedule: str, pp: int,
              report_dir: str | None = None) -> int:
    """`glmc compile FILE --nproc S --pp S ...`: trains `work` pipelined; the rank holding
    the last stage prints `step i  loss x` lines as a single process does, then the plan and
    predicted vs measured bubble."""
    import json
    import time
    from pathlib import Path

    from glmc.capture import split_batch

    if from_env_world() != pp:
        raise ConfigError(f"pipeline: --pp {pp} needs --nproc {pp} (pp x dp is not supported "
                          f"yet); this run has {from_env_world()} processes")
    virtual = 2 if schedule == "interleaved" else 1
    trainer = pipeline_trainer(work.model, work.optimizer, work.loss_fn, work.example_inputs,
                               microbatches, schedule, virtual)
    args, _ = split_batch(work.example_inputs)
    t0 = time.perf_counter()
    for i in range(steps):
        loss = trainer.step(*args)
        if trainer.last:
            print(f"step {i:4d}  loss {loss.item():.6f}", flush=True)
    elapsed = time.perf_counter() - t0
    spans: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(spans, trainer.traces[-1].spans)
    timeline = measured_timeline([StepTrace(r, s) for r, s in enumerate(spans)],
                                 dist.get_world_size())
    if trainer.last:
        plan = trainer.pipeline.plan
        for i, s in enumerate(plan.stages):
            print(f"stage {i}: {', '.join(s.blocks)}  predicted {s.seconds * 1e3:.2f} ms/step, "
                  f"peak {s.peak_bytes / 2**20:.2f} MiB ({s.in_flight} microbatches in flight)")
        print(f"pipeline: {schedule}, {microbatches} microbatches; imbalance "
              f"{plan.imbalance:.3f} (equal split {plan.equal_imbalance:.3f}); bubble predicted "
              f"{plan.bubble:.1%}, measured {timeline.bubble():.1%} (last step); "
              f"{elapsed / max(steps, 1) * 1e3:.1f} ms/step")
        if report_dir:
            out = Path(report_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / "pipeline-trace.json").write_text(json.dumps(
                {"traceEvents": timeline.trace_events()}))
            print(f"report: {out / 'pipeline-trace.json'}")
    dist.destroy_process_group()
    return 0
