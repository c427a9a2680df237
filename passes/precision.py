"""`precision{policy=bf16|fp16|fp32|auto}`: per-op compute dtypes with fp32 master weights.

Every forward op gets a compute dtype from a policy table (data: op name -> rule, extendable and
overridable per op and per module path):

    low    matmul / bmm / addmm / conv / attention: float inputs cast to the low dtype
    fp32   log-softmax and losses, norms (statistics), reductions, exp / log / pow / rsqrt:
           low-precision inputs cast up to fp32
    acc    softmax: runs on its inputs' dtype; ATen's kernel computes in fp32 internally
           (opmath), so the probabilities are stored in the low dtype without an fp32 copy
    keep   everything else: runs on its inputs as they come (ATen promotes mixed inputs);
           a buffer or constant wider than the activation (rotary tables) is cast down once

Casts are made once per value and dtype and shared by every reader (a weight's low-precision
copy is made once per step however many times it is used), at the first reader; a value is
never cast back to a dtype it already has in the graph. Parameters and optimizer state stay fp32:
the backward is derived again from the rewritten forward (`glmc.trace.rederive`), so each gradient
flows back through the casts and reaches its fp32 parameter as fp32, and saved activations are
kept in whatever dtype the forward produced them in — the low one for matmul outputs, which is
where the memory goes down. The loss and new buffer values are returned in their original dtype.

Memory beyond the low-precision activations: the backward casts parameters again right before
it needs them (`recast`, bit-identical) instead of keeping the forward's copies alive; the
cross-entropy over low-precision logits is one fp32 op (`glmc::cross_entropy`) that keeps no
fp32 copy of the logits, and with a bias-free LM head in front of it the head joins it
(`glmc::linear_cross_entropy`, chunked: the logits are never stored). `head=fp32` (default)
computes those logits with fp32 matmuls of the uncast activations: the largest error autocast
leaves in the loss is the bf16 rounding of the logits; `head=low` computes them in the low dtype.
A shifted-LM slice of the logits is absorbed into the targets (ignore_index).

fp16 adds dynamic loss scaling inside the step (`glmc.trace.scaler`: scale, unscale, inf/NaN check,
skip and back off, grow after `growth_interval` clean steps; no host synchronisation).

Off by default, because they round more and measurably moved the loss further from fp64 on the
GLM example: `early_cast` (a pointwise op read only by low-precision ops takes a low-precision
copy of its activation input, so the backward saves that copy) and `cast_constants` (buffers such
as rotary tables are cast down to the activation's dtype instead of promoting it).

`auto` reads, per module, the range of its forward values and gradients from the statistics
the runtime records on the example batch before the passes run (`glmc.trace.valuestats`; the pass
declares `Need.VALUE_STATS` and never runs the model itself). Modules whose values would overflow fp16 (|x| above
65504 / headroom) or underflow it (more than 1% of nonzero values, gradients times the initial
loss scale, below fp16's smallest normal) take bf16; the others take fp16 when fp16 is the
faster type on the device (the cost model's device profile decides; `prefer=fp16` forces the
per-module choice, `prefer=bf16` picks bf16 everywhere). Where neither bf16 nor fp16 matmuls
are faster than fp32 on the device, `auto` keeps fp32 — training must not get slower —
unless `prefer=memory` (or fp16/bf16) asks for the memory saving. The report says why.

Option spellings in a pipeline string: `precision{policy=bf16,ops=_softmax:fp32;mm:low,
modules=head:fp32}`; from Python, `ops` and `modules` may be dicts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from glmc.analysis.cost import get_profile
from glmc.compiler.lossfusion import fuse_head, fuse_loss
from glmc.compiler.lossfusion import is_plain_view as _is_plain_view
from glmc.compiler.passmanager import (Effect, Need, Pass, PassContext, PassResult, StageForm,
                                       StageUnit)
from glmc.errors import ConfigError, PassError
from glmc.ir import kernels  # noqa: F401  (registers glmc's fused ops)
from glmc.ir.graph import REMAT, InputSpec, Phase, Role, TrainGraph, op_name
from glmc.trace.rederive import ForwardProgram, forward_program, rederive
from glmc.trace.scaler import LossScaling
from glmc.trace.valuestats import ModuleStats, ValueStats

aten = torch.ops.aten

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_NAMES = {v: k for k, v in DTYPES.items()}
RULES = ("low", "fp32", "acc", "keep")

_LOW_OPS = ("mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "linear", "convolution",
            "_convolution", "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention")
_FP32_OPS = ("_log_softmax", "log_softmax", "nll_loss_forward", "nll_loss2d_forward",
             "nll_loss", "cross_entropy_loss", "binary_cross_entropy",
             "binary_cross_entropy_with_logits", "mse_loss", "l1_loss", "smooth_l1_loss",
             "huber_loss", "kl_div", "native_layer_norm", "native_batch_norm",
             "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
             "_native_batch_norm_legit_no_training", "native_group_norm", "_fused_rms_norm",
             "sum", "mean", "var", "std", "var_mean", "std_mean", "norm", "linalg_vector_norm",
             "prod", "cumsum", "cumprod", "logsumexp", "logcumsumexp", "exp", "exp2", "log",
             "log2", "log10", "log1p", "expm1", "pow", "rsqrt", "sqrt")

#: The default policy: ATen op name -> rule. Ops not listed follow "keep".
DEFAULT_RULES: Mapping[str, str] = {**dict.fromkeys(_LOW_OPS, "low"),
                                    **dict.fromkeys(_FP32_OPS, "fp32"), "_softmax": "acc"}

FP16_MAX = 65504.0
FP16_MIN_NORMAL = 2.0 ** -14
HEADROOM = 8.0  #: a module is fp16-safe if its values stay below FP16_MAX / HEADROOM
UNDERFLOW_FRACTION = 0.01


@dataclass(frozen=True)
class Cast:
    value: str  #: the node whose value is cast
    src: str
    dst: str
    reader: str  #: the first op reading the cast
    where: str | None
    node: str = ""  #: the cast node in the forward program


@dataclass(frozen=True)
class LayerChoice:
    module: str
    dtype: str
    reason: str
    act_absmax: float = 0.0
    act_underflow: float = 0.0  #: fraction of nonzero forward values below fp16's min normal
    grad_absmax: float = 0.0
    grad_underflow: float = 0.0  #: same for gradients times the initial loss scale


@dataclass(frozen=True)
class PrecisionStats:
    policy: str
    casts_inserted: int = 0
    fused_losses: int = 0  #: fp32 losses computed by glmc::cross_entropy from low logits
    fused_heads: int = 0  #: LM head + loss computed chunk by chunk (glmc::linear_cross_entropy)
    recast_in_backward: int = 0  #: parameter casts made again in the backward, not kept
    forward_dtypes: dict[str, int] = field(default_factory=dict)  #: ops per compute dtype
    step_dtypes: dict[str, dict[str, int]] = field(default_factory=dict)  #: phase -> dtype -> n
    loss_scaling: dict[str, Any] | None = None
    device_note: str = ""
    casts: list[dict[str, Any]] = field(default_factory=list)
    layers: list[dict[str, Any]] = field(default_factory=list)
    node_dtypes: list[list[str]] = field(default_factory=list)  #: [node, op, phase, dtype]

    def report_section(self, ctx: Any) -> Any:
        """The report's precision section (a glmc.compiler.report_parts.ReportSection for the
        SectionContext `ctx`; None when the pass changed nothing): casts, fused losses, loss
        scaling, dtypes per phase, per-module choices, every cast and every node's dtype."""
        from glmc.compiler.report_parts import ReportSection, Text, before_after, mib
        if not ctx.changed:
            return None
        blocks: list[Any] = [Text(
            f"{self.casts_inserted} casts inserted in the forward; {self.fused_losses} loss(es) "
            f"computed in fp32 straight from low-precision logits, {self.fused_heads} of them "
            f"together with their LM head (chunked); {self.recast_in_backward} parameter casts "
            f"made again in the backward instead of kept. {before_after(ctx)}; measured peak "
            f"of the compiled step {mib(ctx.measured_peak_bytes)}.")]
        if self.loss_scaling:
            ls = self.loss_scaling
            blocks.append(Text(
                f"Dynamic loss scaling in the step: initial scale {ls['init_scale']:g}, growth "
                f"{ls['growth_factor']:g} every {ls['growth_interval']} clean steps, backoff "
                f"{ls['backoff_factor']:g}."))
        if self.device_note:
            blocks.append(Text(self.device_note, "note"))
        return ReportSection(f"Precision: {self.policy}", tuple(blocks + self._report_tables()),
                             f"{self.policy}: {self.casts_inserted} casts")

    def _report_tables(self) -> list[Any]:
        """Dtypes per phase, per-module choices, every cast, every node's dtype (folded)."""
        from glmc.compiler.report_parts import Table
        dtypes = sorted({d for v in self.step_dtypes.values() for d in v})
        tables = [Table(("phase", *dtypes), tuple((ph, *(v.get(d, 0) for d in dtypes))
                                                  for ph, v in self.step_dtypes.items()))]
        if self.layers:
            tables.append(Table(
                ("module", "dtype", "|act| max", "act underflow", "|grad x scale| max",
                 "grad underflow", "reason"),
                tuple((x["module"], x["dtype"], f"{x['act_absmax']:.3g}",
                       f"{x['act_underflow']:.1%}", f"{x['grad_absmax']:.3g}",
                       f"{x['grad_underflow']:.1%}", x["reason"]) for x in self.layers),
                "lrrrrrl"))
        tables.append(Table(("cast value", "from", "to", "first reader", "source"),
                            tuple((x["value"], x["src"], x["dst"], x["reader"], x["where"] or "")
                                  for x in self.casts), "lrrll"))
        tables.append(Table(("node", "op", "phase", "dtype"),
                            tuple(tuple(row) for row in self.node_dtypes), "lllr",
                            collapsed=f"dtype of every node ({len(self.node_dtypes)})"))
        return tables


def _parse_map(text: Any, what: str) -> dict[str, str]:
    if text is None or text == "":
        return {}
    if isinstance(text, Mapping):
        return {str(k): str(v) for k, v in text.items()}
    out = {}
    for item in filter(None, (s.strip() for s in str(text).split(";"))):
        key, sep, value = item.rpartition(":")
        if not sep or not key:
            raise ConfigError(f"precision: {what} entry {item!r} must be name:value")
        out[key.strip()] = value.strip()
    return out


@dataclass(frozen=True)
class PrecisionPass(Pass):
    """Assigns compute dtypes (see the module docstring) and re-derives the backward."""

    name = "precision"
    policy: str = "bf16"
    ops: Any = None  #: op name -> rule overrides ("low", "fp32", "acc", "keep")
    modules: Any = None  #: module path prefix -> "bf16" | "fp16" | "fp32"
    loss_scaling: bool = True  #: fp16: dynamic loss scaling in the step
    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    #: auto: "speed" (fp32 where neither bf16 nor fp16 is faster) | "memory" (low precision
    #: even when not faster) | "fp16" | "bf16" (force that dtype where its range suffices)
    prefer: str = "speed"
    fuse_loss: bool = True  #: fp32 cross-entropy read straight from low-precision logits
    head: str = "fp32"  #: LM head feeding the loss: "fp32" | "low" (chunked, fused) | "off"
    early_cast: bool = False  #: pointwise ops read only by low-precision ops store low input
    cast_constants: bool = False  #: buffers/constants wider than the activation are cast down
    recast: bool = True  #: the backward casts parameters again instead of keeping the copies

    def __post_init__(self) -> None:
        # one canonical form for maps given as dicts or strings: "name:value;..." (hashable,
        # and what the pipeline string spells)
        for key in ("ops", "modules"):
            canon = ";".join(f"{k}:{v}" for k, v in _parse_map(getattr(self, key), key).items())
            object.__setattr__(self, key, canon or None)
        if self.policy not in ("fp32", "bf16", "fp16", "auto"):
            raise ConfigError(f"precision: unknown policy {self.policy!r}; use fp32, bf16, "
                              "fp16 or auto")
        if self.head not in ("fp32", "low", "off"):
            raise ConfigError(f"precision: head={self.head!r}; use fp32, low or off")
        if self.prefer not in ("speed", "memory", "fp16", "bf16"):
            raise ConfigError(f"precision: prefer={self.prefer!r}; use speed, memory, fp16 or "
                              "bf16")
        for op, rule in _parse_map(self.ops, "ops").items():
            if rule not in RULES:
                raise ConfigError(f"precision: rule {rule!r} for op {op!r}; use one of {RULES}")
        for mod, dt in _parse_map(self.modules, "modules").items():
            if dt not in DTYPES:
                raise ConfigError(f"precision: dtype {dt!r} for module {mod!r}; use "
                                  f"{sorted(DTYPES)}")
        self.scaling()  # validates the scaler options

    def needs(self) -> frozenset[Need]:
        auto = {Need.VALUE_STATS} if self.policy == "auto" else set()
        return frozenset({Need.STEP, *auto})

    def effects(self) -> frozenset[Effect]:
        if self.policy == "fp32" and not self.modules:
            return frozenset()
        edits = {Effect.EDITS_BACKWARD} if self.recast else set()
        scaled = {Effect.ADDS_STATE} if self.loss_scaling and self.policy in ("fp16", "auto") \
            or "fp16" in str(self.modules) else set()
        return frozenset({Effect.REDERIVES, *edits, *scaled})

    def scaling(self) -> LossScaling:
        return LossScaling(self.init_scale, self.growth_factor, self.backoff_factor,
                           self.growth_interval)

    def stage_forms(self) -> frozenset[StageForm]:
        return frozenset({StageForm.FORWARD})

    def run_stage(self, unit: StageUnit, ctx: PassContext) -> PassResult:
        """A pipeline stage's forward program under this policy (bf16 or fp16) with the
        default op rules (`_assign_forward`); the stage capture differentiates it again."""
        casts = _assign_forward(unit.gm, unit.inputs, self.policy)
        return PassResult(bool(casts), {"casts": len(casts)})

    def run(self, graph: TrainGraph, ctx: PassContext) -> PassResult:
        if self.policy == "fp32" and not self.modules:
            return PassResult(False, PrecisionStats("fp32"))
        program = forward_program(graph)
        device = _device_of(program)
        layers: list[LayerChoice] = []
        note = ""
        modules = _parse_map(self.modules, "modules")
        default = self.policy if self.policy in DTYPES else "bf16"
        if self.policy == "auto":
            choose_fp16, note, faster = _fp16_preferred(self.prefer, device, ctx.profile)
            if not faster and self.prefer == "speed" and not modules:
                # training must not get slower: keep fp32 (prefer=memory takes the saving)
                return PassResult(False, PrecisionStats(
                    "auto", device_note=note + "; auto keeps fp32 for speed "
                    "(prefer=memory: low precision for its memory saving)"))
            layers = choose_layers(graph, program, self.init_scale, choose_fp16, note)
            modules = {**{c.module: c.dtype for c in layers}, **modules}
        rules = {**DEFAULT_RULES, **_parse_map(self.ops, "ops")}
        casts, forward_dtypes = assign(program, rules, modules, DTYPES[default],
                                       self.early_cast, self.cast_constants)
        fused_losses = fuse_loss(program) if self.fuse_loss else 0
        fused_heads = fuse_head(program, self.head == "fp32") if self.head != "off" else 0
        alive = {n.name for n in program.graph.nodes}
        casts = [c for c in casts if c.node in alive]  # the fused loss reads logits uncast
        uses_fp16 = any(isinstance(n.meta.get("val"), torch.Tensor)
                        and n.meta["val"].dtype == torch.float16 for n in program.graph.nodes)
        scaling = self.scaling() if uses_fp16 and self.loss_scaling else None
        rederive(graph, program, scaling)
        recast = recast_in_backward(graph) if self.recast else 0
        stats = PrecisionStats(
            self.policy, len(casts), fused_losses, fused_heads, recast, forward_dtypes, _step_dtypes(graph),
            None if scaling is None else vars(scaling).copy(), note,
            [vars(c) for c in casts], [vars(c) for c in layers], _node_dtypes(graph))
        return PassResult(True, stats)


# ---- dtype assignment ------------------------------------------------------------------------

def _device_of(program: ForwardProgram) -> str:
    for n in program.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            return v.device.type
    return "cpu"


def _module_dtype(module: str | None, modules: Mapping[str, str],
                  default: torch.dtype) -> torch.dtype:
    """The dtype of the longest module-path prefix (on "." boundaries) in `modules`."""
    best, best_len = default, -1
    path = module or ""
    for prefix, dt in modules.items():
        if (path == prefix or path.startswith(prefix + ".") or prefix == "") \
                and len(prefix) > best_len:
            best, best_len = DTYPES[dt], len(prefix)
    return best


def _is_float(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _constant_like(program: ForwardProgram) -> set[fx.Node]:
    """Values computed from buffers and constants only (no parameter, no batch input)."""
    roles = dict(zip([n for n in program.graph.nodes if n.op == "placeholder"],
                     [s.role for s in program.inputs]))
    out: set[fx.Node] = set()
    for n in program.graph.nodes:
        if n.op == "get_attr" or roles.get(n) is Role.BUFFER:
            out.add(n)
        elif n.op == "call_function" and all(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


#: pointwise ops whose backward saves an activation input: computing them from a low-precision
#: copy of that input stores it in low precision (ops whose backward saves nothing, such as
#: add, gain no memory and are left alone: they would only round more)
_EARLY_CAST_OPS = frozenset({"mul", "div", "silu", "gelu", "relu", "tanh", "sigmoid"})


class _Assigner:
    """The state of one `assign` run: the forward graph being rebuilt, the map from old nodes
    to new ones, and the casts made so far, kept in one cache so that a value is cast once
    per dtype and every reader shares the copy."""

    def __init__(self, program: ForwardProgram, rules: Mapping[str, str],
                 modules: Mapping[str, str], default: torch.dtype, early: bool,
                 cast_constants: bool) -> None:
        self.program, self.rules, self.modules, self.default = program, rules, modules, default
        self.early, self.cast_constants = early, cast_constants
        self.old = old = program.graph
        self.fake_mode = detect_fake_mode([n.meta.get("val") for n in old.nodes])
        self.constant = _constant_like(program)
        self.targets = dict(zip([n.name for n in old.nodes if n.op == "placeholder"],
                                [s.target for s in program.inputs]))
        self.params = {name for name, spec in zip(self.targets, program.inputs)
                       if spec.role is Role.PARAMETER}
        self.new = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.cache: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}
        self.casts: list[Cast] = []
        self.counts: dict[str, int] = {}

    def cast(self, value: fx.Node, dtype: torch.dtype, reader: fx.Node) -> fx.Node:
        """`value` (a new-graph node) in `dtype`, made at the first `reader` that asks."""
        if value.meta["val"].dtype == dtype:
            return value
        key = (value, dtype)
        if key not in self.cache:
            if _is_plain_view(value):  # cast the base once and view the cast: one copy per base
                self.cache[key] = self._cast_view(value, dtype, reader)
            else:
                self.cache[key] = self._cast_copy(value, dtype, reader)
        return self.cache[key]

    def _cast_view(self, value: fx.Node, dtype: torch.dtype, reader: fx.Node) -> fx.Node:
        base = self.cast(value.args[0], dtype, reader)
        v = self.new.call_function(value.target, (base, *value.args[1:]), dict(value.kwargs))
        v.meta = dict(value.meta)
        with self.fake_mode:
            v.meta["val"] = value.target(base.meta["val"], *value.args[1:], **value.kwargs)
        return v

    def _cast_copy(self, value: fx.Node, dtype: torch.dtype, reader: fx.Node) -> fx.Node:
        src = value.meta["val"].dtype
        c = self.new.call_function(aten._to_copy.default, (value,), {"dtype": dtype})
        with self.fake_mode:
            c.meta["val"] = value.meta["val"].to(dtype)
        # the cast is attributed to its reader, so the report points at the op that needed it
        c.meta["glmc"] = TrainGraph.info(reader).replace(spec=None, created_by="precision")
        for k in ("stack_trace", "nn_module_stack", "seq_nr"):
            if k in reader.meta:
                c.meta[k] = reader.meta[k]
        info = TrainGraph.info(reader)
        self.casts.append(Cast(self.targets.get(value.name, value.name),
                               _NAMES.get(src, str(src)), _NAMES.get(dtype, str(dtype)),
                               op_name(reader), info.source or info.module, c.name))
        return c

    def low_of(self, n: fx.Node) -> torch.dtype:
        return _module_dtype(TrainGraph.info(n).module, self.modules, self.default)

    def low_readers(self, n: fx.Node) -> set[torch.dtype] | None:
        """The low dtypes of the ops reading `n` (through views) if all of them are low ops."""
        dtypes: set[torch.dtype] = set()
        for u in n.users:
            if u.op == "call_function" and self.rules.get(op_name(u)) == "low" \
                    and self.low_of(u) != torch.float32:
                dtypes.add(self.low_of(u))
            elif _is_plain_view(u) and (sub := self.low_readers(u)) is not None:
                dtypes |= sub
            else:
                return None
        return dtypes or None

    def rule(self, n: fx.Node) -> tuple[str, torch.dtype]:
        """(rule, low dtype) for `n`: its table rule, turned `early` when only low ops read it
        and `explicit` when the model chose a dtype itself."""
        rule = self.rules.get(op_name(n), "keep")
        low = self.low_of(n)
        if rule == "keep" and self.early and op_name(n) in _EARLY_CAST_OPS \
                and n not in self.constant:
            readers = self.low_readers(n)
            if readers is not None and len(readers) == 1:
                rule, low = "early", readers.pop()  # only low ops read it: store it low
        if "dtype" in n.kwargs or op_name(n) == "_to_copy":
            rule = "explicit"  # the model chose this dtype itself
        return rule, low

    def wanted(self, n: fx.Node, rule: str, low: torch.dtype) -> dict[fx.Node, torch.dtype]:
        """The dtype each float input of `n` (an old-graph node) must be cast to by `rule`."""
        env, constant = self.env, self.constant
        floats = [a for a in n.all_input_nodes if _is_float(env[a].meta.get("val"))]
        if rule == "low":
            return {a: low for a in floats}
        if rule == "early":
            # activation inputs cast down (so the backward saves them in low precision);
            # parameters stay fp32, so the op itself still computes and rounds once in fp32
            return {a: low for a in floats if a.name not in self.params and a not in constant}
        if rule == "fp32":
            return {a: torch.float32 for a in floats
                    if env[a].meta["val"].dtype in (torch.bfloat16, torch.float16)}
        if rule in ("keep", "acc") and self.cast_constants:
            acts = {env[a].meta["val"].dtype for a in floats if a not in constant}
            if len(acts) == 1:
                act = acts.pop()
                return {a: act for a in floats if a in constant
                        and env[a].meta["val"].dtype.itemsize > act.itemsize}
        return {}

    def visit(self, n: fx.Node) -> None:
        """Copy `n` into the new graph, with its inputs cast as its rule says."""
        env = self.env
        if n.op != "call_function":
            env[n] = self.new.node_copy(n, lambda a: env[a])
            return
        rule, low = self.rule(n)
        args = fx.map_arg(n.args, lambda a: env[a])
        kwargs = fx.map_arg(n.kwargs, lambda a: env[a])
        want = self.wanted(n, rule, low)
        node = _emit(self.new, n, args, kwargs, {env[a]: d for a, d in want.items()}, self.cast,
                     self.fake_mode)
        env[n] = node
        val = node.meta["val"]
        first = val[0] if isinstance(val, (tuple, list)) else val
        if isinstance(first, torch.Tensor) and first.is_floating_point():
            name = _NAMES.get(first.dtype, str(first.dtype))
            self.counts[name] = self.counts.get(name, 0) + 1

    def finish(self) -> None:
        """Emit the output (the loss and buffers keep their captured dtype) and install the
        new graph in the program's module."""
        old, env = self.old, self.env
        out = old.output_node() if hasattr(old, "output_node") else \
            next(n for n in old.nodes if n.op == "output")
        fixed = []
        for r in out.args[0]:
            v = env[r]
            want_dtype = r.meta["val"].dtype
            fixed.append(self.cast(v, want_dtype, r) if v.meta["val"].dtype != want_dtype else v)
        self.new.output(tuple(fixed))
        self.program.gm.graph = self.new
        self.program.gm.recompile()


def assign(program: ForwardProgram, rules: Mapping[str, str], modules: Mapping[str, str],
           default: torch.dtype, early: bool = True,
           cast_constants: bool = False) -> tuple[list[Cast], dict[str, int]]:
    """Rewrite `program` in place: casts before the ops whose rule needs them. With `early`, a
    pointwise op read only by low-precision ops computes in the low dtype itself (its output
    is stored once, in low precision, instead of in fp32 plus a low-precision copy)."""
    a = _Assigner(program, rules, modules, default, early, cast_constants)
    for n in a.old.nodes:
        a.visit(n)
    a.finish()
    return a.casts, a.counts


def _assign_forward(gm: fx.GraphModule, inputs: list[InputSpec], policy: str) -> list[Cast]:
    """A pipeline stage's forward program under `policy` (bf16 or fp16): `gm` is the stage's
    forward in ATen ops (parameters, buffers, batch leaves and received values -> sent values
    or the loss, each output in its captured dtype; every node with glmc metadata), rewritten
    in place by the same dtype assignment as the precision pass (the default op rules;
    parameters stay fp32 masters, read through casts). The stage capture differentiates the
    result again, as `rederive` does for a whole step. fp16's loss scaling is the pipeline
    runtime's (one scale, one overflow check across every stage:
    `glmc.parallel.pipeline.PipelineTrainer`); auto measures a whole step, so it is not
    accepted here."""
    if policy not in ("bf16", "fp16"):
        raise ConfigError(f"precision: policy {policy!r} on pipeline stages; bf16 and fp16 "
                          "are supported there (auto measures a whole step)")
    program = ForwardProgram(gm, list(inputs), [])
    casts, _ = assign(program, DEFAULT_RULES, {}, DTYPES[policy], early=False)
    return casts


def _emit(g: fx.Graph, n: fx.Node, args: Any, kwargs: Any, want: dict[fx.Node, torch.dtype],
          cast: Any, fake_mode: Any) -> fx.Node:
    """Emit `n` with its inputs cast as `want` says; if ATen rejects the mixed dtypes that
    remain, cast every float input to the widest one (type promotion) and try again."""
    def remap(a: Any, mapping: dict[fx.Node, torch.dtype]) -> Any:
        return fx.map_arg(a, lambda x: cast(x, mapping[x], n) if x in mapping else x)

    for attempt in range(2):
        a2, k2 = remap(args, want), remap(kwargs, want)
        vals_a = fx.map_arg(a2, lambda x: x.meta["val"])
        vals_k = fx.map_arg(k2, lambda x: x.meta["val"])
        try:
            with fake_mode:
                val = n.target(*vals_a, **vals_k)
        except (RuntimeError, TypeError) as e:
            floats = [x for x in _nodes_in(a2) + _nodes_in(k2) if _is_float(x.meta.get("val"))]
            widest = max((x.meta["val"].dtype for x in floats), key=lambda d: d.itemsize,
                         default=None)
            if attempt or widest is None:
                info = TrainGraph.info(n)
                raise PassError(f"precision: {op_name(n)} at {info.source or n.name} fails "
                                f"with its assigned dtypes: {str(e).splitlines()[0]}; override "
                                f"its rule with ops={op_name(n)}:fp32") from e
            want = {x: widest for x in _nodes_in(args) + _nodes_in(kwargs)
                    if _is_float(x.meta.get("val"))}
            continue
        node = g.call_function(n.target, a2, k2)
        node.meta = dict(n.meta)
        node.meta["val"] = val
        return node
    raise AssertionError("unreachable")


def _nodes_in(a: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.map_arg(a, lambda x: out.append(x) or x)
    return out


def _dtype_name(n: fx.Node) -> str | None:
    v = n.meta.get("val")
    if isinstance(v, (tuple, list)):
        v = next((x for x in v if isinstance(x, torch.Tensor)), None)
    if not isinstance(v, torch.Tensor):
        return None
    return _NAMES.get(v.dtype, str(v.dtype).replace("torch.", ""))


def _step_dtypes(graph: TrainGraph) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for n in graph.compute_nodes():
        name = _dtype_name(n)
        if name is None:
            continue
        phase = TrainGraph.info(n).phase.value
        out.setdefault(phase, {})
        out[phase][name] = out[phase].get(name, 0) + 1
    return out


def _node_dtypes(graph: TrainGraph) -> list[list[str]]:
    return [[n.name, op_name(n), TrainGraph.info(n).phase.value, _dtype_name(n) or "-"]
            for n in graph.compute_nodes()]


def recast_in_backward(graph: TrainGraph) -> int:
    """The backward reads the low-precision copies of the parameters (matmul weight gradients
    need them); keeping the forward's copies alive holds half the parameter bytes through the
    whole forward. Cast again right before the first backward reader instead — the same values
    (the parameters do not change within the step), for one cheap bandwidth-bound cast."""
    def derived(v: fx.Node) -> bool:  # a cast or view of parameters only
        if v.op == "placeholder":
            return TrainGraph.info(v).role is Role.PARAMETER
        return v.op == "call_function" and TrainGraph.info(v).phase is Phase.FORWARD and \
            (op_name(v) == "_to_copy" or _is_plain_view(v)) and \
            all(derived(a) for a in v.all_input_nodes)

    g = graph.graph
    made: dict[fx.Node, fx.Node] = {}
    count = 0

    def copy_before(v: fx.Node, where: fx.Node) -> fx.Node:
        nonlocal count
        if v.op == "placeholder":
            return v
        if v not in made:
            args = [copy_before(a, where) for a in v.all_input_nodes]
            mapping = dict(zip(v.all_input_nodes, args))
            with g.inserting_before(where):
                c = g.node_copy(v, lambda a: mapping[a])
            c.meta = {**v.meta, REMAT: True,
                      "glmc": TrainGraph.info(v).replace(phase=Phase.BACKWARD,
                                                        role=Role.GRADIENT)}
            made[v] = c
            count += op_name(v) == "_to_copy"
        return made[v]

    for u in list(g.nodes):
        if u.op != "call_function" or TrainGraph.info(u).phase is not Phase.BACKWARD:
            continue
        for a in list(u.all_input_nodes):
            if a.op == "call_function" and derived(a) and \
                    any(op_name(x) == "_to_copy" for x in _chain(a)):
                u.replace_input_with(a, copy_before(a, u))
    for v in reversed(list(g.nodes)):  # forward copies now read by nobody
        if v in made and not v.users:
            g.erase_node(v)
    return count


def _chain(v: fx.Node) -> list[fx.Node]:
    out, stack = [], [v]
    while stack:
        n = stack.pop()
        if n.op == "call_function":
            out.append(n)
            stack += n.all_input_nodes
    return out


# ---- auto: calibration and device speed ------------------------------------------------------

_RATE_FLOPS = 2.0 * 1024 ** 3  #: a large matmul: where the profile's curves flatten out


def _fp16_preferred(prefer: str, device: str,
                    profile_spec: Any = None) -> tuple[bool, str, bool]:
    """Whether fp16 is the faster low-precision type, and whether either is faster than fp32
    at all, from the cost model's device profile (the calibrated host CPU measures bf16 and
    fp16 matmul curves; GPU profiles are published figures)."""
    if prefer == "bf16":
        return False, "prefer=bf16: every module takes bf16", True
    profile = get_profile(profile_spec, device)
    rates = {k: profile.matmul_rate(str(DTYPES[k]).replace("torch.", ""), _RATE_FLOPS) / 1e12
             for k in ("fp32", "bf16", "fp16")}
    measured = ", ".join(f"{k} {v:.2f}" for k, v in rates.items())
    note = f"matmul TFLOP/s on {profile.name} ({profile.source}): {measured}"
    faster = max(rates["bf16"], rates["fp16"]) >= 1.1 * rates["fp32"]
    if not faster:
        note += "; neither bf16 nor fp16 is faster than fp32 here, low precision saves memory only"
    if prefer == "fp16":
        return True, note + "; prefer=fp16: fp16 wherever its range suffices", faster
    if rates["fp16"] >= 0.9 * rates["bf16"]:
        return True, note + "; fp16 is as fast as bf16: fp16 wherever its range suffices", faster
    return False, note + "; fp16 is slower than bf16: every module takes bf16", faster


def choose_layers(graph: TrainGraph, program: ForwardProgram, init_scale: float,
                  fp16: bool, note: str) -> list[LayerChoice]:
    """bf16 or fp16 for every module that owns a low-precision (matmul-class) op, from the
    value ranges recorded on the example batch (`glmc.trace.valuestats`, graph.meta)."""
    owners = sorted({TrainGraph.info(n).module or "" for n in program.graph.nodes
                     if n.op == "call_function" and DEFAULT_RULES.get(op_name(n)) == "low"})
    ranges: ValueStats = graph.meta["value_stats"]
    limit = FP16_MAX / HEADROOM
    out = []
    for mod in owners:
        entry = ranges.get(mod, ModuleStats())
        fwd_under = entry.forward.fraction_below(FP16_MIN_NORMAL)
        fwd = entry.forward
        grad_absmax = entry.gradient.absmax * init_scale
        grad_under = entry.gradient.fraction_below(FP16_MIN_NORMAL / init_scale)
        facts = dict(act_absmax=fwd.absmax, act_underflow=fwd_under, grad_absmax=grad_absmax,
                     grad_underflow=grad_under)
        if fwd.absmax > limit:
            out.append(LayerChoice(mod, "bf16", f"forward values reach {fwd.absmax:.3g}, above "
                                   f"fp16's {FP16_MAX:.0f}/{HEADROOM:.0f}", **facts))
        elif fwd_under > UNDERFLOW_FRACTION:
            out.append(LayerChoice(mod, "bf16", f"{fwd_under:.1%} of forward values are below "
                                   "fp16's smallest normal", **facts))
        elif grad_under > UNDERFLOW_FRACTION:
            out.append(LayerChoice(mod, "bf16", f"{grad_under:.1%} of gradients times the loss "
                                   f"scale {init_scale:g} are below fp16's smallest normal",
                                   **facts))
        elif not fp16:
            out.append(LayerChoice(mod, "bf16", "in fp16's range, but " + note.split("; ")[-1],
                                   **facts))
        else:
            out.append(LayerChoice(mod, "fp16", f"values within fp16's range (max "
                                   f"{max(fwd.absmax, 0):.3g}, gradients x scale max "
                                   f"{grad_absmax:.3g})", **facts))
    return out
