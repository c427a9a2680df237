"""`shard`: data parallelism with ZeRO stages 0-3, as communication in the step itself.

Runs on the step one rank computes (its slice of the global batch) over a 1-D data-parallel
mesh (`PassContext.mesh`, dim "dp" of N ranks), and turns it into an SPMD program
(`glmc.ir.program`): gradients are averaged over the ranks by torch's functional collectives,
placed in the graph, in buckets that follow the backward's production order.

    stage 0   grads all-reduced (avg)              update on the full params, state replicated
    stage 1   grads all-reduced                    update on this rank's shard; state sharded;
                                                   new params all-gathered
    stage 2   grads reduce-scattered                as stage 1, but only the local grad shard
                                                   is ever whole on a rank after its bucket
    stage 3   as stage 2, and params stored sharded: all-gathered before their first forward
              use (the next bucket prefetched), again before their first backward use

Sharding is by rows (dim 0, like FSDP2's `Shard(0)`): a parameter of shape (d0, ...) keeps
rows [r * k, (r + 1) * k) on rank r, k = ceil(d0 / N), padded with zero rows (a 0-d parameter
counts as one row). The update rule is elementwise, so updating the shard is updating the
parameter; padding rows stay zero (zero grad, zero state, zero param — and are cut off when
gathered). Each bucket is one collective on one flat buffer laid out rank-major:

    reduce-scatter:  cat([pad(g_j).view(N, c_j) for j in bucket], dim=1).view(-1)
                       -> reduce_scatter_tensor(avg) -> split(c_j) -> view(k_j, *rest_j)
    all-gather:      cat([shard_j.view(c_j)]) -> all_gather_into_tensor
                       -> view(N, sum c) -> split(c_j, dim=1) -> reshape(N k_j, ...)[:d0_j]

Overlap (`overlap=true`): each collective is issued as soon as its input exists and waited
for right before its first reader, so the backward keeps computing while buckets reduce (and
the forward while the next stage-3 bucket gathers); `overlap=false` waits at once. The loss
the step returns is averaged over the ranks too (the global batch's loss for a mean loss).

Hierarchical all-reduce (`hierarchical=auto|on|off`, stages 0-1): on a 2-D mesh of nodes x
ranks per node (dims "node" and "local", "dp" their flattening — glmc.parallel.data builds it from
`nodes=` or torchrun's LOCAL_WORLD_SIZE), a gradient bucket's all-reduce becomes

    pad(flat, to a multiple of L) -> reduce_scatter_tensor(avg) over "local"   (1/L each)
      -> all_reduce(avg) over "node"  -> all_gather_into_tensor over "local" -> drop the pad

so only 1/L of the bucket crosses the slow inter-node link per rank. `auto` takes it for a
bucket when the alpha-beta model (glmc.analysis.comm.choose_allreduce, with the `intra_link` and
`inter_link` profiles) predicts it faster than one flat ring over all ranks; the plan keeps
both predictions per bucket. Equal to the flat all-reduce up to the order of the sums. The
three collectives run back to back (each reads the previous wait): the bucket's last
all-gather overlaps the backward, its first two do not.

The pass records a `ShardPlan` in `graph.meta["sharding"]`: which inputs are stored sharded
and how (`Layout`), for the runtime that keeps those shards (glmc.parallel.data).
"""
from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.fx as fx

from glmc.analysis.comm import LinkProfile, choose_allreduce, collective_seconds, get_link
from glmc.compiler.passmanager import Effect, Need, Pass, PassContext, PassResult
from glmc.errors import ConfigError, PassError
from glmc.ir.graph import (ACCUMULATES, GRAD_BUCKET, GRAD_OF, RANK_ARG, REGATHER_S, MeshSpec,
                           OutputKind, Phase, Role, TensorSpec, TrainGraph)
from glmc.ir.plans import DIM, HIERARCHICAL, LOCAL, NODE, Bucket, Layout, ShardPlan
from glmc.ir.program import NodeBuilder, SpmdProgram, insert_collective

aten = torch.ops.aten


#: cheap forward ops a backward may read instead of the parameter itself (`t(w)` saved for
#: `mm(grad, t(w))`); under stage 3 they are made again from the backward's gathered copy
_PARAM_VIEWS = {aten.t.default, aten.permute.default, aten.transpose.int, aten.view.default,
                aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
                aten.unsqueeze.default, aten.squeeze.dim, aten.slice.Tensor, aten.alias.default,
                aten.detach.default, aten._to_copy.default, aten.clone.default,
                aten.select.int}


@dataclass(frozen=True)
class ShardStats:
    stage: int
    ranks: int
    grad_buckets: int
    gather_buckets: int
    collectives: int
    bytes_per_rank: dict[str, int]  #: bytes each rank sends into each collective kind
    sharded_inputs: int
    hierarchical_buckets: int = 0  #: gradient buckets all-reduced in node/across/node steps


@dataclass(frozen=True)
class ShardPass(Pass):
    """Data parallelism with ZeRO-style sharding (see the module docstring)."""

    name = "shard"
    stage: int = 0
    bucket_mb: float = 25.0
    overlap: bool = True
    #: gradient accumulation over micro-batches: the step takes running sums (one per bucket,
    #: and the loss) and 1/k as inputs, so k may change between steps
    accumulate: bool = False
    #: hierarchical all-reduce of stage 0-1 gradient buckets on a (node, local) mesh: "auto"
    #: where the communication model predicts it faster, "on", "off"
    hierarchical: str = "auto"
    intra_link: str = "nvlink4"  #: link profile inside a node (glmc.analysis.comm.get_link)
    inter_link: str = "infiniband-ndr"  #: link profile between nodes
    #: stage 3, the backward's parameters: "always" gathered again (FSDP's reshard after
    #: forward); "budget" the forward's gathered copies kept for the backward, each forward
    #: gather marked with its predicted time (`REGATHER_S`) so the recompute pass, planning
    #: activations and gathers under one memory budget, gathers again what does not fit
    reshard: str = "always"
    #: the link the collectives cross on a 1-D mesh, pricing a gather again ("" : intra_link)
    link: str = ""

    def needs(self) -> frozenset[Need]:
        return frozenset({Need.STEP})

    def effects(self) -> frozenset[Effect]:
        if self.accumulate:  # the running sums and 1/k become step inputs
            return frozenset({Effect.INSERTS_COMM, Effect.ADDS_STATE})
        return frozenset({Effect.INSERTS_COMM})

    def run(self, graph: TrainGraph, ctx: PassContext) -> PassResult:
        if self.stage not in (0, 1, 2, 3):
            raise ConfigError(f"shard: stage must be 0, 1, 2 or 3, got {self.stage}")
        if self.bucket_mb <= 0:
            raise ConfigError(f"shard: bucket_mb must be positive, got {self.bucket_mb}")
        if self.reshard not in ("always", "budget"):
            raise ConfigError(f"shard: reshard must be 'always' or 'budget', got "
                              f"{self.reshard!r}")
        get_link(self.link or self.intra_link)  # an unknown link fails before any rewrite
        mesh = ctx.mesh
        if mesh is None or DIM not in mesh.dim_names + tuple(f for f, _ in mesh.flattened):
            raise ConfigError("shard: the step is not compiled for a data-parallel mesh; run it "
                              "through glmc.optimize(..., parallel=...) or glmc compile --nproc N "
                              "(or torchrun ... -m glmc compile --zero S)")
        if self.stage >= 1 and graph.meta.get("loss_scaling") is not None:
            raise ConfigError("shard: stages 1-3 with fp16 loss scaling are not supported yet "
                              "(the overflow check would see one shard); use stage 0 or bf16")
        if "sharding" in graph.meta:
            raise PassError("shard: the step is already sharded")
        self._check_topology(mesh)
        plan = _Sharder(graph, mesh, self).run()
        graph.meta["sharding"] = plan
        SpmdProgram(graph, mesh).verify()
        colls = [n for n in graph.compute_nodes() if TrainGraph.info(n).comm is not None
                 and TrainGraph.info(n).comm.collective != "wait_tensor"]
        volume: dict[str, int] = {}
        for n in colls:
            kind = TrainGraph.info(n).comm.collective
            spec = TrainGraph.info(n.args[0]).spec
            volume[kind] = volume.get(kind, 0) + (spec.nbytes if spec else 0)
        stats = ShardStats(self.stage, plan.ranks, len(plan.grad_buckets),
                           len(plan.gather_buckets), len(colls), volume, len(plan.layouts),
                           sum(b.hierarchical for b in plan.grad_buckets))
        return PassResult(True, stats)

    def _check_topology(self, mesh: MeshSpec) -> None:
        if self.hierarchical not in HIERARCHICAL:
            raise ConfigError(f"shard: hierarchical must be one of {', '.join(HIERARCHICAL)}, "
                              f"got {self.hierarchical!r}")
        self.links()  # unknown link profiles fail here, before any rewrite
        if self.hierarchical != "on":
            return
        if NODE not in mesh.dim_names or LOCAL not in mesh.dim_names:
            raise ConfigError("shard: hierarchical=on needs a 2-D data-parallel mesh (nodes x "
                              "ranks per node); pass parallel={'nodes': N} (--nodes N) or launch "
                              "with torchrun on several nodes")
        if self.stage >= 2:
            raise ConfigError(f"shard: hierarchical all-reduce applies to ZeRO stages 0-1; "
                              f"stage {self.stage} reduce-scatters the gradients. Use zero 0/1 "
                              "or hierarchical=off")

    def links(self) -> tuple[LinkProfile, LinkProfile]:
        """The (intra-node, inter-node) link profiles."""
        return get_link(self.intra_link), get_link(self.inter_link)


class _Sharder:
    def __init__(self, graph: TrainGraph, mesh: MeshSpec, opts: ShardPass) -> None:
        self.graph, self.g, self.mesh, self.opts = graph, graph.graph, mesh, opts
        self.n = mesh.size(DIM)
        self.emit = NodeBuilder(graph, "shard")
        self.fake = self.emit.fake
        self.plan = ShardPlan(opts.stage, mesh, DIM)
        self.params = {s.target: ph for ph, s in zip(graph.placeholders(), graph.inputs)
                       if s.role is Role.PARAMETER}
        self.layout = {name: Layout(TrainGraph.info(ph).spec.shape, self.n)
                       for name, ph in self.params.items()}
        self.forward_full: dict[fx.Node, fx.Node] = {}  #: stage 3: param -> forward gather
        self._scale: fx.Node | None = None

    # -- node building --
    def contiguous(self, x: fx.Node, phase: Phase, role: Role) -> fx.Node:
        """`x`, or a contiguous copy of it where its layout cannot be viewed flat (a
        channels-last parameter or gradient: ConvNeXt's convolutions)."""
        if x.meta["val"].is_contiguous():
            return x
        return self.emit(aten.clone.default, (x,), phase, role,
                         {"memory_format": torch.contiguous_format}, like=x)

    def rows(self, x: fx.Node, lay: Layout, phase: Phase, role: Role) -> fx.Node:
        """`x` (full shape) as (N k, *rest): reshaped to rows and zero-padded."""
        x = self.contiguous(x, phase, role)
        if not lay.shape:
            x = self.emit(aten.view.default, (x, [1]), phase, role, like=x)
        pad = lay.padded_rows - lay._d0
        if pad:
            spec = [0, 0] * len(lay._rest) + [0, pad]
            x = self.emit(aten.constant_pad_nd.default, (x, spec, 0.0), phase, role, like=x)
        return x

    def my_shard(self, x: fx.Node, lay: Layout, phase: Phase, role: Role) -> fx.Node:
        """This rank's rows of replicated `x` (rank bound per process: RANK_ARG)."""
        padded = self.rows(x, lay, phase, role)
        grid = self.emit(aten.view.default, (padded, [self.n, lay.chunk]), phase, role, like=x)
        mine = self.emit(aten.select.int, (grid, 0, 0), phase, role, like=x)
        mine.meta[RANK_ARG] = (DIM, 2)
        return self.emit(aten.view.default, (mine, list(lay.local_shape)), phase, role, like=x)

    # -- the pass --
    def run(self) -> ShardPlan:
        grads = _gradients(self.graph)
        order = sorted(grads, key=lambda name: _position(self.g, grads[name]))
        stage = self.opts.stage
        if stage == 3:
            self._shard_parameters()
        waits = self._reduce_gradients(order, grads)
        if stage >= 1:
            self._shard_update(waits)
        self._average_loss()
        _settle_waits(self.graph, self.opts.overlap)
        self.g.lint()
        self.graph.gm.recompile()
        return self.plan

    def _buckets(self, names: list[str], collective: str) -> list[Bucket]:
        """`names` in order, cut into buckets of at most bucket_mb (at least one parameter),
        never mixing dtypes or optimizer groups."""
        limit = self.opts.bucket_mb * 2**20
        group = _group_of(self.graph)
        out: list[Bucket] = []
        for name in names:
            spec = TrainGraph.info(self.params[name]).spec
            nbytes = spec.nbytes if self.opts.stage < 3 else self.layout[name].chunk * \
                self.n * torch.empty((), dtype=spec.dtype).element_size()
            last = out[-1] if out else None
            if last is not None and last.nbytes + nbytes <= limit and \
                    _same_kind(self.params, last.params[0], name, group):
                last.params.append(name)
                last.nbytes += nbytes
            else:
                out.append(Bucket([name], nbytes, collective))
        return out

    def _reduce_gradients(self, order: list[str], grads: dict[str, fx.Node]
                          ) -> dict[str, fx.Node]:
        """Averages every gradient over the ranks in buckets; returns per parameter what the
        update now reads (the full average, or this rank's shard of it for stages 2-3)."""
        scatter = self.opts.stage >= 2
        kind = "reduce_scatter_tensor" if scatter else "all_reduce"
        self.plan.grad_buckets = self._buckets(order, kind)
        out: dict[str, fx.Node] = {}
        for b, bucket in enumerate(self.plan.grad_buckets):
            nodes = [grads[p] for p in bucket.params]
            last = max(nodes, key=lambda n: _position(self.g, n))
            readers = {p: [u for u in grads[p].users
                           if TrainGraph.info(u).phase is Phase.OPTIMIZER] for p in bucket.params}
            with self.g.inserting_before(last.next):
                flat = self._flatten(bucket.params, nodes, scatter, Phase.BACKWARD, Role.GRADIENT)
                if self.opts.accumulate:
                    flat = self._accumulate(flat, f"acc:grad{b}")
            pad = 0
            if self._hierarchical(bucket):
                first_coll, wait, pad = self._hierarchical_all_reduce(flat)
            else:
                wait = insert_collective(self.graph, flat, kind, self.mesh, DIM, "avg",
                                         readers=[])
                first_coll = wait.args[0]
            first_coll.meta[GRAD_BUCKET] = b  # what compress finds and rewrites
            first = _earliest(self.g, [r for rs in readers.values() for r in rs])
            pieces = self._unflatten(bucket.params, wait, scatter, Phase.OPTIMIZER, Role.UPDATE,
                                     first, pad)
            for p, piece in zip(bucket.params, pieces):
                for r in readers[p]:
                    r.replace_input_with(grads[p], piece)
                out[p] = piece
        return out

    def _hierarchical(self, bucket: Bucket) -> bool:
        """Whether `bucket`'s all-reduce goes node / across / node (see the module docstring);
        records both predictions on the bucket."""
        opts = self.opts
        if opts.hierarchical == "off" or bucket.collective != "all_reduce" or \
                NODE not in self.mesh.dim_names or LOCAL not in self.mesh.dim_names:
            return False
        nodes, per_node = self.mesh.size(NODE), self.mesh.size(LOCAL)
        intra, inter = opts.links()
        padded = math.ceil(bucket.nbytes / per_node) * per_node
        choice = choose_allreduce(padded, nodes, per_node, intra, inter)
        bucket.predicted = {"flat_s": choice.flat_seconds,
                            "hierarchical_s": choice.hierarchical_seconds}
        bucket.hierarchical = opts.hierarchical == "on" or choice.best == "hierarchical"
        return bucket.hierarchical

    def _hierarchical_all_reduce(self, flat: fx.Node) -> tuple[fx.Node, fx.Node, int]:
        """Average `flat` over every rank in three collectives: reduce-scatter inside the
        node, all-reduce across nodes, all-gather inside the node. Returns the first
        collective, the last wait (the average, padded) and the padding."""
        from torch.distributed.tensor import Partial

        per_node = self.mesh.size(LOCAL)
        numel = flat.meta["val"].numel()
        pad = (-numel) % per_node
        x = flat
        if pad:
            with self.g.inserting_after(flat):
                x = self.emit(aten.constant_pad_nd.default, (flat, [0, pad], 0.0),
                              *_kind(flat), like=flat)
        info = TrainGraph.info(x)  # a partial sum on every rank: Partial on both dims
        x.meta["glmc"] = info.replace(spec=dataclasses.replace(
            info.spec, placements=tuple(Partial("avg") for _ in self.mesh.shape)))
        scattered = insert_collective(self.graph, x, "reduce_scatter_tensor", self.mesh, LOCAL,
                                      "avg", readers=[])
        across = insert_collective(self.graph, scattered, "all_reduce", self.mesh, NODE, "avg",
                                   readers=[])
        gathered = insert_collective(self.graph, across, "all_gather_into_tensor", self.mesh,
                                     LOCAL, readers=[])
        return scattered.args[0], gathered, pad

    def _accumulate(self, value: fx.Node, target: str) -> fx.Node:
        """(value + running sum) * (1/k): the sum, marked ACCUMULATES, is what a micro-batch
        step outputs; the scaled total is what this step communicates."""
        val = value.meta["val"]
        acc = self._input(target, val.shape, val.dtype, val.device)
        total = self.emit(aten.add.Tensor, (value, acc), *_kind(value), like=value)
        total.meta[ACCUMULATES] = target
        return self.emit(aten.mul.Tensor, (total, self.scale), *_kind(value), like=value)

    def _input(self, target: str, shape: Any, dtype: torch.dtype, device: Any) -> fx.Node:
        """A new step input (Role.ACCUMULATOR), recorded in the plan."""
        ph = self.emit.input(target, Role.ACCUMULATOR, shape, dtype, device)
        self.plan.accumulators[target] = TrainGraph.info(ph).spec
        return ph

    @property
    def scale(self) -> fx.Node:
        """The 1/k input (float32 0-d), made on first use."""
        if self._scale is None:
            device = self.graph.placeholders()[0].meta["val"].device
            self._scale = self._input("acc:scale", (), torch.float32, device)
        return self._scale

    def _flatten(self, names: list[str], nodes: list[fx.Node], rank_major: bool, phase: Phase,
                 role: Role) -> fx.Node:
        """One flat buffer of `nodes`: plain concatenation, or rank-major rows for a
        reduce-scatter (see the module docstring)."""
        parts = []
        for name, x in zip(names, nodes):
            lay = self.layout[name]
            if rank_major:
                x = self.rows(x, lay, phase, role)
                parts.append(self.emit(aten.view.default, (x, [self.n, lay.chunk]), phase, role,
                                       like=x))
            else:
                x = self.contiguous(x, phase, role)
                parts.append(self.emit(aten.view.default, (x, [-1]), phase, role, like=x))
        if rank_major:
            cat = self.emit(aten.cat.default, (parts, 1), phase, role, like=nodes[-1])
            return self.emit(aten.view.default, (cat, [-1]), phase, role, like=nodes[-1])
        return self.emit(aten.cat.default, (parts,), phase, role, like=nodes[-1])

    def _unflatten(self, names: list[str], flat: fx.Node, sharded: bool, phase: Phase,
                   role: Role, anchor: fx.Node, pad: int = 0) -> list[fx.Node]:
        """The pieces of a flat buffer (and `pad` trailing elements, dropped), as
        per-parameter shards or full tensors; inserted right before `anchor`."""
        sizes = [self.layout[p].chunk if sharded else math.prod(self.layout[p].shape)
                 for p in names] + ([pad] if pad else [])
        with self.g.inserting_before(anchor):
            split = self.emit(aten.split_with_sizes.default, (flat, sizes), phase, role,
                              like=flat)
            out = []
            for k, p in enumerate(names):
                piece = self.emit(operator.getitem, (split, k), phase, role, like=flat)
                shape = self.layout[p].local_shape if sharded else self.layout[p].shape
                out.append(self.emit(aten.view.default, (piece, list(shape)), phase, role,
                                     like=flat))
        return out

    def _gather(self, shards: list[fx.Node], phase: Phase, role: Role,
                where: fx.Node) -> fx.Node:
        """All-gather `shards` as one flat buffer, issued right after `where`; the wait."""
        with self.g.inserting_before(where.next):
            parts = [self.emit(aten.view.default, (s, [-1]), phase, role, like=s)
                     for s in shards]
            flat = self.emit(aten.cat.default, (parts,), phase, role, like=shards[-1])
        return insert_collective(self.graph, flat, "all_gather_into_tensor", self.mesh, DIM,
                                 readers=[])

    def _unpack(self, names: list[str], wait: fx.Node, phase: Phase, role: Role,
                before: fx.Node) -> list[fx.Node]:
        """Full tensors from a gathered rank-major flat buffer, inserted before `before`."""
        chunks = [self.layout[p].chunk for p in names]
        with self.g.inserting_before(before):
            grid = self.emit(aten.view.default, (wait, [self.n, sum(chunks)]), phase, role,
                             like=wait)
            split = self.emit(aten.split_with_sizes.default, (grid, chunks, 1), phase, role,
                              like=wait)
            out = []
            for k, p in enumerate(names):
                lay = self.layout[p]
                piece = self.emit(operator.getitem, (split, k), phase, role, like=wait)
                x = self.emit(aten.reshape.default, (piece, [lay.padded_rows, *lay._rest]),
                              phase, role, like=wait)
                if lay.padded_rows != lay._d0:
                    x = self.emit(aten.slice.Tensor, (x, 0, 0, lay._d0), phase, role, like=wait)
                if list(x.meta["val"].shape) != list(lay.shape):
                    x = self.emit(aten.view.default, (x, list(lay.shape)), phase, role,
                                  like=wait)
                out.append(x)
        return out

    # -- stages 1-3: the update on this rank's shard --
    def _shard_update(self, grads: dict[str, fx.Node]) -> None:
        phs = dict(zip((s.target for s in self.graph.inputs), self.graph.placeholders()))
        stage3 = self.opts.stage == 3
        if self.opts.stage == 1:  # the all-reduced grad in full: the update reads its shard
            for p, g in grads.items():
                readers = [u for u in g.users if TrainGraph.info(u).phase is Phase.OPTIMIZER]
                with self.g.inserting_before(_earliest(self.g, readers)):
                    mine = self.my_shard(g, self.layout[p], Phase.OPTIMIZER, Role.UPDATE)
                for r in readers:
                    r.replace_input_with(g, mine)
        for spec in self.graph.inputs:  # per-element optimizer state is stored sharded
            if spec.role is not Role.OPTIMIZER_STATE:
                continue
            _, _, owner = spec.target.partition(":")
            ph = phs[spec.target]
            if owner in self.layout and TrainGraph.info(ph).spec.shape == self.layout[owner].shape:
                self._reshape_input(ph, spec.target, self.layout[owner])
        if not stage3:  # the update reads this rank's rows of the replicated parameter
            for p, ph in self.params.items():
                readers = [u for u in ph.users if TrainGraph.info(u).phase is Phase.OPTIMIZER]
                if not readers:
                    continue
                with self.g.inserting_before(_earliest(self.g, readers)):
                    mine = self.my_shard(ph, self.layout[p], Phase.OPTIMIZER, Role.UPDATE)
                for r in readers:
                    r.replace_input_with(ph, mine)
        self._repropagate(Phase.OPTIMIZER)
        outs = dict(zip(self.graph.outputs, self.graph.output_values()))
        new = {s.target: v for s, v in outs.items() if s.kind is OutputKind.PARAM}
        for p, v in new.items():
            if tuple(v.meta["val"].shape) != self.layout[p].local_shape:
                raise PassError(f"shard: the update of {p!r} does not keep the shard's shape "
                                f"{self.layout[p].local_shape}; it is not elementwise")
        if stage3:
            return  # new parameters stay sharded
        order = [p for p, _ in sorted(new.items(), key=lambda kv: _position(self.g, kv[1]))]
        self.plan.gather_buckets = self._buckets(order, "all_gather_into_tensor")
        out_node = self.graph.output_node()
        for bucket in self.plan.gather_buckets:
            shards = [new[p] for p in bucket.params]
            last = max(shards, key=lambda n: _position(self.g, n))
            wait = self._gather(shards, Phase.OPTIMIZER, Role.UPDATE, last)
            fulls = self._unpack(bucket.params, wait, Phase.OPTIMIZER, Role.UPDATE, out_node)
            for p, full in zip(bucket.params, fulls):
                out_node.replace_input_with(new[p], full)

    def _reshape_input(self, ph: fx.Node, target: str, lay: Layout) -> None:
        """Input `ph` now arrives as this rank's padded shard."""
        from torch.distributed.tensor import Replicate, Shard

        info = TrainGraph.info(ph)
        with self.fake:
            ph.meta["val"] = torch.empty(lay.local_shape, dtype=info.spec.dtype,
                                         device=ph.meta["val"].device)
        # Shard(0) over "dp" (every dim it covers); another dim (a tensor-parallel "tp")
        # keeps what it had: the rows are of this rank's tensor-parallel block
        dp = self.mesh.dims(DIM)
        had = info.spec.placements or tuple(Replicate() for _ in self.mesh.shape)
        shards = tuple(Shard(0) if i in dp else had[i] for i in range(self.mesh.ndim))
        ph.meta["glmc"] = info.replace(spec=TensorSpec(lay.local_shape, info.spec.dtype,
                                                       info.spec.device, shards))
        self.plan.layouts[target] = lay

    def _repropagate(self, phase: Phase) -> None:
        """New fake values for `phase`'s nodes (their inputs changed shape)."""
        for n in self.g.nodes:
            if n.op != "call_function" or TrainGraph.info(n).phase is not phase:
                continue
            args, kwargs = fx.map_arg((n.args, n.kwargs), lambda a: a.meta["val"])
            with self.fake:
                n.meta["val"] = n.target(*args, **kwargs)
            info = TrainGraph.info(n)
            spec = TensorSpec.of(n.meta["val"])
            n.meta["glmc"] = info.replace(spec=spec)

    # -- stage 3: parameters stored sharded --
    def _shard_parameters(self) -> None:
        fwd_first: dict[str, fx.Node] = {}
        bwd_first: dict[str, fx.Node] = {}
        chains = _param_views(self.graph, self.params)
        for p, ph in self.params.items():
            readers = [u for u in ph.users if TrainGraph.info(u).phase is Phase.FORWARD]
            if readers:
                fwd_first[p] = min(readers, key=lambda n: _position(self.g, n))
            late = _backward_readers(ph, chains)
            if late:
                bwd_first[p] = min(late, key=lambda n: _position(self.g, n))
            self._reshape_input(ph, p, self.layout[p])
        keep = self.opts.reshard == "budget"
        for phase, first in ((Phase.FORWARD, fwd_first), (Phase.BACKWARD, bwd_first)):
            if keep and phase is Phase.BACKWARD:  # the backward reads the forward's copies
                first = {p: u for p, u in first.items() if not self._keep(self.params[p])}
            order = sorted(first, key=lambda p: _position(self.g, first[p]))
            buckets = self._buckets(order, "all_gather_into_tensor")
            if phase is Phase.FORWARD:
                self.plan.gather_buckets = buckets
            self._gather_for(phase, buckets, first, chains)

    def _keep(self, ph: fx.Node) -> bool:
        """reshard=budget: the backward's readers of parameter `ph` read the forward's
        gathered copy (False: no forward gather to read)."""
        full = self.forward_full.get(ph)
        if full is not None:
            _redirect(ph, full, Phase.BACKWARD)
        return full is not None

    def _gather_for(self, phase: Phase, buckets: list[Bucket], first: dict[str, fx.Node],
                    chains: dict[fx.Node, str]) -> None:
        """Gather each bucket before its first use in `phase`, issuing bucket i + 1 when
        bucket i is first used (prefetch one ahead; all at once without overlap)."""
        role = Role.ACTIVATION if phase is Phase.FORWARD else Role.GRADIENT
        issue_after = None
        for bucket in buckets:
            use = _earliest(self.g, [first[p] for p in bucket.params])
            where = use.prev
            if self.opts.overlap and issue_after is not None:
                where = issue_after  # in flight while the previous bucket's layer computes
            wait = self._gather([self.params[p] for p in bucket.params], phase, role, where)
            if phase is Phase.FORWARD and self.opts.reshard == "budget":
                link = get_link(self.opts.link or self.opts.intra_link)
                wait.args[0].meta[REGATHER_S] = collective_seconds(
                    "all_gather_into_tensor", bucket.nbytes, self.n, link)
            fulls = self._unpack(bucket.params, wait, phase, role, use)
            for p, full in zip(bucket.params, fulls):
                self._rewire(self.params[p], full, phase, chains)
            issue_after = fulls[-1]

    def _rewire(self, ph: fx.Node, full: fx.Node, phase: Phase, chains: dict[fx.Node, str]
                ) -> None:
        """Readers of parameter `ph` in `phase` read `full`; in the backward, forward views of
        the parameter that the backward reads are made again from `full`."""
        _redirect(ph, full, phase)
        if phase is not Phase.BACKWARD:
            self.forward_full[ph] = full
            return
        made: dict[fx.Node, fx.Node] = {ph: full}
        if ph in self.forward_full:  # forward views now read the forward's gathered copy
            made[self.forward_full[ph]] = full
        for v in [v for v, owner in chains.items() if owner == ph.name]:
            late = [u for u in v.users if TrainGraph.info(u).phase is Phase.BACKWARD]
            if not late:
                continue
            first = min(late, key=lambda n: _position(self.g, n))
            with self.g.inserting_before(first):
                copy = self._copy_chain(v, made)
            for u in late:
                u.replace_input_with(v, copy)

    def _copy_chain(self, v: fx.Node, made: dict[fx.Node, fx.Node]) -> fx.Node:
        if v in made:
            return made[v]
        args = fx.map_arg(v.args, lambda a: self._copy_chain(a, made))
        copy = self.emit(v.target, args, Phase.BACKWARD, Role.GRADIENT, dict(v.kwargs), like=v)
        made[v] = copy
        return copy

    def _average_loss(self) -> None:
        outs = self.graph.output_values()
        k = next((i for i, s in enumerate(self.graph.outputs) if s.kind is OutputKind.LOSS), None)
        if k is None:  # an update on its own (a pipeline stage's): no loss
            return
        loss = outs[k]
        if self.opts.accumulate:  # the mean over the micro-batches
            with self.g.inserting_before(self.graph.output_node()):
                total = self._accumulate(loss, "acc:loss")
            self.graph.output_node().replace_input_with(loss, total)
            loss = total
        insert_collective(self.graph, loss, "all_reduce", self.mesh, DIM, "avg",
                          readers=[self.graph.output_node()])


def _redirect(ph: fx.Node, full: fx.Node, phase: Phase) -> None:
    """`phase`'s readers of parameter `ph` (not the shard pass's own nodes) read `full`."""
    for u in list(ph.users):
        if u is not full and TrainGraph.info(u).created_by != "shard" and \
                TrainGraph.info(u).phase is phase:
            u.replace_input_with(ph, full)


def _settle_waits(graph: TrainGraph, overlap: bool) -> None:
    """Move every wait to right before its first reader (overlap) or leave it right after
    its collective."""
    if not overlap:
        return
    g = graph.graph
    for n in list(g.nodes):
        info = n.meta.get("glmc")
        if info is None or info.comm is None or info.comm.collective != "wait_tensor":
            continue
        first = _first_reader(n)
        if first is not None and first.prev is not n:
            first.prepend(n)


def _kind(node: fx.Node) -> tuple[Phase, Role]:
    info = TrainGraph.info(node)
    return info.phase, info.role


def _position(g: fx.Graph, node: fx.Node) -> int:
    # a linear scan: called O(parameters) times on graphs of a few thousand nodes
    for i, n in enumerate(g.nodes):
        if n is node:
            return i
    raise PassError(f"shard: node '{node.name}' is not in the graph")


def _earliest(g: fx.Graph, nodes: Iterable[fx.Node]) -> fx.Node:
    wanted = set(nodes)
    return next(n for n in g.nodes if n in wanted)


def _first_reader(node: fx.Node) -> fx.Node | None:
    users = set(node.users)
    n = node.next
    while n.op != "root":
        if n in users:
            return n
        n = n.next
    return None


def _gradients(graph: TrainGraph) -> dict[str, fx.Node]:
    """Each updated parameter's gradient node (marked GRAD_OF by the step builder)."""
    updated = [s.target for s in graph.outputs if s.kind is OutputKind.PARAM]
    # an update on its own (a pipeline stage's) takes the gradients as inputs
    found: dict[str, fx.Node] = {s.target: ph for ph, s in zip(graph.placeholders(), graph.inputs)
                                 if s.role is Role.GRADIENT and s.target in updated}
    for n in graph.graph.nodes:
        for p in n.meta.get(GRAD_OF, ()):
            if any(TrainGraph.info(u).phase is Phase.OPTIMIZER for u in n.users):
                found[p] = n
    missing = [p for p in updated if p not in found]
    if missing:
        raise PassError(f"shard: cannot find the gradient of {missing[:3]} in the step: a pass "
                        "before shard replaced it without carrying its mark "
                        "(glmc.ir.graph.replace_uses); run shard right after capture's passes")
    return {p: found[p] for p in updated}


def _group_of(graph: TrainGraph) -> dict[str, int]:
    spec = graph.meta.get("optimizer")
    return {p: gi for gi, group in enumerate(spec.groups) for p in group.params} if spec else {}


def _same_kind(params: dict[str, fx.Node], a: str, b: str, group: dict[str, int]) -> bool:
    da, db = TrainGraph.info(params[a]).spec.dtype, TrainGraph.info(params[b]).spec.dtype
    return da == db and group.get(a) == group.get(b)


def _param_views(graph: TrainGraph, params: dict[str, fx.Node]) -> dict[fx.Node, str]:
    """Forward nodes computed by cheap ops from one parameter alone -> that parameter's
    placeholder name."""
    owner: dict[fx.Node, str] = {ph: ph.name for ph in params.values()}
    out: dict[fx.Node, str] = {}
    for n in graph.graph.nodes:
        if n.op != "call_function" or n.target not in _PARAM_VIEWS:
            continue
        if TrainGraph.info(n).phase is not Phase.FORWARD:
            continue
        srcs = {owner.get(a) for a in n.all_input_nodes}
        if len(srcs) == 1 and None not in srcs:
            owner[n] = out[n] = srcs.pop()
    return out


def _backward_readers(ph: fx.Node, chains: dict[fx.Node, str]) -> list[fx.Node]:
    direct = [u for u in ph.users if TrainGraph.info(u).phase is Phase.BACKWARD]
    via = [u for v, o in chains.items() if o == ph.name for u in v.users
           if TrainGraph.info(u).phase is Phase.BACKWARD]
    return direct + via


__all__ = ["ShardPass", "ShardPlan", "ShardStats", "Layout", "Bucket"]
