"""Parallel plan types the runtime reads: how the shard pass laid data-parallel state out
(`ShardPlan`, `Layout`, `Bucket`) and the names of the data-parallel mesh dims."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from glmc.ir.graph import MeshSpec, TensorSpec

DIM = "dp"  #: the mesh dim data parallelism runs over (on a 2-D mesh: NODE x LOCAL flattened)


NODE, LOCAL = "node", "local"  #: a 2-D data-parallel mesh: across nodes, inside a node


HIERARCHICAL = ("auto", "on", "off")


@dataclass(frozen=True)
class Layout:
    """How a tensor of `shape` is stored on each of `ranks` ranks: rows [r k, (r+1) k) of dim 0
    (`k = rows`), zero-padded; a 0-d tensor is one row."""

    shape: tuple[int, ...]
    ranks: int

    @property
    def rows(self) -> int:
        return math.ceil(self._d0 / self.ranks)

    @property
    def _d0(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def _rest(self) -> tuple[int, ...]:
        return tuple(self.shape[1:])

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (self.rows, *self._rest)

    @property
    def chunk(self) -> int:
        """Elements of one rank's shard."""
        return self.rows * math.prod(self._rest)

    @property
    def padded_rows(self) -> int:
        return self.rows * self.ranks

    def local(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's padded shard of `full` (a new tensor)."""
        rows = full.reshape(self._d0, *self._rest)
        out = rows.new_zeros(self.local_shape)
        lo, hi = rank * self.rows, min((rank + 1) * self.rows, self._d0)
        if hi > lo:
            out[: hi - lo].copy_(rows[lo:hi])
        return out

    def valid_rows(self, rank: int) -> int:
        """Rows of rank `rank`'s shard that hold data (the rest is padding)."""
        return max(0, min(self.rows, self._d0 - rank * self.rows))

    def full(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The tensor from every rank's padded shard, in rank order."""
        return torch.cat(shards)[: self._d0].reshape(self.shape)


@dataclass
class Bucket:
    """Parameters whose gradients (or gathered values) travel in one collective."""

    params: list[str]
    nbytes: int
    collective: str
    #: all-reduced in three steps: reduce-scatter in the node, all-reduce across, all-gather
    hierarchical: bool = False
    #: the alpha-beta predictions the choice was made on: {"flat_s", "hierarchical_s"}
    predicted: dict[str, float] | None = None


@dataclass
class ShardPlan:
    """What the shard pass did, for the runtime and the report."""

    stage: int
    mesh: MeshSpec
    dim: str
    #: inputs stored sharded, by InputSpec target (stage >= 1: optimizer state; 3: params)
    layouts: dict[str, Layout] = field(default_factory=dict)
    grad_buckets: list[Bucket] = field(default_factory=list)
    gather_buckets: list[Bucket] = field(default_factory=list)  #: new params (1-2) / fwd (3)
    accumulators: dict[str, TensorSpec] = field(default_factory=dict)  #: by input target

    @property
    def ranks(self) -> int:
        return self.mesh.size(self.dim)


TP = "tp"  #: the mesh dim tensor parallelism runs over


def block_rows(extent: int, rank: int, ranks: int) -> tuple[int, int]:
    """(start, length) of rank `rank`'s block of `extent` rows cut in `ranks` (torch.chunk's
    and DTensor's `Shard` cut: blocks of ceil(extent / ranks), the last ones shorter)."""
    chunk = math.ceil(extent / ranks)
    start = min(rank * chunk, extent)
    return start, min(chunk, extent - start)


@dataclass(frozen=True)
class Tile:
    """How a tensor-parallel parameter (and its optimizer state) is stored: `kind` "column"
    (dim 0, output features) or "row" (dim 1, input features), sharded in equal blocks over
    the ranks of "tp". `groups` > 1: the tensor is `groups` equal parts along `dim` (a fused
    gate/up weight), each sharded on its own, so rank r holds block r of every part."""

    kind: str
    dim: int
    groups: int = 1

    def local(self, full: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
        """Rank `rank`'s block of `full` (a copy)."""
        parts = torch.chunk(full, self.groups, self.dim)
        return torch.cat([p.narrow(self.dim, *block_rows(p.shape[self.dim], rank, ranks))
                          for p in parts], self.dim).clone()

    def full(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from every rank's block, in rank order."""
        pieces = [torch.chunk(s, self.groups, self.dim) for s in shards]
        return torch.cat([pieces[r][g] for g in range(self.groups)
                          for r in range(len(shards))], self.dim)


@dataclass(frozen=True)
class TpPlan:
    """What the tensor_parallel pass decided: ranks of "tp" and the tile of every sharded
    parameter and optimizer state (by input target); the rest is replicated."""

    size: int
    tiles: dict[str, Tile] = field(default_factory=dict)
