"""Tensor-parallel training on torch.distributed: the "tp" mesh over every process, each rank
the whole batch, and the parameters and optimizer state the `tensor_parallel` pass shards.

Every rank runs the same compiled step (an SPMD program) on the same batch; between steps each
sharded tensor lives here as this rank's block (`glmc.ir.plans.Tile`), and the user's
parameters and optimizer state are those blocks, like the local tensors of torch's
`parallelize_module`. Capturing the step again (a new batch shape) and checkpoints see the
whole tensors, gathered (`full_parameters`, `full_state`, `sharded_state_dict`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from glmc.errors import ConfigError
from glmc.ir.graph import MeshSpec, Role, TrainGraph
from glmc.ir.plans import TP, Tile, TpPlan
from glmc.parallel.data import DataParallel, Parallel, init_distributed
from glmc.trace.capture import Batch


class TensorParallel(DataParallel):
    """One rank's view of a tensor-parallel trainer (see the module docstring). Reuses the
    data-parallel strategy's checks (same model and options on every rank, same collectives),
    its failure guard and wait timing; the batch, the passes and the state differ."""

    def __init__(self, options: Parallel, device: str) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from glmc.analysis.comm import measure_link

        init_distributed(device, options.timeout_s)
        self.options = options
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if options.tp != self.world:
            raise ConfigError(f"parallel: tp={options.tp} on {self.world} processes; a "
                              "data-parallel dim beside tensor parallelism is not supported "
                              f"yet, run tp={self.world} (all the processes)")
        if options.zero or options.compress is not None or options.accumulate > 1:
            raise ConfigError("parallel: ZeRO, gradient compression and accumulation shard or "
                              "reduce over data-parallel ranks; with tp alone there are none "
                              "(drop zero/compress/accumulate)")
        self.nodes, self.per_node = 1, self.world
        self.mesh = self.root = init_device_mesh(device, (self.world,), mesh_dim_names=(TP,))
        self.spec = MeshSpec.of(self.mesh)
        self.plan = None
        self.tp: TpPlan | None = None
        self.accumulate = 1
        self.sums: dict[str, torch.Tensor] = {}
        self.comm_state: dict[str, torch.Tensor] = {}
        self.link = measure_link(device=device)
        self.store: dict[str, torch.Tensor] = {}  #: this rank's blocks by input target

    def passes(self, budgeted: bool) -> list[Any]:
        from glmc.passes.tensor_parallel import TensorParallelPass
        return [TensorParallelPass(size=self.world, plan=self.options.tp_plan)]

    def wants_micro_program(self, graph: TrainGraph) -> bool:
        return False

    def local(self, batch: Batch) -> Batch:
        """Every rank trains on the whole batch."""
        return batch

    def micro_batches(self, batch: Batch) -> list[Batch]:
        if self.accumulate != 1:
            raise ConfigError("parallel: gradient accumulation with tensor parallelism is not "
                              "supported yet; leave trainer.parallel.accumulate at 1")
        return [batch]

    # -- the compiled step ----------------------------------------------------------------------

    def install(self, graph: TrainGraph, model: nn.Module, optimizer: torch.optim.Optimizer
                ) -> None:
        """Keep this rank's block of every sharded tensor and point the user's tensors at it.
        Idempotent for a recompile with the same plan."""
        plan: TpPlan = graph.meta["tensor_parallel"]
        if self.tp is not None:
            if plan.tiles != self.tp.tiles:
                raise ConfigError("parallel: a recompiled step shards the state differently "
                                  "from the first; this is a glmc bug, please report it")
            return
        for target, tile in plan.tiles.items():
            container, slot = self._owner(target, model, optimizer)
            full = container[slot] if slot is not None else container.detach()
            block = tile.local(full.detach(), self.rank, self.world)
            self.store[target] = block
            if slot is not None:
                container[slot] = block
            else:
                container.data = block
        self.tp = plan

    @staticmethod
    def _owner(target: str, model: nn.Module, optimizer: torch.optim.Optimizer | None
               ) -> tuple[Any, str | None]:
        params = dict(model.named_parameters())
        if ":" in target:
            key, _, name = target.partition(":")
            return optimizer.state[params[name]], key
        return params[target], None

    def getters(self, graph: TrainGraph, getters: list) -> list:
        out = list(getters)
        for i, spec in enumerate(graph.inputs):
            if spec.target in self.store and spec.role in (Role.PARAMETER,
                                                           Role.OPTIMIZER_STATE):
                t = self.store[spec.target]
                out[i] = lambda _, t=t: t
        return out

    def _full(self, target: str, tile: Tile) -> torch.Tensor:
        shards = [torch.empty_like(self.store[target]) for _ in range(self.world)]
        dist.all_gather(shards, self.store[target].contiguous())
        return tile.full(shards)

    @contextlib.contextmanager
    def full_parameters(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
                        ) -> Iterator[None]:
        """The whole parameters (and optimizer state) for the duration; every rank enters."""
        if self.tp is None:
            yield
            return
        saved = []
        for target, tile in self.tp.tiles.items():
            if ":" in target and optimizer is None:
                continue
            container, slot = self._owner(target, model, optimizer)
            full = self._full(target, tile)
            if slot is None:
                saved.append((container, None, container.data))
                container.data = full
            else:
                saved.append((container, slot, container[slot]))
                container[slot] = full
        try:
            yield
        finally:
            for container, slot, data in saved:
                if slot is None:
                    container.data = data
                else:
                    container[slot] = data

    # -- state ----------------------------------------------------------------------------------

    def full_state(self, model: nn.Module, optimizer: torch.optim.Optimizer
                   ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        with self.full_parameters(model, optimizer):
            model_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
            names = {id(p): n for n, p in model.named_parameters()}
            optim = {f"{k}:{names[id(p)]}": v.detach().clone()
                     for p, st in optimizer.state.items() if id(p) in names
                     for k, v in st.items() if isinstance(v, torch.Tensor)}
        return model_sd, optim

    def sharded_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer
                           ) -> dict[str, dict[str, Any]]:
        """{"model": ..., "optim": ...}: the whole tensors (gathered; rank 0 writes them) for
        torch.distributed.checkpoint."""
        model_sd, optim = self.full_state(model, optimizer)
        return {"model": model_sd, "optim": optim, "comm": {}}

    def load_sharded(self, state: dict[str, dict[str, Any]], model: nn.Module,
                     optimizer: torch.optim.Optimizer) -> None:
        """Write whole tensors loaded by DCP back: this rank's block into the store."""
        params = dict(model.named_parameters())
        with torch.no_grad():
            for part in ("model", "optim"):
                for target, value in state[part].items():
                    tile = self.tp.tiles.get(target) if self.tp is not None else None
                    src = tile.local(value, self.rank, self.world) if tile else value
                    if part == "model":
                        if target in params:
                            params[target].data.copy_(src)
                        else:
                            model.state_dict()[target].copy_(src)
                    else:
                        key, _, name = target.partition(":")
                        optimizer.state[params[name]][key].copy_(src)

