"""The interface through which a pass shows its work in the report, and the units it uses.

A pass's stats dataclass may define

    def report_section(self, ctx: SectionContext) -> ReportSection | None

The report calls it for every pass in the history and stores the result in report.json (the
section is data, not HTML: a title and blocks of text, tables and line plots), so report.html
and `glmc report DIR` render it without knowing which pass wrote it. `SectionContext` gives
the pass what it cannot know from its own stats: the prediction before and after it ran and
the measured peak of the compiled step.

    class CleanupStats:
        def report_section(self, ctx):
            return ReportSection("Cleanup", (Text(f"{self.dead} dead nodes removed"),))

This module sits below the report (glmc.report.summary, glmc.report.html) and imports nothing of
glmc's, so passes may import it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

MiB = 1024 * 1024


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:,.1f} MiB"


def ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:,.1f} ms"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


@dataclass(frozen=True)
class SectionContext:
    """What a pass's section may show beyond its own stats.

    `before` / `after`: the prediction before and after the pass ({"seconds", "peak_bytes",
    ...}; empty when not predicted). `measured_peak_bytes`: the measured peak of the whole
    compiled step (state + in-step), None when not measured.
    """

    changed: bool = True
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)
    measured_peak_bytes: int | None = None


@dataclass(frozen=True)
class Text:
    """A paragraph of plain text (escaped when rendered). `style`: "" | "note" | "warn"."""

    text: str
    style: str = ""


@dataclass(frozen=True)
class Table:
    """Rows of cells (str or number). `align`: one letter per column, "l" or "r" (default:
    text left, numbers right). `collapsed`: a label; the table renders folded under it."""

    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]
    align: str = ""
    collapsed: str = ""


@dataclass(frozen=True)
class LinePlot:
    """A line with markers through (x, y) points, each optionally labelled."""

    title: str
    xlabel: str
    ylabel: str
    x: tuple[float, ...]
    y: tuple[float, ...]
    labels: tuple[str, ...] = ()


Block = Union[Text, Table, LinePlot]
_KINDS: dict[str, type] = {"text": Text, "table": Table, "plot": LinePlot}


@dataclass(frozen=True)
class ReportSection:
    """A pass's part of the report: a title, blocks in order, and an optional one-line
    `summary` for the terminal."""

    title: str
    blocks: tuple[Block, ...] = ()
    summary: str = ""

    def to_dict(self) -> dict[str, Any]:
        kind = {v: k for k, v in _KINDS.items()}
        return {"title": self.title, "summary": self.summary,
                "blocks": [{"kind": kind[type(b)], **_fields(b)} for b in self.blocks]}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "ReportSection":
        blocks = []
        for b in d.get("blocks", []):
            cls = _KINDS.get(b.get("kind", ""))
            if cls is None:
                continue  # written by a newer glmc: skip what this one cannot draw
            args = {k: _tuple(v) for k, v in b.items() if k != "kind"}
            blocks.append(cls(**args))
        return ReportSection(d["title"], tuple(blocks), d.get("summary", ""))


def _fields(b: Block) -> dict[str, Any]:
    return {k: _list(v) for k, v in vars(b).items()}


def _list(v: Any) -> Any:
    return [_list(x) for x in v] if isinstance(v, (tuple, list)) else v


def _tuple(v: Any) -> Any:
    return tuple(_tuple(x) for x in v) if isinstance(v, (tuple, list)) else v


def section_of(stats: Any, ctx: SectionContext) -> ReportSection | None:
    """The section a pass's stats report, or None (no stats, or no `report_section`)."""
    method = getattr(stats, "report_section", None)
    return method(ctx) if callable(method) else None


def before_after(ctx: SectionContext) -> str:
    """'step A -> B, peak C -> D' from a section context's predictions."""
    b, a = ctx.before, ctx.after
    return (f"predicted step {ms(b.get('seconds'))} → {ms(a.get('seconds'))}, predicted "
            f"peak {mib(b.get('peak_bytes'))} → {mib(a.get('peak_bytes'))}")


# ---- reading a compile's dict (report.json) ---------------------------------------------------


def pass_state(r: dict[str, Any]) -> str:
    return "skipped" if r["skipped"] else ("changed" if r["changed"] else "no change")


def brief_stats(stats: Any) -> str:
    """A pass's scalar stats on one line (lists such as recomputed values go to its section)."""
    if not isinstance(stats, dict):
        return str(stats or "")

    def small(v: Any) -> bool:  # e.g. fusion's {pattern: count}
        return isinstance(v, dict) and len(v) <= 8 and \
            all(isinstance(x, (int, float, str)) for x in v.values())
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in stats.items()
                     if not isinstance(v, (list, dict, tuple)) or small(v))


def measured_peak(c: dict[str, Any]) -> tuple[int | None, str]:
    """The measured peak of a compiled step's whole run, and where its state part comes from:
    "tensors" (the storage bytes of the real tensors the step read) or "prediction" (older
    reports and callers that gave `measure_peak` no tensors: predicted state + measured
    in-step peak, which then agrees with the prediction's state part by construction)."""
    meas, pred = c.get("measured"), c.get("predicted")
    if not meas:
        return None, ""
    if meas.get("persistent_bytes") is not None:
        return meas["persistent_bytes"] + meas["peak_bytes"], "tensors"
    if pred:
        return pred["memory"]["persistent_bytes"] + meas["peak_bytes"], "prediction"
    return None, ""
