"""`compress`: gradient compression on the data-parallel step's gradient collectives.

Runs after `shard`: every gradient bucket's collective (marked GRAD_BUCKET) becomes compress ->
collective on the compressed form -> decompress, with error feedback — the part of the gradient
a step's compression dropped is added to the next step's (1-bit Adam, PowerSGD) — kept as
per-rank step state (Role.COMM_STATE: an input and a STATE output of the step; the runtime keeps
it, checkpoints save it).

    method     on the wire per rank (n gradient elements)     collective            stages
    bf16/fp16  2n bytes                                       as shard placed it    0-3
    sign       n/8 bytes + 4 bytes per tensor (its scale)     all-gather, unpacked  0-1
               (block=B: + 4 bytes per B elements instead)
    topk       8k bytes (k = ratio n values + int32 indices)  all-gather, summed    0-1
    powersgd   4 r (rows + cols) per matrix, 4 n_small        two all-reduces       0-1

sign: each tensor of the bucket sends sign(e) packed 8 per byte and one fp32 scale mean(|e|)
(`block=B`: one scale per B consecutive elements of the bucket, as QSGD's buckets: a finer
scale, a smaller error for the residual to carry); the average of scale_r * sign_r over the
ranks replaces the average gradient. topk: the k largest |e| with their positions; the
average of the scattered values. powersgd (rank r, Vogels
et al. 2019, as torch's DDP hook): per matrix M (a parameter viewed as rows x rest, at least
`min_numel` elements): P = M Q, all-reduce P, orthonormalise P, Q = M^T P, all-reduce Q, M ~ P
Q^T; Q persists (warm start); tensors below `min_numel` (biases, norms) or of rank <= r go
uncompressed, in the first all-reduce. sign scales each tensor (or block) separately; topk
picks over the whole bucket. e = gradient + residual; the new residual is e minus what this rank
sent (powersgd: minus the averaged approximation, as torch's hook).
Stages 2-3 reduce-scatter, which a sum of signs or of scattered top-k does not fit: those
methods need stage 0 or 1 (a typed error otherwise); bf16/fp16 cast around any collective.

Warm-up (`warmup_steps=N`, PowerSGD's `start_powerSGD_iter`): the first N steps send the
bucket uncompressed, in the same compiled step. A step counter (step state "compress:step",
checkpointed with the residuals) selects one of two branches per bucket with `torch.cond`,
so only the chosen branch's collectives run:

    warm = lt(step, N)
    avg, ef', q'... = cond(warm, dense, compressed, (flat, ef, q, ...))
      dense:      the bucket's own collective(avg) on flat; ef, q unchanged
      compressed: the rewrite above

Residuals and Q stay at their initial values through the warm-up (as torch's hook: error
feedback starts with compression). The branches run one after the other: a warm-up bucket's
collectives do not overlap the backward. Each branch returns its values packed in one flat
tensor (cut apart after the cond) where they share a dtype: Inductor requires a cond's outputs
to match in storage offset, which views of a collective's buffer do not. Eager and Inductor
backends (a typed error on the others).
"""
from __future__ import annotations

import copy
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from glmc.analysis.comm import collective_seconds, get_link
from glmc.analysis.cost import dispatch_overhead, get_profile, is_view, node_time, op_cost
from glmc.analysis.predict import graph_device
from glmc.compiler.passmanager import Effect, Need, Pass, PassContext, PassResult
from glmc.errors import ConfigError, PassError
from glmc.ir.graph import (GRAD_BUCKET, NodeInfo, OutputKind, OutputSpec, Phase, Role, TensorSpec,
                           TrainGraph)
from glmc.ir.program import NodeBuilder, SpmdProgram, insert_collective

aten = torch.ops.aten
METHODS = ("bf16", "fp16", "sign", "topk", "powersgd")
_LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class CompressPlan:
    """What the runtime needs: the step state to create (target -> (spec, init))."""

    method: str
    state: dict[str, tuple[TensorSpec, str]] = field(default_factory=dict)  #: init: zeros|randn
    wire_bytes: int = 0  #: bytes each rank hands to the gradient collectives per step
    dense_bytes: int = 0  #: the same, uncompressed
    warmup_steps: int = 0  #: the first steps send `dense_bytes` instead
    seed: int = 0  #: powersgd: the seed of the initial Q matrices (the same on every rank)
    #: the collectives of a compressed step and of the dense one: (kind, full buffer bytes)
    collectives: list[tuple[str, int]] = field(default_factory=list)
    dense_collectives: list[tuple[str, int]] = field(default_factory=list)


@dataclass(frozen=True)
class CompressStats:
    method: str
    buckets: int
    compressed_tensors: int
    dense_bytes: int
    wire_bytes: int
    ratio: float
    warmup_steps: int = 0
    price: "Price | None" = None  #: predicted communication and compute (None: not priced)

    def report_section(self, ctx: Any) -> Any:
        from glmc.compiler.report_parts import ReportSection, Table, Text
        p = self.price
        head = (f"{self.method}: {self.wire_bytes:,} bytes on the wire per rank per step "
                f"(dense {self.dense_bytes:,}, {self.ratio}:1)")
        if p is None:
            return ReportSection("Gradient compression", (Text(head),), head)
        rows = (("bytes on the wire per rank", self.dense_bytes, self.wire_bytes),
                (f"communication on {p.link} (us)", round(p.dense_comm_seconds * 1e6, 1),
                 round(p.comm_seconds * 1e6, 1)),
                (f"compress + decompress compute on {p.profile} (us)", 0.0,
                 round(p.compute_seconds * 1e6, 1)),
                ("sum (us)", round(p.dense_comm_seconds * 1e6, 1),
                 round((p.comm_seconds + p.compute_seconds) * 1e6, 1)))
        summary = (f"{head}; predicted {p.comm_seconds * 1e3:.3f} ms on the link + "
                   f"{p.compute_seconds * 1e3:.3f} ms compute vs {p.dense_comm_seconds * 1e3:.3f}"
                   f" ms dense" + (f"; first {self.warmup_steps} steps dense"
                                   if self.warmup_steps else ""))
        blocks = (Text(head), Table(("predicted per step", "dense", self.method), rows),
                  Text("Predicted: alpha-beta per collective (glmc.analysis.comm) on the link above; the "
                       "added ops by the op cost model. The measured step time and exposed "
                       "communication are in the step's prediction check.", "note"))
        return ReportSection("Gradient compression", blocks, summary)


@dataclass(frozen=True)
class Price:
    """The predicted cost of one step's gradient traffic, compressed and dense, per rank."""

    link: str
    profile: str
    comm_seconds: float  #: the compressed step's collectives, back to back
    dense_comm_seconds: float  #: the uncompressed buckets' collectives
    compute_seconds: float  #: the ops compress added (compress, decompress, error feedback)


@dataclass(frozen=True)
class CompressPass(Pass):
    """Gradient compression with error feedback (see the module docstring)."""

    name = "compress"
    method: str = "bf16"
    ratio: float = 0.01  #: topk: the fraction of elements sent
    rank: int = 4  #: powersgd: the rank of the approximation
    error_feedback: bool = True
    min_numel: int = 1024  #: powersgd: smaller tensors go uncompressed
    #: the link the report prices the traffic on (glmc.analysis.comm.get_link: a name or figures)
    link: str = "infiniband-ndr"
    warmup_steps: int = 0  #: the first steps go uncompressed (see the module docstring)
    block: int = 0  #: sign: elements per scale (0: one scale per tensor)
    seed: int = 0  #: powersgd: the initial Q's random seed (torch's hook: `random_seed`)

    def needs(self) -> frozenset[Need]:
        return frozenset({Need.STEP})

    def effects(self) -> frozenset[Effect]:
        return frozenset({Effect.INSERTS_COMM, Effect.ADDS_STATE})

    def run(self, graph: TrainGraph, ctx: PassContext) -> PassResult:
        if self.method not in METHODS:
            raise ConfigError(f"compress: method must be one of {', '.join(METHODS)}, got "
                              f"{self.method!r}")
        if not 0 < self.ratio <= 1 or self.rank < 1:
            raise ConfigError("compress: ratio must be in (0, 1] and rank >= 1")
        if not isinstance(self.block, int) or self.block < 0 or self.block and \
                self.method != "sign":
            raise ConfigError(f"compress: block (elements per scale) is a whole number >= 0 "
                              f"for method sign, got block={self.block!r} with {self.method}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ConfigError(f"compress: seed (PowerSGD's initial Q) is a whole number >= 0, "
                              f"got {self.seed!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError(f"compress: warmup_steps must be a whole number >= 0, got "
                              f"{self.warmup_steps!r}")
        plan = graph.meta.get("sharding")
        if plan is None:
            raise ConfigError("compress: the step has no gradient collectives; compression "
                              "runs on a data-parallel step (after shard: parallel= or --zero)")
        if self.method in ("sign", "topk", "powersgd") and plan.stage >= 2:
            raise ConfigError(f"compress: {self.method} needs the gradients all-reduced "
                              f"(ZeRO stage 0 or 1); stage {plan.stage} reduce-scatters them. "
                              "Use zero 0/1, or method bf16/fp16")
        if any(b.hierarchical for b in plan.grad_buckets):
            raise ConfigError("compress: the gradient buckets are all-reduced hierarchically "
                              "(shard hierarchical=on); compression works on one flat "
                              "collective per bucket: use hierarchical=off (or auto) with it")
        if graph.meta.get("compression") is not None:
            raise PassError("compress: the step's gradients are already compressed")
        if self.warmup_steps and ctx.backend not in ("eager", "inductor"):
            raise ConfigError(f"compress: warmup_steps runs on the eager and inductor backends;"
                              f" {ctx.backend} does not compile the warm-up's torch.cond "
                              "branches. Use one of those (--backend eager) or warmup_steps=0")
        link = get_link(self.link)
        out = _Compressor(graph, plan, self).run()
        SpmdProgram(graph, plan.mesh).verify()
        stats = CompressStats(self.method, len(plan.grad_buckets), out.compressed,
                              out.plan.dense_bytes, out.plan.wire_bytes,
                              round(out.plan.dense_bytes / max(out.plan.wire_bytes, 1), 2),
                              self.warmup_steps, _price(graph, out.plan, plan.ranks, link, ctx))
        graph.meta["compression"] = out.plan
        return PassResult(True, stats)


@dataclass
class _Result:
    plan: CompressPlan
    compressed: int


class _Compressor:
    def __init__(self, graph: TrainGraph, plan: Any, opts: CompressPass) -> None:
        self.graph, self.g, self.plan, self.opts = graph, graph.graph, plan, opts
        self.emit = NodeBuilder(graph, "compress")
        self.mesh, self.dim, self.n = plan.mesh, plan.dim, plan.ranks
        self.out = CompressPlan(opts.method, warmup_steps=opts.warmup_steps, seed=opts.seed)
        self.compressed = 0
        self.new_outputs: list[tuple[OutputSpec, fx.Node]] = []
        self._warm: fx.Node | None = None  #: lt(step, warmup_steps), made on first use

    def run(self) -> _Result:
        colls = [n for n in self.g.nodes if GRAD_BUCKET in n.meta]
        for coll in colls:
            self._rewrite(coll, self.plan.grad_buckets[coll.meta[GRAD_BUCKET]])
        out = self.graph.output_node()
        out.args = (tuple(self.graph.output_values()) + tuple(v for _, v in self.new_outputs),)
        self.graph.outputs += [s for s, _ in self.new_outputs]
        self.g.lint()
        self.graph.gm.recompile()
        return _Result(self.out, self.compressed)

    # -- helpers --
    def op(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        return self.emit(target, args, Phase.BACKWARD, Role.GRADIENT, kwargs, like=self.like)

    def state(self, target: str, shape: tuple, dtype: torch.dtype, init: str = "zeros"
              ) -> fx.Node:
        """Per-rank persistent state: an input now, its new value an output at the end."""
        device = self.like.meta["val"].device
        ph = self.emit.input(target, Role.COMM_STATE, shape, dtype, device)
        self.out.state[target] = (TrainGraph.info(ph).spec, init)
        return ph

    def keep(self, target: str, value: fx.Node) -> None:
        self.new_outputs.append((OutputSpec(OutputKind.STATE, target), value))

    def collective(self, value: fx.Node, kind: str, reduce_op: str | None) -> fx.Node:
        v = value.meta["val"]
        self.out.wire_bytes += v.numel() * v.element_size()
        full = v.numel() * v.element_size() * (self.n if kind == "all_gather_into_tensor" else 1)
        self.out.collectives.append((kind, full))
        return insert_collective(self.graph, value, kind, self.mesh, self.dim, reduce_op,
                                 readers=[])

    # -- one bucket --
    def _rewrite(self, coll: fx.Node, bucket: Any) -> None:
        (wait,) = coll.users
        flat = coll.args[0]
        kind = self.plan.grad_buckets[coll.meta[GRAD_BUCKET]].collective
        v = flat.meta["val"]
        self.out.dense_bytes += v.numel() * v.element_size()
        self.out.dense_collectives.append((kind, v.numel() * v.element_size()))
        self.like = flat
        b = coll.meta[GRAD_BUCKET]
        method = self.opts.method
        readers = list(wait.users)
        if self.opts.warmup_steps:
            with self.g.inserting_before(coll):
                warm = self.warm  # made before the bucket's region: not part of a branch
        before, kept_from = set(self.g.nodes), len(self.new_outputs)
        with self.g.inserting_before(coll):
            e = flat
            if self.opts.error_feedback:
                residual = self.state(f"ef:{b}", tuple(v.shape), v.dtype)
                e = self.op(aten.add.Tensor, flat, residual)
        with self.g.inserting_before(coll):
            if method in _LOW:
                result, sent = self._low(e, kind, _LOW[method])
            else:
                shapes = [self.param_shape(p) for p in bucket.params]
                sizes = [math.prod(shape) for shape in shapes]
                if method == "sign":
                    result, sent = self._sign(e, sizes)
                elif method == "topk":
                    result, sent = self._topk(e)
                else:
                    result, sent = self._powersgd(e, sizes, shapes, bucket.params, b)
            if self.opts.error_feedback:
                self.keep(f"ef:{b}", self.op(aten.sub.Tensor, e, sent))
        for r in readers:
            r.replace_input_with(wait, result)
        if self.opts.warmup_steps:
            region = [n for n in self.g.nodes if n not in before and n.op == "call_function"]
            self._branch(warm, region, result, flat, kind, kept_from, coll, b)
        self.g.erase_node(wait)
        self.g.erase_node(coll)
        self.compressed += 1

    # -- warm-up: cond(step < N, dense, compressed) --
    @property
    def warm(self) -> fx.Node:
        """lt(step, warmup_steps) at the current insertion point (first use); the step
        counter's next value is a state output."""
        if self._warm is None:
            step = self.state("compress:step", (), torch.float32)
            self._warm = self.op(aten.lt.Scalar, step, float(self.opts.warmup_steps))
            self.keep("compress:step", self.op(aten.add.Tensor, step, 1.0))
        return self._warm

    def _branch(self, warm: fx.Node, region: list[fx.Node], result: fx.Node, flat: fx.Node,
                kind: str, kept_from: int, where: fx.Node, b: int) -> None:
        """Move the bucket's compressed `region` into a branch of a `cond` on `warm`, the
        other branch the bucket's dense collective; the state it keeps passes through."""
        kept = self.new_outputs[kept_from:]
        olds = {TrainGraph.info(ph).target: ph for ph in self.graph.placeholders()}
        outs_c = [result, *(value for _, value in kept)]
        # one flat output per branch where the dtypes allow: fresh memory at offset 0 in both
        # branches, which Inductor requires of a cond's outputs (views of a collective's
        # buffer are not, even through a clone)
        pack = len({o.meta["val"].dtype for o in outs_c}) == 1
        with self.g.inserting_before(where):
            dense = insert_collective(self.graph, flat, kind, self.mesh, self.dim, "avg",
                                      readers=[])
            passed = [olds[s.target] if pack else self.op(aten.clone.default, olds[s.target])
                      for s, _ in kept]
            outs_d = [dense, *passed]
            dense_region = [dense.args[0], dense, *(p for p in passed if p.op != "placeholder")]
            if pack:
                packed_c, packed_d = self._pack(outs_c), self._pack(outs_d)
                region += packed_c[1]
                dense_region += packed_d[1]
        operands = _externals(region + dense_region)
        comp = _outline(region, operands, [packed_c[0]] if pack else outs_c)
        warm_gm = _outline(dense_region, operands, [packed_d[0]] if pack else outs_d)
        gm = self.graph.gm
        names = (f"compress_warmup_{b}", f"compress_compressed_{b}")
        gm.add_submodule(names[0], warm_gm)
        gm.add_submodule(names[1], comp)
        with self.g.inserting_before(where):
            attrs = [self.g.get_attr(n) for n in names]
            cond = self.g.call_function(torch.ops.higher_order.cond,
                                        (warm, *attrs, tuple(operands)))
            cond.meta["val"] = (packed_c[0].meta["val"],) if pack else \
                tuple(o.meta["val"] for o in outs_c)
            cond.meta["glmc"] = NodeInfo(Phase.BACKWARD, Role.GRADIENT, None,
                                         created_by="compress")
            picks = self._unpack(cond, outs_c) if pack else \
                [self.op(operator.getitem, cond, k) for k in range(len(outs_c))]
        inside = set(region)
        for old, new in zip(outs_c, picks):
            old.replace_all_uses_with(new, delete_user_cb=lambda u: u not in inside)
        self.new_outputs[kept_from:] = [(s, p) for (s, _), p in zip(kept, picks[1:])]
        for n in reversed(region + dense_region):
            self.g.erase_node(n)

    def _pack(self, values: list[fx.Node]) -> tuple[fx.Node, list[fx.Node]]:
        """cat of `values` flattened, and the nodes made for it."""
        flat = [self.op(aten.view.default, v, [-1]) for v in values]
        cat = self.op(aten.cat.default, flat)
        return cat, [*flat, cat]

    def _unpack(self, cond: fx.Node, like: list[fx.Node]) -> list[fx.Node]:
        """A packed cond output cut back into values shaped as `like`."""
        packed = self.op(operator.getitem, cond, 0)
        sizes = [v.meta["val"].numel() for v in like]
        parts = self.op(aten.split_with_sizes.default, packed, sizes)
        return [self.op(aten.view.default, self.op(operator.getitem, parts, k),
                        list(v.meta["val"].shape)) for k, v in enumerate(like)]

    def param_shape(self, name: str) -> tuple[int, ...]:
        """A parameter's full shape (stages 0-1 keep parameters whole)."""
        ph = next(ph for ph, s in zip(self.graph.placeholders(), self.graph.inputs)
                  if s.target == name and s.role is Role.PARAMETER)
        return tuple(TrainGraph.info(ph).spec.shape)

    def _low(self, e: fx.Node, kind: str, dtype: torch.dtype) -> tuple[fx.Node, fx.Node]:
        """Cast, the bucket's own collective in low precision, cast back."""
        low = self.op(aten._to_copy.default, e, dtype=dtype)
        wait = self.collective(low, kind, "avg")
        back = self.op(aten._to_copy.default, wait, dtype=e.meta["val"].dtype)
        sent = self.op(aten._to_copy.default, low, dtype=e.meta["val"].dtype)
        return back, sent

    def _dense(self, x: fx.Node) -> fx.Node:
        wait = self.collective(x, "all_reduce", "avg")
        return wait

    def _sign(self, e: fx.Node, sizes: list[int]) -> tuple[fx.Node, fx.Node]:
        """Packed signs and one scale per tensor (or per block), all-gathered; the mean of
        scale * sign."""
        n_total = sum(sizes)
        pad = (-n_total) % 8
        scale = self._sign_scales(e, sizes)  # (scales,)
        per_elem = self._scales_per_element(scale, sizes)
        positive = self.op(aten.ge.Scalar, e, 0.0)
        sign = self.op(aten.sub.Tensor, self.op(aten.mul.Tensor, self.op(
            aten._to_copy.default, positive, dtype=e.meta["val"].dtype), 2.0), 1.0)
        sent = self.op(aten.mul.Tensor, sign, per_elem)
        bits = self.op(aten._to_copy.default, positive, dtype=torch.uint8)
        if pad:
            bits = self.op(aten.constant_pad_nd.default, bits, [0, pad], 0.0)
        grid = self.op(aten.view.default, bits, [-1, 8])
        weights = self.op(aten.pow.Scalar, 2, self.op(aten.arange.default, 8, dtype=torch.uint8,
                                                      device=e.meta["val"].device))
        packed = self.op(aten._to_copy.default, self.op(aten.sum.dim_IntList, self.op(
            aten.mul.Tensor, grid, weights), [1]), dtype=torch.uint8)
        all_bits = self.collective(packed, "all_gather_into_tensor", None)
        all_scales = self.collective(scale, "all_gather_into_tensor", None)
        # unpack: (ranks * bytes,) -> (ranks, bytes, 8) bits -> (ranks, n) signs
        unpacked = self.op(aten.bitwise_and.Tensor, self.op(aten.unsqueeze.default, all_bits, 1),
                           weights)
        on = self.op(aten.ne.Scalar, unpacked, 0)
        signs = self.op(aten.sub.Tensor, self.op(aten.mul.Tensor, self.op(
            aten._to_copy.default, on, dtype=e.meta["val"].dtype), 2.0), 1.0)
        signs = self.op(aten.view.default, signs, [self.n, n_total + pad])
        if pad:
            signs = self.op(aten.slice.Tensor, signs, 1, 0, n_total)
        scales_r = self.op(aten.view.default, all_scales, [self.n, -1])
        if self.opts.block:
            per_rank = self._block_rows(scales_r, n_total)
        else:
            rows = [self._expand_scales(self.op(aten.select.int, scales_r, 0, r), sizes)
                    for r in range(self.n)]
            per_rank = self.op(aten.stack.default, rows)
        mean = self.op(aten.mean.dim, self.op(aten.mul.Tensor, signs, per_rank), [0])
        return mean, sent

    def _sign_scales(self, e: fx.Node, sizes: list[int]) -> fx.Node:
        """mean(|e|) per tensor of the bucket, or per `block` elements of it (the last block
        averaged over its own length)."""
        if not self.opts.block:
            pieces = self.op(aten.split_with_sizes.default, e, sizes)
            scales = [self.op(aten.mean.default, self.op(aten.abs.default,
                                                         self.op(operator.getitem, pieces, k)))
                      for k in range(len(sizes))]
            return self.op(aten.stack.default, scales)
        block, n_total = self.opts.block, sum(sizes)
        blocks = -(-n_total // block)
        tail = n_total - (blocks - 1) * block
        mags = self.op(aten.abs.default, e)
        if tail != block:
            mags = self.op(aten.constant_pad_nd.default, mags, [0, block - tail], 0.0)
        sums = self.op(aten.sum.dim_IntList, self.op(aten.view.default, mags, [blocks, block]),
                       [1])
        scale = self.op(aten.div.Tensor, sums, float(block))
        if tail != block:  # the last block's mean over its `tail` real elements
            last = self.op(aten.mul.Tensor, self.op(aten.slice.Tensor, scale, 0, blocks - 1,
                                                    blocks), block / tail)
            scale = self.op(aten.cat.default, [self.op(aten.slice.Tensor, scale, 0, 0,
                                                       blocks - 1), last])
        return scale

    def _scales_per_element(self, scale: fx.Node, sizes: list[int]) -> fx.Node:
        if not self.opts.block:
            return self._expand_scales(scale, sizes)
        rows = self._block_rows(self.op(aten.unsqueeze.default, scale, 0), sum(sizes))
        return self.op(aten.view.default, rows, [-1])

    def _block_rows(self, scales: fx.Node, n_total: int) -> fx.Node:
        """(rows, blocks) block scales -> (rows, n) one per element."""
        wide = self.op(aten.repeat_interleave.self_int, scales, self.opts.block, 1)
        return self.op(aten.slice.Tensor, wide, 1, 0, n_total)

    def _expand_scales(self, scale: fx.Node, sizes: list[int]) -> fx.Node:
        """(tensors,) scales -> (n,) one per element."""
        parts = [self.op(aten.expand.default, self.op(aten.slice.Tensor, scale, 0, k, k + 1),
                         [s]) for k, s in enumerate(sizes)]
        return self.op(aten.cat.default, parts)

    def _topk(self, e: fx.Node) -> tuple[fx.Node, fx.Node]:
        n = e.meta["val"].numel()
        k = max(1, int(n * self.opts.ratio))
        top = self.op(aten.topk.default, self.op(aten.abs.default, e), k)
        idx = self.op(operator.getitem, top, 1)
        vals = self.op(aten.index_select.default, e, 0, idx)
        zeros = self.op(aten.zeros_like.default, e)
        sent = self.op(aten.index_copy.default, zeros, 0, idx, vals)
        idx32 = self.op(aten._to_copy.default, idx, dtype=torch.int32)
        all_vals = self.collective(vals, "all_gather_into_tensor", None)
        all_idx = self.collective(idx32, "all_gather_into_tensor", None)
        summed = self.op(aten.index_add.default, zeros, 0,
                         self.op(aten._to_copy.default, all_idx, dtype=torch.int64), all_vals)
        return self.op(aten.div.Tensor, summed, float(self.n)), sent

    def _powersgd(self, e: fx.Node, sizes: list[int], shapes: list[tuple], names: list[str],
                  b: int) -> tuple[fx.Node, fx.Node]:
        r = self.opts.rank
        pieces = self.op(aten.split_with_sizes.default, e, sizes)
        mats, small = [], []
        for k, (size, shape, name) in enumerate(zip(sizes, shapes, names)):
            piece = self.op(operator.getitem, pieces, k)
            rows = shape[0] if shape else 1
            cols = size // rows
            if size >= self.opts.min_numel and min(rows, cols) > r:
                mats.append((k, piece, rows, cols, name))
            else:
                small.append((k, piece))
        out: dict[int, fx.Node] = {}
        sent: dict[int, fx.Node] = {}
        ps = []
        for k, piece, rows, cols, name in mats:
            q = self.state(f"psgd_q:{name}", (cols, r), e.meta["val"].dtype, init="randn")
            m = self.op(aten.view.default, piece, [rows, cols])
            ps.append((k, m, q, name, rows, cols, self.op(aten.mm.default, m, q)))
        flat_p = [self.op(aten.view.default, p, [-1]) for *_, p in ps]
        flat_small = [p for _, p in small]
        first = self.op(aten.cat.default, flat_p + flat_small) if flat_p + flat_small else None
        if first is None:
            return e, e
        first_avg = self._dense(first)
        part_sizes = [rows * r for _, _, _, _, rows, _, _ in ps] + [s for s in
                                                                    (sizes[k] for k, _ in small)]
        parts = self.op(aten.split_with_sizes.default, first_avg, part_sizes)
        qs = []
        for i, (k, m, q, name, rows, cols, _) in enumerate(ps):
            p_avg = self.op(aten.view.default, self.op(operator.getitem, parts, i), [rows, r])
            p_orth = self.op(operator.getitem, self.op(aten.linalg_qr.default, p_avg), 0)
            q_new = self.op(aten.mm.default, self.op(aten.t.default, m), p_orth)
            qs.append((k, p_orth, q_new, name, rows, cols))
        for j, (k, _) in enumerate(small):
            piece = self.op(operator.getitem, parts, len(ps) + j)
            out[k] = piece
            sent[k] = dict(small)[k]
        if qs:
            cat_q = self.op(aten.cat.default, [self.op(aten.view.default, qn, [-1])
                                               for _, _, qn, *_ in qs])
            q_avg = self._dense(cat_q)
            q_parts = self.op(aten.split_with_sizes.default, q_avg,
                              [cols * r for *_, cols in qs])
            for i, (k, p_orth, _, name, rows, cols) in enumerate(qs):
                q_final = self.op(aten.view.default, self.op(operator.getitem, q_parts, i),
                                  [cols, r])
                approx = self.op(aten.mm.default, p_orth, self.op(aten.t.default, q_final))
                out[k] = self.op(aten.view.default, approx, [-1])
                sent[k] = out[k]  # the residual keeps what the rank-r average missed
                self.keep(f"psgd_q:{name}", q_final)
        order = sorted(out)
        result = self.op(aten.cat.default, [out[k] for k in order])
        sent_all = self.op(aten.cat.default, [sent[k] for k in order])
        return result, sent_all


def _price(graph: TrainGraph, plan: CompressPlan, ranks: int, link: Any, ctx: PassContext
           ) -> Price | None:
    """Predicted seconds of the compressed and the dense gradient traffic on `link`, and of
    the ops the pass added (in the main step and in its compressed branches) on the cost
    model's profile; None where no profile is at hand without measuring this host."""
    prof = _profile(ctx, graph_device(graph))
    if prof is None:
        return None
    comm = sum(collective_seconds(k, b, ranks, link) for k, b in plan.collectives)
    dense = sum(collective_seconds(k, b, ranks, link) for k, b in plan.dense_collectives)
    overhead = dispatch_overhead(prof, ctx.traits)
    nodes = list(graph.graph.nodes)
    for name, sub in graph.gm.named_children():
        if name.startswith("compress_compressed_") and isinstance(sub, fx.GraphModule):
            nodes += list(sub.graph.nodes)
    compute = sum(node_time(op_cost(n), prof, overhead) for n in nodes
                  if n.op == "call_function" and n.meta.get("glmc") is not None
                  and n.meta["glmc"].created_by == "compress" and n.meta["glmc"].comm is None
                  and n.target is not torch.ops.higher_order.cond)
    return Price(link.name, prof.name, comm, dense, compute)


def _profile(ctx: PassContext, device: str) -> Any:
    """The cost model's profile for `device`; on a CPU without a named profile, the host's
    calibration only when it is cached (measuring it takes minutes on a loaded machine)."""
    if ctx.profile is not None or device != "cpu":
        return get_profile(ctx.profile, device)
    from glmc.analysis.calibration import cache_path, calibration_enabled
    if calibration_enabled() and not cache_path().exists():
        return None
    return get_profile(None, device)


def _externals(region: list[fx.Node]) -> list[fx.Node]:
    """The values `region` reads from outside it, in first-use order."""
    inside, out = set(region), []
    for n in region:
        for a in n.all_input_nodes:
            if a not in inside and a not in out:
                out.append(a)
    return out


def _outline(region: list[fx.Node], operands: list[fx.Node], outputs: list[fx.Node]
             ) -> fx.GraphModule:
    """`region`'s nodes as a graph of `operands` returning `outputs` (metadata kept)."""
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for x in operands:
        env[x] = sub.placeholder(x.name)
        env[x].meta = copy.copy(x.meta)
    for n in region:
        env[n] = sub.node_copy(n, lambda a: env[a])
    outs, seen = [], set()
    for o in outputs:  # a branch returns fresh tensors: no view of an input or of another output
        x = env[o]
        if o in operands or o in seen or is_view(o) or o.target is operator.getitem:
            x = sub.call_function(aten.clone.default, (x,))
            x.meta = copy.copy(o.meta)
        seen.add(o)
        outs.append(x)
    sub.output(tuple(outs))
    sub.lint()
    return fx.GraphModule(torch.nn.Module(), sub)


__all__ = ["CompressPass", "CompressPlan", "CompressStats", "Price", "METHODS"]
