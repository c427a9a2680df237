"""Pass base, pass manager and pipeline strings.

The manager — not the passes — times, verifies, snapshots counts, records provenance
(`NodeInfo.created_by`) and lets a pass be disabled by name for bisecting.
"""
from __future__ import annotations

import dataclasses
import enum
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch.fx as fx

from glmc.errors import GlmcError, PassError, PipelineError
from glmc.ir.graph import TrainGraph
from glmc.ir.target import EAGER, BackendTraits


class Effect(enum.Enum):
    """What running a pass does to the step, beyond rewriting nodes. The pipeline is
    validated from these declarations."""

    REDERIVES = "rederives"  #: rebuilds the backward and update from the forward (fusion)
    EDITS_BACKWARD = "edits_backward"  #: rewrites backward nodes in place (recompute)
    INSERTS_COMM = "inserts_comm"  #: adds communication nodes (sharding)
    ADDS_STATE = "adds_state"  #: appends inputs/outputs to the step (loss-scaler state)


class Need(enum.Enum):
    """What a pass needs from the step it runs on."""

    STEP = "step"  #: a whole training step with its optimizer recorded (not a joint graph)
    VALUE_STATS = "value_stats"  #: recorded per-module value ranges (`glmc.trace.valuestats`)
    STAGES = "stages"  #: stage boundaries (a multi-stage program)


def provided(graph: TrainGraph) -> frozenset[Need]:
    """What `graph` offers to passes' needs."""
    have = set()
    if graph.meta.get("optimizer") is not None:
        have.add(Need.STEP)
    if graph.meta.get("value_stats") is not None:
        have.add(Need.VALUE_STATS)
    if graph.meta.get("stages") is not None:
        have.add(Need.STAGES)
    return frozenset(have)


@dataclass(frozen=True)
class PassContext:
    """Facts about the compile target — never options (those live on the passes): the
    backend's traits and the device profile the cost model predicts for."""

    traits: BackendTraits = EAGER
    profile: Any = None  #: cost-model device profile (see glmc.analysis.cost.get_profile)
    mesh: Any = None  #: the MeshSpec a data-parallel step runs on (None: one device)

    @property
    def backend(self) -> str:
        return self.traits.name


@dataclass(frozen=True)
class Verdict:
    """A pass's answer to a measurement of the compiled step: a replacement to compile again
    with (None: keep the plan), and a note for the report."""

    rerun: "Pass | None" = None
    note: str | None = None


@dataclass(frozen=True)
class PassResult:
    changed: bool
    stats: Any = None  #: a small dataclass per pass, shown by the report


@dataclass(frozen=True)
class Pass:
    """A rewrite of a TrainGraph. Subclasses are frozen dataclasses whose fields are options.

    A pass declares its contract: `needs()` (what the step must offer) and `effects()` (what
    running it does: re-derive the backward, edit it, insert communication, add state). Both
    may depend on the options. `spelling()` parses back to an equal pass.
    """

    name: ClassVar[str] = "abstract"

    def run(self, graph: TrainGraph, ctx: PassContext) -> PassResult:
        raise NotImplementedError

    def needs(self) -> frozenset[Need]:
        return frozenset()

    def effects(self) -> frozenset[Effect]:
        return frozenset()

    def after_measure(self, stats: Any, measured_peak: int, retried: bool) -> Verdict:
        """Given this pass's own stats and the measured peak bytes of the compiled step (state
        included): whether to compile again with other options. `retried`: this compile is
        already a rerun. Default: nothing to do."""
        return Verdict()

    @property
    def changes_signature(self) -> bool:
        return Effect.ADDS_STATE in self.effects()

    def options(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def spelling(self) -> str:
        """`name{key=value,...}` with the options that differ from their defaults."""
        opts = ",".join(f"{f.name}={_spell(getattr(self, f.name))}"
                        for f in dataclasses.fields(self)
                        if getattr(self, f.name) != _default(f))
        return f"{self.name}{{{opts}}}" if opts else self.name


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def _spell(value: Any) -> str:
    if isinstance(value, dict):
        return ";".join(f"{k}:{v}" for k, v in value.items())
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1e6:
        return repr(value)
    return str(value)


@dataclass(frozen=True)
class PassRecord:
    """One entry of the pass history."""

    name: str
    options: dict[str, Any]
    changed: bool
    stats: Any
    seconds: float
    nodes_before: int
    nodes_after: int
    skipped: bool = False
    predicted: dict[str, Any] | None = None  #: the observer's prediction after this pass

    def to_dict(self) -> dict[str, Any]:
        stats = dataclasses.asdict(self.stats) if dataclasses.is_dataclass(self.stats) else self.stats
        return {"name": self.name, "options": self.options, "changed": self.changed,
                "stats": stats, "seconds": round(self.seconds, 6),
                "nodes_before": self.nodes_before, "nodes_after": self.nodes_after,
                "skipped": self.skipped, "predicted": self.predicted}


@dataclass
class PassManager:
    """Runs passes in order. `observe(graph)` (e.g. the cost/memory prediction) is called on the
    captured graph and after every pass that changed it; `dump_dir` gets readable Python of the
    step after capture and after each pass (`00_captured.py`, `01_cleanup.py`, ...)."""

    passes: list[Pass]
    disabled: frozenset[str] = frozenset()
    verify: bool = True
    observe: Callable[[TrainGraph], dict[str, Any]] | None = None
    dump_dir: str | None = None
    history: list[PassRecord] = field(default_factory=list)
    initial: dict[str, Any] | None = None  #: the observer's result on the captured graph

    def run(self, graph: TrainGraph, ctx: PassContext | None = None) -> TrainGraph:
        ctx = ctx or PassContext()
        graph.verify()
        check_needs([p for p in self.passes if p.name not in self.disabled], provided(graph))
        self.initial = self.observe(graph) if self.observe else None
        self._dump(graph, 0, "captured")
        last = self.initial
        for i, p in enumerate(self.passes, start=1):
            before = len(graph.graph.nodes)
            if p.name in self.disabled:
                self.history.append(PassRecord(p.name, p.options(), False, None, 0.0,
                                               before, before, skipped=True, predicted=last))
                continue
            record = self._run_one(p, graph, ctx, before)
            if self.observe and record.changed:
                last = self.observe(graph)
            self.history.append(dataclasses.replace(record, predicted=last))
            self._dump(graph, i, p.name)
        return graph

    def _dump(self, graph: TrainGraph, index: int, label: str) -> None:
        if self.dump_dir is None:
            return
        out = Path(self.dump_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{index:02d}_{label}.py").write_text(
            f"# glmc: the training step after '{label}' ({len(graph.graph.nodes)} nodes)\n"
            + graph.code())

    def _run_one(self, p: Pass, graph: TrainGraph, ctx: PassContext, before: int) -> PassRecord:
        signature = graph.signature()
        existing = set(graph.graph.nodes)
        start = time.perf_counter()
        try:
            result = p.run(graph, ctx)
        except GlmcError:
            raise  # typed errors (PassError, BudgetError, ConfigError) reach the user as they are
        except Exception as e:
            raise PassError(f"{p.name}: failed: {e}") from e
        seconds = time.perf_counter() - start
        _stamp_provenance(graph.graph, existing, p.name)
        if self.verify:
            try:
                graph.verify(None if p.changes_signature else signature)
                _check_extends(signature, graph.signature())
            except PassError as e:
                raise PassError(f"{p.name}: left an invalid graph: {e}") from e
        graph.gm.recompile()
        return PassRecord(p.name, p.options(), result.changed, result.stats, seconds,
                          before, len(graph.graph.nodes))


def check_order(passes: list[Pass]) -> None:
    """A pass that re-derives the backward must not follow one whose backward edits (or
    collectives) it would throw away."""
    for j, later in enumerate(passes):
        if Effect.REDERIVES not in later.effects():
            continue
        for earlier in passes[:j]:
            lost = earlier.effects() & {Effect.EDITS_BACKWARD, Effect.INSERTS_COMM}
            if lost:
                what = " and ".join(sorted(e.value for e in lost))
                raise PipelineError(f"pipeline: '{later.name}' re-derives the backward and would "
                                    f"undo '{earlier.name}' ({what}); put '{later.name}' first")


def check_needs(passes: list[Pass], have: frozenset[Need]) -> None:
    """Every pass's needs are offered by the step; one error lists every pass that lacks any."""
    missing = [(p, p.needs() - have) for p in passes if p.needs() - have]
    if not missing:
        return
    why = {Need.STEP: "a whole training step with its optimizer (glmc.optimize / glmc compile; "
                      "not the torch.compile drop-in's joint graph, which is partitioned "
                      "after the passes)",
           Need.VALUE_STATS: "recorded value ranges (the runtime records them on the example "
                             "batch before the passes run)",
           Need.STAGES: "a multi-stage program (stage boundaries)"}
    lines = [f"  {p.spelling()}: needs {'; '.join(why[n] for n in sorted(m, key=str))}"
             for p, m in missing]
    raise PipelineError("pipeline: passes need what this step does not offer:\n"
                        + "\n".join(lines))


def _check_extends(old: tuple, new: tuple) -> None:
    for before, after in zip(old, new):
        if tuple(after[:len(before)]) != tuple(before):
            raise PassError("ir: the step signature changed (inputs or outputs were removed or "
                            "reordered)")


def _stamp_provenance(g: fx.Graph, existing: set[fx.Node], pass_name: str) -> None:
    for n in g.nodes:
        if n not in existing and "glmc" in n.meta:
            n.meta["glmc"] = n.meta["glmc"].replace(created_by=pass_name)


# ---- pipeline strings ------------------------------------------------------------------------

_ITEM = re.compile(r"\s*([A-Za-z_][\w-]*)\s*(?:\{([^}]*)\})?\s*")


def split_pipeline(text: str) -> list[tuple[str, dict[str, str]]]:
    """"cleanup,recompute{budget=0.5}" -> [("cleanup", {}), ("recompute", {"budget": "0.5"})]."""
    items, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = _ITEM.match(text, pos)
        if not m or m.end() == pos:
            raise PipelineError(f"pipeline: cannot parse '{text[pos:]}'; expected "
                                "name or name{key=value,...} separated by commas")
        opts = {}
        for kv in filter(None, (s.strip() for s in (m.group(2) or "").split(","))):
            key, eq, value = kv.partition("=")
            if not eq:
                raise PipelineError(f"pipeline: option '{kv}' of '{m.group(1)}' needs key=value")
            opts[key.strip()] = value.strip()
        items.append((m.group(1), opts))
        pos = m.end()
        if pos < len(text):
            if text[pos] != ",":
                raise PipelineError(f"pipeline: expected ',' at '{text[pos:]}'")
            pos += 1
    return items


def build_pass(cls: type[Pass], raw: dict[str, str]) -> Pass:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(raw) - set(fields)
    if unknown:
        raise PipelineError(f"{cls.name}: unknown option(s) {sorted(unknown)}; "
                            f"known: {sorted(fields) or 'none'}")
    return cls(**{k: _coerce(cls.name, k, v, fields[k].type) for k, v in raw.items()})


def _coerce(pass_name: str, key: str, value: str, annotation: Any) -> Any:
    kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    try:
        if kind == "bool | None" and value.lower() in ("auto", "none"):
            return None
        if kind in ("bool", "bool | None"):
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(value)
            return value.lower() in ("true", "1")
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
    except ValueError:
        raise PipelineError(f"{pass_name}: option {key}={value!r} is not a valid {kind}") from None
    return value
