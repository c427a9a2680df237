"""Pass base, pass manager and its instruments, pipeline stages as pass targets, pipeline strings.

The manager — not the passes — runs every pass through its instruments: it times them,
verifies the graph after each, records provenance (`NodeInfo.created_by`), observes the
prediction, dumps the graph and lets a pass be disabled by name for bisecting. Whole steps
(`PassManager.run`) and pipeline stages (`PassManager.run_stage`) go through the same path.
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
    #: where every rank compiles the same program (data and tensor parallelism): rank 0's
    #: value of a decision, for all ranks (`agree(value) -> rank 0's value`). A pass whose
    #: choice rests on this rank's timings or a solver's time limit asks it, so the ranks'
    #: programs (and their collectives) stay the same. None: one process.
    agree: Any = None

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

    def stage_forms(self) -> frozenset["StageForm"]:
        """Which graphs of a pipeline stage this pass rewrites (`run_stage`); none by default."""
        return frozenset()

    def run_stage(self, unit: "StageUnit", ctx: PassContext) -> PassResult:
        """This pass on one pipeline stage's graph (`unit.form`, one of `stage_forms()`)."""
        raise NotImplementedError(f"{self.name}: does not rewrite pipeline stages")

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
    stage: int | None = None  #: the pipeline stage it rewrote (None: a whole step)
    form: str | None = None  #: which graph of the stage (`StageForm`)

    def to_dict(self) -> dict[str, Any]:
        stats = dataclasses.asdict(self.stats) if dataclasses.is_dataclass(self.stats) else self.stats
        out = {"name": self.name, "options": self.options, "changed": self.changed,
               "stats": stats, "seconds": round(self.seconds, 6),
               "nodes_before": self.nodes_before, "nodes_after": self.nodes_after,
               "skipped": self.skipped, "predicted": self.predicted}
        if self.stage is not None:
            out.update(stage=self.stage, form=self.form)
        return out


# ---- pipeline stages -------------------------------------------------------------------------

class StageForm(enum.Enum):
    """Which graph of a pipeline stage a pass sees (`glmc.trace.stages.capture_stage`)."""

    FORWARD = "forward"  #: the stage's forward program in ATen ops, before it is differentiated
    JOINT = "joint"  #: its joint forward + backward (AOTAutograd's), before the partition


@dataclass
class StageUnit:
    """One pipeline stage's graph as the pass manager hands it to `Pass.run_stage`: rewritten
    in place. `inputs`: the forward program's `InputSpec`s (FORWARD)."""

    index: int
    form: StageForm
    gm: fx.GraphModule
    inputs: list[Any] = field(default_factory=list)

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph



# ---- instruments -----------------------------------------------------------------------------

class Instrument:
    """A hook around every pass the manager runs, on whole steps and pipeline stages alike
    (TVM Relax's `PassInstrument` is the model). `before` hooks run in order, `after` hooks in
    reverse, so the last instrument wraps the pass most closely."""

    def start(self, target: Any) -> None:
        """Before the first pass (the captured graph)."""

    def should_run(self, p: Pass, target: Any) -> bool:
        return True

    def before(self, p: Pass, target: Any) -> None:
        pass

    def after(self, p: Pass, target: Any, record: PassRecord) -> PassRecord:
        return record

    def skipped(self, p: Pass, target: Any, record: PassRecord) -> PassRecord:
        return record


@dataclass
class Disable(Instrument):
    """`--disable NAME`: the pass is recorded as skipped instead of run (for bisecting)."""

    names: frozenset[str] = frozenset()

    def should_run(self, p: Pass, target: Any) -> bool:
        return p.name not in self.names


@dataclass
class Verify(Instrument):
    """After each pass: the step graph is well formed and its signature only extended (a
    stage's graph: fx's lint); a pass that breaks it is named in the error."""

    signature: Any = None

    def before(self, p: Pass, target: Any) -> None:
        if isinstance(target, TrainGraph):
            self.signature = target.signature()

    def after(self, p: Pass, target: Any, record: PassRecord) -> PassRecord:
        try:
            if isinstance(target, TrainGraph):
                target.verify(None if p.changes_signature else self.signature)
                _check_extends(self.signature, target.signature())
            else:
                target.graph.lint()
        except PassError as e:
            raise PassError(f"{p.name}: left an invalid graph: {e}") from e
        except RuntimeError as e:  # fx's lint
            raise PassError(f"{p.name}: left an invalid stage {target.index} graph: {e}") from e
        return record


@dataclass
class Provenance(Instrument):
    """Nodes a pass created carry its name (`NodeInfo.created_by`)."""

    existing: set = field(default_factory=set)

    def before(self, p: Pass, target: Any) -> None:
        self.existing = set(target.graph.nodes)

    def after(self, p: Pass, target: Any, record: PassRecord) -> PassRecord:
        _stamp_provenance(target.graph, self.existing, p.name)
        self.existing = set()
        return record


@dataclass
class Observe(Instrument):
    """The observer's view (e.g. the cost/memory prediction) of the captured step and after
    every pass that changed it, stored on each record (whole steps only)."""

    fn: Callable[[TrainGraph], dict[str, Any]]
    initial: dict[str, Any] | None = None
    last: dict[str, Any] | None = None

    def start(self, target: Any) -> None:
        if isinstance(target, TrainGraph):
            self.initial = self.last = self.fn(target)

    def after(self, p: Pass, target: Any, record: PassRecord) -> PassRecord:
        if not isinstance(target, TrainGraph):
            return record
        if record.changed:
            self.last = self.fn(target)
        return dataclasses.replace(record, predicted=self.last)

    def skipped(self, p: Pass, target: Any, record: PassRecord) -> PassRecord:
        if not isinstance(target, TrainGraph):
            return record
        return dataclasses.replace(record, predicted=self.last)


@dataclass
class Dump(Instrument):
    """Readable Python of the step after capture and after each pass (`00_captured.py`,
    `01_cleanup.py`, ...; a stage's: `stage1_joint_01_cleanup.py`)."""

    directory: str
    index: int = 0

    def start(self, target: Any) -> None:
        self.index = 0
        self._write(target, "captured")

    def after(self, p: Pass, target: Any, record: PassRecord) -> PassRecord:
        self._write(target, p.name)
        return record

    def skipped(self, p: Pass, target: Any, record: PassRecord) -> PassRecord:
        self.index += 1  # the files keep the pass's position in the pipeline
        return record

    def _write(self, target: Any, label: str) -> None:
        out = Path(self.directory)
        out.mkdir(parents=True, exist_ok=True)
        if isinstance(target, TrainGraph):
            name, code = f"{self.index:02d}_{label}.py", target.code()
        else:
            name = f"stage{target.index}_{target.form.value}_{self.index:02d}_{label}.py"
            code = target.gm.code
        (out / name).write_text(f"# glmc: the training step after '{label}' "
                                f"({len(target.graph.nodes)} nodes)\n" + code)
        self.index += 1


@dataclass
class Recompile(Instrument):
    """The module's Python regenerated from the rewritten graph, once it verified (what later
    instruments — the observer, the dump — and the next pass run)."""

    def after(self, p: Pass, target: Any, record: PassRecord) -> PassRecord:
        target.gm.recompile()
        return record


@dataclass
class Timing(Instrument):
    """Each pass's wall time (the innermost instrument: it times the pass alone)."""

    t0: float = 0.0

    def before(self, p: Pass, target: Any) -> None:
        self.t0 = time.perf_counter()

    def after(self, p: Pass, target: Any, record: PassRecord) -> PassRecord:
        return dataclasses.replace(record, seconds=time.perf_counter() - self.t0)


@dataclass
class PassManager:
    """Runs passes in order on a whole step (`run`) or on one pipeline stage's graph
    (`run_stage`), every pass through the same instruments: `disabled` (Disable), `verify`
    (Verify), provenance, `observe(graph)` (Observe: e.g. the cost/memory prediction after
    every pass that changed the step), `dump_dir` (Dump), timing; `instruments` adds more.
    `history` holds one record per pass (and per stage)."""

    passes: list[Pass]
    disabled: frozenset[str] = frozenset()
    verify: bool = True
    observe: Callable[[TrainGraph], dict[str, Any]] | None = None
    dump_dir: str | None = None
    instruments: list[Instrument] = field(default_factory=list)
    history: list[PassRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        # `before` in this order, `after` in reverse: timing, provenance, verification and
        # the recompile first, then what reads the result (extras, observer, dump)
        self._observer = Observe(self.observe) if self.observe else None
        self._stack: list[Instrument] = [Disable(frozenset(self.disabled))]
        if self.dump_dir is not None:
            self._stack.append(Dump(self.dump_dir))
        if self._observer:
            self._stack.append(self._observer)
        self._stack += [*self.instruments, Recompile()]
        if self.verify:
            self._stack.append(Verify())
        self._stack += [Provenance(), Timing()]

    @property
    def initial(self) -> dict[str, Any] | None:
        """The observer's result on the captured graph."""
        return self._observer.initial if self._observer else None

    def run(self, graph: TrainGraph, ctx: PassContext | None = None) -> TrainGraph:
        ctx = ctx or PassContext()
        graph.verify()
        check_needs([p for p in self.passes if p.name not in self.disabled], provided(graph))
        for inst in self._stack:
            inst.start(graph)
        for p in self.passes:
            self._apply(p, graph, lambda p=p: p.run(graph, ctx))
        return graph

    def run_stage(self, unit: StageUnit, ctx: PassContext | None = None) -> StageUnit:
        """The passes that rewrite this form of a stage (`Pass.stage_forms`), in pipeline
        order, each recorded with the stage's index."""
        ctx = ctx or PassContext()
        passes = [p for p in self.passes if unit.form in p.stage_forms()]
        if not passes:
            return unit
        for inst in self._stack:
            inst.start(unit)
        for p in passes:
            self._apply(p, unit, lambda p=p: p.run_stage(unit, ctx))
        return unit

    def _apply(self, p: Pass, target: Any, run: Callable[[], PassResult]) -> None:
        before = len(target.graph.nodes)
        where = {} if isinstance(target, TrainGraph) else \
            {"stage": target.index, "form": target.form.value}
        record = PassRecord(p.name, p.options(), False, None, 0.0, before, before, **where)
        if not all(inst.should_run(p, target) for inst in self._stack):
            record = dataclasses.replace(record, skipped=True)
            for inst in self._stack:
                record = inst.skipped(p, target, record)
            self.history.append(record)
            return
        for inst in self._stack:
            inst.before(p, target)
        try:
            result = run()
        except GlmcError:
            raise  # typed errors (PassError, BudgetError, ConfigError) reach the user as they are
        except Exception as e:
            raise PassError(f"{p.name}: failed: {e}") from e
        record = dataclasses.replace(record, changed=result.changed, stats=result.stats,
                                     nodes_after=len(target.graph.nodes))
        for inst in reversed(self._stack):
            record = inst.after(p, target, record)
        self.history.append(record)


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
