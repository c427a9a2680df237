"""How a Trainer spreads its step over processes: a strategy chosen from the parallel plan.

The Trainer compiles and runs one step the same way whatever the plan; what differs is asked of
its strategy — which slice of the batch this process trains on, which passes the plan adds
(sharding, compression), how the compiled step's inputs are found (sharded state lives in the
strategy's store), and what every rank must agree on. `SingleProcess` answers for one process;
`glmc.parallel.data.DataParallel` for data parallelism (ZeRO 0-3); a pipeline plan is run by
`glmc.parallel.pipeline.PipelineTrainer` instead of a Trainer (`strategy_for`).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from glmc.errors import ConfigError
from glmc.ir.graph import Role, TrainGraph
from glmc.parallel.data import (DataParallel, Parallel, carry_sums, micro_program, reset_sums,
                                split_micro_batches)
from glmc.trace.capture import Batch


class SingleProcess:
    """One process: the batch is the whole batch, no collectives, state in the user's tensors."""

    world = 1
    link = None  #: no link between ranks to price communication on
    spec = None  #: no device mesh
    #: the compiled step may give the user's parameters new storage (a backend's adopt)
    adopts_state = True
    #: the step's communication waits are worth measuring (they are none here)
    measures_comm = False

    def passes(self, budgeted: bool) -> list[Any]:
        return []

    def pipeline(self, passes: list[Any]) -> list[Any]:
        """The pipeline as this strategy runs it (after `passes` were added)."""
        return passes

    def guard(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def local(self, batch: Batch) -> Batch:
        return batch

    def micro_batches(self, batch: Batch) -> list[Batch]:
        return [batch]

    @contextlib.contextmanager
    def full_parameters(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
                        ) -> Iterator[None]:
        yield

    def largest(self, value: int) -> int:
        return value

    #: rank 0's value of a per-rank decision (PassContext.agree); one process decides alone
    agree = None

    def check_same(self, model: nn.Module, batch: Batch, options: Any) -> None:
        pass

    def check_collectives(self, graph: TrainGraph) -> None:
        pass

    def install(self, graph: TrainGraph, model: nn.Module, optimizer: torch.optim.Optimizer
                ) -> None:
        pass

    def bind(self, graph: TrainGraph) -> TrainGraph:
        return graph

    def wants_micro_program(self, graph: TrainGraph) -> bool:
        return False

    def getters(self, graph: TrainGraph, getters: list[Callable]) -> list[Callable]:
        return getters


class Accumulating(SingleProcess):
    """One process, gradient accumulation: the batch in `accumulate` micro-batches, the first
    k - 1 through the step's micro program (running sums, no update), the last through the
    whole step (`glmc.passes.accumulate`). `accumulate` may change between steps."""

    def __init__(self, accumulate: int) -> None:
        if not isinstance(accumulate, int) or accumulate < 1:
            raise ConfigError(f"accumulate: micro-batches per step must be a whole number >= 1,"
                              f" got {accumulate!r}")
        self.accumulate = accumulate
        self.sums: dict[str, torch.Tensor] = {}

    def passes(self, budgeted: bool) -> list[Any]:
        from glmc.passes.accumulate import AccumulatePass
        return [AccumulatePass()]

    def micro_batches(self, batch: Batch) -> list[Batch]:
        return split_micro_batches(batch, self.accumulate)

    def wants_micro_program(self, graph: TrainGraph) -> bool:
        return bool(graph.meta.get("accumulators"))

    def micro_program(self, graph: TrainGraph) -> TrainGraph:
        return micro_program(graph, graph.meta["accumulators"])

    def start_step(self, graph: TrainGraph) -> None:
        reset_sums(self.sums, graph.meta["accumulators"], self.accumulate)

    def carry(self, graph: TrainGraph, sums: list[torch.Tensor]) -> None:
        carry_sums(self.sums, graph, sums)

    def getters(self, graph: TrainGraph, getters: list[Callable]) -> list[Callable]:
        out = list(getters)
        for i, spec in enumerate(graph.inputs):
            if spec.role is Role.ACCUMULATOR:
                out[i] = lambda _, k=spec.target: self.sums[k]
        return out


def strategy_for(parallel: Any, device: str) -> SingleProcess | DataParallel:
    """The strategy of a Trainer's `parallel` option (None, a ZeRO stage, a dict, a
    `Parallel`, or a `ParallelPlan`: one process, accumulating when it asks for
    `accumulate` > 1; data parallel — its `data_parallel()` options)."""
    from glmc.parallel.plan import ParallelPlan
    plan = ParallelPlan.parse(parallel) if isinstance(parallel, str) else parallel
    if isinstance(plan, ParallelPlan) and plan.strategy == "single":
        return Accumulating(plan.accumulate) if plan.accumulate > 1 else SingleProcess()
    options = Parallel.of(parallel)
    if options is not None and options.tp > 1:
        from glmc.parallel.tensor import TensorParallel
        return TensorParallel(options, device)
    return SingleProcess() if options is None else DataParallel(options, device)


def pipeline_plan(parallel: Any) -> Any:
    """The plan of `parallel` when it asks for pipeline stages (a `ParallelPlan` or its
    spelling with `pp`), else None."""
    from glmc.parallel.plan import ParallelPlan
    plan = ParallelPlan.parse(parallel) if isinstance(parallel, str) else parallel
    return plan if isinstance(plan, ParallelPlan) and plan.strategy == "pipeline" else None


def pipeline_trainer_for(model: nn.Module, example_inputs: Any, loss_fn: Any,
                         optimizer: torch.optim.Optimizer | None, plan: Any,
                         options: dict[str, Any]) -> Any:
    """The PipelineTrainer of a pipeline plan over the processes of the default group, with
    the step options that apply to stages (the plan checks the others)."""
    from glmc.parallel.pipeline import plan_trainer
    from glmc.parallel.plan import StepOptions
    supported = {"parallel", "backend", "memory_budget", "precision", "fusion", "passes",
                 "disable", "cuda_graphs", "retain_memory"}
    unsupported = sorted(k for k, v in options.items() if k not in supported and v)
    if unsupported:
        raise ConfigError(f"optimize: {', '.join(unsupported)} cannot apply to a pipeline plan "
                          "yet; drop them or train without pp")
    backend = options.get("backend", "inductor")
    if options.get("retain_memory", True) and model_device(model) == "cpu":  # as the Trainer
        from glmc.runtime.hostalloc import retain_freed_memory
        retain_freed_memory()
    plan.validate(StepOptions(backend=backend, precision=options.get("precision"),
                              passes=options.get("passes"),
                              disable=tuple(options.get("disable") or ()),
                              cuda_graphs=bool(options.get("cuda_graphs"))))
    return plan_trainer(plan, model, optimizer, loss_fn, example_inputs,
                        memory_budget=options.get("memory_budget"), backend=backend,
                        precision=options.get("precision"), fusion=bool(options.get("fusion")))


def model_device(model: nn.Module) -> str:
    """The device type the model's parameters live on ("cpu" for a model without any)."""
    p = next(iter(model.parameters()), None)
    return p.device.type if p is not None else "cpu"
