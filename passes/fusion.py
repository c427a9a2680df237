"""`fusion`: the large patterns of transformer training -> fused, memory-saving ops.

Matched on the step's forward (ATen, any of the spellings below); the backward is derived again
from the fused forward (`glmc.trace.rederive`), so each fused op's backward replaces the hand-written
one and saves only what it needs. Visible on every backend, eager included.

    attention  bmm(q, kᵀ) → (÷√d | ×s) → (masked_fill(causal/bool mask, -inf) | + mask) →
               softmax → (dropout p=0) → bmm(·, v)           → scaled_dot_product_attention
               (grouped-query: k/v repeated by repeat_interleave → enable_gqa, no repeated copy;
               a triu(ones, 1) mask → is_causal). The (seq × seq) probabilities are not stored.
    norm       x · rsqrt(mean(x², -1) + eps) · w (RMSNorm)   → glmc::rms_norm
               (x - mean) / sqrt(var + eps) [· w] [+ b], var as mean((x - mean)²) or
               var(x, correction=0); ÷ sqrt or × rsqrt (LayerNorm) → native_layer_norm
    mlp        act(gate) · up, act ∈ silu / gelu / gelu-tanh → glmc::gated (SwiGLU / GeGLU);
               with `mlp=chunked` (the default pipeline's choice under `memory_budget=min`)
               the whole MLP, bias-free projections included (gate and up separate or one
               merged weight split in two) → glmc::gated_mlp: row chunk by row chunk, its
               backward keeps only the MLP's input and makes each chunk's projections again
    loss       nll(log_softmax(logits)), logits = x @ wᵀ     → glmc::linear_cross_entropy
               (chunked: the (tokens × vocab) logits and their gradient are never stored;
               a shifted-LM slice is absorbed into the targets); without a bias-free head in
               front, the loss alone → glmc::cross_entropy
    optimizer  the per-parameter update chains                → one multi-tensor (`_foreach_*`)
               update per param group, op for op the same formula (bit-identical); with
               `update=fused` (`auto` on Inductor) Adam/AdamW groups in fp32 run ATen's
               fused kernel (`_fused_adamw`, one pass over each tensor; rounds differently)

A pattern fires only when every intermediate value has no other reader (otherwise the fused op
would have to produce it too), and never across a random op with p > 0 (dropout masks would
come from a different generator). Options: `patterns=attention+norm+mlp+loss+optimizer` (any
subset); the default `auto` is all of them, less `optimizer` on a backend that neither fuses
nor runs ATen's fused update (eager), less `loss` on one that fuses (unless `loss=true`: the
default pipeline's choice under a memory budget), and less `attention` with `attention=false`
(what the default pipeline spells under bf16/fp16 on a CPU; see `FusionPass.selected`). The
pass reads no other pass's options.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from glmc.compiler.lossfusion import fuse_head, fuse_loss
from glmc.compiler.patterns import Alt, Capture, Op, Pattern, find, is_float, is_node
from glmc.compiler.passmanager import (Effect, Need, Pass, PassContext, PassResult, StageForm,
                                       StageUnit)
from glmc.errors import ConfigError
from glmc.ir import kernels  # noqa: F401  (registers glmc's fused ops)
from glmc.ir.graph import TrainGraph, is_impure, op_name, replace_uses
from glmc.ir.target import EAGER, BackendTraits
from glmc.trace.rederive import ForwardProgram, forward_program, rederive

aten = torch.ops.aten
PATTERNS = ("attention", "norm", "mlp", "loss", "optimizer")
_VIEWS = ("view", "_unsafe_view", "reshape", "expand", "clone", "contiguous")


@dataclass(frozen=True)
class FusionStats:
    counts: dict[str, int] = field(default_factory=dict)  #: pattern -> regions fused
    regions: list[dict[str, Any]] = field(default_factory=list)  #: pattern, op, source, nodes

    def report_section(self, ctx: Any) -> Any:
        """The report's fusion section (a glmc.compiler.report_parts.ReportSection for the
        SectionContext `ctx`): regions per pattern, prediction before/after, each region."""
        from glmc.compiler.report_parts import ReportSection, Table, Text, before_after, mib
        counts = ", ".join(f"{k}: {v}" for k, v in self.counts.items()) or "none"
        text = (f"Regions fused per pattern: {counts}. {before_after(ctx)}; measured peak of "
                f"the compiled step {mib(ctx.measured_peak_bytes)} (the benchmark "
                "bench_fusion.py measures with and without).")
        rows = tuple((r["pattern"], r["op"], r.get("source") or r.get("module") or "",
                      len(r["nodes"])) for r in self.regions)
        table = Table(("pattern", "fused op", "source", "nodes replaced"), rows, "lllr")
        return ReportSection("Fusion", (Text(text), table), f"fused {counts}")


@dataclass(frozen=True)
class FusionPass(Pass):
    """Replaces attention, RMSNorm, gated-MLP and LM-head+loss patterns by fused ops."""

    name = "fusion"
    #: "+"-joined subset of PATTERNS; "auto": all of them, except `optimizer` on a backend that
    #: does not fuse (eager): there each multi-tensor op materialises the new values of a whole
    #: param group at once, which raised GLM small's measured peak from 180 to 300 MiB, for no
    #: speed on CPU
    patterns: str = "auto"
    #: with `patterns=auto`: include attention (the default pipeline turns it off under
    #: bf16/fp16 on a CPU, where ATen's flash attention measured slower). None (auto): on a
    #: backend that fuses, each attention shape is timed both ways (`AttentionTimer`) and
    #: fused only where SDPA is faster; elsewhere always. (Whole steps on 2 CPU cores did not
    #: settle which is faster: GLM 18M 618 ms unfused vs 639 ms SDPA in one run, Llama 2x384
    #: 1.011 vs 1.019 of torch.compile in another — within this machine's noise.)
    attention: bool | None = None
    #: the `optimizer` pattern's form: `foreach` (bit-identical multi-tensor ops), `fused`
    #: (ATen's fused Adam/AdamW kernels, run in place by Inductor: GLM 18M, 4 layers, its update
    #: took 48 ms as Inductor-compiled foreach loops, 9.7 ms as `_fused_adamw`), or `auto`
    #: (fused on a backend whose traits say it runs them in place, foreach elsewhere)
    update: str = "auto"
    #: with `patterns=auto`: include `loss`. None (auto): not on a backend that fuses, whose
    #: own kernels for the LM head and cross-entropy are faster (GLM 18M, 1024 tokens, vocab
    #: 32000: 633 ms unfused under Inductor, 670-700 ms as glmc's chunked op), at the cost of
    #: holding the (tokens x vocab) logits; the default pipeline spells `loss=true` when a memory
    #: budget is set
    loss: bool | None = None
    #: the `mlp` pattern's reach: `gated` (act(gate) * up -> glmc::gated) or `chunked` (the whole
    #: gated MLP -> glmc::gated_mlp, row chunk by row chunk, recomputing its projections in the
    #: backward: GLM 2x256, 1024 tokens, whole-step peak at budget `min` measured below)
    mlp: str = "gated"
    #: with `mlp=chunked`: rows per chunk (0: `glmc.ir.kernels.mlp_rows`'s default)
    mlp_rows: int = 0

    def needs(self) -> frozenset[Need]:
        return frozenset({Need.STEP})

    def effects(self) -> frozenset[Effect]:
        return frozenset({Effect.REDERIVES})

    def __post_init__(self) -> None:
        unknown = set(self.selected()) - set(PATTERNS)
        if unknown:
            raise ConfigError(f"fusion: unknown pattern(s) {sorted(unknown)}; known: "
                              f"{'+'.join(PATTERNS)}")
        if self.update not in ("auto", "foreach", "fused"):
            raise ConfigError(f"fusion: update={self.update!r}; choose auto, foreach or fused")
        if self.mlp not in ("gated", "chunked"):
            raise ConfigError(f"fusion: mlp={self.mlp!r}; choose gated or chunked")
        if not isinstance(self.mlp_rows, int) or self.mlp_rows < 0:
            raise ConfigError(f"fusion: mlp_rows={self.mlp_rows!r}; a whole number of rows per "
                              "chunk (0: the default)")

    def stage_forms(self) -> frozenset[StageForm]:
        return frozenset({StageForm.FORWARD})

    def run_stage(self, unit: StageUnit, ctx: PassContext) -> PassResult:
        """A pipeline stage's forward program with the forward patterns fused in place
        (`STAGE_PATTERNS`): attention unless `attention=false` (the timing the pass does on
        Inductor is not done for stages), norms, gated MLPs, and the loss where `loss` (None:
        not on a backend that fuses) — on the stage that computes it. The stage capture
        differentiates the result again."""
        loss = self.loss if self.loss is not None else not ctx.traits.fuses
        patterns = tuple(p for p in STAGE_PATTERNS if (loss or p != "loss")
                         and (self.attention is not False or p != "attention"))
        counts = _fuse_forward(unit.gm, unit.inputs, patterns)
        return PassResult(any(counts.values()), counts)

    def selected(self, traits: BackendTraits = EAGER) -> list[str]:
        """`auto` leaves out `optimizer` on a backend that neither fuses nor runs ATen's fused
        update (eager), where it measured bigger (bench_fusion.py). It reads no other option:
        under bf16/fp16 on a CPU the default pipeline spells `attention=false` itself (ATen's
        CPU flash attention in bf16 took GLM small's Inductor step from 236 to 283 ms)."""
        if str(self.patterns) == "auto":
            loss = self.loss if self.loss is not None else not traits.fuses
            update = traits.fuses or traits.fused_update
            return [p for p in PATTERNS if (update or p != "optimizer")
                    and (self.attention is not False or p != "attention")
                    and (loss or p != "loss")]
        return [p.strip() for p in str(self.patterns).replace(",", "+").split("+") if p.strip()]

    def run(self, graph: TrainGraph, ctx: PassContext) -> PassResult:
        selected = self.selected(ctx.traits)
        program = forward_program(graph)
        regions: list[dict[str, Any]] = []
        choose = AttentionTimer() if self.attention is None and ctx.traits.fuses and \
            str(self.patterns) == "auto" else None
        finders: dict[str, Callable[[ForwardProgram, list], int]] = {
            "attention": lambda prog, regs: fuse_attention(prog, regs, choose),
            "norm": fuse_norms, "loss": _fuse_loss,
            "mlp": lambda prog, regs: fuse_gated(prog, regs, self.mlp == "chunked",
                                                 self.mlp_rows)}
        counts = {p: finders[p](program, regions) for p in selected if p in finders}
        rule = graph.meta["optimizer"].rule
        fused = "optimizer" in selected and rule.update_fused is not None and (
            self.update == "fused" or (self.update == "auto" and ctx.traits.fused_update))
        foreach = "optimizer" in selected and rule.update_foreach is not None and (
            not graph.meta.get("foreach_update") or (fused and not graph.meta.get("fused_update")))
        if not any(counts.values()) and not foreach:
            if "optimizer" in selected:
                counts["optimizer"] = 0
            return PassResult(False, FusionStats(counts, regions))
        program.graph.eliminate_dead_code(is_impure_node=is_impure)
        program.gm.recompile()
        rederive(graph, program, graph.meta.get("loss_scaling"),
                 foreach=foreach or bool(graph.meta.get("foreach_update")),
                 fused=fused or bool(graph.meta.get("fused_update")))
        if "optimizer" in selected:
            counts["optimizer"] = _foreach_regions(graph, regions) if foreach else 0
        return PassResult(True, FusionStats(counts, regions))


#: the patterns a pipeline stage's forward takes (`FusionPass.run_stage`)
STAGE_PATTERNS = ("attention", "norm", "mlp", "loss")


def _fuse_forward(gm: fx.GraphModule, inputs: list[Any],
                patterns: tuple[str, ...] = STAGE_PATTERNS) -> dict[str, int]:
    """A pipeline stage's forward program (`gm` over `inputs`) with the fusion pass's forward
    patterns fused in place: attention -> SDPA, RMSNorm / LayerNorm, gated MLP, and the loss
    (on the stage that computes it: the LM head and loss -> `glmc::linear_cross_entropy` when
    both sit on it, the loss alone -> `glmc::cross_entropy` when the logits arrive from the
    stage before). Not `optimizer`: a stage's update is already ATen's fused AdamW. Returns
    the regions fused per pattern."""
    unknown = set(patterns) - set(STAGE_PATTERNS)
    if unknown:
        raise ConfigError(f"fusion: pattern(s) {sorted(unknown)} on pipeline stages; stages "
                          f"take {'+'.join(STAGE_PATTERNS)}")
    program = ForwardProgram(gm, list(inputs), [])
    finders: dict[str, Callable[[ForwardProgram, list], int]] = {
        "attention": lambda prog, regs: fuse_attention(prog, regs, None),
        "norm": fuse_norms, "mlp": fuse_gated, "loss": _fuse_loss}
    regions: list[dict[str, Any]] = []
    counts = {p: finders[p](program, regions) for p in patterns}
    program.graph.eliminate_dead_code(is_impure_node=is_impure)
    program.gm.recompile()
    return counts


def _where(n: fx.Node) -> str | None:
    info = n.meta.get("glmc")
    return (info.source or info.module) if info else None


def _region(regions: list, pattern: str, op: str, anchor: fx.Node, nodes: list) -> None:
    regions.append({"pattern": pattern, "op": op, "source": _where(anchor),
                    "module": getattr(anchor.meta.get("glmc"), "module", None),
                    "nodes": [n.name for n in nodes]})


def _only_user(n: fx.Node) -> fx.Node | None:
    users = list(n.users)
    return users[0] if len(users) == 1 else None


def _strip(n: Any, chain: list) -> Any:
    """Walk up through view-like ops (each with a single reader), recording them."""
    while isinstance(n, fx.Node) and op_name(n) in _VIEWS and len(n.users) == 1:
        chain.append(n)
        n = n.args[0]
    return n


def _shape(n: Any) -> tuple | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


# ---- attention --------------------------------------------------------------------------------

def fuse_attention(program: ForwardProgram, regions: list,
                   choose: Callable[..., str | None] | None = None) -> int:
    """`choose(q, k, v, mask, causal, gqa)` (mask: None or ("not" | "add", node)): None to
    fuse a matched region, or the reason (recorded as a region kept unfused) not to."""
    g = program.graph
    fused = 0
    for sm in [n for n in g.nodes if op_name(n) == "_softmax"]:
        m = _match_attention(sm)
        if m is None:
            continue
        q, k, v, mask, causal, scale, gqa, out, nodes = m
        reason = choose(q, k, v, mask, causal, gqa) if choose is not None else None
        if reason is not None:
            regions.append({"pattern": "attention", "op": f"kept unfused: {reason}",
                            "source": _where(sm), "kept": True,
                            "module": getattr(sm.meta.get("glmc"), "module", None),
                            "nodes": []})
            continue
        if mask is not None:
            mask = _mask_node(mask, out)
        with g.inserting_before(out):
            o = g.call_function(aten.scaled_dot_product_attention.default, (q, k, v),
                                {"attn_mask": mask, "dropout_p": 0.0, "is_causal": causal,
                                 "scale": scale, "enable_gqa": gqa})
        o.meta = {k2: x for k2, x in sm.meta.items() if k2 != "val"}
        replace_uses(out, o)
        _region(regions, "attention", "scaled_dot_product_attention", sm, nodes)
        fused += 1
    return fused


def _match_attention(sm: fx.Node) -> tuple | None:
    if sm.args[1] not in (-1, 3) or sm.args[2] or len(sm.users) != 1:
        return None
    nodes = [sm]
    pre = sm.args[0]
    mask, causal = None, False
    if op_name(pre) == "masked_fill" and len(pre.users) == 1 and pre.args[2] == -math.inf:
        nodes.append(pre)
        mask_node = pre.args[1]
        causal = _is_causal(mask_node)
        if not causal:
            mask = ("not", mask_node)
        pre = pre.args[0]
    elif op_name(pre) == "add" and len(pre.users) == 1 and isinstance(pre.args[1], fx.Node) \
            and _shape(pre.args[1]) is not None and len(_shape(pre.args[1])) <= 4 \
            and _shape(pre.args[1])[-2:] == _shape(pre)[-2:] and _shape(pre.args[0]) == _shape(pre):
        nodes.append(pre)
        mask = ("add", pre.args[1])
        pre = pre.args[0]
    scale = 1.0
    if op_name(pre) in ("div", "mul") and len(pre.users) == 1 and \
            isinstance(pre.args[1], (int, float)):
        nodes.append(pre)
        scale = 1.0 / pre.args[1] if op_name(pre) == "div" else float(pre.args[1])
        pre = pre.args[0]
    chain: list = []
    bmm = _strip(pre, chain)
    if op_name(bmm) != "bmm" or len(bmm.users) != 1:
        return None
    nodes += chain + [bmm]
    q = _bmm_operand(bmm.args[0], nodes)
    kt = _bmm_operand(bmm.args[1], nodes)
    if op_name(kt) != "transpose" or len(kt.users) != 1 or \
            sorted(a % 4 for a in kt.args[1:]) != [2, 3]:
        return None
    nodes.append(kt)
    k = kt.args[0]
    # after the softmax: (clone = dropout with p=0), views, bmm with v, view back
    post = _only_user(sm)
    if post is not None and op_name(post) == "clone" and _only_user(post) is not None:
        nodes.append(post)
        post = _only_user(post)
    p_chain: list = []
    cur = post
    while op_name(cur) in _VIEWS and _only_user(cur) is not None:
        p_chain.append(cur)
        cur = _only_user(cur)
    bmm2 = cur
    if op_name(bmm2) != "bmm" or (p_chain and bmm2.args[0] is not p_chain[-1]) or \
            _only_user(bmm2) is None:
        return None
    nodes += p_chain + [bmm2]
    v = _bmm_operand(bmm2.args[1], nodes)
    out = _only_user(bmm2)
    if out is None or op_name(out) not in ("view", "_unsafe_view"):
        return None
    nodes.append(out)
    shapes = [_shape(x) for x in (q, k, v, out)]
    if any(s is None or len(s) != 4 for s in shapes):
        return None
    (b, h, s, d), (_, hk, lk, dk), (_, hv, lv, dv), o_shape = shapes
    if d != dk or lk != lv or hk != h or hv != h or o_shape != (b, h, s, dv):
        return None
    k2, rk = _unrepeat(k)
    v2, rv = _unrepeat(v)
    gqa = rk > 1 and rk == rv
    if gqa:
        k, v = k2, v2
    return q, k, v, mask, causal, scale, gqa, out, nodes


class AttentionTimer:
    """Times scaled_dot_product_attention (with the region's mask) against bmm + softmax + bmm
    (forward and backward, ATen kernels, random tensors of the region's shapes) and keeps the
    faster. On a fusing backend the compiler folds the scale and mask into the softmax pass,
    so the unfused form is timed without them. Measured once per shape signature."""

    def __init__(self) -> None:
        self.seen: dict[tuple, str | None] = {}

    def __call__(self, q: fx.Node, k: fx.Node, v: fx.Node, mask: Any, causal: bool,
                 gqa: bool) -> str | None:
        vals = [n.meta["val"] for n in (q, k, v)]
        m = mask[1].meta.get("val") if mask is not None else None  # ("not" | "add", node)
        key = (*(tuple(t.shape) for t in vals), vals[0].dtype, str(vals[0].device),
               None if m is None else (tuple(m.shape), m.dtype), causal, gqa)
        if key not in self.seen:
            fused, unfused = _time_attention(vals, m, causal, gqa)
            self.seen[key] = None if fused <= unfused else (
                f"measured bmm+softmax {unfused * 1e3:.2f} ms < fused {fused * 1e3:.2f} ms "
                "(forward + backward)")
        return self.seen[key]


def _time_attention(vals: list, mask: Any, causal: bool, gqa: bool) -> tuple[float, float]:
    """(SDPA, bmm + softmax + bmm) seconds, best of 3, forward + backward."""
    import time
    qv, kv, vv = (torch.randn(tuple(t.shape), dtype=t.dtype, device=t.device) for t in vals)
    m = None
    if mask is not None:
        m = torch.zeros(tuple(mask.shape), device=mask.device).to(mask.dtype) \
            if mask.dtype != torch.bool else torch.ones(tuple(mask.shape), dtype=torch.bool,
                                                         device=mask.device)
    rep = qv.shape[1] // kv.shape[1]
    sync = torch.cuda.synchronize if qv.is_cuda else (lambda: None)

    def fused(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=m, is_causal=causal, enable_gqa=gqa)

    def unfused(q, k, v):
        # what the compiler runs: the two batched matmuls (k/v repeated for grouped-query)
        # and one softmax pass each way, the mask and scale fused into it (so left out here)
        if rep > 1:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return torch.softmax(q @ k.transpose(-2, -1), -1) @ v

    def best(fn) -> float:
        times = []
        for _ in range(3):
            q, k, v = (t.detach().requires_grad_() for t in (qv, kv, vv))
            sync()
            t0 = time.perf_counter()
            fn(q, k, v).sum().backward()
            sync()
            times.append(time.perf_counter() - t0)
        return min(times)
    best(fused), best(unfused)  # warm-up (allocator, kernel selection)
    return best(fused), best(unfused)


def _bmm_operand(n: Any, nodes: list) -> Any:
    """matmul's decomposition of a 4-D operand: view(clone?(expand(x4))) -> x4."""
    for ops in (("view", "_unsafe_view", "reshape"), ("clone",), ("expand",)):
        if isinstance(n, fx.Node) and op_name(n) in ops and len(n.users) == 1:
            nodes.append(n)
            n = n.args[0]
    return n


def _unrepeat(n: fx.Node) -> tuple[fx.Node, int]:
    """k.repeat_interleave(r, dim=1) as ATen spells it: view(clone(expand(unsqueeze(k, 2),
    [b, hk, r, l, d])), [b, hk * r, l, d]) -> (k, r); else (n, 1)."""
    x = n
    if op_name(x) not in ("view", "_unsafe_view") or len(x.users) != 1:
        return n, 1
    x = x.args[0]
    if op_name(x) == "clone" and len(x.users) == 1:
        x = x.args[0]
    if op_name(x) != "expand" or len(x.users) != 1:
        return n, 1
    size = list(x.args[1])
    u = x.args[0]
    if op_name(u) != "unsqueeze" or u.args[1] != 2 or len(size) != 5:
        return n, 1
    return u.args[0], int(size[2])


def _is_causal(mask: fx.Node) -> bool:
    """triu(ones(s, s, bool), diagonal=1): True above the diagonal."""
    if op_name(mask) != "triu" or (mask.args[1] if len(mask.args) > 1 else 0) != 1:
        return False
    ones = mask.args[0]
    shape = _shape(ones)
    return op_name(ones) == "ones" and shape is not None and len(shape) == 2 and \
        shape[0] == shape[1] and ones.kwargs.get("dtype") == torch.bool


def _mask_node(mask: tuple, anchor: fx.Node) -> fx.Node:
    kind, node = mask
    if kind == "add":
        return node
    g = anchor.graph
    with g.inserting_before(anchor):
        inv = g.call_function(aten.logical_not.default, (node,))
    inv.meta = {k: x for k, x in node.meta.items() if k != "val"}
    return inv


# ---- norms and the gated MLP, as declared patterns (glmc.compiler.patterns) ---------------------

_X, _W, _B = Capture("x"), Capture("w", is_node), Capture("b", is_node)
_EPS = Capture("eps", is_float)

#: RMSNorm: w * (x * rsqrt(mean(x ** 2, [-1], keepdim) + eps))
RMS_NORM = Pattern(
    Op("mul", (Op("mul", (_X, Op("rsqrt", (Op("add", (Op("mean", (Op("pow", (_X, 2)), [-1],
                                                                  True)), _EPS)),))),
                  commutative=True, bind="norm"), _W), commutative=True, bind="end"),
    check=lambda b: _per_channel(b, "w"))

#: x - mean(x, [-1], keepdim)
_CENTERED = Op("sub", (_X, Op("mean", (_X, [-1], True))))
#: var(x) + eps, the variance written as mean((x - mean(x)) ** 2) or var(x, correction=0)
_VAR_EPS = Op("add", (Alt((Op("mean", (Op("pow", (_CENTERED, 2)), [-1], True)),
                          Op("var", (_X, [-1]), {"correction": 0, "keepdim": True}))), _EPS))
#: (x - mean(x)) / sqrt(var + eps), or times rsqrt(var + eps)
_LAYER_NORM = Alt((Op("div", (_CENTERED, Op("sqrt", (_VAR_EPS,))), bind="scale"),
                   Op("mul", (_CENTERED, Op("rsqrt", (_VAR_EPS,))), commutative=True,
                      bind="scale")))


def _per_channel(b: dict, name: str) -> bool:
    """b[name] is (d,)-shaped for an input x of last dim d (x of unknown shape: no match)."""
    x = _shape(b["x"])
    return bool(x) and _shape(b[name]) == (x[-1],)


#: LayerNorm with its affine tail, the largest first: [* w] [+ b]
LAYER_NORMS = (
    Pattern(Op("add", (Op("mul", (_LAYER_NORM, _W), commutative=True), _B), commutative=True,
               bind="end"), check=lambda b: _per_channel(b, "w") and _per_channel(b, "b")),
    Pattern(Op("mul", (_LAYER_NORM, _W), commutative=True, bind="end"),
            check=lambda b: _per_channel(b, "w")),
    # no affine: the scale is the end
    *(Pattern(scale, check=lambda b: bool(_shape(b["x"]))) for scale in _LAYER_NORM.options))

#: gated MLP: act(gate) * up, act SiLU or GELU (exact or tanh)
GATED = Pattern(Op("mul", (Op(("silu", "gelu"), (Capture("gate"),), bind="act"),
                           Capture("up", is_node)), commutative=True, bind="end"),
                check=lambda b: _shape(b["act"]) == _shape(b["up"]))


def _replace(g: fx.Graph, end: fx.Node, op: Any, args: tuple, first: bool = True) -> fx.Node:
    """`op(*args)` (its first output where `first`) in place of `end`: inserted before it,
    with its metadata (not its value), reading `end`'s readers."""
    with g.inserting_before(end):
        call = g.call_function(op, args)
        out = g.call_function(operator.getitem, (call, 0)) if first else call
    for n in {call, out}:
        n.meta = {k: v for k, v in end.meta.items() if k != "val"}
    replace_uses(end, out)
    return out


def fuse_rms_norm(program: ForwardProgram, regions: list, consumed: set | None = None) -> int:
    g = program.graph
    fused = 0
    for m in find(RMS_NORM, g, consumed):
        _replace(g, m["end"], torch.ops.glmc.rms_norm.default, (m["x"], m["w"], m["eps"]))
        _region(regions, "norm", "glmc::rms_norm", m["norm"], m.nodes)
        fused += 1
    return fused


def fuse_norms(program: ForwardProgram, regions: list) -> int:
    consumed: set = set()  # a node one norm took is not another's
    return fuse_rms_norm(program, regions, consumed) + \
        fuse_layer_norm(program, regions, consumed)


def fuse_layer_norm(program: ForwardProgram, regions: list, consumed: set | None = None) -> int:
    """(x - mean(x)) / sqrt(var(x) + eps) [* w] [+ b], with var written as mean((x - mean)^2)
    or var(x, correction=0); the scale as div by sqrt or mul by rsqrt -> native_layer_norm
    (`LAYER_NORMS`, the largest affine tail first)."""
    g = program.graph
    fused = 0
    consumed = set() if consumed is None else consumed
    for pattern in LAYER_NORMS:
        for m in find(pattern, g, consumed):
            x = m["x"]
            _replace(g, m.binds.get("end", m["scale"]), aten.native_layer_norm.default,
                     (x, [_shape(x)[-1]], m.binds.get("w"), m.binds.get("b"), m["eps"]))
            _region(regions, "norm", "native_layer_norm", m["scale"], m.nodes)
            fused += 1
    return fused


def fuse_gated(program: ForwardProgram, regions: list, whole: bool = False,
               rows: int = 0) -> int:
    """act(gate) * up -> glmc::gated; with `whole`, each whose projections and down projection
    match `_whole_mlp` -> glmc::gated_mlp (`rows` per chunk; 0: its default)."""
    g = program.graph
    fused = 0
    for m in find(GATED, g):
        act = _activation(m["act"])
        gated = _replace(g, m["end"], torch.ops.glmc.gated.default, (m["gate"], m["up"], act),
                         first=False)
        _erase_dead(g, m.nodes)  # the projections' readers are counted next
        whole_mlp = _whole_mlp(gated) if whole else None
        if whole_mlp is None:
            _region(regions, "mlp", f"glmc::gated({act})", m["end"], m.nodes)
        else:
            args, down, nodes = whole_mlp
            _replace(g, down, torch.ops.glmc.gated_mlp.default, (*args, act, rows),
                     first=False)
            _region(regions, "mlp", f"glmc::gated_mlp({act}, chunked)", m["end"],
                    [*m.nodes, *nodes])
        fused += 1
    return fused


def _erase_dead(g: fx.Graph, nodes: list) -> None:
    dead = [n for n in nodes if n.graph is g and n.op == "call_function"]
    while any(not n.users for n in dead):
        for n in [n for n in dead if not n.users]:
            g.erase_node(n)
            dead.remove(n)


def _projection(n: Any, chain: list) -> tuple[fx.Node, fx.Node] | None:
    """(x, w) of a bias-free linear `view*(mm(x, t(w)))` read only along the chain."""
    mm = _strip(n, chain)
    if op_name(mm) != "mm" or len(mm.users) != 1 or op_name(mm.args[1]) != "t" or \
            len(mm.args[1].users) != 1:
        return None
    chain += [mm, mm.args[1]]
    return mm.args[0], mm.args[1].args[0]


def _half(n: Any, chain: list) -> tuple[fx.Node, int] | None:
    """(split node, index) of `view*(getitem(split(p, size, -1), index))`."""
    item = _strip(n, chain)
    if not is_node(item) or item.target is not operator.getitem or len(item.users) != 1:
        return None
    chain.append(item)
    return item.args[0], item.args[1]


def _whole_mlp(gated: fx.Node) -> tuple[tuple, fx.Node, list] | None:
    """((x, w_gate, w_up | None, w_down), the down projection's mm, the nodes it replaces) of a
    bias-free gated MLP around `gated` whose intermediate values have no other reader: gate
    and up from one merged projection split in two halves, or from two projections of the
    same 2-D x; one 2-D down projection of act(gate) * up."""
    gate, up = gated.args[:2]
    chain: list = []
    down = _only_user(gated)
    while down is not None and op_name(down) in _VIEWS and len(down.users) == 1:
        chain.append(down)
        down = _only_user(down)
    if down is None or op_name(down) != "mm" or op_name(down.args[1]) != "t" or \
            len(down.args[1].users) != 1 or down.args[0] is not (chain[-1] if chain else gated):
        return None
    chain.append(down.args[1])
    w_down = down.args[1].args[0]
    halves = _half(gate, chain), _half(up, chain)
    if halves[0] and halves[1] and halves[0][0] is halves[1][0] and \
            [h[1] for h in halves] == [0, 1]:
        split = halves[0][0]
        inter = _shape(w_down)[-1] if _shape(w_down) else None
        dims = (-1, len(_shape(split.args[0]) or ()) - 1)
        if op_name(split) != "split" or len(split.users) != 2 or len(split.args) != 3 or \
                split.args[1] != inter or split.args[2] not in dims:
            return None
        chain.append(split)
        both = _projection(split.args[0], chain)
        if both is None:
            return None
        x, w_gate, w_up = both[0], both[1], None
        if (_shape(w_gate) or (0,))[0] != 2 * inter:  # gate and up: the weight's two halves
            return None
    else:
        chain = chain[:chain.index(down.args[1]) + 1]
        proj = _projection(gate, chain), _projection(up, chain)
        if proj[0] is None or proj[1] is None or not _same_value(proj[0][0], proj[1][0]):
            return None
        x, w_gate, w_up = proj[0][0], proj[0][1], proj[1][1]
        if _shape(w_gate) != _shape(w_up) or (_shape(w_gate) or (0,))[0] != \
                (_shape(w_down) or (0, 0))[-1]:
            return None
    if not _same_float(x, w_gate, w_up, w_down) or len(_shape(x) or ()) != 2:
        return None
    return (x, w_gate, w_up, w_down), down, chain


def _same_value(a: fx.Node, b: fx.Node) -> bool:
    """a and b are one node, or the same view of one node (each linear views its own input)."""
    return a is b or (op_name(a) in _VIEWS and op_name(a) == op_name(b)
                      and a.args == b.args and a.kwargs == b.kwargs)


def _same_float(*values: Any) -> bool:
    dtypes = {v.meta["val"].dtype for v in values if is_node(v) and "val" in v.meta}
    return len(dtypes) == 1 and next(iter(dtypes)).is_floating_point and \
        all(v is None or (is_node(v) and "val" in v.meta) for v in values)


def _activation(n: fx.Node) -> str:
    if op_name(n) == "silu":
        return "silu"
    return "gelu_tanh" if n.kwargs.get("approximate", "none") == "tanh" else "gelu"


# ---- optimizer --------------------------------------------------------------------------------

def _foreach_regions(graph: TrainGraph, regions: list) -> int:
    """One region per param group: its update runs as multi-tensor (`_foreach_*`) ops or one
    fused kernel (`_fused_adamw`)."""
    ops = [n for n in graph.compute_nodes() if op_name(n).startswith(("_foreach_", "_fused_"))]
    groups = len(graph.meta["optimizer"].groups)
    if ops:
        kinds = sorted({op_name(n) for n in ops if op_name(n).startswith("_fused_")})
        what = f"{len(ops)} _foreach_* ops" if not kinds else \
            f"{', '.join(kinds)} ({len(ops)} multi-tensor ops)"
        regions.append({"pattern": "optimizer", "op": what,
                        "source": graph.meta["optimizer"].kind, "module": None,
                        "nodes": [n.name for n in ops]})
    return groups if ops else 0


# ---- loss -------------------------------------------------------------------------------------

def _fuse_loss(program: ForwardProgram, regions: list) -> int:
    before = {n.name for n in program.graph.nodes}
    count = fuse_loss(program, require_cast=False)
    heads = fuse_head(program, fp32=True)
    for n in program.graph.nodes:
        if n.name not in before and n.target in (torch.ops.glmc.cross_entropy.default,
                                                 torch.ops.glmc.linear_cross_entropy.default):
            _region(regions, "loss", op_name(n), n, [n])
    return max(count, heads)
