"""Pipeline-parallel training: apply a partition plan to a model and run its stages.

    plan = partition pass on the captured step          (passes/partition.py: the cut)
    stage modules = the model's fx graph cut at the plan's blocks   (`split_module`)
    StagedProgram = capture_stage per stage + link + schedule       (`build_program`)
    PipelineTrainer.step(batch): this rank's stages run the schedule (executor.run_rank)

How the model is cut into stage modules is `glmc.parallel.stage_modules`; the report of a
pipelined run is `glmc.parallel.pipeline_report`. A value crossing a cut is sent once per
microbatch; the batch leaves (input ids, labels) are given to every stage that reads them. The
stage modules share the model's parameter tensors, so the model and `state_dict()` stay the
source of truth.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from glmc.compiler.passmanager import PassContext, PassManager, StageForm, StageUnit
from glmc.errors import ConfigError, InputError
from glmc.ir.blocks import step_blocks
from glmc.ir.program import StagedProgram, link
from glmc.ir.split import split_backward
from glmc.parallel.executor import run_rank
from glmc.parallel.pipeline_report import pipeline_report, summary, write_report
from glmc.parallel.plan import ParallelPlan
from glmc.parallel.stage_modules import StageModule, split_module, trace_blocks
from glmc.planning.schedule import COMPUTE, ActionKind, Timeline, from_torch
from glmc.trace import scaler
from glmc.trace.capture import batch_leaves, capture, split_batch
from glmc.trace.optim import resolve_optimizer
from glmc.trace.scaler import SCALE
from glmc.trace.stages import capture_stage


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
    budgets: list["StageBudget | None"] | None = None  #: per stage, under a memory budget
    #: per stage, the recompute pass's stats on its joint graph (None: no budget)
    recompute: list[Any] | None = None
    rank_budget_bytes: int | None = None  #: a per-rank size budget (the report checks it)
    #: fp16 stages: dynamic loss scaling across every stage (`PipelineTrainer`), else None
    loss_scaling: Any = None
    #: what glmc's passes did to each stage (`PassRecord`s with their stage), in order
    passes: list[Any] = field(default_factory=list)
    #: tensor-parallel stages (`glmc.parallel.stage_tp.StageTensorParallel`), else None
    tp: Any = None


@dataclass(frozen=True)
class StageBudget:
    """A stage's memory budget for glmc's recompute pass on its joint graph (`stage_budgets`):
    `spec` a fraction, "min", "selective" or "full" in the pass's spelling, or None with
    `activation_bytes`, the
    bytes its in-flight microbatches' activations may take on its rank; `multiplicity`: the
    microbatches the schedule keeps in flight on it."""

    spec: str | None
    multiplicity: int
    activation_bytes: int | None = None

    def pass_budget(self) -> str:
        """In the pass's spelling for the stage's joint graph, whose own persistent bytes are
        its weights and inputs: `activation_bytes` above them. The joint graph's timeline also
        holds the gradients its backward makes, which on the rank are state outside
        `activation_bytes`: counted twice in the backward, so the plan errs on the safe
        side there; in the forward the accounting is the rank's."""
        return self.spec if self.spec is not None else f"+{int(self.activation_bytes)}B"

    def describe(self) -> str:
        if self.spec in ("min", "selective", "full"):
            return self.spec
        if self.spec is not None:
            return f"{float(self.spec):.0%}"
        return f"{self.activation_bytes / 2**20:.1f} MiB of activations"


def build_program(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any,
                  example_inputs: Any, stage_blocks: Sequence[Sequence[str]], microbatches: int,
                  schedule: str = "1f1b", virtual: int = 1,
                  budgets: Sequence[StageBudget | None] | None = None,
                  precision: str | None = None, fusion: bool = False,
                  backend: str = "eager", loss_scaling: Any = None,
                  tp: Any = None) -> Pipeline:
    """Capture every stage of `model` cut at `stage_blocks` on one microbatch of
    `example_inputs`, link them and attach the schedule (torch's generator for `schedule`).
    Each stage runs glmc's passes through its own pass manager (`stage_passes`: the default
    pipeline's policy for `precision`, `fusion` and the stage's budget), on its forward program
    before it is differentiated (fusion, precision) and on its joint graph before the
    partition (cleanup, recompute); their records are `Pipeline.passes`, per stage.
    `budgets[s]`: stage s's memory budget, planned by the recompute pass with the microbatches
    its schedule keeps in flight (None: it saves all the backward reads); `loss_scaling`
    (fp16): a `glmc.trace.scaler.LossScaling`, default GradScaler's. `tp`: every stage
    tensor-parallel (`glmc.parallel.stage_tp.StageTensorParallel`; the stages' joint graphs
    then go through the tensor_parallel pass instead of the joint passes, and this rank's
    blocks of the sharded parameters are installed at the end)."""
    if loss_scaling is not None and precision != "fp16":
        raise ConfigError(f"pipeline: loss_scaling is for fp16 stages; precision is "
                          f"{precision or 'fp32'}: drop loss_scaling or use precision='fp16'")
    budgeted = budgets is not None and any(b is not None for b in budgets)
    if tp is not None and budgeted:
        raise ConfigError("pipeline: a memory budget with tensor-parallel stages is not "
                          "supported yet (the recompute pass plans a stage's joint graph "
                          "before tensor parallelism rewrites it); drop the budget or tp")
    leaves = microbatch_leaves(example_inputs, microbatches)[0]
    blocks = [b for bs in stage_blocks for b in bs]
    gm = trace_blocks(model, blocks, loss_fn, like(example_inputs, leaves))
    mods = split_module(gm, stage_blocks)
    values = _values(gm, leaves)
    ctx = PassContext(stage_backend(backend).traits())
    stages, opts, stats, records = [], [], [], []
    for sm in mods:
        opt = stage_optimizer(optimizer, sm.module)
        args = [(a, leaves[a] if isinstance(a, int) else values[a].detach()) for a in sm.args]
        budget = budgets[sm.index] if budgets is not None else None
        manager = PassManager(stage_passes(budget, precision, fusion, budgeted))
        stage = capture_stage(sm.index, sm.module, opt, args, send=sm.send,
                              partition=_joint_passes(manager, sm.index, budget, ctx),
                              rewrites=[_forward_passes(manager, sm.index, ctx)], tp=tp)
        found = [r.stats for r in manager.history if r.name == "recompute"]
        stats.append(found[-1] if found else None)
        records += manager.history
        if tp is not None:
            records.append(tp.record(sm.index))
        if schedule == "zbh1":
            stage = split_backward(stage)
        stages.append(stage)
        opts.append(opt)
    if tp is not None:  # after every stage is captured: a tied parameter is read whole
        tp.install([sm.module for sm in mods], opts)
    stages_t = tuple(stages)
    sched = from_torch(schedule, len(stages) // virtual, microbatches, virtual)
    program = StagedProgram(stages_t, link(stages_t), sched, shared_parameters(mods))
    program.verify()
    return Pipeline(program, mods, opts, budgets=list(budgets) if budgets else None,
                    recompute=stats, loss_scaling=(loss_scaling or scaler.LossScaling())
                    if precision == "fp16" else None, passes=records, tp=tp)


def stage_passes(budget: StageBudget | None, precision: str | None, fusion: bool,
                 budgeted: bool) -> list[Any]:
    """The passes a pipeline stage runs: the default pipeline (`glmc.passes.default_pipeline`,
    the one place its policy is written) for this stage's budget, `precision` and `fusion`,
    with what differs on stages: the recompute pass plans the microbatches the schedule keeps
    in flight and skips the Pareto sweep; the fusion pass takes the loss pattern wherever any
    stage is budgeted (else its own rule: not on a backend that fuses)."""
    from glmc.passes import default_pipeline
    out = []
    for p in default_pipeline(budget.pass_budget() if budget is not None else None, precision,
                              fusion=bool(fusion)):
        if p.name == "recompute" and budget is not None:
            p = dataclasses.replace(p, multiplicity=budget.multiplicity, pareto=False)
        elif p.name == "fusion":
            p = dataclasses.replace(p, loss=True if budgeted else None)
        out.append(p)
    return out


def _forward_passes(manager: PassManager, index: int, ctx: PassContext) -> Callable:
    """`capture_stage`'s forward rewrite: the passes that rewrite a stage's forward program."""
    def rewrite(gm: fx.GraphModule, inputs: list[Any]) -> None:
        manager.run_stage(StageUnit(index, StageForm.FORWARD, gm, list(inputs)), ctx)
    return rewrite


def _joint_passes(manager: PassManager, index: int, budget: StageBudget | None,
                  ctx: PassContext) -> Callable:
    """`capture_stage`'s partition hook: the passes that rewrite a stage's joint graph
    (cleanup: e.g. a `Dropout(p=0)`'s copy of the attention weights would otherwise be saved
    beside them; recompute under the stage's budget). A budget the stage cannot meet even
    recomputing all it can is a BudgetError naming the stage."""
    from glmc.errors import BudgetError

    def rewrite(joint: fx.GraphModule) -> None:
        try:
            manager.run_stage(StageUnit(index, StageForm.JOINT, joint), ctx)
        except BudgetError as e:
            raise BudgetError(f"pipeline: stage {index} ({budget.multiplicity} microbatches "
                              f"in flight): {e}") from None
    return rewrite


def sync_seconds(pipe: Pipeline, dp: int, zero: int, link: Any) -> list[float]:
    """Per stage, the predicted seconds of its gradients' synchronisation before its update
    (alpha-beta on `link`, one collective per buffer — a lower bound where buckets split it):
    an all-reduce over the `dp` replicas (ZeRO-1: reduce-scatter, then the new parameters'
    all-gather), and each tied copy's all-reduce over every rank holding one."""
    from glmc.analysis.comm import collective_seconds
    tied = {(s, n) for copies in pipe.program.shared for s, n in copies}
    out = []
    for sm in pipe.stages:
        params = dict(sm.module.named_parameters())
        own = sum(p.numel() * p.element_size() for n, p in params.items()
                  if (sm.index, n) not in tied)
        if zero:
            t = collective_seconds("reduce_scatter_tensor", own, dp, link) + \
                collective_seconds("all_gather_into_tensor", own, dp, link)
        else:
            t = collective_seconds("all_reduce", own, dp, link)
        for copies in pipe.program.shared:
            for s, n in copies:
                if s == sm.index:
                    p = params[n]
                    t += collective_seconds("all_reduce", p.numel() * p.element_size(),
                                            len(copies) * dp, link)
        out.append(t)
    return out


def shared_parameters(mods: Sequence[StageModule]) -> tuple[tuple[tuple[int, str], ...], ...]:
    """Parameters that several stage modules read (tied input and output embeddings cut
    apart): each as ((stage, its name in that stage), ...), in first-use order."""
    where: dict[int, list[tuple[int, str]]] = {}
    for sm in mods:
        for name, p in sm.module.named_parameters():
            copies = where.setdefault(id(p), [])
            if not copies or copies[-1][0] != sm.index:
                copies.append((sm.index, name))
    return tuple(tuple(c) for c in where.values() if len(c) > 1)


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
    """The batch's leaves (`batch_leaves` order) cut into `microbatches` equal parts along
    dim 0."""
    return _equal_rows(batch_leaves(split_batch(batch)), microbatches, "microbatches",
                       "use a divisor of {rows}")


def like(batch: Any, leaves: Sequence[torch.Tensor]) -> Any:
    """`leaves` in the form of `batch`: a tuple, or a dict with `batch`'s keys."""
    _, kwargs = split_batch(batch)
    return dict(zip(kwargs, leaves)) if kwargs else tuple(leaves)


def _equal_rows(leaves: Sequence[torch.Tensor], parts: int, what: str, fix: str
                ) -> list[list[torch.Tensor]]:
    """`leaves` cut into `parts` equal slices of rows (dim 0), or an InputError saying `what`
    does not divide the batch and how to `fix` it (formatted with `rows`)."""
    rows = leaves[0].shape[0]
    if parts < 1 or rows % parts:
        raise InputError(f"pipeline: {parts} {what} do not divide the batch of {rows} rows; "
                         + fix.format(rows=rows))
    chunks = [t.chunk(parts) for t in leaves]
    return [[c[m] for c in chunks] for m in range(parts)]


@dataclass
class StepTrace:
    """What one rank ran in one step: (action, start, end) in wall-clock seconds; `origin`:
    when the step started after a barrier (aligned steps), else 0."""

    rank: int
    spans: list = field(default_factory=list)
    origin: float = 0.0

    def busy(self) -> float:
        return sum(e - s for a, s, e in self.spans if a.kind in COMPUTE)


def measured_timeline(traces: Sequence[StepTrace], num_ranks: int) -> Timeline:
    return Timeline({a: (t.rank, s, e) for t in traces for a, s, e in t.spans}, num_ranks)


@dataclass(frozen=True)
class PipelineMeasurement:
    """What `PipelineTrainer.measure` saw, the same on every rank."""

    timeline: Timeline  #: one barrier-aligned step, times from the barrier
    period_s: float  #: wall seconds per step, steps back to back (slowest rank)
    busy_s: list[float]  #: per rank: compute seconds per step in those steps
    peak_bytes: list[int]  #: per rank: its state + the step's allocator peak above it
    state_bytes: list[int]  #: per rank: parameters + optimizer state (measured storages)
    source: str = ""

    def imbalance(self) -> float | None:
        """The busiest rank's compute per step over the ranks' mean (None: nothing ran)."""
        mean = sum(self.busy_s) / len(self.busy_s)
        return max(self.busy_s) / mean if mean > 0 else None

    def steady_bubble(self) -> float:
        """Idle fraction of back-to-back steps: 1 - mean busy per rank / period (the next
        step's first actions may overlap this one's last, so this can be below the aligned
        step's bubble)."""
        busy = sum(self.busy_s) / len(self.busy_s)
        return 1.0 - busy / self.period_s if self.period_s > 0 else 0.0


class PipelineTrainer:
    """Trains `model` pipelined over the default process group, optionally with data
    parallelism (pp x dp): `dp` replicas of the pipeline, global rank = replica x S +
    pipeline rank (S = pipeline ranks). Pipeline rank r holds stages r, r + S, ... of
    `pipeline`. `step(*batch)` runs one step on the global batch: every rank passes the same
    batch, each replica takes its 1/dp slice (rows), each stage reads what it needs; a stage's
    gradients are averaged over its replicas before its update (one all-reduce of the flat
    gradients per stage). Returns the global-batch mean loss on the ranks holding the last
    stage, None elsewhere. fp16 stages (`pipeline.loss_scaling`): one dynamic loss scale on
    every rank, as `torch.amp.GradScaler` keeps it — it seeds each backward; before the
    updates every rank unscales its gradients and one MAX all-reduce over all ranks (stages
    and replicas) tells whether any overflowed: then every rank skips its updates and backs
    the scale off, so the stages never disagree."""

    def __init__(self, pipeline: Pipeline, timeout_s: float = 300.0, dp: int = 1,
                 zero: int = 0, backend: str = "eager") -> None:
        from glmc.parallel.data import init_distributed
        compiler = stage_backend(backend)  # a bad name fails before any process group
        if zero not in (0, 1):
            raise ConfigError(f"pipeline: ZeRO stage {zero} with a pipeline: a stage sums its "
                              "gradients over the microbatches before any reduction, so only "
                              "the optimizer state can be sharded (stage 1, as DeepSpeed and "
                              "Megatron's distributed optimizer do with pipelines); use zero 0 "
                              "or 1")
        init_distributed("cpu", timeout_s)
        self.pipeline = pipeline
        sched = pipeline.program.schedule
        self.rank, world = dist.get_rank(), dist.get_world_size()
        #: tensor-parallel stages: ranks per stage and this rank's index among them
        self.tp = pipeline.tp.size if pipeline.tp is not None else 1
        self.tp_rank = pipeline.tp.rank if pipeline.tp is not None else 0
        if world != sched.num_ranks * dp * self.tp:
            tp = f" x {self.tp} tensor-parallel ranks" if self.tp > 1 else ""
            raise ConfigError(f"pipeline: {sched.num_ranks} pipeline ranks x {dp} data-parallel "
                              f"replicas{tp} need {sched.num_ranks * dp * self.tp} processes, "
                              f"got {world}")
        unit = self.rank // self.tp  #: this rank's place in the pipelines (tp groups)
        self.dp, self.replica = dp, unit // sched.num_ranks
        self.pp_rank = unit % sched.num_ranks
        #: global rank of every stage in this replica (the peer of this rank's tp index)
        self.ranks = [(self.replica * sched.num_ranks + sched.rank_of(s)) * self.tp
                      + self.tp_rank for s in range(sched.num_stages)]
        # every rank creates every group, in the same order (torch.distributed's rule)
        groups = [dist.new_group([(d * sched.num_ranks + r) * self.tp + t for d in range(dp)])
                  for r in range(sched.num_ranks) for t in range(self.tp)] if dp > 1 else []
        self.dp_group = groups[self.pp_rank * self.tp + self.tp_rank] if groups else None
        self.local = [s for s in range(sched.num_stages) if sched.rank_of(s) == self.pp_rank]
        self.last = (sched.num_stages - 1) in self.local
        #: per shared parameter (`program.shared`): its copies on this rank's stages, and the
        #: group of every rank (all replicas) holding a copy, which sums their gradients
        self.ties: list[tuple[dict[int, str], Any]] = []
        for copies in pipeline.program.shared:
            for t in range(self.tp):  # tensor-parallel stages: the copies' blocks of index t
                members = sorted({(d * sched.num_ranks + sched.rank_of(s)) * self.tp + t
                                  for d in range(dp) for s, _ in copies})
                group = dist.new_group(members)
                if self.rank in members:
                    self.ties.append(({s: n for s, n in copies if s in self.local}, group))
        self.traces: list[StepTrace] = []
        #: what `load_sharded` writes back after a checkpoint load (`sharded_state_dict`)
        self._copy_back: list[Callable[[], None]] = []
        self.zero = zero if dp > 1 else 0
        self.scaling = pipeline.loss_scaling
        #: fp16: the loss scale and growth tracker (glmc.trace.scaler), alike on every rank
        self.scaler = self.scaling.initial_state() if self.scaling is not None else None
        self.skipped = 0  #: steps whose update was skipped (a gradient overflowed)
        #: the program this rank runs: its stages' sharded updates bound to its replicas' group
        self.runnable = pipeline.program
        if self.zero:
            self._shard_updates()
        if pipeline.tp is not None:
            self._bind_tp()
        self.backend = backend
        self.compile_seconds = self._compile(compiler)

    def _compile(self, compiler: Any) -> float:
        """Compile every graph this rank's actions run (forward, backward or ZB-H1's I and W,
        the update) with `compiler` (a glmc Backend) in its write-back form; "eager" runs the
        fx graphs as they are. Returns the compile seconds."""
        if compiler.name == "eager":
            return 0.0
        from glmc.compiler.inplace import compile_inplace
        t0 = time.perf_counter()
        K = ActionKind
        sched = self.runnable.schedule
        for stage in self.local:
            st = self.runnable.stages[stage]
            kinds = {a.kind for a in sched.rank_actions(self.pp_rank) if a.stage == stage}
            graphs = [st.forward] if K.F in kinds else []
            graphs += [st.backward] if K.B in kinds else []
            graphs += list(st.split or ()) if kinds & {K.I, K.W} else []
            graphs += [st.update] if K.UPDATE in kinds else []
            for g in graphs:
                compile_inplace(g, compiler)
        return time.perf_counter() - t0

    def _shard_updates(self) -> None:
        """ZeRO-1 over each stage's replicas: every stage's update becomes glmc's shard pass
        on it (gradients reduce-scattered in buckets, this replica's rows of the optimizer
        state updated, the new parameters all-gathered; `ShardPass(stage=2)` on an update
        alone); the program records the sharded updates (predicted memory), this rank binds
        its own to its replicas' group (a ("dp", "pp") DeviceMesh; with tensor-parallel
        stages the ("dp", "pp", "tp") one, each rank's blocks cut in rows) and keeps its
        optimizer state as its padded rows."""
        from torch.distributed.device_mesh import init_device_mesh

        from glmc.ir.graph import MeshSpec
        from glmc.ir.plans import DIM
        from glmc.ir.program import bind_mesh
        from glmc.passes.shard import ShardPass

        program = self.pipeline.program
        ranks = program.schedule.num_ranks
        mesh = self.pipeline.tp.device_mesh[DIM] if self.pipeline.tp is not None else \
            init_device_mesh("cpu", (self.dp, ranks), mesh_dim_names=(DIM, "pp"))[DIM]
        stages, bound = [], []
        for st in program.stages:
            update = st.update.copy()
            manager = PassManager([ShardPass(stage=2)])
            manager.run(update, PassContext(mesh=MeshSpec((self.dp,), (DIM,))))
            self.pipeline.passes += [dataclasses.replace(r, stage=st.index, form="update")
                                     for r in manager.history]
            stages.append(dataclasses.replace(st, update=update))
            if st.index in self.local:
                self._install(st.index, update.meta["sharding"])
                bound.append(dataclasses.replace(st, update=bind_mesh(update, mesh)))
            else:
                bound.append(stages[-1])
        self.pipeline.program = dataclasses.replace(program, stages=tuple(stages))
        self.runnable = dataclasses.replace(program, stages=tuple(bound))

    def _bind_tp(self) -> None:
        """This rank's stages' graphs with their tensor-parallel collectives on its group."""
        from glmc.ir.program import bind_mesh
        mesh = self.pipeline.tp.device_mesh
        stages = list(self.runnable.stages)
        for s in self.local:
            st = stages[s]
            stages[s] = dataclasses.replace(
                st, forward=bind_mesh(st.forward, mesh), backward=bind_mesh(st.backward, mesh),
                split=tuple(bind_mesh(g, mesh) for g in st.split) if st.split else st.split)
        self.runnable = dataclasses.replace(self.runnable, stages=tuple(stages))

    def _install(self, stage: int, plan: Any) -> None:
        """Stage `stage`'s per-element optimizer state as this replica's padded rows."""
        module, opt = self.pipeline.stages[stage].module, self.pipeline.optimizers[stage]
        for target, lay in plan.layouts.items():
            key, _, name = target.partition(":")
            state = opt.state[module.get_parameter(name)]
            state[key] = lay.local(state[key].detach(), self.replica)

    def _comm_error(self, e: RuntimeError, done: int) -> None:
        """A failed point-to-point op or gradient all-reduce (another rank died, hung or ran
        a different program) as a CommError naming this rank and the action it was in; other
        errors pass through."""
        from glmc.errors import CommError
        from glmc.parallel.data import comm_failure

        text = comm_failure(e)
        if text is None:
            return
        sched = self.pipeline.program.schedule
        actions = sched.rank_actions(self.pp_rank)
        action = actions[done] if done < len(actions) else None
        peer = ""
        if action is not None and action.kind.value.startswith(("SEND", "RECV")):
            forward = action.kind.value.endswith("_F")
            other = action.stage + (1 if forward == action.kind.value.startswith("SEND")
                                    else -1)
            if 0 <= other < sched.num_stages:
                peer = f" with stage {other} on rank {self.ranks[other]}"
        raise CommError(f"pipeline: rank {self.rank} (stages {', '.join(map(str, self.local))}) "
                        f"failed in action {action or 'after its last action'}{peer} ({text}); "
                        "that rank has probably died, hung or runs a different pipeline (a "
                        "hung rank fails the others after the process group's timeout, "
                        "timeout_s); check its output") from e

    def _reduce_grads(self, grads: dict[int, dict[str, torch.Tensor]]) -> bool:
        """Before this rank's first update: fp16's unscale and overflow check (`_unscale`;
        False: every rank skips its updates), then average every local stage's gradients
        over its replicas (one all-reduce of their flat concat per stage), then sum each
        shared parameter's copies over the ranks holding one (and average over replicas), in
        one global order of the shared parameters so no two ranks wait on each other."""
        if self.scaler is not None and not self._unscale(grads):
            return False
        tied = {(s, n) for local, _ in self.ties for s, n in local.items()}
        for stage in sorted(grads):
            names = [n for n in grads[stage] if (stage, n) not in tied]
            if self.dp == 1 or self.zero or not names:  # ZeRO: the update reduce-scatters
                continue
            mine = grads[stage]
            flat = torch.cat([mine[n].reshape(-1) for n in names])
            dist.all_reduce(flat, group=self.dp_group)
            flat /= self.dp
            for n, part in zip(names, flat.split([mine[n].numel() for n in names])):
                mine[n] = part.view_as(mine[n])
        for local, group in self.ties:
            for stage, name in local.items():  # one copy per rank (StagedProgram.verify)
                if name not in grads[stage]:
                    raise ConfigError(f"pipeline: stage {stage} reads the shared parameter "
                                      f"{name!r} but computes no gradient for it, so its copy "
                                      "would drift from the others; freeze it on every stage "
                                      "(requires_grad=False) or cut elsewhere")
                # a copy of its own: the graph's output may be a view of another value
                g = grads[stage][name].clone(memory_format=torch.contiguous_format)
                dist.all_reduce(g, group=group)
                grads[stage][name] = g.div_(self.dp) if self.dp > 1 else g
        return True

    def _unscale(self, grads: dict[int, dict[str, torch.Tensor]]) -> bool:
        """fp16: every local gradient divided by the loss scale (GradScaler's arithmetic,
        `glmc.trace.scaler.unscale_each`: one gradient at a time); whether any rank's held inf/NaN,
        from one MAX all-reduce over the default group (every stage of every replica); the
        scale updated by GradScaler's rule, alike on every rank. Returns whether the updates
        apply (on an overflow the gradients are dropped by the caller)."""
        scale, tracker = self.scaler[SCALE], self.scaler[scaler.TRACKER]
        flag = torch.zeros((), dtype=torch.float32)
        for stage in sorted(grads):
            flag = torch.maximum(flag, scaler.unscale_each(grads[stage], scale).float())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        found = flag > 0
        scale, tracker = scaler.update(scale, tracker, found, self.scaling)
        self.scaler = {SCALE: scale, scaler.TRACKER: tracker}
        if bool(found):
            self.skipped += 1
            return False
        return True

    def replica_batch(self, batch: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """This replica's rows of the global batch."""
        return tuple(replica_slices(tuple(batch), self.dp)[self.replica])

    def step(self, *args: torch.Tensor, aligned: bool = False, **kwargs: torch.Tensor
             ) -> torch.Tensor | None:
        """One step on the batch (positional or keyword tensors, as the model takes them).
        `aligned`: every rank waits at a barrier first and its trace is timed from there
        (what a prediction assumes: all ranks start the step together; on several hosts it
        also removes their clock offsets)."""
        p = self.pipeline
        batch = batch_leaves((args, kwargs))
        mbs = microbatch_leaves(self.replica_batch(batch), p.program.schedule.num_microbatches)
        if aligned:
            dist.barrier()
        trace = StepTrace(self.rank, origin=time.time() if aligned else 0.0)
        try:
            losses = run_rank(self.runnable, {s: p.stages[s].module for s in self.local},
                              {s: p.optimizers[s] for s in self.local}, mbs, ranks=self.ranks,
                              spans=trace.spans,
                              reduce_grads=self._reduce_grads
                              if (self.dp > 1 and not self.zero) or self.ties
                              or self.scaler is not None else None,
                              scale=None if self.scaler is None else self.scaler[SCALE])
        except RuntimeError as e:
            self._comm_error(e, len(trace.spans))
            raise
        self.traces.append(trace)
        if not self.last:
            return None
        loss = torch.stack(losses).mean()
        if self.dp > 1:  # every replica's slice has as many rows: the mean of the means
            dist.all_reduce(loss, group=self.dp_group)
            loss /= self.dp
        return loss

    @contextlib.contextmanager
    def full_parameters(self) -> Iterator[None]:
        """This rank's stages' whole parameters and optimizer state for the duration (with
        tensor-parallel stages: their blocks gathered over each stage's group, every rank
        enters; otherwise they are whole already)."""
        if self.pipeline.tp is None:
            yield
            return
        with self.pipeline.tp.gathered({s: self.pipeline.stages[s].module for s in self.local},
                                       {s: self.pipeline.optimizers[s] for s in self.local}):
            yield

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers of this rank's stages (what an LR schedule sets)."""
        return [self.pipeline.optimizers[s] for s in self.local]

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's stages' parameters, buffers and optimizer state as DCP saves and loads
        them in place: {"model": {"S/name": t}, "optim": {"S/key:name": t}, "layout": ...}
        (S the stage; replicas hold the same keys, DCP writes one copy)."""
        from glmc.trace.optim import ensure_state
        if self.zero:
            raise ConfigError("pipeline: checkpoints of ZeRO-1 pipelines (optimizer state "
                              "sharded over replicas) are not supported yet; use --zero 0")
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        self._copy_back = []
        for s in self.local:
            module, opt = self.pipeline.stages[s].module, self.pipeline.optimizers[s]
            ensure_state(opt)
            names = {id(p): n for n, p in module.named_parameters()}
            model.update({f"{s}/{k}": self._saved(s, k, v)
                          for k, v in module.state_dict().items()})
            optim.update({f"{s}/{k}:{names[id(p)]}": self._saved(s, names[id(p)], v)
                          for p, st in opt.state.items() if id(p) in names
                          for k, v in st.items() if isinstance(v, torch.Tensor)})
        sched = self.pipeline.program.schedule
        tp = f" x tp {self.tp}" if self.tp > 1 else ""
        return {"model": model, "optim": optim,
                "layout": f"pipeline {sched.num_stages} stages x {self.dp} replicas{tp}"}

    def _saved(self, stage: int, name: str, value: torch.Tensor) -> Any:
        """`value` as the checkpoint holds it (tensor-parallel stages: `StageTensorParallel.
        saved`, whose copies back `load_sharded` runs)."""
        if self.pipeline.tp is None:
            return value
        out, back = self.pipeline.tp.saved(stage, name, value)
        if back is not None:
            self._copy_back.append(back)
        return out

    def load_sharded(self, state: dict[str, Any]) -> None:
        """After DCP loaded `state` (this trainer's `sharded_state_dict`, in place): the
        blocks of interleaved parts cut from the whole tensors it loaded (everything else
        was loaded into the live tensors themselves)."""
        del state  # loaded in place; only the gathered copies need writing back
        for back in self._copy_back:
            back()

    def state_dict(self) -> dict[str, Any]:
        """glmc's own state: the fp16 loss scale and the count of skipped updates."""
        return {"scaler": self.scaler, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scaler, self.skipped = state.get("scaler"), int(state.get("skipped", 0))

    def state_tensors(self) -> list[torch.Tensor]:
        """This rank's persistent state: its stages' parameters and optimizer state."""
        out: list[torch.Tensor] = []
        for s in self.local:
            out += list(self.pipeline.stages[s].module.parameters())
            opt = self.pipeline.optimizers[s]
            out += [v for st in opt.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor)]
        return out

    def measure(self, *args: torch.Tensor, steps: int = 3, **kwargs: torch.Tensor
                ) -> "PipelineMeasurement":
        """Train `steps` more steps and measure them (every rank calls this): the wall time
        per step back to back (steady state), one barrier-aligned step's timeline, and one
        step's peak memory per rank (c10 allocator events above the live state, plus that
        state). Returns replica 0's measurement on every rank."""
        from glmc.analysis.memory import measure_peak

        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step(*args, **kwargs)
        period = (time.perf_counter() - t0) / steps
        busy = sum(t.busy() for t in self.traces[-steps:]) / steps
        self.step(*args, aligned=True, **kwargs)
        trace = self.traces[-1]
        spans = [(a, s - trace.origin, e - trace.origin) for a, s, e in trace.spans]
        _, mem = measure_peak(lambda: self.step(*args, **kwargs), state=self.state_tensors())
        mine = {"spans": spans, "period": period, "busy": busy, "peak": mem.peak_bytes,
                "state": mem.persistent_bytes or 0, "source": mem.source}
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        ranks = self.pipeline.program.schedule.num_ranks
        every = every[:ranks * self.tp:self.tp]  # replica 0, tp index 0
        timeline = measured_timeline([StepTrace(r, e["spans"]) for r, e in enumerate(every)],
                                     ranks)
        return PipelineMeasurement(timeline, max(e["period"] for e in every),
                                   [e["busy"] for e in every],
                                   [e["state"] + e["peak"] for e in every],
                                   [e["state"] for e in every], every[0]["source"])


def stage_backend(name: str) -> Any:
    """The glmc backend that compiles pipeline stages: one that updates state in place (a
    stage writes its parameters and optimizer state as it goes)."""
    from glmc.backends import get_backend
    backend = get_backend(name)
    if not backend.traits().inplace:
        raise ConfigError(f"pipeline: backend {name!r} runs functional steps; pipeline stages "
                          "update their state in place and run on 'eager' or 'inductor'")
    return backend


def replica_slices(batch: tuple[torch.Tensor, ...], dp: int) -> list[list[torch.Tensor]]:
    """The global batch's rows cut into `dp` equal replica slices."""
    return _equal_rows(batch, dp, "data-parallel replicas",
                       f"use a batch divisible by {dp} x the microbatches")


def from_env_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def plan_trainer(plan: ParallelPlan, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 loss_fn: Any, example_inputs: Any, *, memory_budget: Any = None,
                 backend: str = "eager", precision: str | None = None,
                 fusion: bool = False) -> "PipelineTrainer":
    """The PipelineTrainer a pipeline plan describes, over the default group's processes (or
    torchrun's, before the group exists): its stages and replicas (`plan.degrees`), its
    microbatches (default: one per stage; gradient accumulation over `plan.accumulate`
    micro-batches is that many times the microbatches in one step: the gradients of all of
    them are summed before the update, as accumulation does), schedule (interleaved: 2
    virtual stages per rank), ZeRO stage and timeout."""
    world = dist.get_world_size() if dist.is_initialized() else from_env_world()
    dims = plan.degrees(world)
    return pipeline_trainer(model, optimizer, loss_fn, example_inputs,
                            (plan.microbatches or dims["pp"]) * plan.accumulate, plan.schedule,
                            2 if plan.schedule == "interleaved" else 1,
                            timeout_s=plan.timeout_s, dp=dims["dp"], cut=plan.cut,
                            memory_budget=memory_budget, zero=plan.zero or 0, backend=backend,
                            precision=precision, fusion=fusion, tp=plan.tp,
                            tp_plan=plan.tp_plan or "", sequence=bool(plan.sequence_parallel),
                            tp_choose=plan.tp_choose or "layout")


def plan_stages(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any,
                example_inputs: Any, stages: int, microbatches: int, schedule: str,
                virtual: int = 1, profile: Any = None, link: Any = None,
                cut: Any = None, backend: str = "eager") -> Any:
    """The partition pass's plan for the whole step, captured once on this process on one
    microbatch (what each stage runs per action); `link`: the link between stages the
    predicted schedule prices transfers on; `cut`: predict this cut instead of choosing
    (`plan_partition`'s `cut`: block indices or "equal"); `backend`: what will run the stages
    (its traits price their ops: Inductor's fusion groups)."""
    from glmc.passes.partition import PartitionPass

    one = like(example_inputs, microbatch_leaves(example_inputs, microbatches)[0])
    graph = capture(model, one, loss_fn, optimizer)
    traits = stage_backend(backend).traits()
    if isinstance(cut, str) and cut != "equal":
        cut = layer_cut(model, step_blocks(graph), cut, stages)
    if cut is not None:
        from glmc.passes.partition import plan_partition
        return plan_partition(graph, stages, microbatches, schedule, [profile] * stages,
                              traits=traits, virtual=virtual, link=link,
                              microbatch_graph=True, cut=cut)
    ps = PartitionPass(stages=stages, microbatches=microbatches, schedule=schedule,
                       virtual=virtual, link=link or "", microbatch_graph=True)
    manager = PassManager([ps])
    manager.run(graph, PassContext(traits=traits, profile=profile))
    return manager.history[-1].stats


def stage_budgets(plan: Any, budget: Any, ranks: int) -> list[StageBudget | None]:
    """Per stage, its budget for glmc's recompute pass (`StageBudget`) from `budget` (the
    pass's Budget spelling) with the microbatches the schedule keeps in flight on it: a size is
    the peak allowed per *rank* — its stages' state first, the rest shared by their in-flight
    activations in proportion to what each would keep (`+size`: that rest itself); a fraction
    or a rule ("min", "selective", "full") applies to every stage. None: no budget. A size
    below a rank's state is a BudgetError naming it."""
    from glmc.errors import BudgetError
    from glmc.passes.recompute import Budget

    if budget is None:
        return [None] * len(plan.stages)
    b = Budget.parse(budget)
    if b.kind in ("min", "selective", "full", "fraction"):
        spec = b.kind if b.kind != "fraction" else str(b.value)
        return [StageBudget(spec, s.in_flight) for s in plan.stages]
    out: list[StageBudget | None] = [None] * len(plan.stages)
    for r in range(ranks):
        own = [i for i in range(len(plan.stages)) if i % ranks == r]
        state = sum(plan.stages[i].state_bytes for i in own)
        acts = [plan.stages[i].in_flight * plan.stages[i].saved_bytes_per_microbatch
                for i in own]
        rest = b.value if b.kind == "above" else b.value - state
        if rest <= 0:
            raise BudgetError(
                f"pipeline: rank {r} (stage{'s' if len(own) > 1 else ''} "
                f"{', '.join(map(str, own))}) needs more than {state / 2**20:.1f} MiB for its "
                f"parameters, gradients and optimizer state before any activation; the budget "
                f"is {b.value / 2**20:.1f} MiB per rank. Raise the budget or use more stages")
        for i, a in zip(own, acts):
            share = a / sum(acts) if sum(acts) else 1 / len(own)
            out[i] = StageBudget(None, plan.stages[i].in_flight, int(rest * share))
    return out


def layer_cut(model: nn.Module, blocks: Sequence[str], text: str, stages: int
              ) -> tuple[int, ...]:
    """A cut spelled in layers (`glmc plan`'s `cut=1/2/4`: the layer of the model's list of
    identical layers each stage after the first starts at; the layer count: the blocks
    after the layers) as the indices of `blocks` (the step's, in order) the stages start
    at; a model without such a list counts blocks. A ConfigError where it does not cut the
    blocks into `stages` non-empty stages."""
    from glmc.parallel.planner import cut_bounds, layer_list
    bounds = cut_bounds(text)
    found = layer_list(model)
    listed = found is not None and f"{found[0]}.0" in blocks
    first = blocks.index(f"{found[0]}.0") if listed else 0
    layers = len(found[1]) if listed else len(blocks)
    out = tuple(first + b for b in bounds)
    if len(out) != stages - 1 or not all(0 < b < len(blocks) for b in out) or \
            max(bounds) > layers:
        raise ConfigError(f"pipeline: cut={text} does not cut the {len(blocks)} blocks "
                          f"({layers} layers from block {first}) into {stages} non-empty "
                          f"stages: give {stages - 1} increasing layer numbers "
                          f"up to {layers}")
    return out


def pipeline_trainer(model: nn.Module, optimizer: torch.optim.Optimizer | None, loss_fn: Any,
                     example_inputs: Any, microbatches: int, schedule: str = "1f1b",
                     virtual: int = 1, timeout_s: float = 300.0, dp: int = 1,
                     memory_budget: Any = None, cut: Any = None, zero: int = 0,
                     backend: str = "eager", precision: str | None = None,
                     fusion: bool = False, tp: int | None = None, tp_plan: str = "",
                     sequence: bool = False, tp_choose: str = "layout") -> PipelineTrainer:
    """A PipelineTrainer over every process of the default group (from torchrun's env):
    world / dp pipeline ranks, `dp` replicas. Rank 0 plans the cut for one replica's slice of
    the batch (the cost model may be calibrated differently per process, so one process
    decides) and broadcasts it; every rank captures its program. `memory_budget` (a size per
    rank, a fraction or "min"): glmc's recompute pass plans each stage's backward so that its
    in-flight microbatches fit (`stage_budgets`). `cut`: use this cut (block indices, or
    "equal") instead of the planned one. `zero=1`: each stage's optimizer state sharded over
    its replicas (`PipelineTrainer`). `backend`: what runs each stage's graphs ("eager":
    the fx graphs; "inductor": each compiled once, in its write-back form). `precision`:
    "bf16" or "fp16" (with dynamic loss scaling across the stages) runs every stage's
    forward under glmc's dtype assignment, `fusion` fuses its
    attention, norms and gated MLPs (`stage_passes`). `tp`: every stage tensor-parallel
    over that many consecutive ranks (`glmc.parallel.stage_tp`; `tp_plan` pins weights,
    `sequence` sequence parallelism inside the stages, `tp_choose` the pass's `choose`,
    on the measured link): world = dp x stages x tp."""
    from glmc.analysis.comm import measure_link
    from glmc.parallel.data import init_distributed
    from glmc.passes.partition import with_sync
    optimizer = resolve_optimizer(model, optimizer)  # None: the default, as on one process
    init_distributed("cpu", timeout_s)
    world = dist.get_world_size()
    tp_size = tp or 1
    if dp < 1 or world % (dp * tp_size):
        raise ConfigError(f"pipeline: {dp} data-parallel replicas"
                          + (f" of {tp_size} tensor-parallel ranks" if tp else "")
                          + f" do not divide the {world} processes")
    stages = world // dp // tp_size * virtual
    leaves = batch_leaves(split_batch(example_inputs))
    example = like(example_inputs, replica_slices(tuple(leaves), dp)[0])
    link = measure_link(reps=21)  # every rank takes part; the same figures everywhere
    stage_tp = _stage_tp(tp, dp, world // dp // tp_size, tp_plan, sequence, tp_choose,
                         link) if tp else None
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        box[0] = plan_stages(model, optimizer, loss_fn, example, stages, microbatches,
                             schedule, virtual, link=link, cut=cut, backend=backend)
    dist.broadcast_object_list(box, src=0)
    plan = box[0]
    budgets = stage_budgets(plan, memory_budget, stages // virtual)
    pipe = build_program(model, optimizer, loss_fn, example,
                         [s.blocks for s in plan.stages], microbatches, schedule, virtual,
                         budgets, precision, fusion, backend, tp=stage_tp)
    pipe.plan = with_sync(plan, sync_seconds(pipe, dp, zero, link), virtual, link)
    pipe.rank_budget_bytes = _rank_budget_bytes(memory_budget)
    return PipelineTrainer(pipe, timeout_s, dp, zero, backend)


def _stage_tp(size: int, dp: int, ranks: int, plan: str, sequence: bool, choose: str,
              link: Any) -> Any:
    """This process's side of tensor-parallel stages: a ("pp", "tp") mesh of `ranks`
    pipeline ranks x `size`, ("dp", "pp", "tp") with `dp` > 1 replicas (tp innermost: a
    group is consecutive ranks); the pass's options, `link` the measured one."""
    from torch.distributed.device_mesh import init_device_mesh

    from glmc.analysis.comm import link_figures

    from glmc.ir.plans import DIM, TP
    from glmc.parallel.stage_tp import StageTensorParallel
    if not isinstance(size, int) or size < 2:
        raise ConfigError(f"pipeline: tp must be a whole number >= 2, got {size!r}")
    shape, names = ((ranks, size), ("pp", TP)) if dp == 1 else \
        ((dp, ranks, size), (DIM, "pp", TP))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return StageTensorParallel(size, mesh.get_local_rank(TP), mesh, plan, sequence, choose,
                               link_figures(link))


def _fused_patterns(pipe: Pipeline) -> str:
    """The forward patterns the fusion pass tried on the stages (its records' counts)."""
    names: list[str] = []
    for r in pipe.passes:
        if r.name == "fusion" and isinstance(r.stats, dict):
            names += [k for k in r.stats if k not in names]
    return "/".join("MLP" if n == "mlp" else n for n in names)


def _rank_budget_bytes(budget: Any) -> int | None:
    """A size budget as bytes per rank (None for no budget, a fraction, min or +size)."""
    from glmc.passes.recompute import Budget
    b = Budget.parse(budget) if budget is not None else None
    return int(b.value) if b is not None and b.kind == "bytes" else None


def train_cli(work: Any, steps: int, plan: ParallelPlan, report_dir: str | None = None,
              memory_budget: Any = None, backend: str = "eager", precision: str | None = None,
              fusion: bool = False) -> int:
    """`glmc compile FILE --nproc N --pp S ...`: trains `work` pipelined as `plan` says; the
    rank holding replica 0's last stage prints `step i  loss x` lines as a single process does,
    then the plan and its predictions against three more measured steps (per-stage peak,
    bubble); with `report_dir`, also report.html (plan, Gantt charts), report.json and Chrome
    traces. More processes than stages: pp x dp (`--nproc` a multiple of `--pp`), with
    `zero=1` the optimizer state sharded over the replicas; `backend` runs the stages' graphs,
    `precision` (bf16, fp16) sets their dtypes. A FILE without an optimizer trains with the
    default one (`resolve_optimizer`), as one process does."""
    trainer = plan_trainer(plan, work.model, work.optimizer, work.loss_fn, work.example_inputs,
                           memory_budget=memory_budget, backend=backend, precision=precision,
                           fusion=fusion)
    args, kwargs = split_batch(work.example_inputs)
    printer = trainer.last and trainer.replica == 0 and trainer.tp_rank == 0
    for i in range(steps):
        loss = trainer.step(*args, **kwargs)
        if printer:
            print(f"step {i:4d}  loss {loss.item():.6f}", flush=True)
    measured = trainer.measure(*args, **kwargs)  # three more steps: not printed as training steps
    if printer:
        data = pipeline_report(trainer.pipeline.plan, measured, trainer.pipeline)
        data["backend"] = {"name": trainer.backend, "precision": precision or "fp32",
                           "fusion": fusion and _fused_patterns(trainer.pipeline),
                           "loss_scale": None if trainer.scaler is None else {
                               "scale": float(trainer.scaler[SCALE]),
                               "skipped": trainer.skipped, "steps": len(trainer.traces)},
                           "compile_seconds": trainer.compile_seconds}  # this rank's
        print(summary(data), flush=True)
        if report_dir:
            print(f"report: {write_report(data, report_dir)}")
    dist.destroy_process_group()
    return 0
