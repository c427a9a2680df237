"""The public entry point: glmc.optimize."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from glmc.compiler.passmanager import Pass
from glmc.runtime.trainer import Trainer, make_trainer


def optimize(model: nn.Module, example_inputs: Any, *, loss_fn: Any = None,
             optimizer: torch.optim.Optimizer | None = None, backend: str = "inductor",
             passes: str | list[Pass] | None = None, memory_budget: Any = None,
             precision: str | None = None, fusion: bool | None = None,
             strict: bool = False,
             disable: tuple[str, ...] = (), **options: Any) -> Trainer:
    """Capture, optimize and compile the training step of `model`.

    `example_inputs` is a tuple of positional args or a dict of keyword args. With
    `loss_fn=None` the model returns the loss (or an object with `.loss`); with `loss_fn`,
    the last batch element (or "labels") is the target: `loss_fn(model(*batch[:-1]), batch[-1])`.
    `optimizer` defaults to AdamW(lr=1e-3). `passes` is a pipeline string
    ("cleanup,recompute{budget=0.5}") or a list of Pass objects; `disable` names passes to skip.
    The default pipeline (`passes=None`) is fusion (auto patterns) and cleanup; `fusion=False`
    leaves fusion out. `precision="bf16"|"fp16"|"auto"` adds the precision pass, `fusion=True`
    the fusion pass, `memory_budget=` the recompute pass; with an explicit pipeline that names
    the pass already, passing the option too is a PipelineError.
    Further `options` are `TrainerOptions` fields: `profile` (cost-model device: None for the
    calibrated host CPU, or "h100", "h200", "a100", "kunpeng920"), `predict`, `measure`,
    `profile_guided`, `dump_dir`, `max_cache`, `retain_memory` (CPU: glibc malloc keeps freed
    memory, glmc.runtime.hostalloc; True by default), `cuda_graphs` (CUDA: the whole step recorded
    once as a CUDA graph and replayed, glmc.runtime.cudagraph; partial: not yet run on a GPU).
    """
    return make_trainer(model, example_inputs, loss_fn=loss_fn, optimizer=optimizer,
                        backend=backend, passes=passes, memory_budget=memory_budget,
                        precision=precision, fusion=fusion, strict=strict,
                        disable=frozenset(disable), **options)
