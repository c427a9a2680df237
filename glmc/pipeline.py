"""The pass registry and the default pipeline."""
from __future__ import annotations

from glmc.errors import PipelineError
from glmc.passmanager import Pass, build_pass, split_pipeline


def registry() -> dict[str, type[Pass]]:
    # one line per pass; imported lazily so `import glmc` stays light
    from glmc.passes.cleanup import CleanupPass
    from glmc.passes.fusion import FusionPass
    from glmc.passes.precision import PrecisionPass
    from glmc.passes.recompute import RecomputePass

    return {cls.name: cls for cls in (FusionPass, PrecisionPass, CleanupPass, RecomputePass)}

#: passes that re-derive the backward from the forward; they must precede passes that rewrite
#: the backward themselves, whose work would otherwise be thrown away
_REDERIVING = ("fusion", "precision")
_BACKWARD_REWRITING = ("precision", "recompute")  # precision also re-casts in the backward


def default_pipeline(memory_budget: object = None, precision: str | None = None,
                     fusion: bool = False) -> list[Pass]:
    reg = registry()
    passes: list[Pass] = []
    if fusion:
        passes.append(reg["fusion"]())  # first: rewrites the forward, re-derives the backward
    if precision not in (None, "fp32"):
        passes.append(reg["precision"](policy=precision))  # first: re-derives the backward
    passes.append(reg["cleanup"]())  # removes joint-export leftovers so later passes see less
    if memory_budget is not None:
        passes.append(reg["recompute"](budget=str(memory_budget)))  # last: sees final graph
    return passes


def parse_pipeline(spec: str | list[Pass] | None, memory_budget: object = None,
                   precision: str | None = None, fusion: bool = False) -> list[Pass]:
    """None -> default pipeline; a pipeline string; or a list of Pass objects. A memory budget
    adds `recompute` at the end of a pipeline that does not name it; a precision adds
    `precision{policy=...}` at the start of one that does not name it."""
    if precision is not None and precision not in ("fp32", "bf16", "fp16", "auto"):
        raise PipelineError(f"precision: unknown policy {precision!r}; use fp32, bf16, fp16 "
                            "or auto")
    if spec is None:
        return default_pipeline(memory_budget, precision, fusion)
    passes = _parse(spec)
    if memory_budget is not None and not any(p.name == "recompute" for p in passes):
        passes.append(registry()["recompute"](budget=str(memory_budget)))
    named = [p for p in passes if p.name == "precision"]
    if precision not in (None, "fp32") and not named:
        passes.insert(0, registry()["precision"](policy=precision))
    elif precision is not None and named and named[0].policy != precision:  # type: ignore[attr-defined]
        raise PipelineError(f"precision: the pipeline names precision{{policy="
                            f"{named[0].policy}}} but precision={precision!r} was "  # type: ignore[attr-defined]
                            "passed too; give it once")
    if fusion and not any(p.name == "fusion" for p in passes):
        passes.insert(0, registry()["fusion"]())
    _check_order(passes)
    return passes


def _check_order(passes: list[Pass]) -> None:
    names = [p.name for p in passes]
    for r in _REDERIVING:
        for b in _BACKWARD_REWRITING:
            if r != b and r in names and b in names and names.index(b) < names.index(r):
                raise PipelineError(f"pipeline: '{r}' re-derives the backward and would undo "
                                    f"'{b}'; put '{r}' before '{b}'")


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
