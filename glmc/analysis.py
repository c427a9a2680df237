"""Predicted step time and peak memory of a step graph on a backend and device profile."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from glmc.cost import CostEstimate, DeviceProfile, estimate_time, get_profile
from glmc.ir import TrainGraph
from glmc.memory import MemoryEstimate, simulate


@dataclass
class Prediction:
    time: CostEstimate
    memory: MemoryEstimate

    def to_dict(self, points: int = 400) -> dict[str, Any]:
        return {"time": self.time.to_dict(), "memory": self.memory.to_dict(points)}

    def brief(self) -> dict[str, Any]:
        return {"seconds": self.time.seconds, "peak_bytes": self.memory.peak_bytes,
                "transient_bytes": self.memory.transient_bytes}


def predict(graph: TrainGraph, backend: Any, profile: DeviceProfile | str | None = None,
            measured_node_times: dict[str, float] | None = None) -> Prediction:
    """Model the program `backend` runs: the write-back lowering of `graph`, fused or not."""
    from glmc.backends import get_backend
    from glmc.backends.base import lower_writeback
    if isinstance(backend, str):
        backend = get_backend(backend)
    prof = get_profile(profile, device=graph_device(graph))
    lowered = lower_writeback(graph, backend.early_writeback).graph
    return Prediction(estimate_time(lowered, prof, backend.fuses, measured_node_times),
                      simulate(lowered, backend.fuses))


def graph_device(graph: TrainGraph) -> str:
    for ph in graph.placeholders():
        spec = TrainGraph.info(ph).spec
        if spec is not None:
            return spec.device
    return "cpu"
