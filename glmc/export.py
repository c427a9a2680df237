"""Export of the optimized step (partial: graph source and signature; weights with the
reports/export issue)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def export_step(trainer: Any, directory: str) -> list[str]:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    graph = trainer.graph
    step_py = out / "step.py"
    step_py.write_text("# glmc: optimized training step (ATen fx graph)\nimport torch\n"
                       + graph.code())
    sig = out / "signature.json"
    sig.write_text(json.dumps({
        "inputs": [{"role": s.role.value, "target": s.target} for s in graph.inputs],
        "outputs": [{"kind": s.kind.value, "target": s.target} for s in graph.outputs],
    }, indent=2))
    return [str(step_py), str(sig)]
