"""The one executor of pipeline schedules: runs any `glmc.planning.schedule.Schedule` for one
rank's stages over `torch.distributed` point-to-point ops (`run_rank`, `run_stage`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from glmc.compiler.inplace import Values, batch_values, run_inplace, state_values
from glmc.errors import ConfigError
from glmc.ir.graph import OutputKind, Role, TrainGraph
from glmc.ir.program import Boundary, Stage, StagedProgram
from glmc.planning.schedule import CONSUMED, Action, ActionKind, dense, fresh_gradients, i_only


@dataclass
class _StageRun:
    """The state of one rank's stage during one step."""

    program: StagedProgram
    index: int
    module: nn.Module
    optimizer: torch.optim.Optimizer
    ranks: Sequence[int]
    mb: list[Values]  #: per microbatch: batch leaves, received values, saved values, loss seed
    state: Values = field(default_factory=dict)
    sent: list[dict[str, torch.Tensor]] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    owned: set[str] = field(default_factory=set)  #: gradients summed into in place
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    works: list = field(default_factory=list)
    #: fp16 loss scaling: the current scale, which seeds every backward (None: unscaled)
    scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.state = state_values(self.module, self.optimizer)
        self.sent = [{} for _ in self.mb]

    @property
    def stage(self) -> Stage:
        return self.program.stages[self.index]

    def run(self, a: Action) -> None:
        K = ActionKind
        handlers = {K.F: self.forward, K.B: self.backward, K.I: self.backward_input,
                    K.W: self.backward_weight, K.UPDATE: self.update,
                    K.SEND_F: self.send, K.SEND_B: self.send, K.RECV_F: self.recv,
                    K.RECV_B: self.recv}
        if a.kind not in handlers:
            raise ConfigError(f"run_stage: action {a} ({a.kind.name}) needs a graph stage "
                              f"{self.index} does not have")
        handlers[a.kind](a)

    def _call(self, graph: TrainGraph, m: int, consume: Iterable[Role] = ()) -> dict:
        return run_inplace(graph, self.mb[m], self.state, consume=consume)

    def forward(self, a: Action) -> None:
        m = a.microbatch
        for (kind, target), v in self._call(self.stage.forward, m).items():
            if kind is OutputKind.LOSS:  # the backward's seed: d(mean over microbatches)/d loss
                self.losses[m] = v.detach()
                seed = torch.full_like(v, 1.0 / len(self.mb))
                self.mb[m][(Role.GRADIENT, "")] = seed if self.scale is None \
                    else seed.mul_(self.scale.to(seed.dtype))
            elif kind is OutputKind.SEND:
                self.sent[m][target] = v
            else:
                self.mb[m][(Role.SAVED, target)] = v

    def backward(self, a: Action, graph: TrainGraph | None = None, last: bool = True,
                 consume: Iterable[Role | tuple[Role, str]] = ()) -> None:
        m = a.microbatch
        # the microbatch's last backward action takes its saved values and cotangents along
        consume = CONSUMED["B"] if last else consume
        graph = graph or self.stage.backward
        fresh = fresh_gradients(graph)
        for (kind, target), v in self._call(graph, m, consume).items():
            if kind is OutputKind.GRADIENT:
                self._accumulate(target, v, target in fresh)
            elif kind is OutputKind.SAVED:  # what I stashes for W
                self.mb[m][(Role.SAVED, target)] = v
            else:
                self.sent[m][target] = v
        if last:  # the microbatch's saved and received values are done with
            self.mb[m] = {k: v for k, v in self.mb[m].items()
                          if k[0] not in (Role.SAVED, Role.BOUNDARY)}

    def _accumulate(self, target: str, v: torch.Tensor, fresh: bool) -> None:
        """Sum a microbatch's gradient in, in place where the first one is the backward's own
        dense storage (`fresh_gradients`), as autograd's AccumulateGrad does; otherwise (a
        view of an input, expanded, shared with another output) the first is kept as the
        graph returned it, the second sum is a fresh tensor and later ones add into it."""
        if target not in self.grads:
            self.grads[target] = v
            if fresh and dense(v):
                self.owned.add(target)
        elif target in self.owned:
            self.grads[target].add_(v)
        else:
            self.grads[target] = self.grads[target] + v
            self.owned.add(target)

    def backward_input(self, a: Action) -> None:
        """ZB-H1's I: also takes along (frees as it goes) the microbatch's saved values and
        cotangents that W does not read (`i_only`)."""
        i_graph, w_graph = self._split(a)
        self.backward(a, i_graph, last=False, consume=i_only(i_graph, w_graph))

    def backward_weight(self, a: Action) -> None:
        self.backward(a, self._split(a)[1])

    def _split(self, a: Action) -> tuple[TrainGraph, TrainGraph]:
        split = self.stage.split
        if split is None:
            raise ConfigError(f"run_stage: action {a} needs stage {self.index}'s backward "
                              "split into I and W (glmc.ir.split.split_backward)")
        return split

    def update(self, a: Action) -> None:
        grads = {(Role.GRADIENT, n): g for n, g in self.grads.items()}
        self.grads = {}  # each gradient is freed in the update after its last read
        run_inplace(self.stage.update, grads, self.state, consume=CONSUMED["U"])

    def _boundaries(self, a: Action, sending: bool) -> list[tuple[int, Boundary]]:
        gradient = a.kind in (ActionKind.SEND_B, ActionKind.RECV_B)
        return [(i, b) for i, b in enumerate(self.program.boundaries)
                if b.is_gradient == gradient
                and (b.src_stage if sending else b.dst_stage) == self.index]

    def send(self, a: Action) -> None:
        m, n = a.microbatch, len(self.mb)
        ops = [dist.P2POp(dist.isend, self.sent[m].pop(b.name).contiguous(),
                          self.ranks[b.dst_stage], tag=i * n + m)
               for i, b in self._boundaries(a, sending=True)]
        if ops:
            self.works += dist.batch_isend_irecv(ops)  # waited at the end of the step

    def recv(self, a: Action) -> None:
        m, n = a.microbatch, len(self.mb)
        device = next(self.module.parameters()).device
        bufs = {b.name: torch.empty(b.spec.shape, dtype=b.spec.dtype, device=device)
                for _, b in self._boundaries(a, sending=False)}
        ops = [dist.P2POp(dist.irecv, bufs[b.name], self.ranks[b.src_stage], tag=i * n + m)
               for i, b in self._boundaries(a, sending=False)]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        self.mb[m].update({(Role.BOUNDARY, k): v for k, v in bufs.items()})


def run_rank(program: StagedProgram, modules: dict[int, nn.Module],
             optimizers: dict[int, torch.optim.Optimizer],
             microbatches: Sequence[Sequence[torch.Tensor]], ranks: Sequence[int] | None = None,
             spans: list | None = None,
             reduce_grads: Callable[[dict[int, dict[str, torch.Tensor]]], bool | None]
             | None = None, scale: torch.Tensor | None = None) -> list[torch.Tensor]:
    """One training step of every stage this process holds (`modules` / `optimizers` by stage):
    `run_stage` for several (virtual) stages. `ranks[s]`: the process of stage s (default:
    the schedule's `rank_of`). `spans`, if given, receives (action, start, end) of every
    action in wall-clock seconds (`time.time()`: comparable across processes of one host).
    `reduce_grads({stage: {name: gradient}})`: run once, before this rank's first update, on
    every local stage's accumulated gradients (the schedule runs every backward first); it
    may replace them: data-parallel replicas average theirs there, and the copies of a
    shared parameter (`program.shared`) must be summed there — required when a local stage
    has one. If it returns False, this rank's updates are skipped (fp16 loss scaling: a
    gradient overflowed somewhere; every rank must decide alike). `scale`: fp16's loss scale,
    which seeds every microbatch's backward (gradients come out multiplied by it); without it
    fp16 stages run unscaled — `PipelineTrainer` passes it and does the unscaling and the
    overflow check in its `reduce_grads`."""
    import time

    sched = program.schedule
    if len(microbatches) != sched.num_microbatches:
        raise ConfigError(f"run_stage: got {len(microbatches)} microbatches, the schedule has "
                          f"{sched.num_microbatches}")
    ranks = [sched.rank_of(s) for s in range(sched.num_stages)] if ranks is None \
        else list(ranks)
    runs = {s: _StageRun(program, s, modules[s], optimizers[s], ranks,
                         [batch_values(b) for b in microbatches], scale=scale) for s in modules}
    actions = sched.rank_actions(sched.rank_of(next(iter(modules))))
    _check_reduction(program, actions, set(runs), reduce_grads is not None)
    reduced, apply = False, True
    for action in actions:
        t0 = time.time()  # the first update's span includes the reduction before it
        if action.kind is ActionKind.UPDATE and not reduced and reduce_grads is not None:
            apply = reduce_grads({s: run.grads for s, run in runs.items()}) is not False
            reduced = True
        if action.kind is ActionKind.UPDATE and not apply:
            runs[action.stage].grads = {}  # skipped: parameters and optimizer state stay
        else:
            runs[action.stage].run(action)
        if spans is not None:
            spans.append((action, t0, time.time()))
    for run in runs.values():
        for work in run.works:
            work.wait()
    return [v for run in runs.values() for _, v in sorted(run.losses.items())]


def _check_reduction(program: StagedProgram, actions: Sequence[Action], local: set[int],
                     reducing: bool) -> None:
    """A rank whose stages hold a shared parameter needs `reduce_grads` (else each copy
    would take only its own stage's part of the gradient), and a reduction needs every local
    backward done before the rank's first update."""
    tied = sorted({s for copies in program.shared for s, _ in copies} & local)
    if tied and not reducing:
        raise ConfigError(f"run_rank: stage{'s' if len(tied) > 1 else ''} "
                          f"{', '.join(map(str, tied))} hold a parameter shared with other "
                          "stages (tied weights): their gradients must be summed across those "
                          "stages' ranks before the update — run the pipeline through "
                          "glmc.parallel.pipeline.PipelineTrainer, or pass reduce_grads")
    kinds = [a.kind for a in actions]
    if reducing and ActionKind.UPDATE in kinds:
        first = kinds.index(ActionKind.UPDATE)
        late = [a for a in actions[first:] if a.kind in (ActionKind.B, ActionKind.W)]
        if late:
            raise ConfigError(f"run_rank: {late[0]} runs after this rank's first update; "
                              "gradients are reduced once before it, so the schedule must "
                              "run every backward first")


def run_stage(program: StagedProgram, stage: int, module: nn.Module,
              optimizer: torch.optim.Optimizer, microbatches: Sequence[Sequence[torch.Tensor]],
              ranks: Sequence[int] | None = None) -> list[torch.Tensor]:
    """One training step of `program` for `stage` on this rank: runs the stage's actions of
    `program.schedule` in order, exchanging boundary values with the other stages' ranks
    (`ranks[s]`, default rank s) by point-to-point ops; gradients accumulate over the
    microbatches (the loss is their mean) and UPDATE writes the new parameters and optimizer
    state into `module` and `optimizer`. Returns the per-microbatch losses (last stage)."""
    if len(microbatches) != program.schedule.num_microbatches:
        raise ConfigError(f"run_stage: got {len(microbatches)} microbatches, the schedule has "
                          f"{program.schedule.num_microbatches}")
    ranks = list(range(len(program.stages))) if ranks is None else list(ranks)
    run = _StageRun(program, stage, module, optimizer, ranks,
                    [batch_values(b) for b in microbatches])
    actions = program.schedule.actions(stage)
    _check_reduction(program, actions, {stage}, False)
    for action in actions:
        run.run(action)
    for work in run.works:
        work.wait()
    return [run.losses[m] for m in sorted(run.losses)]
