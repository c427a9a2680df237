"""`partition`: choose where to cut a step into pipeline stages, by predicted cost.

Guarantees: the step is not rewritten (the pass plans; `glmc.parallel.pipeline` applies the
plan by capturing each stage of the module, `glmc.trace.stages.capture_stage`). The plan cuts the
forward between *layer-granular blocks* — an item of the model's list of layers (`blocks.0`,
or nested as in transformers, `model.layers.0`), or a module at that list's depth (`embed`,
`head`; `model.embed_tokens`, `lm_head`): `block_names` — in the order the forward first
uses them, into `stages` contiguous groups, minimising the predicted time of the slowest stage
(forward + backward + its parameters' update, from the cost model's node times, per stage's
device profile) and, among equally slow cuts, the bytes sent across cuts. Dynamic programming
over the blocks' topological order: O(stages x blocks^2).

    step (GLM tiny)  ->  plan: stage 0 = embed, blocks.0   | x [4, 32, 64] ->
                             stage 1 = blocks.1, norm, head (+ loss);  imbalance 1.03

Node times are grouped by module path (forward: `NodeInfo.module`; backward: the forward
module AOTAutograd recorded); nodes of no block (the loss, glue) count on the last block; the
update time is split over blocks by parameter count. Memory per stage: its state (parameters,
gradients, optimizer state) plus its saved activations times the microbatches the schedule
keeps in flight on it (`glmc.planning.schedule.Timeline.in_flight`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from glmc.analysis.cost import get_profile
from glmc.analysis.predict import predict
from glmc.compiler.passmanager import Need, Pass, PassContext, PassResult
from glmc.errors import ConfigError, PassError
from glmc.ir.blocks import block_names, owner, step_blocks  # noqa: F401 (their API)
from glmc.ir.graph import Phase, Role, TrainGraph
from glmc.planning.schedule import Action, ActionKind, from_torch, simulate

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbh1")
LINK_BYTES_PER_S = 5e9  #: boundary transfer rate assumed when comparing cuts (host memory)


# ---- the plan (data) ---------------------------------------------------------------------------

@dataclass(frozen=True)
class BlockCost:
    name: str
    seconds: tuple[float, float, float]  #: forward, backward, update (one full batch)
    state_bytes: int  #: parameters + gradients + optimizer state
    saved_bytes: int  #: forward values the backward reads (one full batch)
    out_bytes: int  #: forward values read after the block (what a cut after it sends)


@dataclass(frozen=True)
class StagePlan:
    blocks: tuple[str, ...]
    seconds: float  #: forward + backward + update, one full batch, on its profile
    forward_s: float
    backward_s: float
    update_s: float
    state_bytes: int
    saved_bytes_per_microbatch: int
    in_flight: int  #: microbatches whose activations the schedule keeps at once
    send_bytes: int  #: per microbatch, to the next stage
    profile: str
    #: before the update: the gradients' synchronisation on the link (data-parallel replicas,
    #: tied copies on other stages; `with_sync`), part of `seconds`
    sync_s: float = 0.0

    @property
    def peak_bytes(self) -> int:
        return self.state_bytes + self.in_flight * self.saved_bytes_per_microbatch


@dataclass(frozen=True)
class PartitionPlan:
    """The chosen cut (first block of each stage after the first) and what it predicts."""

    blocks: tuple[str, ...]
    cut: tuple[int, ...]
    stages: tuple[StagePlan, ...]
    schedule: str
    microbatches: int
    bubble: float  #: predicted idle fraction of the schedule on these stage times
    equal_imbalance: float  #: imbalance of an equal split of blocks, for comparison
    notes: tuple[str, ...] = field(default=())
    timeline: Any = None  #: the predicted schedule (glmc.planning.schedule.Timeline), if simulated
    link: dict | None = None  #: the link transfers were priced on (LinkProfile.to_dict)

    @property
    def imbalance(self) -> float:
        """Slowest stage over the mean stage."""
        times = [s.seconds for s in self.stages]
        return max(times) / (sum(times) / len(times)) if sum(times) > 0 else 1.0

    def report_section(self, ctx: Any) -> Any:
        from glmc.compiler.report_parts import ReportSection, Table, Text, mib, ms
        rows = [(str(i), ", ".join(s.blocks), s.profile, ms(s.forward_s), ms(s.backward_s),
                 ms(s.update_s), ms(s.seconds), str(s.in_flight), mib(s.peak_bytes),
                 mib(s.send_bytes)) for i, s in enumerate(self.stages)]
        return ReportSection("Pipeline partition", (
            Text(f"{len(self.stages)} stages, {self.microbatches} microbatches, schedule "
                 f"{self.schedule}; imbalance (max/mean) {self.imbalance:.3f} (equal split of "
                 f"blocks: {self.equal_imbalance:.3f}); predicted bubble {self.bubble:.1%}."),
            Table(("stage", "blocks", "profile", "F", "B", "update", "total", "in flight",
                   "peak", "sends/mb"), tuple(rows))))


# ---- the solver (plain data) -------------------------------------------------------------------

def balanced_cut(times: Sequence[Sequence[float]], cut_cost: Sequence[float], stages: int
                 ) -> tuple[int, ...]:
    """Split blocks 0..n-1 into `stages` contiguous non-empty groups. `times[s][b]`: block b's
    time on stage s's device; `cut_cost[b]`: cost of cutting after block b (added to the
    sending stage). Minimises the slowest stage, then the summed cut cost. Returns the first
    block of stages 1.. ."""
    n = len(times[0])
    if not 1 <= stages <= n:
        raise ConfigError(f"partition: {stages} stages need at least as many blocks; the step "
                          f"has {n}")
    pre = np.zeros((stages, n + 1))  # pre[s, j]: blocks [0, j) on stage s's device
    pre[:, 1:] = np.cumsum(np.asarray(times, dtype=float), axis=1)
    cost = np.asarray(cut_cost, dtype=float)
    send = np.concatenate(([0.0], cost[:n - 1], [0.0]))  # a stage ending before block j sends
    before = np.concatenate(([np.inf], cost))  # cutting before block i
    # top, spent [s, j]: (bottleneck, total cut cost) placing blocks [0, j) on stages [0, s],
    # compared as the tuples they are (the first of equals kept); a column per end j, a row
    # per first block i of stage s
    top = np.full((stages, n + 1), np.inf)
    spent = np.full((stages, n + 1), np.inf)
    arg = np.zeros((stages, n + 1), dtype=np.int64)
    top[0, 1:] = pre[0, 1:] + send[1:]
    spent[0, 1:] = 0.0
    ends = np.arange(n + 1)
    for s in range(1, stages):
        neck = np.maximum(top[s - 1][:, None], pre[s][None, :] - pre[s][:, None] + send)
        neck[(ends[:, None] < s) | (ends[:, None] >= ends[None, :])] = np.inf
        paid = spent[s - 1] + before
        low = neck.min(axis=0)
        k = np.argmin(np.where(neck == low, paid[:, None], np.inf), axis=0)
        cols = ends[s + 1:]
        top[s, cols], spent[s, cols], arg[s, cols] = low[cols], paid[k[cols]], k[cols]
    cut, j = [], n
    for s in range(stages - 1, 0, -1):
        j = int(arg[s, j])
        cut.append(j)
    return tuple(reversed(cut))


# ---- costing the blocks of a captured step -----------------------------------------------------

def _module_of(n: Any, info: Any) -> str | None:
    if info.phase is Phase.FORWARD:
        return info.module
    from glmc.trace.step import _module_path  # the recorded forward module of a backward node
    return _module_path(n.meta.get("fwd_nn_module_stack"))


def block_costs(graph: TrainGraph, profile: Any = None, traits: Any = None,
                repeat: int = 1) -> list[BlockCost]:
    """Forward, backward and update seconds, state and activation bytes of every block.
    `repeat`: the graph is of one microbatch and the step runs it that many times (forward,
    backward and activations scale by it, per-op overheads included; the update does not)."""
    blocks = step_blocks(graph)
    kw = {"traits": traits} if traits is not None else {}
    node_s = predict(graph, profile=profile, **kw).time.node_seconds
    secs = {b: [0.0, 0.0, 0.0] for b in blocks}
    saved = dict.fromkeys(blocks, 0)
    out = dict.fromkeys(blocks, 0)
    update = 0.0
    for n in graph.compute_nodes():
        info = graph.info(n)
        t = node_s.get(n.name, 0.0)
        if info.phase is Phase.OPTIMIZER:
            update += t
            continue
        if info.phase not in (Phase.FORWARD, Phase.BACKWARD):
            continue
        b = owner(_module_of(n, info), blocks) or blocks[-1]  # glue and loss: the last block
        secs[b][0 if info.phase is Phase.FORWARD else 1] += t
        if info.phase is Phase.FORWARD and info.spec is not None:
            size = info.spec.nbytes
            users = [graph.info(u) for u in n.users if u.op == "call_function"]
            if any(u.phase is Phase.BACKWARD for u in users):
                saved[b] += size
            if any(u.phase is Phase.FORWARD and owner(u.module, blocks) not in (b, None)
                   for u in users):
                out[b] += size
    params, state = _state_bytes(graph, blocks)
    total = sum(params.values()) or 1
    return [BlockCost(b, (secs[b][0] * repeat, secs[b][1] * repeat,
                          update * params[b] / total), state[b], saved[b] * repeat,
                      out[b] * repeat) for b in blocks]


def _state_bytes(graph: TrainGraph, blocks: Sequence[str]) -> tuple[dict, dict]:
    params, state = dict.fromkeys(blocks, 0), dict.fromkeys(blocks, 0)
    named = block_names(s.target for s in graph.inputs if s.role is Role.PARAMETER)
    for spec, ph in zip(graph.inputs, graph.placeholders()):
        t = graph.info(ph).spec
        if t is None or spec.role not in (Role.PARAMETER, Role.OPTIMIZER_STATE):
            continue
        name = spec.target.split(":", 1)[-1]
        b = owner(name, blocks) or named.get(name)
        if b not in params:
            continue
        size = t.nbytes
        if spec.role is Role.PARAMETER:
            params[b] += size
            state[b] += 2 * size  # the parameter and its gradient
        else:
            state[b] += size
    return params, state


# ---- the pass ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class PartitionPass(Pass):
    """Plans a pipeline: `partition{stages=2,microbatches=4,schedule=1f1b}`. `profiles`:
    one device profile per stage, `;`-separated (`h100;kunpeng920`), for heterogeneous
    stages (the cut balances predicted time, not FLOPs); empty: the context's profile.
    `virtual`: stages per rank (interleaved only). Leaves the graph unchanged; the plan is the
    pass's stats and `graph.meta["partition"]`."""

    name = "partition"
    stages: int = 2
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual: int = 1
    profiles: str = ""
    link: Any = ""  #: glmc.analysis.comm link between stages (name, figures or a LinkProfile); empty:
    #: transfers are free in the predicted schedule
    microbatch_graph: bool = False  #: the graph is of one microbatch (see plan_partition)

    def needs(self) -> frozenset[Need]:
        return frozenset({Need.STEP})

    def run(self, graph: TrainGraph, ctx: PassContext) -> PassResult:
        if self.schedule not in SCHEDULES:
            raise PassError(f"partition: unknown schedule {self.schedule!r}; use "
                            f"{', '.join(SCHEDULES)}")
        if self.microbatches < 1 or self.stages < 1:
            raise PassError("partition: stages and microbatches must be positive")
        from glmc.analysis.comm import get_link
        plan = plan_partition(graph, self.stages, self.microbatches, self.schedule,
                              self._profiles(ctx), ctx.traits, self.virtual,
                              get_link(self.link) if self.link else None,
                              self.microbatch_graph)
        graph.meta["partition"] = plan
        return PassResult(False, plan)

    def _profiles(self, ctx: PassContext) -> list[Any]:
        names = [p for p in self.profiles.split(";") if p]
        if names and len(names) != self.stages:
            raise PassError(f"partition: {len(names)} profiles for {self.stages} stages; give "
                            "one per stage")
        return names or [ctx.profile] * self.stages


def plan_partition(graph: TrainGraph, stages: int, microbatches: int, schedule: str = "1f1b",
                   profiles: Sequence[Any] | None = None, traits: Any = None,
                   virtual: int = 1, link: Any = None,
                   microbatch_graph: bool = False, cut: Sequence[int] | str | None = None
                   ) -> PartitionPlan:
    """The cost-balanced plan for `graph` (see the module docstring). `link`: the link
    between neighbouring stages (glmc.analysis.comm; e.g. this host's, measured): boundary transfers
    then take time in the predicted schedule (a send its call cost, a receive the latency and
    bytes / bandwidth after its send); without one they are free. `microbatch_graph`:
    `graph` is the step on one microbatch (the accurate input: per-op overheads are paid per
    microbatch); otherwise the full batch, its forward and backward split evenly. `cut`: the
    first block of each stage after the first, or "equal" (an equal split of blocks), to
    predict a given cut instead of choosing one (e.g. to compare against glmc's)."""
    profiles = list(profiles or [None] * stages)
    by_profile = {}
    for p in profiles:
        key = getattr(get_profile(p), "name", str(p))
        if key not in by_profile:
            by_profile[key] = block_costs(graph, p, traits,
                                          microbatches if microbatch_graph else 1)
    keys = [getattr(get_profile(p), "name", str(p)) for p in profiles]
    costs = [by_profile[k] for k in keys]
    names = tuple(c.name for c in costs[0])
    times = [[sum(c.seconds) for c in cs] for cs in costs]
    send = [c.out_bytes / microbatches / LINK_BYTES_PER_S for c in costs[0]]
    if cut is None:
        cut = balanced_cut(times, send, stages)
    elif cut == "equal":
        cut = tuple(_equal_bounds(len(names), stages)[1:-1])
    cut = tuple(cut)
    if len(cut) != stages - 1 or list(cut) != sorted(set(cut)) or \
            not all(0 < c < len(names) for c in cut):
        raise ConfigError(f"partition: cut {cut} does not split {len(names)} blocks into "
                          f"{stages} non-empty stages")
    bounds = list(zip((0, *cut), (*cut, len(names))))
    plans = [_stage_plan(costs[s][i:j], microbatches, keys[s]) for s, (i, j) in enumerate(bounds)]
    timeline = _timeline(plans, schedule, microbatches, virtual, link)
    if timeline is not None:
        plans = [_with_in_flight(p, timeline.in_flight(s)) for s, p in enumerate(plans)]
    eq = _equal_imbalance(times, stages)
    return PartitionPlan(names, cut, tuple(plans), schedule, microbatches,
                         timeline.bubble() if timeline else 0.0, eq, timeline=timeline,
                         link=link.to_dict() if link is not None else None)


def with_sync(plan: PartitionPlan, sync_s: Sequence[float], virtual: int = 1,
              link: Any = None) -> PartitionPlan:
    """`plan` with each stage's gradient synchronisation before its update (`sync_s[s]`
    seconds: the all-reduce over data-parallel replicas or ZeRO-1's reduce-scatter and
    all-gather, the tied copies' all-reduce) in its predicted time, the schedule simulated
    again."""
    import dataclasses
    plans = [dataclasses.replace(p, sync_s=t, seconds=p.seconds - p.sync_s + t)
             for p, t in zip(plan.stages, sync_s)]
    timeline = _timeline(plans, plan.schedule, plan.microbatches, virtual, link)
    return dataclasses.replace(plan, stages=tuple(plans), timeline=timeline,
                               bubble=timeline.bubble() if timeline else plan.bubble)


def _stage_plan(blocks: Sequence[BlockCost], mbs: int, profile: str) -> StagePlan:
    f, b, u = (sum(c.seconds[k] for c in blocks) for k in range(3))
    return StagePlan(tuple(c.name for c in blocks), f + b + u, f, b, u,
                     sum(c.state_bytes for c in blocks),
                     sum(c.saved_bytes for c in blocks) // mbs, mbs,
                     blocks[-1].out_bytes // mbs, profile)


def _with_in_flight(p: StagePlan, k: int) -> StagePlan:
    import dataclasses
    return dataclasses.replace(p, in_flight=k)


def _timeline(plans: Sequence[StagePlan], schedule: str, mbs: int, virtual: int,
              link: Any = None) -> Any:
    """The schedule simulated on per-microbatch stage times (and boundary transfers on
    `link`); None for interleaved stages whose count is not a multiple of the virtual stages
    per rank."""
    if len(plans) % virtual or (schedule == "interleaved") != (virtual > 1):
        return None
    sched = from_torch(schedule, len(plans) // virtual, mbs, virtual)
    return simulate(sched, action_seconds(plans, mbs, link))


def action_seconds(plans: Sequence[StagePlan], mbs: int, link: Any = None) -> Any:
    """Predicted seconds of each action of a schedule over `plans`' stages: compute from the
    stage's predicted times per microbatch; a send costs the link's call cost (the transfer
    is asynchronous); a receive the latency plus the bytes over the bandwidth (it starts when
    its send has been issued); transfers are free without a link. The activation gradient
    sent back has the activation's size."""
    K = ActionKind

    def seconds(a: Action) -> float:
        p = plans[a.stage]
        if a.kind is K.UPDATE:
            return p.update_s + p.sync_s
        compute = {K.F: p.forward_s, K.B: p.backward_s, K.I: p.backward_s / 2,
                   K.W: p.backward_s / 2}
        if a.kind in compute:
            return compute[a.kind] / mbs
        if link is None:
            return 0.0
        if a.kind in (K.SEND_F, K.SEND_B):
            return link.call_s
        nbytes = plans[a.stage - 1].send_bytes if a.kind is K.RECV_F else p.send_bytes
        return link.latency_s + nbytes / link.bandwidth
    return seconds


def _equal_bounds(n: int, stages: int) -> list[int]:
    return [round(n * s / stages) for s in range(stages + 1)]


def _equal_imbalance(times: Sequence[Sequence[float]], stages: int) -> float:
    bounds = _equal_bounds(len(times[0]), stages)
    per = [sum(times[s][bounds[s]:bounds[s + 1]]) for s in range(stages)]
    return max(per) / (sum(per) / stages) if sum(per) > 0 and all(per) else float("inf")
