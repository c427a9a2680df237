"""Data-parallel training on torch.distributed: the process group, the mesh, each rank's slice
of the global batch, and the state the `shard` pass stores sharded.

Every rank runs the same compiled step (an SPMD program, glmc.ir.program) on its slice of the
global batch; the step's functional collectives are the only communication. What ZeRO shards
lives here between steps, as this rank's zero-padded rows (`Layout`): optimizer state for stages
1-3, parameters too for stage 3. The user's tensors are views of those rows (the valid ones), so
`optimizer.state` and, under stage 3, the module's parameters hold this rank's shard like FSDP2's
local tensors; `sharded_state_dict()` presents them as DTensors for `torch.distributed.checkpoint`
(save on N ranks, load on M), `full_state_dict()` gathers them.

The mesh is 1-D ("dp") on one node; on several (`Parallel.nodes`, or torchrun's
LOCAL_WORLD_SIZE) it is 2-D, ("node", "local"), with "dp" its flattening: the flat collectives
and the checkpoints use "dp", a hierarchical gradient all-reduce the two sub-groups.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import shutil
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from glmc.analysis.comm import LinkProfile, measure_link, measure_waits
from glmc.errors import CommError, ConfigError, InputError
from glmc.ir.graph import (ACCUMULATES, RANDOM_OPS, MeshSpec, OutputKind, OutputSpec, Role,
                           TrainGraph, op_name)
from glmc.ir.plans import DIM, LOCAL, NODE, Layout, ShardPlan
from glmc.ir.program import bind_mesh, comm_nodes
from glmc.passes.shard import ShardPass
from glmc.trace.capture import Batch, batch_leaves, describe

ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Parallel:
    """Data parallelism options: ZeRO stage (0 plain data parallel, 1 optimizer state, 2 and
    gradients, 3 and parameters sharded), gradient bucket size, overlap of communication with
    compute, and the timeout of every collective (a dead or hung rank fails the step after
    it, naming the collective, instead of hanging)."""

    zero: int = 0
    bucket_mb: float = 25.0
    overlap: bool = True
    timeout_s: float = 300.0
    #: micro-batches per step (gradient accumulation, one collective per bucket per step);
    #: > 1 compiles the step with running sums, and `trainer.parallel.accumulate` may then
    #: change between steps
    accumulate: int = 1
    #: gradient compression: a method ("bf16", "fp16", "sign", "topk", "powersgd") or a dict
    #: of the compress pass's options (glmc.passes.compress)
    compress: Any = None
    #: nodes the ranks run on (a 2-D mesh: nodes x ranks per node, ranks numbered node by
    #: node); None: from torchrun's LOCAL_WORLD_SIZE (one node without it)
    nodes: int | None = None
    #: hierarchical gradient all-reduce on several nodes, stages 0-1 (passes/shard.py):
    #: "auto" where the communication model predicts it faster, "on", "off"
    hierarchical: str = "auto"
    intra_link: str = "nvlink4"  #: link profile inside a node (glmc.analysis.comm.get_link)
    inter_link: str = "infiniband-ndr"  #: link profile between nodes
    #: tensor parallel over this many ranks (every process; glmc.parallel.tensor), 1: none
    tp: int = 1
    #: pins of the tensor_parallel pass: "glob:column|row|replicate;..."
    tp_plan: str = ""
    #: sequence parallelism beside tp (the tensor_parallel pass's `sequence`)
    tp_sequence: bool = False
    #: the tensor_parallel pass's `choose`: "layout" (every unit sharded) or "time"
    tp_choose: str = "layout"

    @staticmethod
    def of(value: Any) -> "Parallel | None":
        """None; a Parallel; an int (the ZeRO stage); a dict of the fields; or a
        `ParallelPlan` (or its spelling) without pipeline stages."""
        from glmc.parallel.plan import ParallelPlan
        if isinstance(value, str):
            value = ParallelPlan.parse(value)
        if isinstance(value, ParallelPlan):
            if value.validate().strategy == "pipeline":
                raise ConfigError("parallel: a pipeline plan (pp=...) runs on "
                                  "glmc.parallel.pipeline.pipeline_trainer, not a Trainer; "
                                  "glmc.optimize chooses it when given the plan")
            value = value.data_parallel()
        if value is None or isinstance(value, Parallel):
            return value
        if isinstance(value, bool):
            raise ConfigError("parallel: pass the ZeRO stage (0-3), a dict or glmc.Parallel")
        if isinstance(value, int):
            value = {"zero": value}
        if not isinstance(value, dict):
            raise ConfigError(f"parallel: expected a ZeRO stage, a dict or glmc.Parallel, got "
                              f"{type(value).__name__}")
        known = {f.name for f in dataclasses.fields(Parallel)}
        unknown = set(value) - known
        if unknown:
            raise ConfigError(f"parallel: unknown option(s) {sorted(unknown)}; known: "
                              f"{', '.join(sorted(known))}")
        p = Parallel(**value)
        if not isinstance(p.tp, int) or isinstance(p.tp, bool) or p.tp < 1:
            raise ConfigError(f"parallel: tp must be a whole number >= 1, got {p.tp!r}")
        if not isinstance(p.tp_plan, str) or (p.tp_plan and p.tp == 1):
            raise ConfigError(f"parallel: tp_plan must be a string of pins and needs tp > 1, "
                              f"got tp_plan={p.tp_plan!r} with tp={p.tp}")
        if p.tp_choose not in ("layout", "time") or (p.tp_choose != "layout" and p.tp == 1):
            raise ConfigError(f"parallel: tp_choose is 'layout' or 'time' and needs tp > 1, "
                              f"got tp_choose={p.tp_choose!r} with tp={p.tp}")
        if not isinstance(p.tp_sequence, bool) or (p.tp_sequence and p.tp == 1):
            raise ConfigError(f"parallel: tp_sequence (sequence parallelism) is true or false "
                              f"and needs tp > 1, got tp_sequence={p.tp_sequence!r} with "
                              f"tp={p.tp}")
        if p.zero not in (0, 1, 2, 3):
            raise ConfigError(f"parallel: zero must be 0, 1, 2 or 3, got {p.zero}")
        if not isinstance(p.accumulate, int) or p.accumulate < 1:
            raise ConfigError(f"parallel: accumulate must be a whole number >= 1, got "
                              f"{p.accumulate!r}")
        if p.nodes is not None and (not isinstance(p.nodes, int) or isinstance(p.nodes, bool)
                                    or p.nodes < 1):
            raise ConfigError(f"parallel: nodes must be a whole number >= 1, got {p.nodes!r}")
        if p.hierarchical not in ("auto", "on", "off"):
            raise ConfigError(f"parallel: hierarchical must be auto, on or off, got "
                              f"{p.hierarchical!r}")
        if p.hierarchical == "on" and p.compress is not None:
            raise ConfigError("parallel: compress sends one flat collective per gradient bucket;"
                              " it does not combine with hierarchical='on' (use 'auto' or "
                              "'off')")
        return p

    def passes(self, link: LinkProfile | None = None, budgeted: bool = False) -> list[Any]:
        """The shard pass, and the compress pass when asked. `link`: this host's measured
        link (prices a stage-3 gather again); `budgeted`: a memory budget is set, so stage 3
        keeps the forward's gathered parameters for the backward where the recompute pass
        finds room, and gathers again the rest (shard reshard=budget)."""
        # compressed buckets travel flat (compress rewrites one collective per bucket)
        hierarchical = "off" if self.compress is not None else self.hierarchical
        from glmc.analysis.comm import link_figures
        figures = ""
        if budgeted and link is not None and 0 < link.bandwidth < float("inf"):
            figures = link_figures(link)
        out: list[Any] = [ShardPass(stage=self.zero, bucket_mb=self.bucket_mb,
                                    overlap=self.overlap, accumulate=self.accumulate > 1,
                                    hierarchical=hierarchical, intra_link=self.intra_link,
                                    inter_link=self.inter_link,
                                    reshard="budget" if budgeted else "always",
                                    # a stage-3 gather crosses the nodes' link
                                    link=figures if (self.nodes or 1) == 1 else
                                    self.inter_link)]
        if self.compress is not None:
            from glmc.passes.compress import CompressPass
            opts = {"method": self.compress} if isinstance(self.compress, str) else \
                dict(self.compress)
            # the report prices the traffic on the link the gradients cross
            opts.setdefault("link", self.inter_link if (self.nodes or 1) > 1 else
                            self.intra_link)
            try:
                out.append(CompressPass(**opts))
            except TypeError as e:
                raise ConfigError(f"parallel: compress options {opts}: {e}") from None
        return out


def topology(nodes: int | None, world: int, rank: int) -> tuple[int, int]:
    """(nodes, ranks per node) of `world` ranks: `nodes` if given, else torchrun's
    LOCAL_WORLD_SIZE (checked against GROUP_RANK: ranks must be numbered node by node), else
    one node."""
    if nodes is None:
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local is None:
            return 1, world
        per_node = int(local)
        if per_node < 1 or world % per_node:
            raise ConfigError(f"parallel: LOCAL_WORLD_SIZE={local} does not divide the "
                              f"{world} ranks; every node must run as many ranks")
        group = os.environ.get("GROUP_RANK")
        if group is not None and rank // per_node != int(group):
            raise ConfigError(f"parallel: rank {rank} is on node {group} (GROUP_RANK), not "
                              f"{rank // per_node}: ranks are not numbered node by node; pass "
                              "parallel={'nodes': 1} to run flat")
        return world // per_node, per_node
    if world % nodes:
        raise ConfigError(f"parallel: nodes={nodes} does not divide the {world} ranks; pass a "
                          "number of nodes that does")
    return nodes, world // nodes


def comm_failure(e: BaseException) -> str | None:
    """The first line of `e` when it is a failed or timed-out collective / point-to-point
    operation of the process group (gloo, NCCL, c10d), else None."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    words = ("gloo", "nccl", "timeout", "timed out", "connection", "peer", "socket", "c10d")
    return text if any(w in text.lower() for w in words) else None


def init_distributed(device: str, timeout_s: float) -> None:
    """The default process group from torchrun's environment, unless the user made one."""
    if dist.is_initialized():
        return
    missing = [k for k in ENV if k not in os.environ]
    if missing:
        raise ConfigError(f"parallel: no process group and no {', '.join(missing)} in the "
                          "environment; launch with `glmc compile FILE --nproc N`, `torchrun "
                          "--nproc_per_node N ...`, or call torch.distributed.init_process_group")
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart:  # torchrun --max-restarts: the agent's store still holds the failed attempt's
        # keys (torch 2.13: gloo's restarted ranks read dead peers' addresses and fail to
        # connect), so this attempt's keys get a prefix of their own
        store = dist.PrefixStore(f"glmc/attempt_{restart}", dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
            int(os.environ["WORLD_SIZE"]), False, timeout=timedelta(seconds=timeout_s)))
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=timedelta(seconds=timeout_s))
        return
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def split_micro_batches(batch: Batch, k: int, whose: str = "the", times: str = "") -> list[Batch]:
    """`batch` cut into `k` equal micro-batches along dim 0 (0-d tensors and non-tensors go
    to each whole); an InputError when its rows do not divide by `k`."""
    if k == 1:
        return [batch]
    args, kwargs = batch
    leaves = [t for t in batch_leaves(batch) if t.dim() > 0]
    rows = leaves[0].shape[0] if leaves else 0
    if rows % k:
        raise InputError(f"parallel: {whose} {rows} rows of the batch {describe(batch)} do not "
                         f"split into accumulate={k} micro-batches; pass a batch whose size "
                         f"divides by {times}{k}")
    n = rows // k

    def cut(t: Any, i: int) -> Any:
        return t[i * n:(i + 1) * n] if isinstance(t, torch.Tensor) and t.dim() else t
    return [(tuple(cut(t, i) for t in args), {key: cut(v, i) for key, v in kwargs.items()})
            for i in range(k)]


def reset_sums(sums: dict[str, torch.Tensor], accumulators: dict[str, Any], k: int) -> None:
    """Zero the running sums (made on first use from their specs) and set `acc:scale` to 1/k."""
    for target, spec in accumulators.items():
        t = sums.get(target)
        if t is None or tuple(t.shape) != tuple(spec.shape):
            t = sums[target] = torch.zeros(spec.shape, dtype=spec.dtype, device=spec.device)
        if target == "acc:scale":
            t.fill_(1.0 / k)
        else:
            t.zero_()


def carry_sums(sums: dict[str, torch.Tensor], micro: TrainGraph,
               values: list[torch.Tensor]) -> None:
    """A micro-batch program's outputs (its running sums) become the next one's inputs."""
    with torch.no_grad():
        for spec, value in zip(micro.outputs, values):
            sums[spec.target].copy_(value)


def micro_program(graph: TrainGraph, accumulators: dict[str, Any]) -> TrainGraph:
    """The step of a micro-batch that is not the last: forward and backward, the gradients
    (or gradient buckets) and the loss added to their running sums; no collective on
    gradients, no update (dead code, removed). Outputs the sums, one per accumulator."""
    micro = graph.copy()
    sums = {n.meta[ACCUMULATES]: n for n in micro.graph.nodes if ACCUMULATES in n.meta}
    targets = [t for t in accumulators if t in sums]
    micro.output_node().args = (tuple(sums[t] for t in targets),)
    micro.outputs = [OutputSpec(OutputKind.ACCUMULATOR, t) for t in targets]
    micro.graph.eliminate_dead_code(
        is_impure_node=lambda n: n.op in ("placeholder", "output")
        or op_name(n) in RANDOM_OPS)  # every draw stays: the RNG stream is eager's
    micro.gm.recompile()
    micro.verify()
    return micro


def rows_of(batch: Batch, index: int, parts: int, what: str) -> Batch:
    """Slice `index` of `parts` equal slices (dim 0) of every tensor of `batch`; a batch whose
    rows do not divide is an InputError naming the `parts` (`what`: "ranks", ...)."""
    args, kwargs = batch

    def cut(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        if t.shape[0] % parts:
            raise InputError(f"parallel: the global batch {describe(batch)} has "
                             f"{t.shape[0]} rows, which do not divide by {parts} {what}; "
                             f"pass a batch whose size is a multiple of {parts}")
        n = t.shape[0] // parts
        return t[index * n:(index + 1) * n]
    return tuple(cut(t) for t in args), {k: cut(v) for k, v in kwargs.items()}


class Swaps:
    """Tensors replaced for a while (the whole parameters and optimizer state of a sharded
    run, gathered): `put` replaces a parameter's `.data` (slot None) or a dict entry (an
    optimizer state's `slot`) and remembers what was there; `restored()` puts every one back
    when its block ends."""

    def __init__(self) -> None:
        self.saved: list[tuple[Any, Any, torch.Tensor]] = []

    def put(self, container: Any, slot: Any, value: torch.Tensor) -> None:
        if slot is None:
            self.saved.append((container, None, container.data))
            container.data = value
        else:
            self.saved.append((container, slot, container[slot]))
            container[slot] = value

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        try:
            yield
        finally:
            for container, slot, data in self.saved:
                if slot is None:
                    container.data = data
                else:
                    container[slot] = data


class DataParallel:
    """One rank's view of a data-parallel trainer (see the module docstring)."""

    def __init__(self, options: Parallel, device: str) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        init_distributed(device, options.timeout_s)
        self.options = options
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        #: the rank, group size and group ZeRO shards the state over ("dp"; None: the default
        #: group): a tensor-parallel trainer's data-parallel replicas (glmc.parallel.tensor)
        self.shard_rank, self.shard_world, self.shard_group = self.rank, self.world, None
        self.nodes, self.per_node = topology(options.nodes, self.world, self.rank)
        if self.nodes > 1 and self.per_node > 1:  # node x local, "dp" their flattening
            self.root = init_device_mesh(device, (self.nodes, self.per_node),
                                         mesh_dim_names=(NODE, LOCAL))
            #: the 1-D data-parallel mesh: DTensor state dicts, checkpoints
            self.mesh = self.root._flatten(DIM)
            self.spec = MeshSpec.of(self.root, ((DIM, (NODE, LOCAL)),))
        else:
            self.mesh = self.root = init_device_mesh(device, (self.world,),
                                                     mesh_dim_names=(DIM,))
            self.spec = MeshSpec.of(self.mesh)
        self.plan: ShardPlan | None = None
        #: micro-batches per step; may change between steps when compiled with accumulate > 1
        self.accumulate = options.accumulate
        self.sums: dict[str, torch.Tensor] = {}  #: running sums by accumulator input target
        #: per-rank communication state (error feedback, PowerSGD's Q) by input target
        self.comm_state: dict[str, torch.Tensor] = {}
        self.link = measure_link(device=device)  #: this host's link, timed once
        self.store: dict[str, torch.Tensor] = {}  #: padded local shards by input target
        self._owners: dict[str, tuple[Any, str]] = {}  #: target -> (container, key) of the view

    #: the compiled step must not give parameters new storage: they are views of the store
    adopts_state = False
    #: measure the communication the step waits for (profiler events, third step)
    measures_comm = True

    def passes(self, budgeted: bool) -> list[Any]:
        """The passes this plan adds to the pipeline: the shard pass (and compression), with
        this host's measured link (`Parallel.passes`)."""
        return self.options.passes(self.link, budgeted)

    def pipeline(self, passes: list[Any]) -> list[Any]:
        """The pipeline as this strategy runs it (after `passes` were added): unchanged."""
        return passes

    def wants_micro_program(self, graph: TrainGraph) -> bool:
        """Gradient accumulation: the step was compiled with running sums."""
        return bool(graph.meta["sharding"].accumulators)

    # -- batches --------------------------------------------------------------------------------

    def local(self, batch: Batch) -> Batch:
        """This rank's slice (dim 0) of every tensor of the global batch."""
        return rows_of(batch, self.rank, self.world, "ranks")

    def micro_batches(self, batch: Batch) -> list[Batch]:
        """This rank's batch cut into `accumulate` micro-batches (dim 0)."""
        k = self.accumulate
        if k > 1 and not self.options.accumulate > 1:
            raise ConfigError("parallel: accumulate > 1 needs a step compiled for it; pass "
                              "parallel={'accumulate': k} with k > 1 when creating the trainer")
        return split_micro_batches(batch, k, "this rank's", "ranks x ")

    def start_step(self, graph: TrainGraph) -> None:
        """Zero the running sums and set 1/k for a step of `accumulate` micro-batches."""
        reset_sums(self.sums, graph.meta["sharding"].accumulators, self.accumulate)

    def carry(self, graph: TrainGraph, sums: list[torch.Tensor]) -> None:
        """A micro-batch step's running sums become the next one's inputs."""
        carry_sums(self.sums, graph, sums)

    def micro_program(self, graph: TrainGraph) -> TrainGraph:
        """The step of a micro-batch that is not the last (`micro_program`)."""
        return micro_program(graph, graph.meta["sharding"].accumulators)

    def check_same(self, model: nn.Module, batch: Batch, options: Any) -> None:
        """Every rank trains the same model on the same batch structure with the same options
        (a dataclass; `progress` and `dump_dir` may differ between ranks): a typed error naming
        the ranks that differ, before any collective could hang on a mismatch."""
        what = repr({k: v for k, v in dataclasses.asdict(options).items()
                     if k not in ("progress", "dump_dir")})
        h = hashlib.sha256()
        for name, p in model.named_parameters():
            h.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
        for t in batch_leaves(batch):
            h.update(f"{tuple(t.shape)}{t.dtype}".encode())
        h.update(what.encode())
        self._agree(h, "have a different model, batch structure or options than rank 0",
                    "every rank must run the same script on a batch of the same shapes")

    def _agree(self, h: Any, differ: str, fix: str) -> None:
        """All ranks' fingerprints `h` (a hashlib object) equal rank 0's, else a ConfigError
        naming the odd ranks: they `differ`; `fix` says what to do."""
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, h.hexdigest()[:16])
        odd = [r for r, v in enumerate(every) if v != every[0]]
        if odd:
            raise ConfigError(f"parallel: ranks {odd} {differ} (fingerprints {every}); {fix}")

    def agree(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (`PassContext.agree`): every rank compiles the same
        program, and a decision made from one rank's timings holds for all."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def largest(self, value: int) -> int:
        """The largest of every rank's `value`."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def check_collectives(self, graph: TrainGraph) -> None:
        """Every rank's step issues the same collectives in the same order (kinds and
        shapes): plans made per rank (recompute's, which may gather a ZeRO-3 bucket again)
        could differ where the ranks' cost profiles differ, and a mismatch would hang. A
        typed error naming the ranks, before the first step."""
        h = hashlib.sha256()
        for n in comm_nodes(graph):
            spec = TrainGraph.info(n).spec
            h.update(f"{op_name(n)}{tuple(spec.shape) if spec else ()}".encode())
        self._agree(h, "planned different communication than rank 0 (per-rank plans: the "
                    "recompute pass's, which decides which ZeRO-3 buckets to gather again, "
                    "differ where the ranks' cost profiles differ or its solver stopped at "
                    "its time limit)", "give every rank the same profile (profile=..., "
                    "--profile), the greedy solver (recompute{solver=greedy}), or no memory "
                    "budget")

    # -- the compiled step ----------------------------------------------------------------------

    def bind(self, graph: TrainGraph) -> TrainGraph:
        return bind_mesh(graph, self.root, self.spec)

    def install(self, graph: TrainGraph, model: nn.Module, optimizer: torch.optim.Optimizer
                ) -> None:
        """Keep the state `graph` reads sharded as this rank's padded rows, and point the
        user's tensors at their valid rows. Idempotent for a recompile with the same plan."""
        plan: ShardPlan = graph.meta["sharding"]
        compression = graph.meta.get("compression")
        for target, (spec, init) in (compression.state.items() if compression else ()):
            if target in self.comm_state:
                continue
            if init == "randn":  # the same on every rank (PowerSGD's initial Q)
                gen = torch.Generator().manual_seed(compression.seed)
                t = torch.randn(spec.shape, generator=gen, dtype=spec.dtype)
            else:
                t = torch.zeros(spec.shape, dtype=spec.dtype)
            self.comm_state[target] = t.to(spec.device)
        if self.plan is not None:
            if plan.layouts != self.plan.layouts:
                raise ConfigError("parallel: a recompiled step shards the state differently "
                                  "from the first; this is a glmc bug, please report it")
            return
        params = dict(model.named_parameters())
        for target, lay in plan.layouts.items():
            if ":" in target:
                key, _, name = target.partition(":")
                container, slot = optimizer.state[params[name]], key
            else:
                container, slot = params[target], None
            full = container[slot] if slot is not None else container.detach()
            if tuple(full.shape) != lay.shape:
                raise ConfigError(f"parallel: {target!r} is {tuple(full.shape)}, the step "
                                  f"shards {lay.shape}")
            padded = lay.local(full.detach(), self.shard_rank)
            self.store[target] = padded
            valid = padded[: lay.valid_rows(self.shard_rank)] if lay.shape else padded
            if slot is not None:
                container[slot] = valid
            else:
                container.data = valid
            self._owners[target] = (container, slot)
        self.plan = plan

    def getters(self, graph: TrainGraph, getters: list) -> list:
        """`getters` with the sharded inputs read from the store."""
        out = list(getters)
        for i, spec in enumerate(graph.inputs):
            if spec.target in self.store and spec.role in (Role.PARAMETER,
                                                           Role.OPTIMIZER_STATE):
                t = self.store[spec.target]
                out[i] = lambda _, t=t: t
            elif spec.role is Role.ACCUMULATOR:
                out[i] = lambda _, k=spec.target: self.sums[k]
            elif spec.role is Role.COMM_STATE:
                t = self.comm_state[spec.target]
                out[i] = lambda _, t=t: t
        return out

    @contextlib.contextmanager
    def full_parameters(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
                        ) -> Iterator[None]:
        """The module's full parameters (stage 3) and the optimizer's full state (stages 1-3)
        for the duration: what capturing the step again (a new batch shape, a recompile
        with other pass options) reads; every rank must enter it together."""
        if self.plan is None or (optimizer is None and
                                 not any(":" not in t for t in self.plan.layouts)):
            yield
            return
        params = dict(model.named_parameters())
        swaps = Swaps()
        for target, lay in self.plan.layouts.items():
            if ":" in target:
                if optimizer is None:
                    continue
                key, _, name = target.partition(":")
                swaps.put(optimizer.state[params[name]], key, self._gather(target, lay))
            else:
                swaps.put(params[target], None, self._gather(target, lay))
        with swaps.restored():
            yield

    def _gather(self, target: str, lay: Layout) -> torch.Tensor:
        shards = [torch.empty_like(self.store[target]) for _ in range(self.shard_world)]
        dist.all_gather(shards, self.store[target].contiguous(), group=self.shard_group)
        return lay.full(shards)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """A collective that fails or outlives the process group's timeout (a rank died or
        hung) becomes a CommError naming this rank, instead of a gloo/NCCL traceback."""
        try:
            yield
        except RuntimeError as e:
            text = comm_failure(e)
            if text is None:
                raise
            raise CommError(f"parallel: a collective failed on rank {self.rank} of "
                            f"{self.world} ({text}); another rank has probably died, hung or "
                            "run a different step (a hung rank fails the others after the "
                            "process group's timeout: glmc's is parallel={'timeout_s': 300}); "
                            "check the other ranks' output") from e

    def time_waits(self, run: Any) -> tuple[Any, float | None]:
        """`run()`'s result and the seconds the step spent blocked in collective waits
        (glmc.analysis.comm.measure_waits) on the rank that waited least: the one that reached
        the collectives last waits for the communication the step did not hide alone, the
        others for it and for that rank (load imbalance, the OS's scheduling). None where a
        rank could not measure (the user's profiler runs there). Every rank must call it."""
        out, waited = measure_waits(run)
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, waited)
        return out, None if None in every else min(every)

    # -- state ----------------------------------------------------------------------------------

    def full_state(self, model: nn.Module, optimizer: torch.optim.Optimizer
                   ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Full (gathered) model and optimizer state tensors on every rank: (model state_dict,
        {"key:param": tensor})."""
        model_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        names = {id(p): n for n, p in model.named_parameters()}
        optim = {f"{k}:{names[id(p)]}": v.detach().clone()
                 for p, st in optimizer.state.items() if id(p) in names
                 for k, v in st.items() if isinstance(v, torch.Tensor)}
        layouts = self.plan.layouts if self.plan is not None else {}
        for target, lay in layouts.items():
            full = self._gather(target, lay)
            (optim if ":" in target else model_sd)[target] = full
        return model_sd, optim

    def sharded_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer
                           ) -> dict[str, dict[str, Any]]:
        """{"model": ..., "optim": ...} with sharded tensors as DTensors (Shard(0) over the
        mesh), the rest as plain tensors: what torch.distributed.checkpoint saves and loads in
        place, resharding between world sizes."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        model_sd: dict[str, Any] = dict(model.state_dict())
        names = {id(p): n for n, p in model.named_parameters()}
        optim: dict[str, Any] = {f"{k}:{names[id(p)]}": v for p, st in optimizer.state.items()
                                 if id(p) in names for k, v in st.items()
                                 if isinstance(v, torch.Tensor)}
        for table in (model_sd, optim):
            for target, t in list(table.items()):
                lay = self.plan.layouts.get(target) if self.plan is not None else None
                if lay is not None and lay.shape:
                    stride = torch.empty(lay.shape, device="meta").stride()
                    table[target] = DTensor.from_local(
                        self.store[target][: lay.valid_rows(self.rank)], self.mesh, [Shard(0)],
                        run_check=False, shape=torch.Size(lay.shape), stride=stride)
                elif lay is not None:  # a 0-d tensor: rank 0's row holds it
                    table[target] = DTensor.from_local(self.store[target][0].clone(), self.mesh,
                                                       [Replicate()], run_check=False)
        comm = {k: DTensor.from_local(v.unsqueeze(0), self.mesh, [Shard(0)], run_check=False)
                for k, v in self.comm_state.items()}  # one row per rank: its own residual
        return {"model": model_sd, "optim": optim, "comm": comm}

    def load_sharded(self, state: dict[str, dict[str, Any]], model: nn.Module,
                     optimizer: torch.optim.Optimizer) -> None:
        """Write a state dict loaded by DCP (shaped like `sharded_state_dict`) into the store
        and the user's tensors (a 0-d sharded value goes back into its row)."""
        from torch.distributed.tensor import DTensor

        current = self.sharded_state_dict(model, optimizer)
        with torch.no_grad():
            for target, value in state.get("comm", {}).items():
                src = value.to_local() if isinstance(value, DTensor) else value
                self.comm_state[target].copy_(src.reshape(self.comm_state[target].shape))
            for part in ("model", "optim"):
                for target, value in state[part].items():
                    dst = current[part][target]
                    src = value.to_local() if isinstance(value, DTensor) else value
                    if isinstance(dst, DTensor):
                        lay = self.plan.layouts[target] if self.plan else None
                        if lay is not None and not lay.shape:
                            self.store[target][0].copy_(src)
                            continue
                        dst = dst.to_local()
                    dst.copy_(src)


# ---- checkpoints -------------------------------------------------------------------------------

def save_checkpoint(trainer: Any, path: str) -> None:
    """Save the trainer's sharded state with torch.distributed.checkpoint. Written to a staging
    directory and renamed into place by rank 0 after every rank finished: an interrupted save
    leaves the previous checkpoint at `path` whole."""
    import torch.distributed.checkpoint as dcp

    dp: DataParallel = _dp(trainer)
    target = Path(path)
    staging = target.with_name(target.name + ".saving")
    if dp.rank == 0 and staging.exists():
        shutil.rmtree(staging)
    dist.barrier()
    state = dp.sharded_state_dict(trainer.model, trainer.optimizer)
    state["trainer"] = {k: v for k, v in trainer.state_dict().items()}
    dcp.save(state, checkpoint_id=str(staging))
    dist.barrier()
    if dp.rank == 0:
        old = target.with_name(target.name + ".old")
        if target.exists():
            target.rename(old)
        staging.rename(target)
        if old.exists():
            shutil.rmtree(old)
    dist.barrier()


def load_checkpoint(trainer: Any, path: str) -> None:
    """Load a checkpoint saved by `save_checkpoint` on any number of ranks (DCP reshards)."""
    import torch.distributed.checkpoint as dcp

    dp: DataParallel = _dp(trainer)
    if not Path(path).exists():
        raise ConfigError(f"load_checkpoint: no checkpoint at {path}")
    state = dp.sharded_state_dict(trainer.model, trainer.optimizer)
    state.pop("trainer", None)
    dcp.load(state, checkpoint_id=str(path))
    dp.load_sharded(state, trainer.model, trainer.optimizer)


def _dp(trainer: Any) -> DataParallel:
    dp = getattr(trainer, "parallel", None)
    if dp is None:
        raise ConfigError("checkpoint: the trainer is not data parallel; use model.state_dict() "
                          "and optimizer.state_dict()")
    return dp
