"""Tensor-parallel training on torch.distributed: the "tp" mesh (or ("dp", "tp") with
data-parallel replicas, ZeRO 0-3 over "dp"), each tensor-parallel group its replica's rows of
the batch, and the parameters and optimizer state the `tensor_parallel` pass shards.

Every rank runs the same compiled step (an SPMD program) on the same batch; between steps each
sharded tensor lives here as this rank's block (`glmc.ir.plans.Tile`), and the user's
parameters and optimizer state are those blocks, like the local tensors of torch's
`parallelize_module`. Capturing the step again (a new batch shape) and checkpoints see the
whole tensors, gathered (`full_parameters`, `full_state`, `sharded_state_dict`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from glmc.errors import ConfigError
from glmc.ir.graph import MeshSpec, TrainGraph
from glmc.ir.plans import DIM, TP, Tile, TpPlan, block_rows
from glmc.parallel.data import (DataParallel, Parallel, Swaps, init_distributed,
                                micro_program, reset_sums, rows_of, split_micro_batches)
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
        tp = options.tp
        if self.world % tp:
            raise ConfigError(f"parallel: tp={tp} does not divide the {self.world} processes; "
                              f"run a multiple of {tp} (the rest are data-parallel replicas)")
        if options.nodes not in (None, 1):
            raise ConfigError("parallel: with tp, several nodes are not supported yet (drop "
                              "nodes)")
        if options.compress is not None and self.world == tp:
            raise ConfigError(f"parallel: compress with tp={tp} on {self.world} processes: it "
                              "compresses the gradients sent between data-parallel replicas "
                              f"and there are none; run {2 * tp} or more processes or drop "
                              "compress")
        self.dp = self.world // tp
        if options.zero and self.dp == 1:
            raise ConfigError(f"parallel: zero={options.zero} with tp={tp} on {self.world} "
                              "processes: ZeRO shards over data-parallel replicas and there are "
                              f"none; run {2 * tp} or more processes (a multiple of {tp}) or "
                              "drop zero")
        self.nodes, self.per_node = 1, self.world
        if self.dp > 1:  # dp x tp, ranks numbered dp-major: a tp group is consecutive ranks
            self.root = init_device_mesh(device, (self.dp, tp), mesh_dim_names=(DIM, TP))
        else:
            self.root = init_device_mesh(device, (tp,), mesh_dim_names=(TP,))
        self.mesh = self.root
        self.spec = MeshSpec.of(self.root)
        self.tp_rank, self.tp_size = self.root.get_local_rank(TP), tp
        self.dp_rank = self.root.get_local_rank(DIM) if self.dp > 1 else 0
        self.tp_group = self.root.get_group(TP)
        if self.dp > 1:  # ZeRO shards each rank's blocks over its data-parallel replicas
            self.shard_rank, self.shard_world = self.dp_rank, self.dp
            self.shard_group = self.root.get_group(DIM)
        self.plan = None
        self.tp: TpPlan | None = None
        #: micro-batches per step (tp alone: the accumulate pass's running sums of this
        #: rank's gradient blocks; with replicas, the shard pass's of its buckets)
        self.accumulate = options.accumulate
        self.sums: dict[str, torch.Tensor] = {}
        self.comm_state: dict[str, torch.Tensor] = {}
        self.link = measure_link(device=device)
        self.store: dict[str, torch.Tensor] = {}  #: this rank's blocks by input target
        #: the whole shape of every sharded tensor (`gather_block` cuts by it)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._owners: dict[str, tuple[Any, str]] = {}

    def passes(self, budgeted: bool) -> list[Any]:
        """The tensor_parallel pass, then (with data-parallel replicas) the shard pass's
        gradient all-reduce over "dp"."""
        from glmc.passes.tensor_parallel import TensorParallelPass
        from glmc.passes.accumulate import AccumulatePass
        from glmc.analysis.comm import link_figures
        out: list[Any] = [TensorParallelPass(size=self.tp_size, plan=self.options.tp_plan,
                                             sequence=self.options.tp_sequence,
                                             choose=self.options.tp_choose,
                                             link=link_figures(self.link))]
        if self.options.accumulate > 1 and self.dp == 1:  # with replicas: the shard pass
            out.append(AccumulatePass())  # sums its buckets (ZeRO's accumulation)
        return out + (self.options.passes(self.link, budgeted) if self.dp > 1 else [])

    def pipeline(self, passes: list[Any]) -> list[Any]:
        return tp_pipeline(passes)

    def wants_micro_program(self, graph: TrainGraph) -> bool:
        return bool(_accumulators(graph))

    def micro_program(self, graph: TrainGraph) -> TrainGraph:
        return micro_program(graph, _accumulators(graph))

    def start_step(self, graph: TrainGraph) -> None:
        reset_sums(self.sums, _accumulators(graph), self.accumulate)

    def local(self, batch: Batch) -> Batch:
        """The rows of this rank's data-parallel replica (the whole batch with tp alone): the
        ranks of one tensor-parallel group read the same rows."""
        if self.dp == 1:
            return batch
        return rows_of(batch, self.dp_rank, self.dp, "data-parallel replicas")

    def micro_batches(self, batch: Batch) -> list[Batch]:
        """The batch in `accumulate` micro-batches (every rank of the group the same)."""
        k = self.accumulate
        if k > 1 and not self.options.accumulate > 1:
            raise ConfigError("parallel: accumulate > 1 needs a step compiled for it; pass "
                              "parallel={'tp': T, 'accumulate': k} with k > 1 when creating "
                              "the trainer")
        return split_micro_batches(batch, k)

    # -- the compiled step ----------------------------------------------------------------------

    def install(self, graph: TrainGraph, model: nn.Module, optimizer: torch.optim.Optimizer
                ) -> None:
        """Keep this rank's block of every sharded tensor and point the user's tensors at it;
        then, with data-parallel replicas, the shard pass's ZeRO layouts cut those blocks
        (and the whole tensors tp leaves replicated) into this replica's rows. Idempotent for
        a recompile with the same plan."""
        plan: TpPlan = graph.meta["tensor_parallel"]
        if self.tp is None:
            self._same_generators(graph)
            for target, tile in plan.tiles.items():
                container, slot = self._owner(target, model, optimizer)
                full = container[slot] if slot is not None else container.detach()
                block = tile.local(full.detach(), self.tp_rank, self.tp_size)
                self.store[target] = block
                self.shapes[target] = tuple(full.shape)
                if slot is not None:
                    container[slot] = block
                else:
                    container.data = block
            self.tp = plan
        elif plan.tiles != self.tp.tiles:
            raise ConfigError("parallel: a recompiled step shards the state differently "
                              "from the first; this is a glmc bug, please report it")
        if "sharding" in graph.meta:  # the data-parallel replicas' plan (ZeRO 0-3)
            super().install(graph, model, optimizer)

    def _same_generators(self, graph: TrainGraph) -> None:
        """A step with random ops (dropout) draws one process's masks on every rank of a
        tensor-parallel group (passes/tensor_parallel.py `_dropout`): their generators must
        be in the same state, else each rank keeps a block of a different mask."""
        if not any(TrainGraph.info(n).rng is not None for n in graph.compute_nodes()):
            return
        cuda = self.root.device_type == "cuda"
        state = torch.cuda.get_rng_state() if cuda else torch.random.get_rng_state()
        mine = hashlib.sha256(state.numpy().tobytes()).hexdigest()[:16]
        every: list[Any] = [None] * self.tp_size
        dist.all_gather_object(every, mine, group=self.tp_group)
        if len(set(every)) > 1:
            raise ConfigError(f"parallel: the step draws random numbers (dropout) and the "
                              f"ranks of a tensor-parallel group hold different generator "
                              f"states ({every}); seed every rank the same "
                              "(torch.manual_seed(S) before glmc.optimize, as glmc train "
                              "--seed does) so that each keeps its block of the same masks")

    @staticmethod
    def _owner(target: str, model: nn.Module, optimizer: torch.optim.Optimizer | None
               ) -> tuple[Any, str | None]:
        params = dict(model.named_parameters())
        if ":" in target:
            key, _, name = target.partition(":")
            return optimizer.state[params[name]], key
        return params[target], None

    def _full(self, target: str, block: torch.Tensor, tile: Tile) -> torch.Tensor:
        return gather_block(block, tile, self.shapes[target], self.tp_size, self.tp_group)

    @contextlib.contextmanager
    def full_parameters(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
                        ) -> Iterator[None]:
        """The whole parameters (and optimizer state) for the duration: ZeRO's rows gathered
        over "dp" into this rank's blocks, the blocks over "tp"; every rank enters."""
        with super().full_parameters(model, optimizer), self._whole_blocks(model, optimizer):
            yield

    @contextlib.contextmanager
    def _whole_blocks(self, model: nn.Module, optimizer: torch.optim.Optimizer | None
                      ) -> Iterator[None]:
        if self.tp is None:
            yield
            return
        swaps = Swaps()
        for target, tile in self.tp.tiles.items():
            if ":" in target and optimizer is None:
                continue
            container, slot = self._owner(target, model, optimizer)
            block = container[slot] if slot is not None else container.detach()
            swaps.put(container, slot, self._full(target, block, tile))
        with swaps.restored():
            yield

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
        """{"model": ..., "optim": ...} for torch.distributed.checkpoint: each tensor-parallel
        block as a DTensor (`Shard(dim)` over "tp", `Replicate()` over "dp": every rank
        writes only its block, DCP reshards on load — to one process, to data parallelism,
        to another tp); a fused weight stored in interleaved parts (no DTensor placement
        says that) and the replicated tensors whole. Under ZeRO each rank's rows are
        gathered over "dp" into its block first."""
        from torch.distributed.tensor import Replicate, Shard

        tiles = self.tp.tiles if self.tp is not None else {}
        with DataParallel.full_parameters(self, model, optimizer):  # ZeRO rows -> tp blocks
            model_sd: dict[str, Any] = {k: v.detach() for k, v in model.state_dict().items()}
            names = {id(p): n for n, p in model.named_parameters()}
            optim: dict[str, Any] = {f"{k}:{names[id(p)]}": v for p, st in
                                     optimizer.state.items() if id(p) in names
                                     for k, v in st.items() if isinstance(v, torch.Tensor)}
            for table in (model_sd, optim):
                for target, block in list(table.items()):
                    tile = tiles.get(target)
                    if tile is None:
                        continue
                    if tile.groups > 1:
                        table[target] = self._full(target, block, tile)
                        continue
                    placements = [Shard(tile.dim) if d == TP else Replicate()
                                  for d in self.root.mesh_dim_names]
                    table[target] = block_dtensor(block, self.root, placements,
                                                  self.shapes[target])
        return {"model": model_sd, "optim": optim, "comm": {}}

    def load_sharded(self, state: dict[str, dict[str, Any]], model: nn.Module,
                     optimizer: torch.optim.Optimizer) -> None:
        """Write what DCP loaded (`sharded_state_dict`'s shapes) back: this rank's block (a
        DTensor's local tensor, or cut from a whole tensor) into the store."""
        from torch.distributed.tensor import DTensor

        params = dict(model.named_parameters())
        layouts = self.plan.layouts if self.plan is not None else {}
        with torch.no_grad():
            for part in ("model", "optim"):
                for target, value in state[part].items():
                    tile = self.tp.tiles.get(target) if self.tp is not None else None
                    if isinstance(value, DTensor):
                        src = value.to_local()
                    else:
                        src = tile.local(value, self.tp_rank, self.tp_size) if tile else value
                    if target in layouts:  # ZeRO's rows of the block (the user's are views)
                        self.store[target].copy_(layouts[target].local(src, self.dp_rank))
                    elif part == "model":
                        if target in params:
                            params[target].data.copy_(src)
                        else:
                            model.state_dict()[target].copy_(src)
                    else:
                        key, _, name = target.partition(":")
                        optimizer.state[params[name]][key].copy_(src)


def block_dtensor(block: torch.Tensor, mesh: Any, placements: list[Any],
                  whole: tuple[int, ...]) -> Any:
    """`block` (this rank's, sharing its storage) as a DTensor of the contiguous `whole`
    shape: DTensor would otherwise take the global extent as ranks x this block's (wrong
    for a vocabulary cut unevenly)."""
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(block, mesh, placements, run_check=False,
                              shape=torch.Size(whole),
                              stride=torch.empty(whole, device="meta").stride())


def gather_block(block: torch.Tensor, tile: Tile, whole: tuple[int, ...], size: int,
                 group: Any) -> torch.Tensor:
    """The whole tensor (shape `whole`) from every rank's `block` over the tensor-parallel
    `group` of `size` ranks (every rank calls it). Each rank's extent along the tile's dim is
    `Tile.local`'s cut of each part (uneven where a vocabulary does not divide by tp)."""
    part = whole[tile.dim] // tile.groups
    extents = [block_rows(part, r, size)[1] * tile.groups for r in range(size)]
    longest, d = max(extents), tile.dim
    padded = block
    if block.shape[d] < longest:  # all_gather takes equal shapes: pad, then trim
        shape = list(block.shape)
        shape[d] = longest - block.shape[d]
        padded = torch.cat([block, block.new_zeros(shape)], d)
    shards = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(shards, padded.contiguous(), group=group)
    return tile.full([s.narrow(d, 0, e) for s, e in zip(shards, extents)])


def tp_pipeline(passes: list[Any]) -> list[Any]:
    """The fusion pass leaves the LM head and its cross-entropy unfused unless asked for
    (`loss=true`, e.g. under a memory budget): the tensor_parallel pass then shards the
    head over the vocabulary into torch's loss-parallel cross-entropy, where glmc's fused
    head would stay whole on every rank. Likewise the MLP stays `gated` (its projections
    are what the pass shards), not `chunked`. The precision pass's fused fp32
    cross-entropy (`fuse_loss`, one glmc op of the head and the loss) is left out for the
    same reason: the head stays a matmul into `_log_softmax`."""
    out = []
    for p in passes:
        if p.name == "fusion":
            p = dataclasses.replace(p, loss=False if p.loss is None else p.loss,
                                    mlp="gated")
        elif p.name == "precision" and p.fuse_loss:
            p = dataclasses.replace(p, fuse_loss=False)
        out.append(p)
    return out


def _accumulators(graph: TrainGraph) -> dict[str, Any]:
    """The step's running sums: the accumulate pass's (tp alone) or the shard pass's buckets
    (with data-parallel replicas)."""
    if graph.meta.get("accumulators"):
        return graph.meta["accumulators"]
    plan = graph.meta.get("sharding")
    return plan.accumulators if plan is not None else {}
