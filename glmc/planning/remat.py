"""Rematerialization planning: which forward values to keep for the backward, which to recompute.

The problem is stated over *units* — forward values that own storage (views, and on a fusing
backend the pointwise ops it inlines, are transparent) — on the step's node order:

* a unit is produced at `produced`, read by the forward until `last_fwd`, and read by the
  backward at `bwd_reads` (node indices); `inputs` are the units it is computed from;
* a plan is a set R of recomputed units. A recomputed unit's copy is made right before the
  first backward node that needs it — directly, or through the copy of a recomputed consumer —
  and lives until its last such use (one copy per unit, shared by later readers). Every other
  unit that is read by the backward, or by a recomputed unit, is *stored*: it stays alive from
  the forward until its last (direct or recompute) use;
* the memory at node t is the baseline liveness (no recompute) with every unit's post-forward
  lifetime replaced by what the plan makes of it. `evaluate()` computes it exactly for this
  model; the glmc recompute pass checks the result against the full liveness simulation of
  the rewritten graph;
* with `multiplicity` k > 1 (a pipeline stage whose schedule keeps k microbatches in flight),
  the stored units of k - 1 other microbatches are live throughout: every stored unit counts
  k - 1 more times at every node.

Solvers: `greedy` (repeatedly recompute the unit with the best bytes-freed-at-the-peak per
second of recompute, checked exactly; fast, used for large graphs) and `milp` (exact for the
model: a mixed-integer program over keep/recompute binaries with continuous liveness variables
at a set of time points, grown by constraint generation until `evaluate()` agrees; solved by
HiGHS through `scipy.optimize.milp` under a time limit).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np


@dataclass(frozen=True)
class Unit:
    name: str
    size: int
    cost: float  #: predicted seconds to recompute
    produced: int
    last_fwd: int  #: last forward read (>= produced)
    bwd_reads: tuple[int, ...]  #: node indices of backward reads, sorted
    inputs: tuple[int, ...]  #: indices of the units it is computed from
    recomputable: bool = True
    source: str | None = None
    #: recomputed under selective recomputation (`selective`): a recomputable value cheap to
    #: make again for the bytes it holds (`glmc.analysis.opcost.selective_keeps`)
    selective: bool = False
    #: recomputed under full recomputation (`full`): a recomputable value made inside one of
    #: the model's layers that the layer does not hand on (Megatron-LM's full activation
    #: recomputation: each layer keeps its input, its backward runs its forward again)
    full: bool = False

    @property
    def needed(self) -> bool:
        return bool(self.bwd_reads)


@dataclass
class Problem:
    units: list[Unit]
    base: np.ndarray  #: baseline live bytes after each node (no recompute)
    persistent: int = 0
    multiplicity: int = 1  #: microbatches whose stored units are live at once
    consumers: list[list[int]] = field(init=False)
    fixed: np.ndarray = field(init=False)  #: baseline minus every unit's post-forward life

    def __post_init__(self) -> None:
        self.base = np.asarray(self.base, dtype=np.int64)
        self.consumers = [[] for _ in self.units]
        for i, u in enumerate(self.units):
            for j in u.inputs:
                self.consumers[j].append(i)
        delta = np.zeros(len(self.base) + 1, dtype=np.int64)
        for u in self.units:
            if u.needed and u.bwd_reads[-1] > u.last_fwd:
                delta[u.last_fwd + 1] -= u.size
                delta[u.bwd_reads[-1] + 1] += u.size
        self.fixed = self.base + np.cumsum(delta)[:-1]

    @property
    def n(self) -> int:
        return len(self.base)


@dataclass
class Plan:
    recompute: frozenset[int]
    peak: int
    peak_at: int
    cost: float
    solver: str
    seconds: float = 0.0
    gap: float | None = None  #: relative optimality gap reported by the MILP solver
    notes: list[str] = field(default_factory=list)


def closure(p: Problem, recompute: Iterable[int]) -> frozenset[int]:
    """Drop recomputed units nobody needs (no backward read, no recomputed consumer)."""
    r = set(recompute)
    changed = True
    while changed:
        changed = False
        for i in list(r):
            if not p.units[i].needed and not any(c in r for c in p.consumers[i]):
                r.discard(i)
                changed = True
    return frozenset(r)


def creation_times(p: Problem, r: frozenset[int]) -> dict[int, int]:
    """When each recomputed unit's copy is made (units in reverse production order)."""
    made: dict[int, int] = {}
    for i in sorted(r, key=lambda i: -p.units[i].produced):
        u = p.units[i]
        t = u.bwd_reads[0] if u.bwd_reads else p.n
        for c in p.consumers[i]:
            if c in made:
                t = min(t, made[c])
        made[i] = t
    return made


def timeline(p: Problem, recompute: Iterable[int]) -> np.ndarray:
    r = frozenset(recompute)
    made = creation_times(p, r)
    delta = np.zeros(p.n + 1, dtype=np.int64)
    for i, u in enumerate(p.units):
        last = u.bwd_reads[-1] if u.bwd_reads else -1
        for c in p.consumers[i]:
            if c in made:
                last = max(last, made[c])
        if i in r:
            start = made[i]
        elif u.needed or last >= 0:
            start = u.last_fwd + 1  # stored: lives on past the forward
        else:
            continue
        if last >= start:
            delta[start] += u.size
            delta[last + 1] -= u.size
    out = p.fixed + np.cumsum(delta)[:-1]
    if p.multiplicity > 1:  # the other in-flight microbatches' stored units, throughout
        out += (p.multiplicity - 1) * stored_bytes(p, r)
    return out


def stored_bytes(p: Problem, recompute: Iterable[int]) -> int:
    """Bytes of one microbatch's units kept past the forward (read by the backward, or by a
    recomputed unit, and not recomputed themselves)."""
    r = frozenset(recompute)
    return sum(u.size for i, u in enumerate(p.units) if i not in r and
               (u.needed or any(c in r for c in p.consumers[i])))


def evaluate(p: Problem, recompute: Iterable[int]) -> tuple[int, int]:
    """(peak bytes, node index of the peak) of a plan."""
    tl = timeline(p, recompute)
    at = int(np.argmax(tl))
    return int(tl[at]), at


def plan_cost(p: Problem, r: Iterable[int]) -> float:
    return float(sum(p.units[i].cost for i in r))


# ---- greedy -----------------------------------------------------------------------------------


def _move(p: Problem, r: frozenset[int], i: int) -> frozenset[int]:
    """Recompute unit i; inputs that would otherwise be kept only for it are recomputed too
    when they can be (chains of cheap ops), else kept."""
    new = set(r) | {i}
    stack = [i]
    while stack:
        k = stack.pop()
        for j in p.units[k].inputs:
            uj = p.units[j]
            if j in new or uj.needed or not uj.recomputable:
                continue
            new.add(j)
            stack.append(j)
    return frozenset(new)


def greedy(p: Problem, target: int | None, top_k: int = 6, deadline: float | None = None) -> Plan:
    """Recompute, one move at a time, the stored unit live at the current peak with the best
    (peak reduction) / (recompute seconds), until the peak is within `target` (None: until no
    move lowers it: the smallest peak this heuristic reaches)."""
    start = time.perf_counter()
    r: frozenset[int] = frozenset()
    peak, at = evaluate(p, r)
    tried_out: set[int] = set()
    while target is None or peak > target:
        if deadline is not None and time.perf_counter() > deadline:
            break
        cands = []
        for i, u in enumerate(p.units):
            if i in r or i in tried_out or not u.recomputable or not u.needed:
                continue
            # kept, and live at the peak (every stored unit is, with other microbatches')
            if p.multiplicity > 1 or u.last_fwd < at <= u.bwd_reads[-1]:
                cands.append((u.size / (u.cost + 1e-9), i))
        if not cands:
            break
        cands.sort(reverse=True)
        best = None
        for _, i in cands[:top_k]:
            m = closure(p, _move(p, r, i))
            pk, pat = evaluate(p, m)
            gain = peak - pk
            extra = plan_cost(p, m) - plan_cost(p, r)
            if gain > 0:
                score = gain / (extra + 1e-9)
                if best is None or score > best[0]:
                    best = (score, m, pk, pat)
            else:
                tried_out.add(i)
        if best is None:
            continue
        _, r, peak, at = best
        tried_out.clear()
    return Plan(r, peak, at, plan_cost(p, r), "greedy", time.perf_counter() - start)


def selective(p: Problem) -> Plan:
    """Selective recomputation (Korthikanti et al. 2022): every unit marked `selective`
    (pointwise ops, norms, softmax: cheap per byte) made again in the backward from the kept
    outputs of matmuls, attention, collectives and random ops; no search, no budget."""
    return _rule(p, "selective")


def full(p: Problem) -> Plan:
    """Full recomputation (Megatron-LM's): every unit marked `full` (all a layer makes but
    what it hands on, random ops and collectives aside) made again in the layer's backward
    from its input; no search, no budget."""
    return _rule(p, "full")


def _rule(p: Problem, flag: str) -> Plan:
    start = time.perf_counter()
    r = closure(p, (i for i, u in enumerate(p.units) if getattr(u, flag)))
    peak, at = evaluate(p, r)
    return Plan(r, peak, at, plan_cost(p, r), flag, time.perf_counter() - start)


# ---- MILP -------------------------------------------------------------------------------------


def milp(p: Problem, target: int | None, time_limit: float = 30.0,
         rounds: int = 12) -> Plan | None:
    """Exact for the model. Minimizes recompute seconds subject to memory <= target at the
    time points in T (target None: minimizes the peak first, then seconds); T starts at the
    baseline peak and grows with the plan's true peak until `evaluate` agrees. Returns None
    when scipy is missing or the solver gives up within `time_limit`."""
    try:
        from scipy.optimize import Bounds, LinearConstraint
        from scipy.optimize import milp as scipy_milp
        from scipy.sparse import coo_matrix
    except ImportError:
        return None
    start = time.perf_counter()
    first_bwd = min((u.bwd_reads[0] for u in p.units if u.needed), default=p.n - 1)
    points = {int(np.argmax(p.base)), first_bwd}
    best: Plan | None = None
    gap = None
    for _ in range(rounds):
        left = time_limit - (time.perf_counter() - start)
        if left <= 0:
            break
        sol = _solve(p, sorted(points), target, left, scipy_milp, Bounds, LinearConstraint,
                     coo_matrix)
        if sol is None:
            break
        r, gap = sol
        r = closure(p, r)
        peak, at = evaluate(p, r)
        plan = Plan(r, peak, at, plan_cost(p, r), "milp", time.perf_counter() - start, gap)
        if target is not None and peak <= target or target is None and at in points:
            best = plan
            break
        if at in points:  # cannot happen for an exact model; keep the plan and stop
            best = plan
            break
        points.add(at)
    if best is not None:
        best.seconds = time.perf_counter() - start
        best.notes.append(f"{len(points)} time points")
    return best


class _Milp:
    """The recompute MILP: its variable layout and its constraint rows, one family per method.

    Variables: r_i (binary), s_i (binary), then per time point t: made[i,t] (copy made at or
    before t), prev[i,t] (made before t), live[i,t], kept[i,t] (continuous in [0, 1]; made/prev
    are pinned to exact 0/1 values by the binaries, live/kept are pushed to their lower bounds),
    then M (peak). Rows are collected as COO triplets so the sparse matrix is built once."""

    def __init__(self, p: Problem, points: list[int]) -> None:
        self.p, self.points = p, points
        self.n_u = n_u = len(p.units)
        self.R0, self.S0 = 0, n_u
        self.base = 2 * n_u
        self.nvar = self.base + 4 * n_u * len(points) + 1
        self.M = self.nvar - 1
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.row = 0

    def made(self, i: int, k: int) -> int:
        return self.base + (4 * k) * self.n_u + i

    def prev(self, i: int, k: int) -> int:
        return self.base + (4 * k + 1) * self.n_u + i

    def live(self, i: int, k: int) -> int:
        return self.base + (4 * k + 2) * self.n_u + i

    def kept(self, i: int, k: int) -> int:
        return self.base + (4 * k + 3) * self.n_u + i

    def add(self, coefs: dict[int, float], lower: float, upper: float) -> None:
        for c, v in coefs.items():
            self.rows.append(self.row)
            self.cols.append(c)
            self.vals.append(v)
        self.lo.append(lower)
        self.hi.append(upper)
        self.row += 1

    def add_units(self) -> None:
        """What holds whatever the time: a needed unit is kept or recomputed, and a recompute
        reads inputs that exist (kept or recomputed themselves)."""
        R0, S0 = self.R0, self.S0
        for i, u in enumerate(self.p.units):
            if u.needed:
                self.add({R0 + i: 1, S0 + i: 1}, 1, np.inf)  # available to the backward
            for j in u.inputs:
                self.add({S0 + j: 1, R0 + j: 1, R0 + i: -1}, 0, np.inf)  # inputs exist

    def add_point(self, k: int, t: int) -> None:
        """The rows of time point t (the k-th): when each copy exists, what is live, and the
        memory bound, in this order per unit and then the memory row."""
        for i, u in enumerate(self.p.units):
            self._add_made(i, u, k, t)
            if u.produced <= t:
                self._add_live(i, u, k, t)
        self._add_memory(k, t)

    def _add_made(self, i: int, u: Unit, k: int, t: int) -> None:
        # made[i,t] = r_i and (read directly by t, or a consumer's copy made by t): the copy
        # is made exactly when first needed, as the rewriter places it; prev[i,t] is the same
        # at t - 1
        inf, R0, consumers = np.inf, self.R0, self.p.consumers[i]
        for var, when in ((self.made, t), (self.prev, t - 1)):
            direct = bool(u.bwd_reads) and u.bwd_reads[0] <= when
            if direct:
                self.add({var(i, k): 1, R0 + i: -1}, 0, inf)
            self.add({var(i, k): 1, R0 + i: -1}, -inf, 0)
            if not direct:
                self.add({var(i, k): 1, **{var(c, k): -1 for c in consumers}}, -inf, 0)
            for c in consumers:
                # a consumer's copy made by then needs this unit's copy (if recomputed)
                self.add({var(i, k): 1, var(c, k): -1, R0 + i: -1}, -1, inf)

    def _add_live(self, i: int, u: Unit, k: int, t: int) -> None:
        # only after the forward's last read: before it the baseline already counts the unit
        if u.last_fwd >= t:
            return
        inf, R0, S0 = np.inf, self.R0, self.S0
        made, prev, live, kept = self.made, self.prev, self.live, self.kept
        last_direct = u.bwd_reads[-1] if u.bwd_reads else -1
        # copy live at t: made by t and still to be read at or after t
        if last_direct >= t:
            self.add({live(i, k): 1, made(i, k): -1}, 0, inf)
            self.add({kept(i, k): 1, S0 + i: -1}, 0, inf)  # stored and still needed
        for c in self.p.consumers[i]:
            # a consumer copy made at or after t still reads it
            self.add({live(i, k): 1, made(i, k): -1, R0 + c: -1, prev(c, k): 1}, -1, inf)
            self.add({kept(i, k): 1, S0 + i: -1, R0 + c: -1, prev(c, k): 1}, -1, inf)

    def _add_memory(self, k: int, t: int) -> None:
        coefs = {self.M: -1.0}
        others = self.p.multiplicity - 1  # other microbatches' stored units (s_i)
        for i, u in enumerate(self.p.units):
            if u.produced <= t and u.last_fwd < t:
                coefs[self.live(i, k)] = float(u.size)
                coefs[self.kept(i, k)] = float(u.size)
            if others:
                coefs[self.S0 + i] = float(others * u.size)
        self.add(coefs, -np.inf, -float(self.p.fixed[t]))

    def objective(self, target: int | None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(cost, integrality, lower, upper). Costs are scaled so the peak term dominates the
        recompute term, which dominates the tie-break toward keeping less."""
        p, nvar, R0, S0, M = self.p, self.nvar, self.R0, self.S0, self.M
        integrality = np.zeros(nvar)
        integrality[: 2 * self.n_u] = 1
        lb = np.zeros(nvar)
        ub = np.ones(nvar)
        for i, u in enumerate(p.units):
            if not u.recomputable:
                ub[R0 + i] = 0
        lb[M], ub[M] = 0, np.inf
        scale = max(float(np.max(p.base)), 1.0)
        cost = np.zeros(nvar)
        total_cost = sum(u.cost for u in p.units) + 1e-12
        if target is None:
            cost[M] = 1.0 / scale  # minimize the peak first ...
            for i, u in enumerate(p.units):
                cost[R0 + i] = 1e-4 * u.cost / total_cost  # ... then recompute time
        else:
            ub[M] = float(target)
            for i, u in enumerate(p.units):
                cost[R0 + i] = u.cost / total_cost
        for i, u in enumerate(p.units):  # a tie-break toward keeping less
            cost[S0 + i] = 1e-7 * u.size / scale
        return cost, integrality, lb, ub


def _solve(p: Problem, points: list[int], target: int | None, time_limit: float,
           scipy_milp, Bounds, LinearConstraint, coo_matrix):
    """One MILP solve at `points`: (recomputed units, relative gap), or None if HiGHS found no
    solution in time. scipy is passed in because `milp` imports it lazily, once."""
    m = _Milp(p, points)
    m.add_units()
    for k, t in enumerate(points):
        m.add_point(k, t)
    cost, integrality, lb, ub = m.objective(target)
    a = coo_matrix((m.vals, (m.rows, m.cols)), shape=(m.row, m.nvar)).tocsr()
    res = scipy_milp(cost, constraints=LinearConstraint(a, np.array(m.lo), np.array(m.hi)),
                     integrality=integrality, bounds=Bounds(lb, ub),
                     options={"time_limit": max(time_limit, 1.0), "disp": False,
                              "mip_rel_gap": 1e-4})
    if res.x is None:
        return None
    r = frozenset(i for i in range(m.n_u) if res.x[m.R0 + i] > 0.5)
    gap = getattr(res, "mip_gap", None)
    return r, (float(gap) if gap is not None else None)
