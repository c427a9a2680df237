"""Recorded value statistics: per module, how large and how small its forward values and
gradients are — what a precision decision needs, recorded once so passes never run a model.

The runtime records them on the example batch before the passes run (when a pass declares
`Need.VALUE_STATS`) by running the functional fp32 step once: no parameter, buffer, optimizer or
RNG state changes. They are stored in `graph.meta["value_stats"]` and saved with the graph.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from glmc.ir.graph import Phase

_MIN_EXP, _MAX_EXP = -160, 160  #: frexp exponent range kept (covers fp32 subnormals to max)


@dataclass
class Range:
    """absmax and a log2 histogram of the nonzero finite magnitudes of a set of values."""

    absmax: float = 0.0
    #: frexp exponent -> count: |x| in [2^(e-1), 2^e)
    exponents: dict[int, int] = field(default_factory=dict)

    def add(self, t: torch.Tensor) -> None:
        a = t.detach().abs().float()
        finite = a[torch.isfinite(a) & (a > 0)]
        if not finite.numel():
            return
        self.absmax = max(self.absmax, float(finite.max()))
        _, e = torch.frexp(finite)
        e = e.clamp(_MIN_EXP, _MAX_EXP) - _MIN_EXP
        for k, c in enumerate(torch.bincount(e.flatten()).tolist()):
            if c:
                self.exponents[k + _MIN_EXP] = self.exponents.get(k + _MIN_EXP, 0) + c

    @property
    def nonzero(self) -> int:
        return sum(self.exponents.values())

    def fraction_below(self, threshold: float) -> float:
        """Fraction of nonzero values whose magnitude is surely below `threshold`."""
        if not self.nonzero:
            return 0.0
        below = sum(c for e, c in self.exponents.items() if 2.0 ** e <= threshold)
        return below / self.nonzero

    def to_dict(self) -> dict[str, Any]:
        return {"absmax": self.absmax, "exponents": {str(k): v for k, v in self.exponents.items()}}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Range":
        return Range(float(d["absmax"]), {int(k): int(v) for k, v in d["exponents"].items()})


@dataclass
class ModuleStats:
    forward: Range = field(default_factory=Range)
    gradient: Range = field(default_factory=Range)  #: backward values (unscaled)


ValueStats = dict[str, ModuleStats]


def record_value_stats(gm: fx.GraphModule, inputs: list[torch.Tensor]) -> ValueStats:
    """Run the functional step `gm` once on `inputs`; per owning module (NodeInfo.module) the
    range of its forward values and of its backward values. Changes no state, draws no RNG."""
    stats: ValueStats = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            info = n.meta.get("glmc")
            if info is None or info.module is None or info.phase not in (Phase.FORWARD,
                                                                         Phase.BACKWARD):
                return out
            entry = stats.setdefault(info.module, ModuleStats())
            rng = entry.forward if info.phase is Phase.FORWARD else entry.gradient
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    rng.add(t)
            return out

    devices = sorted({str(t.device) for t in inputs
                      if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        Recorder(gm).run(*inputs)
    return stats


def stats_to_dict(stats: ValueStats) -> dict[str, Any]:
    return {m: {"forward": s.forward.to_dict(), "gradient": s.gradient.to_dict()}
            for m, s in stats.items()}


def stats_from_dict(d: dict[str, Any]) -> ValueStats:
    return {m: ModuleStats(Range.from_dict(s["forward"]), Range.from_dict(s["gradient"]))
            for m, s in d.items()}
