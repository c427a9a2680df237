"""What passes and analyses may know about the backend that will run a step.

Passes and the cost/memory models never import a backend: the runtime asks the chosen backend
for its `BackendTraits` and hands them down (in `PassContext.traits`, or as an argument to the
models). A backend describes itself through this one small interface:

    traits = get_backend("inductor").traits()
    traits.fuses                  # True: pointwise ops are inlined into kernels
    traits.fusion(graph)          # which nodes it inlines, what each kernel reads
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch.fx as fx


class FusionModel(Protocol):
    """A backend's model of which nodes become kernels of their own."""

    def inlined(self, node: fx.Node) -> bool:
        """True when `node` is computed inside its consumers' kernels (no buffer of its own)."""

    def reads(self, node: fx.Node) -> list[fx.Node]:
        """The materialized values (inputs, kernel outputs) the kernel rooted at `node` reads."""

    def kernel_cost(self, node: fx.Node, cost: Any) -> Any:
        """`cost` (a glmc.analysis.cost.OpCost) with the bytes read by the whole kernel."""


@dataclass(frozen=True)
class BackendTraits:
    """The facts about a backend that planning depends on.

    `fusion` maps a step graph to the backend's fusion model; None means every op is its own
    kernel (eager). `early_writeback`: new state is written into its input as soon as possible,
    freeing the new tensor early (see glmc.ir.writeback). `inplace`: the backend can run the
    write-back form of a step (state updated in place); otherwise the runtime copies outputs.
    `fused_update`: see the field.
    """

    name: str = "eager"
    fusion: Callable[[fx.Graph], FusionModel] | None = None
    early_writeback: bool = True
    inplace: bool = True
    #: the backend runs ATen's fused optimizer kernels (`_fused_adamw`) in place on the state
    #: (the fusion pass's `update=auto` picks them there)
    fused_update: bool = False

    @property
    def fuses(self) -> bool:
        return self.fusion is not None


EAGER = BackendTraits()
