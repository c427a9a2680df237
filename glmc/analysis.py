"""Predicted step time and peak memory of a step graph, for a backend's traits and a device.

The backend is known only through its `BackendTraits` (glmc.target): this module, like the
cost and memory models it combines, never imports a backend.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from glmc.cost import CostEstimate, DeviceProfile, estimate_time, get_profile
from glmc.ir import TrainGraph
from glmc.memory import MemoryEstimate, simulate
from glmc.target import EAGER, BackendTraits
from glmc.writeback import lower_writeback


@dataclass
class Prediction:
    time: CostEstimate
    memory: MemoryEstimate

    def to_dict(self, points: int = 400) -> dict[str, Any]:
        return {"time": self.time.to_dict(), "memory": self.memory.to_dict(points)}

    def brief(self) -> dict[str, Any]:
        return {"seconds": self.time.seconds, "peak_bytes": self.memory.peak_bytes,
                "transient_bytes": self.memory.transient_bytes}


def predict(graph: TrainGraph, traits: BackendTraits = EAGER,
            profile: DeviceProfile | str | None = None,
            measured_node_times: dict[str, float] | None = None) -> Prediction:
    """Model the program a backend with `traits` runs, fused per `traits.fusion`: the
    write-back lowering of `graph` (copies early or late per `traits.early_writeback`) on a
    backend that updates state in place, the functional step itself on one that does not."""
    prof = get_profile(profile, device=graph_device(graph))
    lowered = lower_writeback(graph, traits.early_writeback).graph if traits.inplace \
        else graph.graph
    return Prediction(estimate_time(lowered, prof, traits, measured_node_times),
                      simulate(lowered, traits))


def graph_device(graph: TrainGraph) -> str:
    for ph in graph.placeholders():
        spec = TrainGraph.info(ph).spec
        if spec is not None:
            return spec.device
    return "cpu"
