"""Predicted step time and peak memory of a step graph, for a backend's traits and a device.

The backend is known only through its `BackendTraits` (glmc.ir.target): this module, like the
cost and memory models it combines, never imports a backend.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from glmc.analysis.comm import CommEstimate, LinkProfile, estimate_comm, has_comm
from glmc.analysis.cost import CostEstimate, DeviceProfile, estimate_time, get_profile
from glmc.analysis.memory import MemoryEstimate, simulate
from glmc.ir.graph import TrainGraph
from glmc.ir.target import EAGER, BackendTraits
from glmc.ir.writeback import lower_writeback


@dataclass
class Prediction:
    time: CostEstimate
    memory: MemoryEstimate
    comm: CommEstimate | None = None  #: an SPMD step's communication (glmc.analysis.comm)
    #: the program both models ran (the write-back lowering on an in-place backend): the
    #: nodes `memory.timeline` indexes
    program: Any = None

    @property
    def step_seconds(self) -> float:
        """Compute plus the communication it does not hide."""
        return self.comm.step_seconds if self.comm is not None else self.time.seconds

    def to_dict(self, points: int = 400) -> dict[str, Any]:
        out = {"time": self.time.to_dict(), "memory": self.memory.to_dict(points)}
        if self.comm is not None:
            out["communication"] = self.comm.to_dict()
        return out

    def brief(self) -> dict[str, Any]:
        return {"seconds": self.step_seconds, "peak_bytes": self.memory.peak_bytes,
                "transient_bytes": self.memory.transient_bytes}


def predict(graph: TrainGraph, traits: BackendTraits = EAGER,
            profile: DeviceProfile | str | None = None,
            measured_node_times: dict[str, float] | None = None,
            link: LinkProfile | None = None, ranks: int = 1) -> Prediction:
    """Model the program a backend with `traits` runs, fused per `traits.fusion`: the
    write-back lowering of `graph` (copies early or late per `traits.early_writeback`) on a
    backend that updates state in place, the functional step itself on one that does not.
    With a `link`, the step's collectives over `ranks` ranks too (glmc.analysis.comm)."""
    prof = get_profile(profile, device=graph_device(graph))
    lowered = lower_writeback(graph, traits.early_writeback, fused_in_place=True).graph \
        if traits.inplace else graph.graph
    time = estimate_time(lowered, prof, traits, measured_node_times)
    comm = None
    if link is not None and has_comm(graph):
        comm = estimate_comm(lowered, time.node_seconds, ranks, link)
    done = comm.done_at if comm is not None else None
    return Prediction(time, simulate(lowered, traits, done_at=done), comm, lowered)


def graph_device(graph: TrainGraph) -> str:
    for ph in graph.placeholders():
        spec = TrainGraph.info(ph).spec
        if spec is not None:
            return spec.device
    return "cpu"
