"""`recompute{budget=...}`: activation rematerialization under a memory budget.

Chooses which forward values the backward keeps and which it recomputes, minimizing predicted
recompute time subject to the predicted peak memory of the *whole step* (forward, backward,
optimizer; the program the backend runs) staying within the budget.

    budget=0.5     peak = state + 0.5 x (no-recompute peak - state): a fraction of the memory
                   the step needs on top of weights, optimizer state and batch
    budget=2GiB    the whole step's peak in bytes (also MiB, GB, MB, plain integers)
    budget=min     the smallest peak this pass can reach
    budget=+64MiB  weights, optimizer state and batch plus this many bytes
    budget=selective  the peak of selective recomputation (Korthikanti et al. 2022: the
                   outputs of matmuls, attention, collectives and random ops kept, the cheap
                   values made from them — pointwise ops, norms, softmax — recomputed), at
                   the least recompute time the solvers find for that peak (the rule's own
                   plan where they find none cheaper)
    budget=full    full recomputation (Megatron-LM's): each of the model's layers keeps only
                   its input; its backward makes everything else it made again (random ops
                   and collectives kept); no search, the peak it gives

With `multiplicity=k` (a pipeline stage's joint graph, `RecomputePass.run_stage`) the peak counts the
values k - 1 other in-flight microbatches keep for their backward (`glmc.planning.remat`).

Guarantees:
* Random ops (dropout) are never recomputed: they are kept, so masks and gradients are
  bit-identical to no recompute. Ops read by the optimizer update are never recomputed, and
  recomputed copies are placed in the backward only, before their first reader.
* Views are recomputed with their base (free); on a fusing backend (Inductor) the pointwise ops
  it inlines into consumers are already recomputed by it and are left to it.
* The plan's peak is checked by the full liveness simulation of the rewritten step; if the
  model and the simulation disagree, the pass tightens its target and plans again.
* A budget below the smallest reachable peak raises `BudgetError` naming that minimum.

Optimizer update (`update=auto|end|early`): the planner solves the step twice — with the update
at the end (as captured: ATen's fused Adam(W) once per group, every gradient alive until it
runs) and with each parameter's update right after its gradient is complete, which frees the
gradient there (`glmc.planning.updates`; bit-identical) — and keeps the placement whose plan
meets the budget at the lower predicted time (recompute plus the per-parameter calls), or
under `min` the lower peak. Steps with loss scaling or collectives keep the update at the end.

Solvers (`solver=auto|milp|greedy`, `time_limit=` seconds): see `glmc.planning.remat`. `auto` runs the
greedy heuristic, then the MILP when the graph has at most `milp_units` candidate values, and
keeps the cheaper valid plan; the report says which produced it and the MILP's gap.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from glmc.analysis.cost import get_profile, is_view, node_time, op_cost, value_bytes
from glmc.analysis.opcost import selective_keeps
from glmc.analysis.memory import simulate
from glmc.analysis.predict import graph_device
from glmc.compiler.passmanager import (Effect, Need, Pass, PassContext, PassResult, StageForm,
                                       StageUnit, Verdict)
from glmc.errors import BudgetError, ConfigError
from glmc.ir.blocks import owner, step_blocks
from glmc.ir.graph import RANDOM_OPS, REGATHER_S, Phase, TrainGraph, is_collective, is_comm, op_name
from glmc.ir.target import BackendTraits, FusionModel
from glmc.ir.writeback import lower_writeback
from glmc.planning.remat import (Plan, Problem, Unit, evaluate, full, greedy, milp, plan_cost,
                                 selective, stored_bytes)
from glmc.planning.updates import (early_update_blocker, place_updates_early, split_fused_updates,
                                   split_overhead_s)
from glmc.trace.step import joint_to_traingraph

BUDGET_TOLERANCE = 0.01  #: measured peak may exceed a memory budget by this fraction

#: the budgets that are rules (which values to make again), not a peak to meet
RULES = ("selective", "full")
_UNITS = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 1 << 10, "mi": 1 << 20,
          "gi": 1 << 30, "ti": 1 << 40}


@dataclass(frozen=True)
class Budget:
    #: "fraction" | "bytes" | "min" | "above" (persistent + value bytes) | "selective" | "full"
    kind: str
    value: float = 0.0

    @staticmethod
    def parse(spec: Any) -> "Budget":
        if isinstance(spec, Budget):
            return spec
        if isinstance(spec, (int, float)) and not isinstance(spec, bool):
            return Budget("fraction", float(spec)) if spec <= 1 else Budget("bytes", float(spec))
        text = str(spec).strip().lower()
        if text in ("min", "selective", "full"):
            return Budget(text)
        if text.startswith("+"):
            above = Budget.parse(text[1:])
            if above.kind != "bytes":
                raise ConfigError(f"recompute: budget {spec!r}: '+' takes a size (+64MiB), "
                                  "the bytes allowed above weights, optimizer state and batch")
            return Budget("above", above.value)
        m = re.fullmatch(r"([0-9.]+(?:e[0-9]+)?)\s*([kmgt]i?)?b?", text)
        if not m:
            raise ConfigError(f"recompute: budget {spec!r} is not a fraction (0.5), a size "
                              "(2GiB, 500MB, 1e9), 'min', 'selective' or 'full'")
        number = float(m.group(1))
        if m.group(2) is None and number <= 1 and not text.endswith("b"):  # "1B": a byte
            if number <= 0:
                raise ConfigError("recompute: a fractional budget must be in (0, 1]")
            return Budget("fraction", number)
        return Budget("bytes", number * _UNITS.get(m.group(2) or "", 1))

    def target(self, baseline_peak: int, persistent: int) -> int | None:
        if self.kind in RULES or self.kind == "min":
            return None
        if self.kind == "fraction":
            return int(persistent + self.value * (baseline_peak - persistent))
        if self.kind == "above":
            return int(persistent + self.value)
        return int(self.value)


@dataclass(frozen=True)
class RecomputeStats:
    budget: str
    budget_bytes: int | None  #: the budget as bytes of the whole step's peak (None: min)
    target_bytes: int | None  #: what the plan aimed at: the budget minus any margin
    baseline_peak: int
    persistent_bytes: int
    planned_peak: int
    predicted_peak: int  #: full liveness simulation of the rewritten step
    solver: str
    solve_seconds: float
    milp_gap: float | None
    greedy_seconds_extra: float | None  #: the heuristic's recompute seconds, for comparison
    recomputed: int
    kept: int
    extra_flops: float
    extra_seconds: float
    candidates: int
    recomputed_values: list = field(default_factory=list)  #: (name, bytes, source), largest
    kept_values: list = field(default_factory=list)  #: (name, bytes, source), largest kept
    pareto: list = field(default_factory=list)  #: (budget, peak bytes, extra seconds)
    notes: list = field(default_factory=list)
    #: where the optimizer update runs: "end" of the step, or "early" (each parameter's right
    #: after its gradient is complete); and the seconds the early form's extra calls cost
    update: str = "end"
    update_seconds: float = 0.0  #: predicted seconds of the chosen form (update, head chunks)
    head_rows: int = 0  #: rows per chunk given to the fused LM heads (0: their default)

    def report_section(self, ctx: Any) -> Any:
        """The report's recompute section (a glmc.compiler.report_parts.ReportSection for the
        SectionContext `ctx`): budget against planned, predicted and measured peak, the solver,
        the largest recomputed and kept values, the Pareto curve."""
        from glmc.compiler.report_parts import LinePlot, MiB, ReportSection, Table, Text, mib, ms
        budget = f"{self.budget} ({mib(self.budget_bytes)})" if self.budget_bytes is not None \
            else self.budget
        gap = f", MILP gap {self.milp_gap:.2g}" if self.milp_gap is not None else ""
        blocks: list[Any] = [Text(
            f"Budget {budget}; peak without recompute {mib(self.baseline_peak)}; "
            f"planned {mib(self.planned_peak)}, predicted (full simulation) "
            f"{mib(self.predicted_peak)}, measured {mib(ctx.measured_peak_bytes)}. "
            f"{self.recomputed} of {self.candidates} values recomputed, {self.kept} kept for the "
            f"backward; +{self.extra_flops / 1e9:.3f} GFLOP, +{ms(self.extra_seconds)} "
            f"predicted. Solver: {self.solver} in {self.solve_seconds:.2f} s{gap}; heuristic's "
            f"plan: +{ms(self.greedy_seconds_extra)}. Optimizer update: "
            + ("each parameter's right after its gradient is complete, freeing the gradient "
               f"(+{ms(self.update_seconds)} predicted for the extra calls)."
               if self.update == "early" else "at the end of the step.")
            + (f" Fused LM head: {self.head_rows} rows per chunk." if self.head_rows else ""))]
        if self.notes:
            blocks.append(Text("; ".join(str(n) for n in self.notes), "note"))
        for title, values in (("recomputed value", self.recomputed_values),
                              ("kept for the backward", self.kept_values)):
            blocks.append(Table((f"{title} (largest)", "size", "source"),
                                tuple((n, mib(b), src or "") for n, b, src in values), "lrl"))
        if self.pareto:
            blocks.append(LinePlot(
                "runtime-memory Pareto curve (budget sweep, greedy)", "predicted peak (MiB)",
                "predicted recompute (ms)", tuple(p[1] / MiB for p in self.pareto),
                tuple(p[2] * 1e3 for p in self.pareto), tuple(str(p[0]) for p in self.pareto)))
        return ReportSection("Recompute", tuple(blocks),
                             f"budget {budget}: predicted "
                             f"{mib(self.predicted_peak)}, measured {mib(ctx.measured_peak_bytes)}")


@dataclass(frozen=True)
class RecomputePass(Pass):
    """Keep or recompute each activation to fit the step's peak memory into a budget."""

    name = "recompute"
    budget: str = "0.5"
    solver: str = "auto"
    time_limit: float = 5.0
    milp_units: int = 1200
    pareto: bool = True
    margin: int = 0  #: bytes kept free below the budget (set by the trainer's measured retry)
    multiplicity: int = 1  #: microbatches in flight whose saved values are live at once
    #: where the optimizer update runs: "auto" (the cost model chooses), "end" (after the whole
    #: backward, as captured) or "early" (each parameter's as soon as its gradient is complete)
    update: str = "auto"

    def __post_init__(self) -> None:
        Budget.parse(self.budget)  # a bad budget fails when the pipeline is parsed
        if self.solver not in ("auto", "milp", "greedy"):
            raise ConfigError(f"recompute: solver must be auto, milp or greedy, not "
                              f"{self.solver!r}")
        if self.update not in ("auto", "end", "early"):
            raise ConfigError(f"recompute: update must be auto, end or early, not "
                              f"{self.update!r}")

    def needs(self) -> frozenset[Need]:
        # a joint graph (torch.compile drop-in) is partitioned after the passes: the
        # partitioner would move the copies, which read forward values only, into the forward
        return frozenset({Need.STEP})

    def effects(self) -> frozenset[Effect]:
        return frozenset({Effect.EDITS_BACKWARD})

    def stage_forms(self) -> frozenset[StageForm]:
        return frozenset({StageForm.JOINT})

    def run_stage(self, unit: StageUnit, ctx: PassContext) -> PassResult:
        """For a pipeline stage: its AOTAutograd joint graph rewritten before the default
        partition, under `budget` (a fraction, a size — `+N` above the stage's weights and
        inputs — or "min") with the `multiplicity` microbatches its schedule keeps in flight;
        the partition then saves what the plan keeps and the backward recomputes the rest."""
        return self.run(joint_to_traingraph(unit.gm), ctx)

    def after_measure(self, stats: Any, measured_peak: int, retried: bool) -> Verdict:
        """The budget holds on *measured* memory: when the measured peak exceeds it (ops'
        internal workspaces, backend buffer choices), plan again once with the target lowered
        by the overshoot; if that still misses, say so."""
        if not isinstance(stats, RecomputeStats) or stats.budget_bytes is None:
            return Verdict()
        over = measured_peak - stats.budget_bytes
        if over <= BUDGET_TOLERANCE * stats.budget_bytes:
            return Verdict()
        if retried:
            return Verdict(note=f"recompute: measured peak {measured_peak:,} bytes is over the "
                                f"budget's {stats.budget_bytes:,} by {over:,} after one retry")
        return Verdict(dataclasses.replace(self, margin=self.margin + over),
                       f"recompute: measured peak {measured_peak:,} bytes exceeded the budget's "
                       f"{stats.budget_bytes:,}; recompiled with the target lowered by "
                       f"{over:,} bytes")

    def run(self, graph: TrainGraph, ctx: PassContext) -> PassResult:
        if self.solver not in ("auto", "milp", "greedy"):
            raise ConfigError(f"recompute: solver must be auto, milp or greedy, not "
                              f"{self.solver!r}")
        spec = self.budget
        budget = Budget.parse(spec)
        backend = ctx.traits
        profile = get_profile(ctx.profile, graph_device(graph))
        lowered = lower_writeback(graph, backend.early_writeback, backend.inplace).graph
        problem, units = build_problem(lowered, backend, profile, self.multiplicity,
                                       _blocks(graph))
        baseline_peak = evaluate(problem, ())[0]
        budget_bytes = target = budget.target(baseline_peak, problem.persistent)
        if target is not None and self.margin:
            target -= self.margin
        start = time.perf_counter()
        placements, (chosen, plan, heuristic) = self._choose_form(
            graph, backend, profile, problem, units, target)
        problem, units = chosen.problem, chosen.units
        shortfall = None
        if plan is None or (target is not None and plan.peak > target):
            chosen, plan, shortfall = self._floor(placements, target, baseline_peak)
            problem, units = chosen.problem, chosen.units
        form = graph.copy()  # the chosen form, applied to `graph` once the ranks agree
        chosen.apply(form)
        # check against the full simulation; tighten on disagreement
        notes = list(plan.notes)
        notes += [c.note for c in placements if c.note]
        if shortfall is not None:
            notes.append(f"the measured retry's target is {_mib(shortfall)} below the lowest "
                         "reachable peak: using the lowest")
        predicted = _simulate_with(form, problem, units, plan.recompute, backend)
        for _ in range(3):
            if target is None or predicted <= target or shortfall is not None:
                break
            notes.append(f"simulation {_mib(predicted)} > target: tightened by "
                         f"{_mib(predicted - plan.peak)}")
            tighter, _ = self._solve(problem, target - (predicted - plan.peak))
            if tighter is None:
                break
            plan = tighter
            predicted = _simulate_with(form, problem, units, plan.recompute, backend)
        solve_seconds = time.perf_counter() - start
        pareto = self._pareto(problem, baseline_peak) if self.pareto else []
        prefetch = False
        if plan.recompute and budget.kind != "min" and target is not None:
            ahead = _simulate_with(form, problem, units, plan.recompute, backend, True)
            prefetch = ahead <= target and ahead != predicted  # fits, and something moved
            if prefetch:
                notes.append(f"gathers made again prefetched one ahead: {_mib(ahead)}")
                predicted = ahead
        chosen, names, prefetch = _agreed(ctx, chosen, {units[i] for i in plan.recompute},
                                          prefetch, notes)
        chosen.apply(graph)
        if names:
            rewrite(graph, names, backend, prefetch)
        changed = bool(names) or chosen.name == "early" or bool(chosen.head_rows)
        rec = sorted(plan.recompute, key=lambda i: -problem.units[i].size)
        kept = sorted((i for i, u in enumerate(problem.units)
                       if u.needed and i not in plan.recompute),
                      key=lambda i: -problem.units[i].size)
        stats = RecomputeStats(
            budget=str(spec), budget_bytes=budget_bytes, target_bytes=target, baseline_peak=baseline_peak,
            persistent_bytes=problem.persistent, planned_peak=plan.peak,
            predicted_peak=predicted, solver=plan.solver, solve_seconds=round(solve_seconds, 3),
            milp_gap=plan.gap,
            greedy_seconds_extra=round(heuristic.cost, 6) if heuristic is not None else None,
            recomputed=len(plan.recompute),
            kept=len(kept),
            extra_flops=_flops(lowered, {units[i].split("#")[0] for i in plan.recompute}),
            extra_seconds=round(plan.cost, 6), candidates=len(problem.units),
            recomputed_values=[(problem.units[i].name, problem.units[i].size,
                                problem.units[i].source) for i in rec[:25]],
            kept_values=[(problem.units[i].name, problem.units[i].size,
                          problem.units[i].source) for i in kept[:25]],
            pareto=pareto, notes=notes, update=chosen.name,
            update_seconds=round(chosen.overhead, 6), head_rows=chosen.head_rows)
        return PassResult(changed, stats)

    def _floor(self, placements: list["_Placement"], target: int, baseline_peak: int
               ) -> tuple["_Placement", Plan, int]:
        """Under a measured retry whose target no plan meets: the lowest reachable plan of
        any form and the shortfall (a running job is not failed); else `BudgetError` naming
        the lowest reachable peak."""
        floors = [(c, self._solve(c.problem, None)[0]) for c in placements]
        floors = [(c, f) for c, f in floors if f is not None]
        chosen, floor = min(floors, key=lambda cf: cf[1].peak) if floors else \
            (placements[0], None)
        lowest = floor.peak if floor is not None else baseline_peak
        if self.margin and floor is not None:
            return chosen, floor, lowest - target
        raise BudgetError(
            f"recompute: budget {self.budget} ({_mib(target)}) is below the smallest peak "
            f"this step can reach with recompute, {_mib(lowest)} (no recompute: "
            f"{_mib(baseline_peak)}; weights, optimizer state and batch alone: "
            f"{_mib(chosen.problem.persistent)}); raise the budget to at least {_mib(lowest)}")

    def _choose_form(self, graph: TrainGraph, backend: BackendTraits, profile: Any,
                     problem: Problem, units: list[str], target: int | None
                     ) -> tuple[list["_Placement"], tuple]:
        """The forms of the step considered (update placements, then narrower fused-head
        chunks where the plan misses the budget or aims at `min`) and the chosen
        (form, plan, heuristic's plan)."""
        placements = self._placements(graph, backend, profile, problem, units)
        chosen = self._choose(placements, target)
        plan = chosen[1]
        rule = Budget.parse(self.budget).kind in RULES
        if plan is None or (target is None and not rule) or \
                (target is not None and plan.peak > target):
            # smaller fused-head chunks hold less while the logits of a chunk exist
            narrow = self._narrow_heads(graph, backend, profile, chosen[0], plan, target)
            if narrow:
                placements += [n for n, _ in narrow]
                chosen = self._choose_solved(
                    [chosen, *((n, *solved) for n, solved in narrow)], target)
        return placements, chosen

    def _placements(self, graph: TrainGraph, backend: BackendTraits, profile: Any,
                    problem: Problem, units: list[str]) -> list["_Placement"]:
        """The update placements the planner may choose from: the update at the end of the
        step (as captured), and — unless `update=end` or the step cannot take it — each
        parameter's update right after its gradient is complete (`glmc.planning.updates`),
        planned on a scratch copy."""
        end = _Placement("end", problem, units, 0.0)
        blocker = early_update_blocker(graph)
        if self.update == "end" or (blocker is not None and self.update == "auto"):
            if blocker is not None and self.update == "auto" and "no optimizer" not in blocker:
                end.note = f"update kept at the end of the step: {blocker}"
            return [end]
        if blocker is not None:
            raise ConfigError(f"recompute: update=early does not apply to this step: {blocker}; "
                              "use update=auto or update=end")
        early = graph.copy()
        split_fused_updates(early)
        if not place_updates_early(early):
            return [end]
        lowered = lower_writeback(early, backend.early_writeback, backend.inplace).graph
        e_problem, e_units = build_problem(lowered, backend, profile, self.multiplicity,
                                           _blocks(graph))
        placed = _Placement("early", e_problem, e_units,
                            split_overhead_s(early, profile.op_overhead_s))
        return [placed] if self.update == "early" else [end, placed]

    def _narrow_heads(self, graph: TrainGraph, backend: BackendTraits, profile: Any,
                      base: "_Placement", plan: Plan | None, target: int | None
                      ) -> list[tuple["_Placement", tuple[Plan | None, Plan | None]]]:
        """`base` again with the fused LM heads' chunks halved, down to `MIN_HEAD_ROWS` rows
        (their cost priced by the cost model: more, smaller matmuls), each solved; stops at
        the first that fits `target`, or (`min`) once halving no longer lowers the peak."""
        from glmc.ir.kernels import head_rows
        heads = _heads(graph.graph)
        if not heads:
            return []
        x, w = heads[0].args[0].meta["val"], heads[0].args[1].meta["val"]
        rows = head_rows(x.shape[0], w.shape[0])
        out: list = []
        base_time = sum(node_time(op_cost(n), profile, profile.op_overhead_s) for n in heads)
        best = plan.peak if plan is not None else None
        while rows // 2 >= MIN_HEAD_ROWS:
            rows //= 2
            form = graph.copy()
            narrowed = dataclasses.replace(base, head_rows=rows)
            narrowed.apply(form)
            lowered = lower_writeback(form, backend.early_writeback, backend.inplace).graph
            problem, units = build_problem(lowered, backend, profile, self.multiplicity,
                                           _blocks(graph))
            extra = sum(node_time(op_cost(n), profile, profile.op_overhead_s)
                        for n in _heads(form.graph)) - base_time
            narrowed = dataclasses.replace(narrowed, problem=problem, units=units,
                                           overhead=base.overhead + max(0.0, extra))
            solved = self._solve(problem, target)
            out.append((narrowed, solved))
            peak = solved[0].peak if solved[0] is not None else None
            if peak is None or (target is not None and peak <= target) or \
                    (best is not None and peak >= best):
                break
            best = peak
        return out

    def _choose(self, placements: list["_Placement"], target: int | None
                ) -> tuple["_Placement", Plan | None, Plan | None]:
        """The placement whose plan meets the target at the least predicted extra time
        (recompute + the update's extra calls); under `min`, the lowest peak."""
        return self._choose_solved([(c, *self._solve(c.problem, target)) for c in placements],
                                   target)

    @staticmethod
    def _choose_solved(solved: list[tuple["_Placement", Plan | None, Plan | None]],
                       target: int | None) -> tuple["_Placement", Plan | None, Plan | None]:
        fits = [s for s in solved if s[1] is not None and (target is None or s[1].peak <= target)]
        if not fits:
            return solved[0]
        if target is None:
            return min(fits, key=lambda s: (s[1].peak, s[1].cost + s[0].overhead))
        return min(fits, key=lambda s: s[1].cost + s[0].overhead)

    def _solve(self, problem: Problem, target: int | None) -> tuple[Plan | None, Plan | None]:
        kind = Budget.parse(self.budget).kind
        if kind == "full":  # the rule as it is: what the planner prices, Megatron-LM runs
            return full(problem), None
        if kind == "selective":  # the rule's peak, at the least
            rule = selective(problem)  # recompute time the solvers find for it (never more
            solved, heuristic = self._search(problem, rule.peak)  # than the rule's own)
            cheaper = solved is not None and solved.peak <= rule.peak and \
                solved.cost < rule.cost
            best = solved if cheaper else rule
            best.notes.append(f"selective rule: {len(rule.recompute)} values recomputed, "
                              f"peak {_mib(rule.peak)}, {rule.cost * 1e3:.3f} ms of recompute; "
                              + ("the solver's plan at that peak is cheaper" if cheaper
                                 else "kept"))
            return best, heuristic
        return self._search(problem, target)

    def _search(self, problem: Problem, target: int | None
                ) -> tuple[Plan | None, Plan | None]:
        deadline = time.perf_counter() + self.time_limit
        heuristic = greedy(problem, target, deadline=deadline)
        if target is None:
            # `min`: the lowest peak the heuristic reaches, then the cheapest plan at that peak
            target = heuristic.peak
        use_milp = self.solver == "milp" or (self.solver == "auto"
                                             and len(problem.units) <= self.milp_units)
        if self.solver == "greedy" or not use_milp:
            return heuristic, heuristic
        left = max(1.0, deadline - time.perf_counter())
        exact = milp(problem, target, time_limit=left)
        candidates = [p for p in (exact, heuristic) if p is not None and
                      (target is None or p.peak <= target)]
        if not candidates:
            return heuristic, heuristic
        key = (lambda p: (p.peak, p.cost)) if target is None else (lambda p: p.cost)
        best = min(candidates, key=key)
        if exact is not None and best is heuristic:
            best.notes.append("the MILP did not beat the heuristic within the time limit")
        return best, heuristic

    def _pareto(self, problem: Problem, baseline_peak: int) -> list:
        points = []
        for frac in (1.0, 0.75, 0.5, 0.25):
            target = int(problem.persistent + frac * (baseline_peak - problem.persistent))
            plan = greedy(problem, target)
            if plan.peak <= target:
                points.append((frac, plan.peak, round(plan.cost, 6)))
        low = greedy(problem, None)
        points.append(("min", low.peak, round(low.cost, 6)))
        return points


@dataclass
class _Placement:
    """One form of the step the planner may pick — where the optimizer update runs and how
    many rows the fused LM head takes per chunk — with its recompute problem."""

    name: str  #: "end" | "early"
    problem: Problem
    units: list[str]
    overhead: float  #: predicted seconds the form adds (the early form's extra calls)
    note: str = ""
    head_rows: int = 0  #: rows per chunk of every fused LM head (0: the kernel's default)

    def apply(self, graph: TrainGraph) -> None:
        if self.name == "early":
            split_fused_updates(graph)
            place_updates_early(graph)
        if self.head_rows:
            for n in _heads(graph.graph):
                n.args = (*n.args[:6], self.head_rows)


def _agreed(ctx: Any, chosen: _Placement, names: set[str], prefetch: bool, notes: list[str]
            ) -> tuple[_Placement, set[str], bool]:
    """Rank 0's decision — the step's form, the values made again, the prefetch — where
    every rank compiles the same program (`PassContext.agree`): each rank prices with its own
    timings and the solver stops at its time limit, so their plans may differ, and with them
    the collectives a ZeRO-3 or tensor-parallel step issues. One process: its own."""
    if getattr(ctx, "agree", None) is None:
        return chosen, names, prefetch
    mine = (chosen.name, chosen.head_rows, sorted(names), prefetch)
    name, rows, agreed, prefetch = ctx.agree(mine)
    if (name, rows, agreed) != mine[:3]:
        notes.append(f"rank 0's plan adopted ({len(agreed)} values made again; this rank's "
                     f"own: {len(names)}); the figures above are this rank's own plan's")
    return dataclasses.replace(chosen, name=name, head_rows=rows), set(agreed), prefetch


def _heads(g: fx.Graph) -> list[fx.Node]:
    return [n for n in g.nodes if n.target is torch.ops.glmc.linear_cross_entropy.default]


#: the fewest rows per chunk a memory budget may give a fused LM head: its matmuls' inner size
#: for grad w (glmc.ir.kernels.HEAD_MIN_ROWS measured 256 on par with unfused, 65 1.8x slower)
MIN_HEAD_ROWS = 64


# ---- graph -> problem -------------------------------------------------------------------------


def _mib(n: int | None) -> str:
    return "min" if n is None else f"{n / (1 << 20):,.2f} MiB ({n:,} bytes)"


def _phase(n: fx.Node) -> Phase | None:
    info = n.meta.get("glmc")
    return info.phase if info is not None else None


def _transparent(n: fx.Node, groups: FusionModel | None) -> bool:
    if n.op != "call_function":
        return False
    t = n.target
    if isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable:
        return False
    return is_view(n) or (groups is not None and groups.inlined(n))


def _tuple_unit(n: fx.Node, is_unit: dict) -> bool:
    return bool(is_unit.get(n)) and isinstance(n.meta.get("val"), (tuple, list))


def _key_name(key: tuple[fx.Node, int | None]) -> str:
    node, k = key
    return node.name if k is None else f"{node.name}#{k}"


def build_problem(lowered: fx.Graph, traits: BackendTraits, profile: Any,
                  multiplicity: int = 1, blocks: Sequence[str] = ()
                  ) -> tuple[Problem, list[str]]:
    """Units (forward values owning storage; each output of a multi-output op is its own unit)
    of the lowered step, with sizes, recompute seconds, read times, and the baseline liveness
    timeline. Returns the problem and the unit names (`node` or `node#k`). `blocks` (the
    step's, `glmc.ir.blocks.step_blocks`): a value one block hands to another's forward
    (the residual stream) is a checkpoint selective recomputation keeps."""
    groups = traits.fusion(lowered) if traits.fusion is not None else None
    nodes = list(lowered.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    is_unit = {n: (n.op == "call_function" and _phase(n) is Phase.FORWARD
                   and not _transparent(n, groups)) for n in nodes}
    Key = tuple  # (node, output index or None)
    deps: dict[fx.Node, frozenset] = {}
    keys: list[Key] = []
    for n in nodes:  # the units a node's value is made of (through transparent nodes)
        if is_unit[n]:
            val = n.meta.get("val")
            if isinstance(val, (tuple, list)):
                own = [(n, k) for k, v in enumerate(val) if isinstance(v, torch.Tensor)]
            else:
                own = [(n, None)]
            keys.extend(own)
            deps[n] = frozenset(own)
        elif n.op == "call_function" and n.target is operator.getitem and \
                _tuple_unit(n.args[0], is_unit):
            deps[n] = frozenset({(n.args[0], n.args[1])})
        elif _transparent(n, groups):
            deps[n] = frozenset().union(*(deps.get(a, frozenset()) for a in n.all_input_nodes))
        else:
            deps[n] = frozenset()
    kidx = {k: i for i, k in enumerate(keys)}
    fwd_last = {k: index[k[0]] for k in keys}
    bwd: dict[Key, list[int]] = {k: [] for k in keys}
    blocked: set[fx.Node] = set()
    for n in nodes:
        if _transparent(n, groups):
            continue
        ins: set = set()
        for a in n.all_input_nodes:
            ins |= deps.get(a, frozenset())
        ph = _phase(n)
        for key in ins:
            if key[0] is n:
                continue
            if ph is Phase.FORWARD:
                fwd_last[key] = max(fwd_last[key], index[n])
            else:
                bwd[key].append(index[n])
                if ph is not Phase.BACKWARD:
                    blocked.add(key[0])  # read by the optimizer update or the output
    overhead = profile.kernel_overhead_s if traits.fuses else profile.op_overhead_s
    block = functools.partial(_block, blocks=blocks)
    handed = _handed_on(nodes, deps, groups, block)
    units = []
    for key in keys:
        n, k = key
        val = n.meta.get("val")
        size = value_bytes(val if k is None else val[k])
        recomputable = _recomputable(n, blocked)
        inputs: set = set()
        for a in n.all_input_nodes:
            inputs |= deps.get(a, frozenset())
        info = n.meta.get("glmc")
        # a kept ZeRO-3 gather is "recomputed" by gathering again: its predicted comm time
        cost = n.meta[REGATHER_S] if REGATHER_S in n.meta else \
            node_time(op_cost(n), profile, overhead)
        units.append(Unit(
            name=_key_name(key), size=size, cost=cost,
            produced=index[n], last_fwd=fwd_last[key], bwd_reads=tuple(sorted(set(bwd[key]))),
            inputs=tuple(sorted(kidx[u] for u in inputs if u[0] is not n)),
            recomputable=recomputable, source=getattr(info, "source", None),
            selective=recomputable and REGATHER_S not in n.meta and n not in handed
            and not selective_keeps(n),
            full=recomputable and not is_collective(n) and n not in handed
            and _layer(block(n))))
    mem = simulate(lowered, traits)
    base = [sum(v.values()) for _, v in mem.timeline]
    return Problem(units, base, mem.persistent_bytes, multiplicity), [u.name for u in units]


def _recomputable(n: fx.Node, blocked: set[fx.Node]) -> bool:
    """Whether `n`'s value may be made again: a pure op, not random, not read by the update
    or the output, not a collective (but a ZeRO-3 gather, gathered again)."""
    t = n.target
    return (isinstance(t, torch._ops.OpOverload) and not t._schema.is_mutable
            and op_name(n) not in RANDOM_OPS and n not in blocked
            and (not is_collective(n) or REGATHER_S in n.meta))  # unpriced


def _block(n: fx.Node, blocks: Sequence[str]) -> str | None:
    return owner(getattr(n.meta.get("glmc"), "module", None), blocks)


def _handed_on(nodes: list[fx.Node], deps: dict, groups: Any,
               block: Callable[[fx.Node], str | None]) -> set[fx.Node]:
    """The forward values a block (`block`: a node's) hands to another block's forward
    (through transparent nodes): the checkpoints selective and full recomputation keep."""
    out: set[fx.Node] = set()
    for n in nodes:
        if _transparent(n, groups) or _phase(n) is not Phase.FORWARD or block(n) is None:
            continue
        for a in n.all_input_nodes:
            out.update(key[0] for key in deps.get(a, ()) if key[0] is not n
                       and block(key[0]) not in (None, block(n)))
    return out


def _blocks(graph: TrainGraph) -> list[str]:
    """The step's blocks (`glmc.ir.blocks.step_blocks`); a pipeline stage's joint graph
    names no parameters: the blocks `joint_to_traingraph` placed its forward nodes in."""
    return step_blocks(graph) or list(dict.fromkeys(
        info.module for n in graph.compute_nodes()
        if (info := graph.info(n)).module and info.phase is Phase.FORWARD))


def _layer(block: str | None) -> bool:
    """Whether `block` (`glmc.ir.blocks.block_names`) is an item of the model's list of
    layers (`model.layers.3`), which full recomputation makes again whole."""
    return block is not None and block.rsplit(".", 1)[-1].isdigit()


def _flops(lowered: fx.Graph, names: set[str]) -> float:
    """FLOPs of recomputing these nodes once each."""
    return float(sum(op_cost(n).flops for n in lowered.nodes if n.name in names))


# ---- rewrite ----------------------------------------------------------------------------------


def rewrite(graph: TrainGraph, recompute: set[str], traits: BackendTraits,
            prefetch: bool = False) -> int:
    """Give every backward reader of a recomputed value a copy made right before the first
    such reader (copies of views and inlined ops over recomputed values come along). With
    `prefetch`, the gathers among the copies are issued one ahead (`_prefetch_gathers`): the
    pass does so when its budget still holds with the longer-lived buffers, never under
    `min`."""
    g = graph.graph
    groups = traits.fusion(g) if traits.fusion is not None else None
    memo: dict[fx.Node, bool] = {}

    tuple_units = {name.split("#")[0] for name in recompute if "#" in name}

    def depends(a: fx.Node) -> bool:
        if a not in memo:
            if a.op != "call_function" or _phase(a) is not Phase.FORWARD:
                memo[a] = False
            elif a.name in recompute or a.name in tuple_units:
                memo[a] = True
            elif a.target is operator.getitem and isinstance(a.args[0], fx.Node) and \
                    a.args[0].name in tuple_units:
                memo[a] = f"{a.args[0].name}#{a.args[1]}" in recompute
            elif _transparent(a, groups):
                memo[a] = any(depends(x) for x in a.all_input_nodes)
            else:
                memo[a] = False
        return memo[a]

    copies: dict[fx.Node, fx.Node] = {}
    made: set[fx.Node] = set()

    def materialize(a: Any, before: fx.Node) -> Any:
        if not isinstance(a, fx.Node) or not depends(a):
            return a
        if a in copies:
            return copies[a]
        args = fx.map_arg(a.args, lambda x: materialize(x, before))
        kwargs = fx.map_arg(a.kwargs, lambda x: materialize(x, before))
        with g.inserting_before(before):
            c = g.call_function(a.target, args, kwargs)
        c.meta = dict(a.meta)
        c.meta["glmc"] = a.meta["glmc"].replace(phase=Phase.BACKWARD)
        if "partitioner_tag" in c.meta:  # a joint graph: AOTAutograd's partition reads it
            c.meta["partitioner_tag"] = "is_backward"
        copies[a] = c
        made.add(c)
        return c

    for b in list(g.nodes):
        if b.op == "output" or b in made or _phase(b) is not Phase.BACKWARD:
            continue
        if any(depends(a) for a in b.all_input_nodes):
            b.args = fx.map_arg(b.args, lambda x: materialize(x, b))
            b.kwargs = fx.map_arg(b.kwargs, lambda x: materialize(x, b))
    if prefetch:
        _prefetch_gathers(g, made)
    g.lint()
    return len(copies)


def _prefetch_gathers(g: fx.Graph, made: set[fx.Node]) -> None:
    """Issue each collective the rewrite made again (a kept ZeRO-3 bucket gathered again for
    its backward readers) as soon as the one before it has arrived — one ahead, as the shard
    pass prefetches the forward's gathers — not right before its own wait: the gather then
    runs while the previous bucket's layer computes. Its wait stays before its first reader.
    The copies it reads (none for a shard pass bucket, whose flat shard is a forward value)
    move with it."""
    colls = [n for n in g.nodes if n in made and is_collective(n)]
    for prev, coll in zip(colls, colls[1:]):
        arrived = next((u for u in prev.users if is_comm(u)), None)  # prev's wait_tensor
        if arrived is None:
            continue
        order = {n: i for i, n in enumerate(g.nodes)}
        if order[coll] < order[arrived]:
            continue
        chain = sorted((n for n in _made_ancestors(coll, made) if order[n] > order[arrived]),
                       key=order.__getitem__)
        anchor = arrived
        for n in chain:
            anchor.append(n)
            anchor = n


def _made_ancestors(node: fx.Node, made: set[fx.Node]) -> list[fx.Node]:
    """`node` and the rewrite's copies it reads, directly or through other copies."""
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        if n not in out:
            out.append(n)
            todo += [a for a in n.all_input_nodes if a in made]
    return out


def _simulate_with(graph: TrainGraph, problem: Problem, units: list[str],
                   recompute: frozenset[int], backend: Any, prefetch: bool = False) -> int:
    """Predicted peak of the step with this plan applied (on a scratch copy of the graph),
    with the values the problem's other in-flight microbatches keep (`glmc.planning.remat`)."""
    scratch = graph.copy()
    if recompute:
        rewrite(scratch, {units[i] for i in recompute}, backend, prefetch)
    peak = simulate(lower_writeback(scratch, backend.early_writeback, backend.inplace).graph, backend).peak_bytes
    if problem.multiplicity > 1:
        peak += (problem.multiplicity - 1) * stored_bytes(problem, recompute)
    return peak


__all__ = ["RecomputePass", "Budget", "build_problem", "rewrite", "evaluate",
           "plan_cost"]
