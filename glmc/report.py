"""The compile report: what each pass did, compile times, backend fallbacks."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from glmc.errors import Offense
from glmc.passmanager import PassRecord


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

    def to_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "backend": self.backend,
                "capture_seconds": round(self.capture_seconds, 4),
                "passes_seconds": round(self.passes_seconds, 4),
                "backend_seconds": round(self.backend_seconds, 4),
                "nodes_captured": self.nodes_captured, "nodes_final": self.nodes_final,
                "passes": [r.to_dict() for r in self.history],
                "fallbacks": [{"op": f.reason, "where": f.location} for f in self.fallbacks]}


@dataclass
class Report:
    compiles: list[CompileRecord] = field(default_factory=list)

    @property
    def history(self) -> list[PassRecord]:
        return self.compiles[-1].history if self.compiles else []

    def to_dict(self) -> dict[str, Any]:
        return {"compiles": [c.to_dict() for c in self.compiles]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def summary(self) -> str:
        lines = []
        for c in self.compiles:
            lines.append(f"compile {c.batch} -> {c.backend}: capture {c.capture_seconds:.2f}s, "
                         f"passes {c.passes_seconds:.2f}s, backend {c.backend_seconds:.2f}s, "
                         f"nodes {c.nodes_captured} -> {c.nodes_final}")
            for r in c.history:
                state = "skipped" if r.skipped else ("changed" if r.changed else "no change")
                stats = r.to_dict()["stats"]
                lines.append(f"  {r.name:<12} {state:<9} {r.seconds * 1e3:7.1f} ms  "
                             f"{r.nodes_before:>5} -> {r.nodes_after:<5} {stats or ''}")
            if c.fallbacks:
                lines.append(f"  {len(c.fallbacks)} op(s) fell back to eager:")
                lines += [f"  {f}" for f in c.fallbacks]
        return "\n".join(lines)
