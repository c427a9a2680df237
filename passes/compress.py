"""`compress`: gradient compression on the data-parallel step's gradient collectives.

Runs after `shard`: every gradient bucket's collective (marked GRAD_BUCKET) becomes compress ->
collective on the compressed form -> decompress, with error feedback — the part of the gradient
a step's compression dropped is added to the next step's (1-bit Adam, PowerSGD) — kept as
per-rank step state (Role.COMM_STATE: an input and a STATE output of the step; the runtime keeps
it, checkpoints save it).

    method     on the wire per rank (n gradient elements)     collective            stages
    bf16/fp16  2n bytes                                       as shard placed it    0-3
    sign       n/8 bytes + 4 bytes per tensor (its scale)     all-gather, unpacked  0-1
    topk       8k bytes (k = ratio n values + int32 indices)  all-gather, summed    0-1
    powersgd   4 r (rows + cols) per matrix, 4 n_small        two all-reduces       0-1

sign: each tensor of the bucket sends sign(e) packed 8 per byte and one fp32 scale mean(|e|);
the average of scale_r * sign_r over the ranks replaces the average gradient. topk: the k
largest |e| with their positions; the average of the scattered values. powersgd (rank r, Vogels
et al. 2019, as torch's DDP hook): per matrix M (a parameter viewed as rows x rest, at least
`min_numel` elements): P = M Q, all-reduce P, orthonormalise P, Q = M^T P, all-reduce Q, M ~ P
Q^T; Q persists (warm start); tensors below `min_numel` (biases, norms) or of rank <= r go
uncompressed, in the first all-reduce. sign scales each tensor of the bucket separately; topk
picks over the whole bucket. e = gradient + residual; the new residual is e minus what this rank
sent (powersgd: minus the averaged approximation, as torch's hook).
Stages 2-3 reduce-scatter, which a sum of signs or of scattered top-k does not fit: those
methods need stage 0 or 1 (a typed error otherwise); bf16/fp16 cast around any collective.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from glmc.errors import ConfigError, PassError
from glmc.ir import GRAD_BUCKET, OutputKind, OutputSpec, Phase, Role, TensorSpec, TrainGraph
from glmc.passmanager import Effect, Need, Pass, PassContext, PassResult
from glmc.program import NodeBuilder, SpmdProgram, insert_collective

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


@dataclass(frozen=True)
class CompressStats:
    method: str
    buckets: int
    compressed_tensors: int
    dense_bytes: int
    wire_bytes: int
    ratio: float


@dataclass(frozen=True)
class CompressPass(Pass):
    """Gradient compression with error feedback (see the module docstring)."""

    name = "compress"
    method: str = "bf16"
    ratio: float = 0.01  #: topk: the fraction of elements sent
    rank: int = 4  #: powersgd: the rank of the approximation
    error_feedback: bool = True
    min_numel: int = 1024  #: powersgd: smaller tensors go uncompressed

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
        plan = graph.meta.get("sharding")
        if plan is None:
            raise ConfigError("compress: the step has no gradient collectives; compression "
                              "runs on a data-parallel step (after shard: parallel= or --zero)")
        if self.method in ("sign", "topk", "powersgd") and plan.stage >= 2:
            raise ConfigError(f"compress: {self.method} needs the gradients all-reduced "
                              f"(ZeRO stage 0 or 1); stage {plan.stage} reduce-scatters them. "
                              "Use zero 0/1, or method bf16/fp16")
        if graph.meta.get("compression") is not None:
            raise PassError("compress: the step's gradients are already compressed")
        out = _Compressor(graph, plan, self).run()
        SpmdProgram(graph, plan.mesh).verify()
        stats = CompressStats(self.method, len(plan.grad_buckets), out.compressed,
                              out.plan.dense_bytes, out.plan.wire_bytes,
                              round(out.plan.dense_bytes / max(out.plan.wire_bytes, 1), 2))
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
        self.out = CompressPlan(opts.method)
        self.compressed = 0
        self.new_outputs: list[tuple[OutputSpec, fx.Node]] = []

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
        return insert_collective(self.graph, value, kind, self.mesh, self.dim, reduce_op,
                                 readers=[])

    # -- one bucket --
    def _rewrite(self, coll: fx.Node, bucket: Any) -> None:
        (wait,) = coll.users
        flat = coll.args[0]
        kind = self.plan.grad_buckets[coll.meta[GRAD_BUCKET]].collective
        v = flat.meta["val"]
        self.out.dense_bytes += v.numel() * v.element_size()
        self.like = flat
        b = coll.meta[GRAD_BUCKET]
        method = self.opts.method
        readers = list(wait.users)
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
        self.g.erase_node(wait)
        self.g.erase_node(coll)
        self.compressed += 1

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
        """Packed signs and one scale per tensor, all-gathered; the mean of scale * sign."""
        n_total = sum(sizes)
        pad = (-n_total) % 8
        pieces = self.op(aten.split_with_sizes.default, e, sizes)
        scales = [self.op(aten.mean.default, self.op(aten.abs.default,
                                                     self.op(operator.getitem, pieces, k)))
                  for k in range(len(sizes))]
        scale = self.op(aten.stack.default, scales)  # (tensors,)
        per_elem = self._expand_scales(scale, sizes)
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
        scales_r = self.op(aten.view.default, all_scales, [self.n, len(sizes)])
        rows = [self._expand_scales(self.op(aten.select.int, scales_r, 0, r), sizes)
                for r in range(self.n)]
        per_rank = self.op(aten.stack.default, rows)
        mean = self.op(aten.mean.dim, self.op(aten.mul.Tensor, signs, per_rank), [0])
        return mean, sent

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


__all__ = ["CompressPass", "CompressPlan", "CompressStats", "METHODS"]
