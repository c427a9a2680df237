"""Tensor parallelism inside pipeline stages (3-D parallelism, `dp x pp x tp`).

Each pipeline stage runs on a tensor-parallel group of `size` ranks: the `tensor_parallel`
pass rewrites the stage's joint graph (AOTAutograd's forward + backward of the stage, before
the partition) into the local program of one rank (`TensorParallelPass.run_joint`: the same
seeds and sharding propagation as on a whole step), the partition then splits it into the
stage's forward and backward, and the update is captured on the blocks' shapes. Values cross
the cuts whole (`Replicate`): the rank of tp index t of stage s sends to the rank of tp index
t of stage s + 1, as Megatron-LM's pipeline does without its scatter-gather optimisation.

Global ranks are `(replica * S + pipeline rank) * size + tp index` (a tensor-parallel group is
consecutive ranks, inside one node). Every rank captures every stage, each as its own tp
index runs it (a vocab-parallel table's row offset and a dropout mask's block are that
rank's); `install` then keeps this rank's blocks of the sharded parameters and their
optimizer state in the user's tensors, as the whole-step tensor parallelism does
(`glmc.parallel.tensor`), and `gathered` makes them whole again for a while.
"""
from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from glmc.errors import ConfigError
from glmc.ir.graph import InputSpec, MeshSpec, OutputSpec
from glmc.ir.plans import TP, Tile, TpPlan


@dataclass
class StageTensorParallel:
    """The tensor-parallel side of a pipeline's stages for this rank (see the module
    docstring): `size` ranks per stage, this rank's `rank` among them, the `device_mesh`
    (dims "pp", "tp"; "dp", "pp", "tp" with replicas) the collectives run on;
    `plan`/`sequence`: the pass's pins and sequence parallelism, `choose` and `link` its
    cost-model choice. `plans[s]`: stage s's tiles; `stats[s]`: the pass's record of it."""

    size: int
    rank: int
    device_mesh: Any
    plan: str = ""
    sequence: bool = False
    choose: str = "layout"  #: the pass's `choose`
    link: str = ""  #: the pass's `link`: the tp collectives' (measured) link
    plans: dict[int, TpPlan] = field(default_factory=dict)
    stats: dict[int, Any] = field(default_factory=dict)
    #: per stage: the pass's seconds, and the joint graph's nodes before and after
    _timing: dict[int, tuple[float, int, int]] = field(default_factory=dict)
    #: (stage, parameter name) -> whole shape of each sharded parameter, kept when installed
    _shapes: dict[tuple[int, str], tuple[int, ...]] = field(default_factory=dict)

    @property
    def mesh(self) -> MeshSpec:
        return MeshSpec.of(self.device_mesh)

    def shard(self, index: int, joint: fx.GraphModule, inputs: list[InputSpec],
              outputs: list[OutputSpec | None]) -> fx.GraphModule:
        """`capture_stage`'s hook: stage `index`'s joint graph as this rank runs it."""
        import time

        from glmc.compiler.passmanager import PassContext
        from glmc.passes.tensor_parallel import TensorParallelPass
        p = TensorParallelPass(size=self.size, plan=self.plan, sequence=self.sequence,
                               choose=self.choose, link=self.link)
        t0, before = time.perf_counter(), len(joint.graph.nodes)
        ctx = PassContext(agree=self.agree) if self.choose == "time" else None
        local, plan, stats = p.run_joint(joint, inputs, outputs, self.mesh, self.device_mesh,
                                         ctx)
        self.plans[index], self.stats[index] = plan, stats
        self._timing[index] = (time.perf_counter() - t0, before, len(local.graph.nodes))
        return local

    def agree(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (`PassContext.agree`): every rank captures every
        stage (`build_program`), so each stage's choice is rank 0's for all of its tp ranks
        and replicas alike."""
        import torch.distributed as dist
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def record(self, index: int) -> Any:
        """The pass's record on stage `index` (for the pipeline's pass history)."""
        from glmc.compiler.passmanager import PassRecord
        seconds, before, after = self._timing[index]
        return PassRecord("tensor_parallel", {"size": self.size, "plan": self.plan,
                                              "sequence": self.sequence,
                                              "choose": self.choose}, True,
                          self.stats[index], seconds, before, after, stage=index, form="joint")

    def local_shapes(self, index: int, module: nn.Module) -> dict[str, tuple[int, ...]]:
        """`capture_stage`'s hook: the shape of this rank's block of each sharded parameter
        of stage `index` (what its update runs on)."""
        tiles = self.plans[index].tiles
        return {name: tuple(tiles[name].local(torch.empty(p.shape, device="meta"), self.rank,
                                              self.size).shape)
                for name, p in module.named_parameters() if name in tiles}

    def install(self, modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]
                ) -> None:
        """Every stage's sharded parameters (and each stage optimizer's state of the same
        shape) replaced by this rank's block, in place in the user's tensors; a parameter
        tied across stages (one tensor read by two stages, each with its own optimizer
        state) must be sharded alike in both. Every pin (`plan`) must name a parameter of
        some stage."""
        from glmc.passes.tensor_parallel import TensorParallelPass
        names = {n for m in modules for n, _ in m.named_parameters()}
        for glob, _ in TensorParallelPass(size=self.size, plan=self.plan).pins():
            if not any(fnmatch.fnmatchcase(n, glob) for n in names):
                raise ConfigError(f"pipeline: tp plan pin {glob!r} matches no parameter of "
                                  f"any stage; parameters are e.g. {sorted(names)[:4]}")
        seen: dict[int, tuple[Tile | None, int, str]] = {}
        for index, (module, opt) in enumerate(zip(modules, optimizers)):
            tiles = self.plans[index].tiles
            for name, p in module.named_parameters():
                tile = tiles.get(name)
                if id(p) in seen and seen[id(p)][0] != tile:
                    other, first, there = seen[id(p)]
                    raise ConfigError(
                        f"pipeline: the parameter {name!r} of stage {index} is {there!r} of "
                        f"stage {first}, sharded there as {other} and here as {tile}; pin "
                        f"both names alike, e.g. tp_plan='{there}:replicate;{name}:replicate'")
                if tile is None:
                    seen.setdefault(id(p), (None, index, name))
                    continue
                if id(p) not in seen:  # the tensor itself, once
                    seen[id(p)] = (tile, index, name)
                    self._shapes[(index, name)] = tuple(p.shape)
                    with torch.no_grad():
                        p.data = tile.local(p.detach(), self.rank, self.size)
                whole = self._shapes[seen[id(p)][1:]]  # the first copy's: a tied one's too
                self._shapes[(index, name)] = whole
                for key, v in opt.state.get(p, {}).items():  # this stage's optimizer's state
                    if isinstance(v, torch.Tensor) and tuple(v.shape) == whole:
                        opt.state[p][key] = tile.local(v.detach(), self.rank, self.size)

    @contextlib.contextmanager
    def gathered(self, modules: dict[int, nn.Module],
                 optimizers: dict[int, torch.optim.Optimizer]) -> Iterator[None]:
        """The whole parameters and optimizer state of the given stages (by index) for the
        duration (every rank of each stage's tensor-parallel group enters with them)."""
        from glmc.parallel.data import Swaps
        from glmc.parallel.tensor import gather_block
        group = self.device_mesh.get_group(TP)
        swaps = Swaps()
        blocks: dict[int, torch.Tensor] = {}  #: a tied parameter's block, gathered once
        for index, module in modules.items():
            opt = optimizers[index]
            tiles = self.plans[index].tiles
            for name, p in module.named_parameters():
                if name not in tiles:
                    continue
                whole = self._shapes[(index, name)]
                if id(p) not in blocks:
                    blocks[id(p)] = p.data
                    swaps.put(p, None, gather_block(p.data, tiles[name], whole, self.size,
                                                    group))
                for key, v in opt.state.get(p, {}).items():  # each stage optimizer's own
                    if isinstance(v, torch.Tensor) and v.shape == blocks[id(p)].shape:
                        swaps.put(opt.state[p], key,
                                  gather_block(v, tiles[name], whole, self.size, group))
        with swaps.restored():
            yield

    def saved(self, index: int, name: str, value: torch.Tensor
              ) -> tuple[Any, Callable[[], None] | None]:
        """`value` (stage `index`'s parameter `name`, or an optimizer state of it) as a
        checkpoint holds it: a sharded block as a DTensor (`Shard(dim)` over "tp": each rank
        writes its block, DCP loads in place and reshards), a block of interleaved parts
        whole (gathered: no placement says "interleaved"; every rank of the group calls
        this alike) with the copy back into the block to run after a load; anything else
        as it is. Returns (what to save, the copy back or None)."""
        from torch.distributed.tensor import Shard

        from glmc.parallel.tensor import block_dtensor, gather_block
        tile = self.plans[index].tiles.get(name)
        whole = self._shapes.get((index, name), ())
        if tile is None or value.dim() != len(whole):  # a replicated tensor, a step count
            return value, None
        if tile.groups > 1:
            full = gather_block(value, tile, whole, self.size, self.device_mesh.get_group(TP))

            def back() -> None:
                with torch.no_grad():
                    value.copy_(tile.local(full, self.rank, self.size))
            return full, back
        return block_dtensor(value, self.device_mesh[TP], [Shard(tile.dim)], whole), None
