"""The backend contract.

A backend has a `name`, `traits()` (what planning may know about it: glmc.ir.target), `supports
(node)` (None when it takes the node, else the reason) and `compile(graph) -> CompiledStep`.

The compiled step is a function over explicit state: `step(inputs) -> outputs`, both in the
order of the graph's signature (`graph.inputs`, `graph.outputs`). Writing new state into the
user's tensors is the runtime's job. A backend whose traits say `inplace` may instead be asked
for the write-back form (`inplace=True`, glmc.ir.writeback): it updates the state inputs in place
and returns the loss alone — how eager and Inductor keep their in-place speed.
"""
from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from glmc.errors import (BackendError, ConfigError, ExportError, GlmcError, Offense,
                         UnsupportedOpError)
from glmc.ir.graph import TrainGraph, op_name
from glmc.ir.target import BackendTraits
from glmc.ir.writeback import copy_graph, lower_writeback

StepFn = Callable[[list[torch.Tensor]], list[torch.Tensor]]


@dataclass
class CompiledStep:
    """What a backend returns: the callable plus what the report needs to know about it."""

    fn: StepFn
    backend: str
    inplace: bool = False  #: state is updated in place; the call returns [loss]
    fallbacks: list[Offense] = field(default_factory=list)
    compile_seconds: float = 0.0
    #: per-kernel timing hooks of this step (glmc.analysis.phases.Instrument), where the backend has them
    instrument: Any = None
    #: a functional step whose state outputs are memory the caller may keep: none aliases an
    #: input of the call or an output it returned before and still holds. The runtime then
    #: points the user's tensors at the outputs (`t.data = out`) instead of copying them back,
    #: and state stays where the backend wrote it (ONNX Runtime's bound buffers, TVM's arrays)
    adopt: bool = False
    #: the step in fx's boxed calling convention where the backend has it: `boxed(inputs)`
    #: takes the list over and clears it, so each input is freed after its last read (what
    #: a pipeline stage's backward and update want for their saved values and gradients)
    boxed: StepFn | None = None

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.fn(inputs)


class Backend(abc.ABC):
    name: str = "abstract"

    def __repr__(self) -> str:
        """The same on every rank (ranks compare their options' text): the class, no address.
        A backend with options shows them (TvmBackend)."""
        return f"{type(self).__name__}()"

    def traits(self) -> BackendTraits:
        return BackendTraits(self.name)

    def supports(self, node: fx.Node) -> str | None:
        """None if this backend compiles `node`; otherwise why it falls back or fails."""
        return None

    def unsupported(self, graph: TrainGraph) -> list[Offense]:
        offenses = []
        for n in graph.compute_nodes():
            reason = self.supports(n)
            if reason is not None:
                where = TrainGraph.info(n).source or TrainGraph.info(n).module or n.name
                offenses.append(Offense(f"{op_name(n)}: {reason}", where))
        return offenses

    #: a backend without per-op fallback (an external compiler: ONNX Runtime, TVM) names the
    #: ops it cannot take only when its compile fails (or first under `strict`): checking
    #: every compile would cost a fraction of it on every success
    per_op_fallback: bool = True
    #: how a backend without per-op fallback words "these ops do not lower"
    unsupported_message: str = "op(s) of the step are not supported"

    def check(self, graph: TrainGraph) -> None:
        """Refuse a step before compiling it (e.g. random ops a compiler cannot train with)."""

    def notes(self) -> list[Offense]:
        """What the last compile runs differently from eager (for the report)."""
        return []

    def compile(self, graph: TrainGraph, strict: bool = False, inplace: bool = False,
                fallbacks: list[Offense] | None = None) -> CompiledStep:
        """The step as a callable: functional (`inputs -> outputs`), or with `inplace` the
        write-back form (state inputs updated in place, returns [loss]). `fallbacks`: the ops
        this backend runs as fallbacks, when already known (a warm start's cached step)."""
        traits = self.traits()
        if inplace and not traits.inplace:
            raise ConfigError(f"backend '{self.name}': cannot update state in place; compile "
                              "the functional step and write the outputs back")
        self.check(graph)
        known = fallbacks is not None and not strict  # notes included
        if not known:
            fallbacks = self.unsupported(graph) if self.per_op_fallback or strict else []
        if strict and fallbacks:
            raise self._unsupported_error(fallbacks, None)
        start = time.perf_counter()
        gm = lower_writeback(graph, traits.early_writeback) if inplace else copy_graph(graph)
        try:
            fn = self._compile(gm, graph)
        except Exception as e:  # the compiler's own exception types; one typed error out
            if not self.per_op_fallback and (not isinstance(e, GlmcError) or
                                             isinstance(e, UnsupportedOpError)):
                offenses = self.unsupported(graph)  # name every op, not the first failure
                if offenses:
                    raise self._unsupported_error(offenses, e) from e
            if isinstance(e, GlmcError):
                raise
            text = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise BackendError(f"backend '{self.name}': compiling the step failed: "
                               f"{type(e).__name__}: {text}; try backend='eager' or report "
                               "it with the step (glmc.save_graph)") from e
        return CompiledStep(fn, self.name, inplace,
                            list(fallbacks) if known else fallbacks + self.notes(),
                            time.perf_counter() - start, getattr(fn, "instrument", None),
                            adopt=not inplace and getattr(fn, "adopt", False),
                            boxed=getattr(fn, "boxed", None))

    def _unsupported_error(self, offenses: list[Offense], cause: Exception | None
                           ) -> UnsupportedOpError:
        if self.per_op_fallback:
            return UnsupportedOpError(self.name, offenses)
        return ExportError(f"backend '{self.name}': {len(offenses)} {self.unsupported_message}",
                           offenses)

    @abc.abstractmethod
    def _compile(self, gm: fx.GraphModule, graph: TrainGraph) -> StepFn:
        """Compile `gm` (the functional step, or its write-back form) into `inputs -> outputs`."""


#: TrainGraph.meta key: a directory (the step cache entry of this step) where a backend may keep
#: its compiled step for the next process to load instead of compiling (warm start)
ARTIFACT_DIR = "artifact_dir"


def step_device(graph: TrainGraph) -> torch.device:
    """Where the step runs: the device of its state inputs (the learning rates are CPU
    scalars even for a CUDA step)."""
    for ph in graph.placeholders():
        spec = TrainGraph.info(ph).spec
        if spec is not None and spec.device != "cpu":
            return torch.device(spec.device)
    return torch.device("cpu")
