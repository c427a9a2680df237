"""The pass registry and the default pipeline."""
from __future__ import annotations

from glmc.errors import PipelineError
from glmc.passmanager import Pass, build_pass, split_pipeline


def registry() -> dict[str, type[Pass]]:
    # one line per pass; imported lazily so `import glmc` stays light
    from glmc.passes.cleanup import CleanupPass

    return {cls.name: cls for cls in (CleanupPass,)}


def default_pipeline() -> list[Pass]:
    reg = registry()
    return [
        reg["cleanup"](),  # first: removes joint-export leftovers so later passes see less
    ]


def parse_pipeline(spec: str | list[Pass] | None) -> list[Pass]:
    """None -> default pipeline; a pipeline string; or a list of Pass objects."""
    if spec is None:
        return default_pipeline()
    if isinstance(spec, list):
        return spec
    reg = registry()
    passes = []
    for name, opts in split_pipeline(spec):
        if name not in reg:
            raise PipelineError(f"pipeline: unknown pass '{name}'; known: {', '.join(sorted(reg))}")
        passes.append(build_pass(reg[name], opts))
    return passes
