"""The pass registry and the default pipeline."""
from __future__ import annotations

from glmc.errors import PipelineError
from glmc.passmanager import Pass, build_pass, split_pipeline


def registry() -> dict[str, type[Pass]]:
    # one line per pass; imported lazily so `import glmc` stays light
    from glmc.passes.cleanup import CleanupPass
    from glmc.passes.recompute import RecomputePass

    return {cls.name: cls for cls in (CleanupPass, RecomputePass)}


def default_pipeline(memory_budget: object = None) -> list[Pass]:
    reg = registry()
    passes = [
        reg["cleanup"](),  # first: removes joint-export leftovers so later passes see less
    ]
    if memory_budget is not None:
        passes.append(reg["recompute"](budget=str(memory_budget)))  # last: sees final graph
    return passes


def parse_pipeline(spec: str | list[Pass] | None, memory_budget: object = None) -> list[Pass]:
    """None -> default pipeline; a pipeline string; or a list of Pass objects. A memory budget
    adds `recompute` at the end of a pipeline that does not name it."""
    if spec is None:
        return default_pipeline(memory_budget)
    passes = _parse(spec)
    if memory_budget is not None and not any(p.name == "recompute" for p in passes):
        passes.append(registry()["recompute"](budget=str(memory_budget)))
    return passes


def _parse(spec: str | list[Pass]) -> list[Pass]:
    if isinstance(spec, list):
        return list(spec)
    reg = registry()
    passes = []
    for name, opts in split_pipeline(spec):
        if name not in reg:
            raise PipelineError(f"pipeline: unknown pass '{name}'; known: {', '.join(sorted(reg))}")
        passes.append(build_pass(reg[name], opts))
    return passes
