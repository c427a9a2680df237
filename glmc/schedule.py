"""Pipeline schedules as data, and the one executor that runs any of them.

A schedule is a DAG of `Action`s (networkx): which stage runs what for which microbatch, with
an edge wherever one action needs another first — data (a send before its receive, a forward
before its backward) or order (the schedule's choice, e.g. GPipe runs every forward before
any backward). Schedules differ only in how that DAG is generated; `run_stage` executes any
of them for one rank's stage.

The vocabulary is torch.distributed.pipelining's (`_ComputationType` / `_Action` in
torch/distributed/pipelining/schedules.py): F (forward), B (full backward), W (backward of the
weights alone), SEND_F / RECV_F (activations), SEND_B / RECV_B (their gradients), and actions
print as torch's do ("1F0", "0SEND_F1"). glmc adds UPDATE: the optimizer step, once per stage
after the last backward, which torch leaves outside its schedules.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import networkx as nx
import torch
import torch.distributed as dist
import torch.nn as nn

from glmc.errors import ConfigError, PassError
from glmc.ir import OutputKind, Role, TrainGraph
from glmc.program import (Boundary, Stage, StagedProgram, Values, batch_values, gather,
                          state_values, write_back)


class ActionKind(str, enum.Enum):
    """What an action does (values spelled as torch's `_ComputationType`)."""

    F = "F"  #: forward of one microbatch: stage's forward graph
    B = "B"  #: full backward of one microbatch: stage's backward graph; gradients accumulate
    W = "W"  #: weight-only backward (zero-bubble schedules); no glmc stage has one yet
    SEND_F = "SEND_F"  #: send this microbatch's activations to the next stage(s)
    RECV_F = "RECV_F"  #: receive this microbatch's activations from the previous stage(s)
    SEND_B = "SEND_B"  #: send the gradients of received activations back
    RECV_B = "RECV_B"  #: receive the gradients of sent activations
    UPDATE = "UPDATE"  #: the optimizer update with the accumulated gradients (no microbatch)


_RANK = {k: i for i, k in enumerate(ActionKind)}


@dataclass(frozen=True)
class Action:
    stage: int
    kind: ActionKind
    microbatch: int | None = None

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{'' if self.microbatch is None else self.microbatch}"


@dataclass
class Schedule:
    """A DAG of actions over `num_stages` stages and `num_microbatches` microbatches. Edges
    carry `why="data"` or `why="order"`."""

    dag: nx.DiGraph
    num_stages: int
    num_microbatches: int

    def linear(self) -> list[Action]:
        """One deterministic topological order of every action: each rank runs its own
        actions in this order, so all ranks agree (deadlock-free with non-blocking sends)."""
        m = self.num_microbatches
        return list(nx.lexicographical_topological_sort(
            self.dag, key=lambda a: (m if a.microbatch is None else a.microbatch, a.stage,
                                     _RANK[a.kind])))

    def actions(self, stage: int) -> list[Action]:
        return [a for a in self.linear() if a.stage == stage]

    def verify(self, num_stages: int, links: set[tuple[int, int]]) -> None:
        """Acyclic; every stage runs F and B of every microbatch, its sends and receives where
        `links` (forward (sender, receiver) pairs) say so, and UPDATE once after all its B."""
        if not nx.is_directed_acyclic_graph(self.dag):
            cycle = " -> ".join(str(u) for u, _ in nx.find_cycle(self.dag))
            raise PassError(f"schedule: has a cycle: {cycle}")
        if num_stages != self.num_stages:
            raise PassError(f"schedule: is for {self.num_stages} stages, the program has "
                            f"{num_stages}")
        missing = sorted(map(str, _required(num_stages, self.num_microbatches, links)
                             - set(self.dag)))
        if missing:
            raise PassError(f"schedule: lacks actions {missing}")
        for a, needs in _dependencies(self.num_microbatches, links, num_stages):
            if not nx.has_path(self.dag, needs, a):
                raise PassError(f"schedule: {a} does not wait for {needs}")

    def __str__(self) -> str:
        return "\n".join(f"# schedule stage {s}: " + " ".join(map(str, self.actions(s)))
                         for s in range(self.num_stages))


def _required(stages: int, mbs: int, links: set[tuple[int, int]]) -> set[Action]:
    need = {Action(s, ActionKind.UPDATE) for s in range(stages)}
    for m in range(mbs):
        need |= {Action(s, k, m) for s in range(stages) for k in (ActionKind.F, ActionKind.B)}
        for src, dst in links:
            need |= {Action(src, ActionKind.SEND_F, m), Action(dst, ActionKind.RECV_F, m),
                     Action(dst, ActionKind.SEND_B, m), Action(src, ActionKind.RECV_B, m)}
    return need


def _dependencies(mbs: int, links: set[tuple[int, int]], stages: int
                  ) -> Iterable[tuple[Action, Action]]:
    """(action, what it must come after) for every data dependency."""
    A, K = Action, ActionKind
    for m in range(mbs):
        for s in range(stages):
            yield A(s, K.B, m), A(s, K.F, m)  # the backward reads the forward's saved values
            yield A(s, K.UPDATE), A(s, K.B, m)
        for src, dst in links:
            yield from ((A(src, K.SEND_F, m), A(src, K.F, m)),
                        (A(dst, K.RECV_F, m), A(src, K.SEND_F, m)),
                        (A(dst, K.F, m), A(dst, K.RECV_F, m)),
                        (A(dst, K.SEND_B, m), A(dst, K.B, m)),
                        (A(src, K.RECV_B, m), A(dst, K.SEND_B, m)),
                        (A(src, K.B, m), A(src, K.RECV_B, m)))


def build(order: dict[int, list[Action]], num_microbatches: int,
          links: set[tuple[int, int]]) -> Schedule:
    """The schedule that runs each stage's compute actions in `order` (the generator's
    choice) and adds the communication and data dependencies every schedule shares."""
    dag = nx.DiGraph()
    for actions in order.values():
        dag.add_nodes_from(actions)
        nx.add_path(dag, actions, why="order")
    for action, needs in _dependencies(num_microbatches, links, len(order)):
        dag.add_edge(needs, action, why="data")
    return Schedule(dag, len(order), num_microbatches)


def gpipe(num_stages: int, num_microbatches: int, links: set[tuple[int, int]]) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards, then its update."""
    K = ActionKind
    order = {s: [Action(s, K.F, m) for m in range(num_microbatches)]
             + [Action(s, K.B, m) for m in range(num_microbatches)] + [Action(s, K.UPDATE)]
             for s in range(num_stages)}
    return build(order, num_microbatches, links)


# ---- the executor ------------------------------------------------------------------------------

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
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    works: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.state = state_values(self.module, self.optimizer)
        self.sent = [{} for _ in self.mb]

    @property
    def stage(self) -> Stage:
        return self.program.stages[self.index]

    def run(self, a: Action) -> None:
        K = ActionKind
        handlers = {K.F: self.forward, K.B: self.backward, K.UPDATE: self.update,
                    K.SEND_F: self.send, K.SEND_B: self.send, K.RECV_F: self.recv,
                    K.RECV_B: self.recv}
        if a.kind not in handlers:
            raise ConfigError(f"run_stage: action {a} ({a.kind.name}) needs a graph stage "
                              f"{self.index} does not have")
        handlers[a.kind](a)

    def _call(self, graph: TrainGraph, m: int) -> dict:
        outs = graph.gm(*gather(graph, self.mb[m], self.state))
        return write_back(graph, outs, self.module, self.optimizer)

    def forward(self, a: Action) -> None:
        m = a.microbatch
        for (kind, target), v in self._call(self.stage.forward, m).items():
            if kind is OutputKind.LOSS:  # the backward's seed: d(mean over microbatches)/d loss
                self.losses[m] = v.detach()
                self.mb[m][(Role.GRADIENT, "")] = torch.full_like(v, 1.0 / len(self.mb))
            elif kind is OutputKind.SEND:
                self.sent[m][target] = v
            else:
                self.mb[m][(Role.SAVED, target)] = v

    def backward(self, a: Action) -> None:
        m = a.microbatch
        for (kind, target), v in self._call(self.stage.backward, m).items():
            if kind is OutputKind.GRADIENT:
                self.grads[target] = self.grads[target] + v if target in self.grads else v
            else:
                self.sent[m][target] = v
        self.mb[m] = {k: v for k, v in self.mb[m].items() if k[0] is not Role.SAVED}

    def update(self, a: Action) -> None:
        grads = {(Role.GRADIENT, n): g for n, g in self.grads.items()}
        graph = self.stage.update
        write_back(graph, graph.gm(*gather(graph, grads, self.state)), self.module,
                   self.optimizer)

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
    for action in program.schedule.actions(stage):
        run.run(action)
    for work in run.works:
        work.wait()
    return [run.losses[m] for m in sorted(run.losses)]
