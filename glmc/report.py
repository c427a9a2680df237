"""The compile report: passes, predicted vs measured time and memory, fallbacks, warnings.

`Report.to_dict()` is the whole truth (it is what `report.json` holds); the terminal summary
and `report.html` are rendered from that dict alone, so `glmc report DIR` can re-render them
from a saved `report.json`.
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

from glmc.errors import Offense
from glmc.passmanager import PassRecord

MiB = 1024 * 1024


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

    def to_dict(self) -> dict[str, Any]:
        steps = self.step_seconds[1:] or self.step_seconds  # the first call warms caches
        measured_time = statistics.median(steps) if steps else None
        out = {"batch": self.batch, "backend": self.backend,
               "capture_seconds": round(self.capture_seconds, 4),
               "passes_seconds": round(self.passes_seconds, 4),
               "backend_seconds": round(self.backend_seconds, 4),
               "nodes_captured": self.nodes_captured, "nodes_final": self.nodes_final,
               "passes": [r.to_dict() for r in self.history],
               "fallbacks": [{"op": f.reason, "where": f.location} for f in self.fallbacks],
               "predicted_captured": self.predicted_captured, "predicted": self.predicted,
               "measured": dict(self.measured) if self.measured else None,
               "steps_run": len(self.step_seconds),
               "measured_step_seconds": measured_time, "warnings": list(self.warnings)}
        out["errors"] = _errors(out)
        return out


def _errors(c: dict[str, Any]) -> dict[str, float | None]:
    """Relative error of the prediction against the measurement: predicted / measured - 1."""
    pred, meas = c.get("predicted"), c.get("measured")
    mem = trans = t = None
    if pred and meas:
        total = pred["memory"]["persistent_bytes"] + meas["peak_bytes"]
        mem = pred["memory"]["peak_bytes"] / total - 1 if total else None
        trans = (pred["memory"]["transient_bytes"] / meas["peak_bytes"] - 1
                 if meas["peak_bytes"] else None)
    if pred and c.get("measured_step_seconds"):
        t = pred["time"]["seconds"] / c["measured_step_seconds"] - 1
    return {"peak_memory": mem, "transient_memory": trans, "step_time": t}


@dataclass
class Report:
    compiles: list[CompileRecord] = field(default_factory=list)

    @property
    def history(self) -> list[PassRecord]:
        return self.compiles[-1].history if self.compiles else []

    def to_dict(self) -> dict[str, Any]:
        return {"glmc_report": 1,
                "created": datetime.datetime.now().isoformat(timespec="seconds"),
                "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
                           f"{platform.processor() or platform.platform()}",
                "torch": torch.__version__,
                "compiles": [c.to_dict() for c in self.compiles]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, default=str)

    def summary(self) -> str:
        return summary(self.to_dict())

    def write(self, directory: str | Path) -> list[Path]:
        """Write report.json and the self-contained report.html into `directory`."""
        from glmc.report_html import render_html
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        data = self.to_dict()
        (out / "report.json").write_text(json.dumps(data, indent=1, default=str))
        (out / "report.html").write_text(render_html(data))
        return [out / "report.json", out / "report.html"]


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


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:,.1f} MiB"


def ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:,.1f} ms"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def _brief(stats: Any) -> str:
    """A pass's scalar stats on one line (lists such as recomputed values go to the HTML)."""
    if not isinstance(stats, dict):
        return str(stats or "")
    def small(v: Any) -> bool:  # e.g. fusion's {pattern: count}
        return isinstance(v, dict) and len(v) <= 8 and \
            all(isinstance(x, (int, float, str)) for x in v.values())
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in stats.items()
                     if not isinstance(v, (list, dict, tuple)) or small(v))


def pass_state(r: dict[str, Any]) -> str:
    return "skipped" if r["skipped"] else ("changed" if r["changed"] else "no change")


def summary(data: dict[str, Any]) -> str:
    lines = []
    for c in data["compiles"]:
        lines.append(f"compile {c['batch']} -> {c['backend']}: capture {c['capture_seconds']:.2f}s, "
                     f"passes {c['passes_seconds']:.2f}s, backend {c['backend_seconds']:.2f}s, "
                     f"nodes {c['nodes_captured']} -> {c['nodes_final']}")
        for r in c["passes"]:
            pred = r.get("predicted") or {}
            lines.append(f"  {r['name']:<12} {pass_state(r):<9} {r['seconds'] * 1e3:7.1f} ms  "
                         f"{r['nodes_before']:>5} -> {r['nodes_after']:<5} "
                         f"pred {ms(pred.get('seconds'))}, {mib(pred.get('peak_bytes'))}  "
                         f"{_brief(r['stats'])}")
        pred, meas, err = c.get("predicted"), c.get("measured"), c.get("errors") or {}
        if pred:
            mem = pred["memory"]
            lines.append(f"  predicted: step {ms(pred['time']['seconds'])}, peak {mib(mem['peak_bytes'])}"
                         f" ({mib(mem['persistent_bytes'])} state + {mib(mem['transient_bytes'])} "
                         f"during the step) on {pred['time']['profile']}")
            if pred["time"]["unknown_ops"]:
                lines.append(f"  ops without a cost rule (generic bytes rule used): "
                             f"{pred['time']['unknown_ops']}")
        if meas or c.get("measured_step_seconds"):
            total = (pred["memory"]["persistent_bytes"] + meas["peak_bytes"]) if pred and meas \
                else None
            lines.append(f"  measured:  step {ms(c.get('measured_step_seconds'))} "
                         f"(median of {max(c['steps_run'] - 1, 0)}), peak {mib(total)} "
                         f"({mib(meas['peak_bytes']) if meas else '-'} during the step)"
                         f"  | error: time {pct(err.get('step_time'))}, "
                         f"peak {pct(err.get('peak_memory'))}")
        if c["fallbacks"]:
            lines.append(f"  {len(c['fallbacks'])} op(s) fell back to eager:")
            lines += [f"    {f['op']} at {f['where']}" for f in c["fallbacks"]]
        lines += [f"  warning: {w}" for w in c.get("warnings", [])]
    return "\n".join(lines)
