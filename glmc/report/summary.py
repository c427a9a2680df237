"""The compile report: passes, predicted vs measured time and memory, fallbacks, warnings.

`Report.to_dict()` is the whole truth (it is what `report.json` holds); the terminal summary
and `report.html` are rendered from that dict alone, so `glmc report DIR` can re-render them
from a saved `report.json`. Each pass's own part of the report comes from its stats
(`report_section`, see glmc.compiler.report_parts) and is stored with the pass in report.json.

Memory is reported predicted and measured side by side, each split into the state the step
reads (persistent) and what it allocates while it runs (in-step); `errors` holds the model's
relative error on the whole peak and on each part separately.
"""
from __future__ import annotations

import datetime
import json
import platform
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from glmc.analysis.comm import chrome_trace
from glmc.compiler.passmanager import PassRecord
from glmc.compiler.report_parts import (MiB, SectionContext, brief_stats, measured_peak, mib, ms,
                                        pass_state, pct, section_of)
from glmc.errors import Offense
from glmc.report.html import render_html

__all__ = ["CompileRecord", "Report", "load", "summary", "render_html", "MiB", "mib", "ms",
           "pct", "pass_state"]


@dataclass
class CompileRecord:
    batch: str
    backend: str
    capture_seconds: float
    passes_seconds: float
    backend_seconds: float
    nodes_captured: int
    nodes_final: int
    history: list[PassRecord]
    fallbacks: list[Offense]
    predicted_captured: dict[str, Any] | None = None  #: full prediction of the captured graph
    predicted: dict[str, Any] | None = None  #: full prediction of the compiled graph
    measured: dict[str, Any] | None = None  #: memory of one real step (see memory.Measurement)
    step_seconds: list[float] = field(default_factory=list)  #: wall time of every step run
    warnings: list[str] = field(default_factory=list)
    #: the cost model's predicted seconds per node of the compiled graph (not serialized)
    node_seconds: dict[str, float] = field(default_factory=dict, repr=False)
    #: the measured per-phase profile (glmc.analysis.phases.PhaseProfile.to_dict), when one was run
    phases: dict[str, Any] | None = None
    #: the host memory policy in force (glmc.runtime.hostalloc), CPU steps
    host_memory: str | None = None
    #: the step cache (glmc.runtime.stepcache): "hit KEY" (capture and passes skipped),
    #: "stored KEY", "not stored: why", or None (off)
    step_cache: str | None = None

    def to_dict(self) -> dict[str, Any]:
        steps = self.step_seconds[1:]  # the first call warms caches: never a measurement
        out = {"batch": self.batch, "backend": self.backend,
               "capture_seconds": round(self.capture_seconds, 4),
               "passes_seconds": round(self.passes_seconds, 4),
               "backend_seconds": round(self.backend_seconds, 4),
               "nodes_captured": self.nodes_captured, "nodes_final": self.nodes_final,
               "passes": [r.to_dict() for r in self.history],
               "fallbacks": [{"op": f.reason, "where": f.location} for f in self.fallbacks],
               "predicted_captured": self.predicted_captured, "predicted": self.predicted,
               "measured": dict(self.measured) if self.measured else None,
               "steps_run": len(self.step_seconds), "steps_timed": len(steps),
               # the fastest step: the one least disturbed by other work on the machine
               "measured_step_seconds": min(steps) if steps else None,
               "median_step_seconds": statistics.median(steps) if steps else None,
               "warnings": list(self.warnings), "phases": self.phases,
               "host_memory": self.host_memory, "step_cache": self.step_cache}
        out["measured_peak_bytes"], out["measured_state_from"] = measured_peak(out)
        out["errors"] = _errors(out)
        spread = _load_warning(steps)
        if spread is not None and spread not in out["warnings"]:
            out["warnings"].append(spread)
        for entry, ctx, record in zip(out["passes"], _section_contexts(out), self.history):
            section = section_of(record.stats, ctx)
            entry["section"] = section.to_dict() if section is not None else None
        return out


#: median / fastest step above which the timings are reported as disturbed
LOADED_SPREAD = 1.25


def _load_warning(steps: list[float]) -> str | None:
    """A warning when the timed steps of one compiled step vary more than the step itself
    can (same shapes, same work): other work on the machine took the cores."""
    if len(steps) < 3 or min(steps) <= 0:
        return None
    spread = statistics.median(steps) / min(steps)
    if spread <= LOADED_SPREAD:
        return None
    return (f"step times vary: the median of {len(steps)} timed steps is {spread:.2f}x the "
            "fastest — the machine looks loaded; the measured step time (and its error) is "
            "the fastest step's")


def _section_contexts(c: dict[str, Any]) -> list[SectionContext]:
    """For each pass of a compile: whether it changed the step, the prediction before and
    after it, and the measured peak of the compiled step."""
    captured = c.get("predicted_captured")
    last = {"seconds": captured["time"]["seconds"],
            "peak_bytes": captured["memory"]["peak_bytes"]} if captured else {}
    out = []
    for r in c["passes"]:
        after = r.get("predicted") or {}
        out.append(SectionContext(r["changed"], last, after, c.get("measured_peak_bytes")))
        last = after or last
    return out


def _errors(c: dict[str, Any]) -> dict[str, float | None]:
    """Relative errors of the prediction against the measurement (predicted / measured - 1):
    the whole peak, its in-step (transient) part and its state (persistent) part, and the step
    time. The state part is None unless the state was measured from real tensors."""
    pred, meas = c.get("predicted"), c.get("measured")
    out: dict[str, float | None] = {"peak_memory": None, "transient_memory": None,
                                    "persistent_memory": None, "step_time": None}
    if pred and meas:
        mem = pred["memory"]
        out["transient_memory"] = _rel(mem["transient_bytes"], meas["peak_bytes"])
        out["persistent_memory"] = _rel(mem["persistent_bytes"], meas.get("persistent_bytes"))
        out["peak_memory"] = _rel(mem["peak_bytes"], c.get("measured_peak_bytes"))
    if pred:
        out["step_time"] = _rel(predicted_step_seconds(pred), c.get("measured_step_seconds"))
        comm, measured = pred.get("communication"), (meas or {}).get("exposed_comm_seconds")
        if comm is not None and measured is not None:
            out["exposed_comm"] = _rel(comm["exposed_seconds"], measured)
    return out


def predicted_step_seconds(pred: dict[str, Any]) -> float:
    """Compute, plus the communication the step waits for on a data-parallel step."""
    comm = pred.get("communication")
    return comm["step_seconds"] if comm else pred["time"]["seconds"]


def _rel(predicted: float, measured: float | None) -> float | None:
    return predicted / measured - 1 if measured else None


@dataclass
class Report:
    compiles: list[CompileRecord] = field(default_factory=list)
    #: a `glmc train` run's curve: rows of step, loss, lr, step_s, tokens_per_s, mfu
    training: list[dict[str, Any]] | None = None
    #: `--plan auto`'s choice: {"of", "chosen", "runners_up"}, each plan {"rank",
    #: "spelling", "step_s", "peak_bytes"} (glmc.frontend.planning)
    plan: dict[str, Any] | None = None

    @property
    def history(self) -> list[PassRecord]:
        return self.compiles[-1].history if self.compiles else []

    def to_dict(self) -> dict[str, Any]:
        return {"glmc_report": 1,
                "created": datetime.datetime.now().isoformat(timespec="seconds"),
                "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
                           f"{platform.processor() or platform.platform()}",
                "torch": torch.__version__,
                "compiles": [c.to_dict() for c in self.compiles],
                **({"training": self.training} if self.training else {}),
                **({"plan": self.plan} if self.plan else {})}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, default=str)

    def summary(self) -> str:
        return summary(self.to_dict())

    def write(self, directory: str | Path) -> list[Path]:
        """Write report.json and the self-contained report.html into `directory`."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        data = self.to_dict()
        (out / "report.json").write_text(json.dumps(data, indent=1, default=str))
        (out / "report.html").write_text(render_html(data))
        written = [out / "report.json", out / "report.html"]
        comm = ((data["compiles"] or [{}])[-1].get("predicted") or {}).get("communication")
        if comm:  # the predicted compute/communication timeline, for Perfetto
            (out / "timeline-predicted.json").write_text(json.dumps(chrome_trace(comm)))
            written.append(out / "timeline-predicted.json")
        return written


def load(directory: str | Path) -> dict[str, Any]:
    from glmc.errors import InputError
    path = Path(directory)
    path = path / "report.json" if path.is_dir() else path
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"report: {path} does not exist; write one with "
                         "`glmc compile FILE --report-dir DIR`") from None
    except json.JSONDecodeError as e:
        raise InputError(f"report: {path} is not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("glmc_report") != 1:
        raise InputError(f"report: {path} is not a glmc report (no 'glmc_report' marker)")
    return data


def summary(data: dict[str, Any]) -> str:
    """The terminal summary of a report dict (what `glmc report DIR` prints)."""
    lines: list[str] = []
    for c in data["compiles"]:
        lines.append(f"compile {c['batch']} -> {c['backend']}: capture "
                     f"{c['capture_seconds']:.2f}s, passes {c['passes_seconds']:.2f}s, backend "
                     f"{c['backend_seconds']:.2f}s, nodes {c['nodes_captured']} -> "
                     f"{c['nodes_final']}")
        lines += _pass_lines(c)
        lines += _prediction_lines(c)
        lines += phase_lines(c.get("phases"), (c.get("phases") or {}).get("reference"))
        if c.get("host_memory"):
            lines.append(f"  host memory: {c['host_memory']}")
        if c.get("step_cache"):
            lines.append(f"  step cache: {c['step_cache']}")
        if c["fallbacks"]:
            lines.append(f"  {len(c['fallbacks'])} op(s) fell back to eager:")
            lines += [f"    {f['op']} at {f['where']}" for f in c["fallbacks"]]
        lines += [f"  warning: {w}" for w in c.get("warnings", [])]
    lines += plan_lines(data.get("plan"), data["compiles"][-1] if data["compiles"] else {})
    return "\n".join(lines)


def plan_lines(plan: dict[str, Any] | None, last: dict[str, Any]) -> list[str]:
    """`--plan auto`'s choice: its rank among the plans priced, predicted against this rank's
    measured step, and the runners-up."""
    if not plan:
        return []
    top = plan["chosen"]
    measured = last.get("median_step_seconds")
    meas = f", measured {measured * 1e3:.1f} ms" if measured else ""
    lines = [f"plan (--plan auto): {top['spelling']}, rank {top['rank']} of {plan['of']} "
             f"priced: predicted {top['step_s'] * 1e3:.1f} ms{meas}, "
             f"{mib(top['peak_bytes'])} per process"]
    lines += [f"  runner-up {p['rank']}: {p['spelling']}: predicted {p['step_s'] * 1e3:.1f} ms "
              f"({p['step_s'] / top['step_s']:.2f}x), {mib(p['peak_bytes'])}"
              for p in plan["runners_up"]]
    return lines


def _pass_lines(c: dict[str, Any]) -> list[str]:
    lines = []
    for r in c["passes"]:
        pred = r.get("predicted") or {}
        lines.append(f"  {r['name']:<12} {pass_state(r):<9} {r['seconds'] * 1e3:7.1f} ms  "
                     f"{r['nodes_before']:>5} -> {r['nodes_after']:<5} "
                     f"pred {ms(pred.get('seconds'))}, {mib(pred.get('peak_bytes'))}  "
                     f"{brief_stats(r['stats'])}")
        section = r.get("section") or {}
        if section.get("summary"):
            lines.append(f"  {'':<12} {section['summary']}")
    return lines


def phase_lines(phases: dict[str, Any] | None, reference: dict[str, float] | None = None
                ) -> list[str]:
    """The measured per-phase profile (glmc.analysis.phases), with a reference's phase times (e.g.
    torch.compile's forward, backward and optimizer.step()) side by side when given."""
    if not phases:
        return []
    step = phases["step_seconds"]
    lines = [f"  per phase (measured, {phases['backend']}, median of {phases['steps']} "
             f"steps, kernel calls timed):"]
    for p in ("forward", "backward", "optimizer", "other"):
        t = phases["phases"].get(p, 0.0)
        ref = f"   torch.compile {ms(reference[p])}" if reference and p in reference else ""
        top = [k["kernel"] for k in phases.get("top_kernels", [])
               if k["phases"].get(p, 0) >= 0.5][:2]
        lines.append(f"    {p:<10} {ms(t):>10} {t / step if step else 0:6.1%}{ref}"
                     + (f"   top: {', '.join(top)}" if top else ""))
    return lines


def _prediction_lines(c: dict[str, Any]) -> list[str]:
    """Predicted and measured time and memory, state and in-step parts apart, with errors."""
    pred, meas, err = c.get("predicted"), c.get("measured"), c.get("errors") or {}
    lines = []
    if pred:
        mem, t = pred["memory"], pred["time"]
        lines.append(f"  predicted: step {ms(predicted_step_seconds(pred))}, peak "
                     f"{mib(mem['peak_bytes'])} "
                     f"({mib(mem['persistent_bytes'])} state + {mib(mem['transient_bytes'])} "
                     f"during the step) on {t['profile']}")
        if t.get("profile_provenance"):
            lines.append(f"  cost profile: {t['profile_provenance']}")
        comm = pred.get("communication")
        if comm:
            link = comm["link"]
            lines.append(f"  communication: {comm['collectives']} collectives over "
                         f"{comm['ranks']} ranks, {ms(comm['comm_seconds'])} on the link, "
                         f"{ms(comm['exposed_seconds'])} exposed (compute "
                         f"{ms(comm['compute_seconds'])}); link {link['name']}: "
                         f"{link['latency_us']:.1f} us, {link['bandwidth_GBps']:.2f} GB/s")
        if t["unknown_ops"]:
            lines.append(f"  ops without a cost rule (generic bytes rule used): "
                         f"{t['unknown_ops']}")
    if meas or c.get("measured_step_seconds"):
        total, state_from = measured_peak(c)
        state = meas.get("persistent_bytes") if meas else None
        state_text = mib(state) if state is not None else \
            ("not measured" if state_from != "prediction" else "predicted")
        timed = c.get("steps_timed", max(c["steps_run"] - 1, 0))
        when = f"fastest of {timed}" if timed else "not timed: only the warm-up step ran"
        lines.append(f"  measured:  step {ms(c.get('measured_step_seconds'))} "
                     f"({when}), peak {mib(total)} "
                     f"({state_text} state + {mib(meas['peak_bytes']) if meas else '-'} during "
                     f"the step)")
        if meas and meas.get("exposed_comm_seconds") is not None:
            lines.append(f"  measured communication: {ms(meas['exposed_comm_seconds'])} waiting "
                         f"in collectives (error {pct(err.get('exposed_comm'))})")
        lines.append(f"  error:     time {pct(err.get('step_time'))}, peak "
                     f"{pct(err.get('peak_memory'))} (in-step {pct(err.get('transient_memory'))}"
                     f", state {pct(err.get('persistent_memory'))})")
    return lines
