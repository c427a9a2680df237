"""Pipeline schedules as data, their simulation, and the memory they predict per stage.

A schedule is a DAG of `Action`s (networkx): which stage runs what for which microbatch, with
an edge wherever one action needs another first — data (a send before its receive, a forward
before its backward) or order (the schedule's choice, e.g. GPipe runs every forward before
any backward). Schedules differ only in how that DAG is generated; `glmc.parallel.executor` runs any
of them for one rank's stages.

The vocabulary is torch.distributed.pipelining's (`_ComputationType` / `_Action` in
torch/distributed/pipelining/schedules.py): F (forward), B (full backward), I / W (backward of the
inputs / of the weights alone, zero-bubble), SEND_F / RECV_F (activations), SEND_B / RECV_B (their gradients), and actions
print as torch's do ("1F0", "0SEND_F1"). glmc adds UPDATE: the optimizer step, once per stage
after the last backward, which torch leaves outside its schedules.
"""
from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import networkx as nx
import torch
import torch.fx as fx

from glmc.compiler.inplace import inplace_module
from glmc.errors import ConfigError, PassError
from glmc.ir.graph import FRESH_GRADIENTS, OutputKind, Role, TrainGraph
from glmc.ir.program import Stage, StagedProgram


class ActionKind(str, enum.Enum):
    """What an action does (values spelled as torch's `_ComputationType`)."""

    F = "F"  #: forward of one microbatch: stage's forward graph
    B = "B"  #: full backward of one microbatch: stage's backward graph; gradients accumulate
    I = "I"  #: input-gradient backward of one microbatch (zero-bubble): sends grads early
    W = "W"  #: weight-gradient backward of one microbatch (zero-bubble): after its I
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
    split_backward: bool = False  #: B is two actions, I then W (zero-bubble schedules)
    stages_per_rank: int = 1  #: > 1: virtual stages, stage s on rank s % (stages // this)

    @property
    def num_ranks(self) -> int:
        return self.num_stages // self.stages_per_rank

    def rank_of(self, stage: int) -> int:
        return stage % self.num_ranks

    def rank_actions(self, rank: int) -> list[Action]:
        """What `rank` runs, in order: its compute actions in the schedule's order, each
        preceded by the receives it reads and followed by the sends of what it produced —
        receives are posted as late as the computation allows (a rank never blocks on a value
        it does not need yet), sends as early. Deadlock-free: every rank follows one DAG."""
        K = ActionKind
        sends = {K.F: K.SEND_F, K.B: K.SEND_B, K.I: K.SEND_B}
        recvs = {K.F: K.RECV_F, K.B: K.RECV_B, K.I: K.RECV_B}
        out = []
        for a in self.linear():
            if self.rank_of(a.stage) != rank or a.kind not in COMPUTE:
                continue
            before, after = Action(a.stage, recvs.get(a.kind, a.kind), a.microbatch), \
                Action(a.stage, sends.get(a.kind, a.kind), a.microbatch)
            out += [before] if a.kind in recvs and before in self.dag else []
            out.append(a)
            out += [after] if a.kind in sends and after in self.dag else []
        return out

    def linear(self) -> list[Action]:
        """One deterministic topological order of every action (each rank's compute actions
        keep the order the generator chose: they are chained by "order" edges)."""
        m = self.num_microbatches
        return list(nx.lexicographical_topological_sort(
            self.dag, key=lambda a: (m if a.microbatch is None else a.microbatch, a.stage,
                                     _RANK[a.kind])))

    def actions(self, stage: int) -> list[Action]:
        """What `stage` runs, in order (its part of its rank's `rank_actions`)."""
        return [a for a in self.rank_actions(self.rank_of(stage)) if a.stage == stage]

    def verify(self, num_stages: int, links: set[tuple[int, int]]) -> None:
        """Acyclic; every stage runs F and B of every microbatch, its sends and receives where
        `links` (forward (sender, receiver) pairs) say so, and UPDATE once after all its B."""
        if not nx.is_directed_acyclic_graph(self.dag):
            cycle = " -> ".join(str(u) for u, _ in nx.find_cycle(self.dag))
            raise PassError(f"schedule: has a cycle: {cycle}")
        if num_stages != self.num_stages:
            raise PassError(f"schedule: is for {self.num_stages} stages, the program has "
                            f"{num_stages}")
        missing = sorted(map(str, _required(num_stages, self.num_microbatches, links,
                                            self.split_backward) - set(self.dag)))
        if missing:
            raise PassError(f"schedule: lacks actions {missing}")
        for a, needs in _dependencies(self.num_microbatches, links, num_stages,
                                      self.split_backward):
            if not nx.has_path(self.dag, needs, a):
                raise PassError(f"schedule: {a} does not wait for {needs}")

    def __str__(self) -> str:
        return "\n".join(f"# schedule stage {s}: " + " ".join(map(str, self.actions(s)))
                         for s in range(self.num_stages))


def _required(stages: int, mbs: int, links: set[tuple[int, int]], split: bool = False
              ) -> set[Action]:
    need = {Action(s, ActionKind.UPDATE) for s in range(stages)}
    kinds = (ActionKind.F, ActionKind.I, ActionKind.W) if split else (ActionKind.F, ActionKind.B)
    for m in range(mbs):
        need |= {Action(s, k, m) for s in range(stages) for k in kinds}
        for src, dst in links:
            need |= {Action(src, ActionKind.SEND_F, m), Action(dst, ActionKind.RECV_F, m),
                     Action(dst, ActionKind.SEND_B, m), Action(src, ActionKind.RECV_B, m)}
    return need


def _dependencies(mbs: int, links: set[tuple[int, int]], stages: int, split: bool = False
                  ) -> Iterable[tuple[Action, Action]]:
    """(action, what it must come after) for every data dependency. With `split`, I (input
    gradients) takes B's place on the path to the previous stage and W follows I."""
    A, K = Action, ActionKind
    grad = K.I if split else K.B  # the action that computes the gradients sent back
    for m in range(mbs):
        for s in range(stages):
            yield A(s, grad, m), A(s, K.F, m)  # the backward reads the forward's saved values
            if split:
                yield A(s, K.W, m), A(s, K.I, m)  # W reads what I stashed
            yield A(s, K.UPDATE), A(s, K.W if split else K.B, m)
        for src, dst in links:
            yield from ((A(src, K.SEND_F, m), A(src, K.F, m)),
                        (A(dst, K.RECV_F, m), A(src, K.SEND_F, m)),
                        (A(dst, K.F, m), A(dst, K.RECV_F, m)),
                        (A(dst, K.SEND_B, m), A(dst, grad, m)),
                        (A(src, K.RECV_B, m), A(dst, K.SEND_B, m)),
                        (A(src, grad, m), A(src, K.RECV_B, m)))


def build(order: dict[int, list[Action]], num_microbatches: int,
          links: set[tuple[int, int]], num_stages: int | None = None,
          split_backward: bool = False, stages_per_rank: int = 1) -> Schedule:
    """The schedule that runs each stage's (or, with virtual stages, each rank's) compute
    actions in `order` (the generator's choice) and adds the communication and data
    dependencies every schedule shares."""
    stages = len(order) if num_stages is None else num_stages
    dag = nx.DiGraph()
    for actions in order.values():
        dag.add_nodes_from(actions)
        nx.add_path(dag, actions, why="order")
    for action, needs in _dependencies(num_microbatches, links, stages, split_backward):
        dag.add_edge(needs, action, why="data")
    return Schedule(dag, stages, num_microbatches, split_backward, stages_per_rank)


def gpipe(num_stages: int, num_microbatches: int, links: set[tuple[int, int]]) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards, then its update."""
    K = ActionKind
    order = {s: [Action(s, K.F, m) for m in range(num_microbatches)]
             + [Action(s, K.B, m) for m in range(num_microbatches)] + [Action(s, K.UPDATE)]
             for s in range(num_stages)}
    return build(order, num_microbatches, links)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): stage s runs min(S-1-s, M) warm-up forwards, then alternates
    one forward and one backward, then drains its backwards; at most S-s microbatches in
    flight. glmc's own generator: torch 2.13's `Schedule1F1B._get_pipeline_order` emits
    forward M (one past the last microbatch) on the last rank and skips forward 0."""
    K, m = ActionKind, num_microbatches
    order = {}
    for s in range(num_stages):
        warm = min(num_stages - 1 - s, m)
        acts = [Action(s, K.F, i) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action(s, K.F, warm + i), Action(s, K.B, i)]
        acts += [Action(s, K.B, i) for i in range(m - warm, m)] + [Action(s, K.UPDATE)]
        order[s] = acts
    return build(order, m, {(s, s + 1) for s in range(num_stages - 1)})


#: glmc's schedule names -> torch.distributed.pipelining's schedule class
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                   "interleaved": "ScheduleInterleaved1F1B",
                   "zbh1": "ScheduleInterleavedZeroBubble"}


def from_torch(name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int = 1
               ) -> Schedule:
    """The schedule torch.distributed.pipelining generates under `name` (see
    `TORCH_SCHEDULES`): its per-rank compute order (`_get_pipeline_order` of the single-stage
    schedules, `_calculate_single_rank_operations` of the multi-stage ones; torch's bubbles
    (None) and REDUCE_GRAD dropped), as a glmc DAG with every send/receive and data edge, and
    one UPDATE per stage after its last backward. "zbh1" is torch's interleaved zero-bubble
    generator with one stage per rank (ZB-H1); "interleaved" needs `stages_per_rank` > 1."""
    if name == "1f1b":
        return one_f_one_b(num_ranks, num_microbatches)
    if name not in TORCH_SCHEDULES:
        raise ConfigError(f"schedule: unknown schedule {name!r}; use "
                          f"{', '.join(TORCH_SCHEDULES)}")
    if (stages_per_rank > 1) != (name == "interleaved"):
        raise ConfigError(f"schedule: {name} runs {'several stages' if name == 'interleaved' else 'one stage'} "
                          f"per rank, not {stages_per_rank}")
    stages = num_ranks * stages_per_rank
    torch_order = _torch_order(name, num_ranks, num_microbatches, stages_per_rank)
    kinds = {"F": ActionKind.F, "B": ActionKind.B, "I": ActionKind.I, "W": ActionKind.W}
    order = {}
    for rank, ops in torch_order.items():
        acts = [Action(op.stage_index, kinds[op.computation_type.value], op.microbatch_index)
                for op in ops if op is not None and op.computation_type.value in kinds]
        own = sorted({a.stage for a in acts})
        order[rank] = acts + [Action(s, ActionKind.UPDATE) for s in own]
    links = {(s, s + 1) for s in range(stages - 1)}
    return build(order, num_microbatches, links, stages, name == "zbh1", stages_per_rank)


def _torch_order(name: str, ranks: int, mbs: int, per_rank: int) -> dict[int, list]:
    """torch's generator, called on a stand-in for the schedule object: the generators read
    only these counts, and building the real schedule needs live PipelineStage objects."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as ts

    cls = getattr(ts, TORCH_SCHEDULES[name])
    if name == "gpipe":
        return cls._get_pipeline_order(SimpleNamespace(_num_stages=ranks, _n_microbatches=mbs))
    rounds = max(1, mbs // ranks)
    if mbs % rounds:
        raise ConfigError(f"schedule: {name} needs the microbatches ({mbs}) to be a multiple "
                          f"of the rounds ({rounds})")
    me = SimpleNamespace(n_local_stages=per_rank, pp_group_size=ranks, _n_microbatches=mbs,
                         number_of_rounds=rounds, microbatches_per_round=mbs // rounds)
    return {r: cls._calculate_single_rank_operations(me, r) for r in range(ranks)}


@dataclass(frozen=True)
class Timeline:
    """When each action runs: (rank, start, end) in seconds from the step's start."""

    spans: dict[Action, tuple[int, float, float]]
    num_ranks: int

    @property
    def makespan(self) -> float:
        return max((e for _, _, e in self.spans.values()), default=0.0) - \
            min((s for _, s, _ in self.spans.values()), default=0.0)

    def bubble(self) -> float:
        """Idle fraction of the ranks' compute time: 1 - busy / (ranks x makespan)."""
        busy = sum(e - s for a, (_, s, e) in self.spans.items() if a.kind in COMPUTE)
        span = self.makespan
        return 1.0 - busy / (self.num_ranks * span) if span > 0 else 0.0

    def in_flight(self, stage: int) -> int:
        """The most microbatches whose forward ran on `stage` and whose backward (B or W)
        has not finished: how many microbatches' activations the stage keeps at once."""
        events = []
        for a, (_, s, e) in self.spans.items():
            if a.stage == stage and a.kind is ActionKind.F:
                events.append((e, 1))
            elif a.stage == stage and a.kind in (ActionKind.B, ActionKind.I):
                events.append((e, -1))  # I frees the activations; W keeps only what I stashed
        level = peak = 0
        for _, d in sorted(events, key=lambda x: (x[0], x[1])):
            level += d
            peak = max(peak, level)
        return peak


COMPUTE = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W, ActionKind.UPDATE})


def simulate(schedule: Schedule, seconds: Callable[[Action], float]) -> Timeline:
    """The timeline the executor would produce if `seconds(action)` were exact: every rank
    runs `rank_actions` in order, each as soon as the rank is free and the actions it depends
    on have finished (a receive finishes when its send has)."""
    queues = [schedule.rank_actions(r) for r in range(schedule.num_ranks)]
    pos, free = [0] * len(queues), [0.0] * len(queues)
    spans: dict[Action, tuple[int, float, float]] = {}
    progressed = True
    while progressed:
        progressed = False
        for r, q in enumerate(queues):
            while pos[r] < len(q) and all(p in spans for p in schedule.dag.predecessors(q[pos[r]])):
                a = q[pos[r]]
                start = max([free[r], *(spans[p][2] for p in schedule.dag.predecessors(a))])
                spans[a] = (r, start, start + seconds(a))
                free[r], pos[r], progressed = spans[a][2], pos[r] + 1, True
    stuck = [str(q[p]) for p, q in zip(pos, queues) if p < len(q)]
    if stuck:
        raise PassError(f"schedule: deadlocks; the ranks wait at {stuck}")
    return Timeline(spans, schedule.num_ranks)


#: the inputs each action's graph takes over from the runner (`_StageRun`: the last backward
#: of a microbatch, the update), by action
CONSUMED = {"B": (Role.SAVED, Role.BOUNDARY, Role.GRADIENT), "U": (Role.GRADIENT,)}


CONSUMED["W"] = CONSUMED["B"]  # ZB-H1's W is the microbatch's last backward action


def fresh_gradients(graph: TrainGraph) -> frozenset[str]:
    """The gradient outputs of a backward `graph` that own their storage: made by an op of
    the graph (not a view of an input), dense (not expanded), sharing their storage with no
    other output. The runner sums later microbatches into them in place. Kept in `graph.meta`."""
    from glmc.ir.writeback import storage_key
    if FRESH_GRADIENTS in graph.meta:
        return graph.meta[FRESH_GRADIENTS]
    keys = [storage_key(v) if isinstance(v, fx.Node) else None for v in graph.output_values()]
    counts = Counter(keys)
    fresh = set()
    for spec, v, k in zip(graph.outputs, graph.output_values(), keys):
        val = v.meta.get("val") if isinstance(v, fx.Node) else None
        if spec.kind is OutputKind.GRADIENT and k is not None and counts[k] == 1 \
                and k[0].op == "call_function" and isinstance(val, torch.Tensor) \
                and dense(val):
            fresh.add(spec.target)
    graph.meta[FRESH_GRADIENTS] = frozenset(fresh)
    return graph.meta[FRESH_GRADIENTS]


def dense(t: torch.Tensor) -> bool:
    """True when `t`'s elements fill its storage span once each (no stride 0, no gaps, any
    order of dimensions): a tensor that can be summed into in place."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def i_only(i_graph: TrainGraph, w_graph: TrainGraph) -> list[tuple[Role, str]]:
    """The inputs of ZB-H1's I (saved values, cotangents) that its W does not read: I's run
    takes them along, so a microbatch keeps only W's part of its saved values until W."""
    needed = {(spec.role, spec.target) for spec in w_graph.inputs}
    return [(spec.role, spec.target) for spec in i_graph.inputs
            if spec.role in CONSUMED["B"] and (spec.role, spec.target) not in needed]


def predicted_peaks(program: StagedProgram) -> list[int]:
    """Per rank, the predicted peak bytes of one step of `program` under its schedule: the
    rank's parameters and optimizer state, plus, walking its actions in order, the saved
    activations of its in-flight microbatches (and ZB-H1's stash between I and W), the
    gradients accumulated so far and the running action's own transient bytes (glmc.analysis.memory's
    liveness simulation of the graph the action runs, above that graph's inputs; gradients
    summed in place add nothing, the second microbatch's sum of one that is not
    (`fresh_gradients`) adds the largest such gradient to what its backward leaves)."""
    sched = program.schedule
    mem = {st.index: _StageMemory.of(st) for st in program.stages}
    K = ActionKind
    peaks = []
    for r in range(sched.num_ranks):
        mine = [s for s in range(sched.num_stages) if sched.rank_of(s) == r]
        base = sum(mem[s].params + mem[s].state for s in mine)
        in_flight = dict.fromkeys(mine, 0)
        grads_live = dict.fromkeys(mine, 0)
        finished = dict.fromkeys(mine, 0)  # microbatches whose gradients are summed in
        peak = base
        for a in sched.rank_actions(r):
            s, m = a.stage, mem[a.stage]
            live = base + sum(in_flight.values()) + sum(grads_live.values())
            key = {K.F: "F", K.B: "B", K.I: "I", K.W: "W", K.UPDATE: "U"}.get(a.kind)
            if key is None:
                continue
            peak = max(peak, live + m.transient[key])
            if a.kind in (K.B, K.W) and finished[s] == 1:
                # the second microbatch's sums of gradients not summed in place are fresh
                # tensors, made one by one after its backward, beside the new and old ones
                peak = max(peak, live + m.ending[key] + m.largest_grad)
            finished[s] += a.kind in (K.B, K.W)
            if a.kind is K.F:
                in_flight[s] += m.saved
            elif a.kind is K.I:  # W's part of the saved values stays, with I's stash
                in_flight[s] += m.stash - m.i_frees
            elif a.kind in (K.B, K.W):  # the microbatch's last backward frees them
                in_flight[s] -= m.saved + (m.stash - m.i_frees if a.kind is K.W else 0)
                grads_live[s] = m.grads
            else:
                grads_live[s] = 0
        peaks.append(peak)
    return peaks


@dataclass
class _StageMemory:
    """One stage's bytes for `predicted_peaks`: its state, what a forward saves (with the
    received values it saves as they are), what ZB-H1's I stashes and frees of the saved
    values (`i_only`), each action's transient bytes above its graph's inputs and its bytes
    at its end (`ending`), and the largest gradient (`largest_grad`)."""

    params: int
    grads: int
    state: int
    saved: int
    stash: int
    i_frees: int
    transient: dict[str, int]
    ending: dict[str, int]  #: each action's bytes at its end above its inputs, as transient
    #: the largest gradient not summed in place (`fresh_gradients`): the second microbatch's
    #: accumulation (`_StageRun._accumulate`) allocates its sum fresh while the first gradient
    #: and the new one are live
    largest_grad: int = 0

    @classmethod
    def of(cls, st: Stage) -> "_StageMemory":
        from glmc.analysis.memory import simulate

        roots = _saved_roots(st)
        forward_roots = _saved_roots(st, forward_only=True)
        graphs = {"F": st.forward, "B": st.backward, "U": st.update}
        if st.split is not None:
            graphs.update(I=st.split[0], W=st.split[1])
        transient, left, ending = {}, {}, {}
        for key, g in graphs.items():
            # as run_inplace runs it: early write-back, and the inputs the action takes
            # along freed after their last read
            lowered = inplace_module(g).graph
            sizes = _taken_bytes(st, key, g, lowered, roots, forward_roots)
            est = simulate(lowered, consumed=list(sizes), input_bytes=sizes)
            # above all its inputs (the runner counts the taken ones until the action starts)
            transient[key] = est.transient_bytes - sum(sizes.values())
            left[key] = est.left_bytes
            ending[key] = est.left_bytes - sum(sizes.values())  # at its end, as transient
        sizes = {role: 0 for role in Role}
        largest = 0
        fresh = fresh_gradients(st.backward if st.split is None else st.split[1])
        for spec, ph in zip(st.update.inputs, st.update.placeholders()):
            info = st.update.info(ph).spec
            sizes[spec.role] += info.nbytes if info is not None else 0
            if spec.role is Role.GRADIENT and info is not None and spec.target not in fresh:
                largest = max(largest, info.nbytes)
        return cls(sizes[Role.PARAMETER], sizes[Role.GRADIENT], sizes[Role.OPTIMIZER_STATE],
                   left["F"] + _saved_received(st, forward_roots), left.get("I", 0),
                   _i_frees(st),
                   transient, ending, largest)


def _taken_bytes(st: Stage, key: str, g: TrainGraph, lowered: fx.Graph,
                 roots: dict[str, fx.Node], forward_roots: dict[str, fx.Node]
                 ) -> dict[fx.Node, int]:
    """The placeholders of action `key`'s lowered graph that the runner hands over (frees
    after their last read), with the bytes each frees there. Saved values that are views of
    one storage free it once, at the alias read last; a view of a parameter or a batch input
    frees nothing (not taken); ZB-H1's I does not free a storage W still reads through
    another alias."""
    from glmc.analysis.memory import storage_bytes

    phs = [n for n in lowered.nodes if n.op == "placeholder"]
    keys, kept = set(), set()  # ZB-H1's I: what it takes along, the storages W still reads
    if key == "I" and st.split is not None:
        keys = set(i_only(*st.split))
        kept = {roots.get(spec.target) for spec in st.split[1].inputs
                if spec.role is Role.SAVED} - {None}
    views = {t for t, root in forward_roots.items()
             if root.op == "placeholder"}  # saved views of parameters, batch inputs
    taken = [(ph, spec) for ph, spec in zip(phs, g.inputs)
             if (spec.role in CONSUMED.get(key, ()) or (spec.role, spec.target) in keys)
             and spec.target not in views
             and not (spec.role is Role.SAVED and roots.get(spec.target) in kept)]
    order = {n: i for i, n in enumerate(lowered.nodes)}
    groups: dict[Any, list[fx.Node]] = {}
    for ph, spec in taken:
        root = roots.get(spec.target) if spec.role is Role.SAVED else None
        groups.setdefault(root if root is not None else ph, []).append(ph)
    sizes = dict.fromkeys((ph for ph, _ in taken), 0)
    for aliases in groups.values():
        last = max(aliases, key=lambda ph: max((order[u] for u in ph.users), default=order[ph]))
        sizes[last] = storage_bytes(last.meta.get("val"))
    return sizes


def _saved_received(st: Stage, forward_roots: dict[str, fx.Node]) -> int:
    """Bytes of the received values a forward saves as they are (a saved alias of a boundary
    input): the runner keeps them until the microbatch's last backward, and the forward's
    `left` (new values only) does not count them."""
    from glmc.analysis.memory import storage_bytes
    received = {ph for ph, spec in zip(st.forward.placeholders(), st.forward.inputs)
                if spec.role is Role.BOUNDARY}
    saved = set(forward_roots.values()) & received
    return sum(storage_bytes(ph.meta.get("val")) for ph in saved)


def _saved_roots(st: Stage, forward_only: bool = False) -> dict[str, fx.Node]:
    """By saved target (the forward's, and ZB-H1's I stash), the node whose storage it is a
    view of (`alias_root`): targets sharing a root share their storage."""
    from glmc.ir.writeback import alias_root
    graphs = [st.forward] + ([st.split[0]] if st.split is not None and not forward_only
                             else [])
    return {spec.target: alias_root(v) for g in graphs
            for spec, v in zip(g.outputs, g.output_values())
            if spec.kind is OutputKind.SAVED and isinstance(v, fx.Node)}


def _i_frees(st: Stage) -> int:
    """Bytes ZB-H1's I frees of a microbatch's saved values: each storage the forward saves
    (views of one value share it) whose every saved alias W does not read."""
    from glmc.analysis.memory import storage_bytes
    from glmc.ir.writeback import alias_root
    if st.split is None:
        return 0
    mine = {target for role, target in i_only(*st.split) if role is Role.SAVED}
    roots: dict[fx.Node, list[str]] = {}
    for spec, v in zip(st.forward.outputs, st.forward.output_values()):
        if spec.kind is OutputKind.SAVED and isinstance(v, fx.Node):
            roots.setdefault(alias_root(v), []).append(spec.target)
    return sum(storage_bytes(root.meta.get("val")) for root, targets in roots.items()
               if root.op != "placeholder" and all(t in mine for t in targets))
