"""glmc passes, one module each, and their registry: a new pass adds a module and one line in
`registry()`. Also the default pipeline and how API options add passes to a pipeline."""
from __future__ import annotations

from typing import Any

from glmc.compiler.passmanager import Effect, Pass, build_pass, check_order, split_pipeline
from glmc.errors import PipelineError

PRECISIONS = ("fp32", "bf16", "fp16", "auto")


def registry() -> dict[str, type[Pass]]:
    # one line per pass; imported lazily so `import glmc` stays light
    from glmc.passes.accumulate import AccumulatePass
    from glmc.passes.cleanup import CleanupPass
    from glmc.passes.clip import ClipPass
    from glmc.passes.compress import CompressPass
    from glmc.passes.fusion import FusionPass
    from glmc.passes.partition import PartitionPass
    from glmc.passes.precision import PrecisionPass
    from glmc.passes.recompute import RecomputePass
    from glmc.passes.shard import ShardPass
    from glmc.passes.tensor_parallel import TensorParallelPass

    return {cls.name: cls for cls in (FusionPass, PrecisionPass, CleanupPass, RecomputePass,
                                      ShardPass, CompressPass, PartitionPass,
                                      AccumulatePass, ClipPass, TensorParallelPass)}


def default_pipeline(memory_budget: Any = None, precision: str | None = None,
                     fusion: bool | None = None, device: str = "cpu") -> list[Pass]:
    """The passes that measured beneficial and safe, one per line, in the order they must run.
    `fusion=None` is the default choice; `True` is the fusion pass with its own defaults."""
    reg = registry()
    passes: list[Pass] = []
    if fusion is None:
        # first: rewrites the forward and re-derives the backward. Under bf16/fp16 on a CPU,
        # no attention fusion: ATen's bf16 CPU flash attention measured 1.2x slower on GLM small
        low_cpu = precision in ("bf16", "fp16", "auto") and device == "cpu"
        # the fused LM head + loss saves the logits' memory but is slower than Inductor's own
        # kernels: the fusion pass leaves it out on Inductor unless a memory budget is set;
        # attention likewise is timed both ways there (auto) unless memory matters. The
        # rules (selective, full recomputation) aim at no peak: they fuse as without one
        # (under tensor parallelism the fused head stayed whole on every rank: Llama x2
        # tp=2 selective 666 ms against 592 without recompute)
        budget = memory_budget is not None and str(memory_budget) not in ("selective", "full")
        attention = False if low_cpu else (True if budget else None)
        # the smallest peak: the whole gated MLP chunked, its projections made again in the
        # backward (held-out GLM 2x256: the MLP backward's projections were that peak)
        mlp = "chunked" if str(memory_budget) == "min" else "gated"
        passes.append(reg["fusion"](attention=attention, loss=True if budget else None,
                                    mlp=mlp))
    elif fusion:
        passes.append(reg["fusion"]())
    if precision not in (None, "fp32"):
        passes.append(reg["precision"](policy=precision))  # re-derives; edits the backward
    passes.append(reg["cleanup"]())  # removes joint-export leftovers so later passes see less
    if memory_budget is not None:
        passes.append(reg["recompute"](budget=str(memory_budget)))  # last: sees the final graph
    return passes


def parse_pipeline(spec: str | list[Pass] | None, memory_budget: Any = None,
                   precision: str | None = None, fusion: bool | None = None,
                   device: str = "cpu") -> list[Pass]:
    """None -> the default pipeline (fusion on unless `fusion=False`); a pipeline string; or a
    list of Pass objects. With an explicit pipeline, each API option adds its pass only when
    the pipeline does not name that pass; naming it *and* passing the option is an error (one
    place decides each option)."""
    if precision is not None and precision not in PRECISIONS:
        raise PipelineError(f"precision: unknown policy {precision!r}; use "
                            f"{', '.join(PRECISIONS)}")
    if spec is None:
        passes = default_pipeline(memory_budget, precision, fusion, device)
    else:
        passes = _parse(spec)
        _add_option(passes, "recompute", memory_budget, "memory_budget",
                    lambda: registry()["recompute"](budget=str(memory_budget)), last=True)
        low = precision if precision not in (None, "fp32") else None
        _add_option(passes, "precision", low, "precision",
                    lambda: registry()["precision"](policy=precision))
        _add_option(passes, "fusion", fusion or None, "fusion", lambda: registry()["fusion"]())
    check_order(passes)
    return passes


def with_pass(passes: list[Pass], extra: Pass) -> list[Pass]:
    """`passes` with `extra` added where its effects allow: before a pass that edits the
    backward in place (recompute plans memory on the step as it will run), else last. A
    pipeline that already names `extra`'s pass keeps its own."""
    if any(p.name == extra.name for p in passes):
        return list(passes)
    after = max((i + 1 for i, p in enumerate(passes) if Effect.REDERIVES in p.effects()),
                default=0)
    at = next((i for i, p in enumerate(passes) if i >= after and
               Effect.EDITS_BACKWARD in p.effects()), len(passes))
    out = [*passes[:at], extra, *passes[at:]]
    check_order(out)
    return out


def _add_option(passes: list[Pass], name: str, value: Any, option: str, make: Any,
                last: bool = False) -> None:
    if value is None:
        return
    named = [p for p in passes if p.name == name]
    if named:
        raise PipelineError(f"{option}: the pipeline names {named[0].spelling()} and "
                            f"{option}={value!r} was passed too; give it in one place")
    passes.insert(len(passes) if last else 0, make())


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
