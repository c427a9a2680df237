"""The planner: price every parallel plan of a step on a cluster and rank them.

    plans = plan_step(model, example_inputs, cluster=Cluster.parse("16x8:a100-80g"))
    plans[0].spelling()   # 'dp=16,tp=8,pp=1,zero=1,microbatch=1,...'

How a plan is priced (the figures are glmc's own programs, not a formula per model):

1. **Capture, clustered.** The step is captured once on one sequence (the first row of the
   example batch; the batch's rows are the global batch) with fake tensors, so a model built on
   the meta device plans without memory. Where the model holds a list of identical layers (same
   class, same parameter shapes), only two of them are captured and the list's length is
   restored by repetition: a 96-layer model costs what a 2-layer one does.
2. **Per tensor-parallel degree.** For each degree `t`, the `tensor_parallel` pass shards a
   copy of the captured step over a fake mesh of `t` ranks (once as captured, as pipeline
   stages run it, and once after the default fusion and cleanup passes, as a whole step
   compiles); the cost model prices every node of that local program on the device profile
   (Inductor's fusion model on GPUs); each layer
   then has forward/backward/update seconds, the activations its backward reads, the bytes it
   hands to the next layer and its all-reduces, all per sequence.
3. **Per plan** (`dp x tp x pp`, ZeRO stage, sequences per micro-batch, schedule, virtual
   stages, recompute), without capturing again: layers are cut into `pp` stages by
   `passes.partition.balanced_cut`; a micro-batch of `b` sequences costs `b` times a sequence
   on its stage plus its tensor-parallel all-reduces (alpha-beta on the link inside a node,
   not overlapped, as Megatron-LM runs them) and the send to the next stage; the pipeline
   takes `m` slowest-stage micro-batches plus its fill and drain, one micro-batch through
   every other stage (`(pp - 1)` slowest-stage micro-batches where the stages are balanced;
   divided by `v` interleaved with `v` virtual stages; ZB-H1 a third of 1F1B's). The data-
   parallel gradient synchronisation is replayed on the link bucket by bucket (the plan's
   `bucket` MB, as `passes.shard` cuts them; a ring spanning nodes pays the inter-node
   latency once per node): each bucket's all-reduce (reduce-scatter under ZeRO
   2-3) starts when the last micro-batch's backward has produced it, one collective at a time,
   beside the compute at the link's measured `progress` of its own speed (gloo's threads share
   the cores) and at full speed after it; what is left when the backward ends is exposed, and
   the compute loses the link's `contention` per second a collective ran beside it.
   ZeRO-3's parameter all-gathers (per bucket, the next prefetched while the previous
   bucket computes) in each micro-batch's forward and backward, and ZeRO 1-2's all-gather
   of the new parameters after the update, are exposed where nothing hides them. The update
   follows (sharded over dp under ZeRO >= 1). Processes that outnumber a host's cores
   (`--cluster local`, 4 processes on 2 cores) share them fairly: the computing part of the
   step lasts at least as long as every rank's busy time takes under processor sharing (a
   pipeline's bubble frees cores for the busy stages, so one micro-batch through 4 stages
   loses nothing; 4 data-parallel ranks take twice as long); the excess is `contention`;
   each collective or send/receive a rank blocks on then also waits for a core (`wake_s`).
   Memory per device, from the liveness of the program glmc compiles
   (`glmc.analysis.memory.simulate` on the one-sequence step: a whole step after the default
   passes, fusion and cleanup; a pipeline stage as captured, the way stages run): per block
   the values its backward reads (per sequence, and apart what is the same for any micro-
   batch: the fused LM head's weight gradient, made in its forward), and at each node what
   it holds above what the blocks before it saved, with its fused op's workspace apart (it
   grows with the rows up to a chunk: a chunked kernel's cap); the update's own transient.
   A rank's peak is the larger of its busiest block (the activations of the micro-batches
   in flight — 1F1B: `pp - stage`; GPipe: all `m`; interleaved: `pp` plus the extra virtual
   chunks; ZB-H1: `pp`, up to `stage + 1` of them past their I keeping, beside what they saved
   (or, recomputed, the forward values their W reads), I's values their W reads,
   `PartCost.stash_bytes` — with that block's peak, and the gradients live by then:
   all of them once micro-batches accumulate) and its update, on top of parameters and
   optimizer state by precision and ZeRO stage; ZeRO's buckets (`passes.shard`, the plan's
   `bucket`) add stage 3's gathered parameters (a bucket and the prefetched next; on CPUs
   gloo's staged copy of the one in flight), stages 2-3's gradients the backward made so
   far whole up to a bucket (the rest reduce-scattered), and stages 1-2's all-gathered new
   parameters after the update.

Recompute: `full` makes every layer's forward again in its backward and keeps the layer's
output (the recompute pass at `min` runs it); `selective` keeps the outputs of matmuls,
attention and collectives and makes the cheap ops between them again (Korthikanti et al.
2022; `PartCost.selective_*`, priced as the rule: the recompute pass at `selective` runs the
rule's peak at no more recompute time); a budget (`recompute=0.5`, `recompute=40GiB`,
`recompute=+8GiB`, the recompute pass's spelling: a share of the activations, a peak per
device, bytes above the state) is priced per rank on the lower hull of the three modes'
(memory, recompute time) points — the cheapest mix of them that meets the rank's target
(`glmc.parallel.search`; the pass's MILP picks values one by one and can do better). Not
priced: dropout (the planning copy sets it to 0;
random ops are not sharded yet). Heterogeneous clusters: each pipeline stage is
priced on its own device kind (`glmc.parallel.search`).
"""
from __future__ import annotations

import copy
from collections import defaultdict
import dataclasses
import math
import operator
import time
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from glmc.analysis.cost import dispatch_overhead
from glmc.analysis.memory import workspaces
from glmc.analysis.opcost import op_cost, value_bytes
from glmc.analysis.predict import predict
from glmc.compiler.passmanager import PassContext
from glmc.errors import ConfigError, GlmcError
from glmc.ir.blocks import block_names, owner, step_blocks
from glmc.ir.graph import MeshSpec, Phase, Role, TrainGraph, is_comm, is_view
from glmc.ir.writeback import alias_readers, alias_root
from glmc.parallel.cluster import DeviceKind
from glmc.passes.shard import ShardPass
from glmc.passes.tensor_parallel import TensorParallelPass
from glmc.trace.capture import capture, split_batch
from glmc.trace.optim import resolve_optimizer

SCHEDULES = ("1f1b", "interleaved", "gpipe", "zbh1")
RECOMPUTE = ("none", "selective", "full")
#: recompute modes and each one's share of every layer on a rank: how a memory budget is priced
#: (the mix of the two modes either side of the budget on the rank's hull); a mode alone is
#: ((mode, 1.0),)
Mix = tuple[tuple[str, float], ...]
PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: bytes per parameter: (parameter, gradient, optimizer state incl. an fp32 master copy)
_STATE = {"fp32": (4, 4, 8), "bf16": (2, 4, 12), "fp16": (2, 4, 12)}
#: sequences per micro-batch the search tries
MICROBATCHES = (1, 2, 4, 8, 16)
#: the keys of a plan's spelling, in order
KEYS = ("dp", "tp", "pp", "zero", "microbatch", "schedule", "virtual", "recompute",
        "precision", "compress", "bucket", "cut")
#: data-parallel gradient compression (`passes.compress`'s methods); "none": dense
COMPRESS = ("none", "bf16", "fp16", "sign", "topk", "powersgd")
#: the ones the search tries: rounding the gradients to 16 bits for the wire changes them no
#: more than a half-precision all-reduce does (DDP's bf16 hook); the 1-bit, sparse and low-
#: rank methods change convergence, so the planner prices them only where a spelling fixes
#: them (`--fix compress=sign`), never picks them for the user
SEARCHED_COMPRESS = ("none", "bf16")
#: the data-parallel bucket sizes (MB) the search tries: the runtime's default (25, as
#: `passes.shard` and DDP cut) up to a transformer layer's worth at 100B+ parameters (FSDP's
#: unit; DeepSpeed's reduce bucket is 5e8 elements); across many nodes each collective pays a
#: ring's latency, so small buckets cost there what large ones cost in memory
BUCKETS = (25, 100, 400, 1600)


# ---- the plan point and its spelling -----------------------------------------------------------

@dataclass(frozen=True)
class PlanPoint:
    """One point of the search space, spelled `dp=..,tp=..,pp=..,...` (`KEYS`)."""

    dp: int
    tp: int
    pp: int
    zero: int
    microbatch: int
    schedule: str
    virtual: int
    recompute: str
    precision: str
    #: the data-parallel gradient bucket (and ZeRO-3 gather bucket) in MB (`--bucket-mb`);
    #: spelled only where the runtime buckets: data-parallel replicas without a pipeline (a
    #: pipeline all-reduces each stage's gradients at once)
    bucket: int = int(ShardPass.bucket_mb)  #: the runtime's default
    #: the data-parallel gradients' compression (`COMPRESS`); spelled where there are
    #: data-parallel replicas
    compress: str = "none"
    #: pipelines: where each stage after the first starts, in layers of the model's list of
    #: identical layers (0: the glue before them ends the first stage; the layer count: the
    #: glue after them is a stage), or in blocks where the model has no such list; spelled
    #: `cut=2/4/7`. Empty: the planner's (`evaluate` fills it in), the runtime runs it as is
    cut: tuple[int, ...] = ()

    def spelling(self) -> str:
        return ",".join(f"{k}={self._spelt(k)}" for k in KEYS
                        if (k != "bucket" or (self.dp > 1 and self.pp == 1))
                        and (k != "compress" or self.dp > 1)
                        and (k != "cut" or (self.pp > 1 and self.cut)))

    def _spelt(self, key: str) -> str:
        return "/".join(map(str, self.cut)) if key == "cut" else str(getattr(self, key))

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp

    def runtime_gaps(self) -> list[str]:
        """What glmc's runtime cannot run of this plan yet (empty: it runs as spelled)."""
        gaps = []
        if self.tp > 1 and self.pp > 1 and self.recompute != "none":
            gaps.append("recomputation in tensor-parallel pipeline stages")
        if self.tp > 1 and self.zero and self.dp == 1:
            gaps.append(f"ZeRO-{self.zero} beside tensor parallelism without data-parallel "
                        "replicas")
        if self.pp > 1 and self.zero > 1:
            gaps.append(f"ZeRO-{self.zero} with pipelining")
        if self.schedule == "interleaved" and self.virtual != 2:
            gaps.append(f"{self.virtual} virtual stages (the runtime interleaves 2)")
        if self.compress != "none" and self.pp > 1:
            gaps.append("gradient compression with pipelining")
        if self.compress in ("sign", "topk", "powersgd") and self.zero > 1:
            gaps.append(f"compress={self.compress} with ZeRO-{self.zero} (it all-gathers or "
                        "all-reduces; stages 2-3 reduce-scatter)")
        return gaps


def parse_spelling(text: str) -> dict[str, Any]:
    """A partial plan: the keys given (the rest are the planner's to choose)."""
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in KEYS:
            raise ConfigError(f"plan: cannot read {part!r} in {text!r}; spell a plan as "
                              f"KEY=VALUE,... with keys {', '.join(KEYS)}")
        value = value.strip()
        if key == "recompute" and value not in RECOMPUTE:
            out[key] = recompute_budget(value)
            continue
        if key == "cut":
            out[key] = cut_bounds(value)
            continue
        if key in ("schedule", "recompute", "precision", "compress"):
            allowed = {"schedule": SCHEDULES, "recompute": RECOMPUTE,
                       "precision": PRECISIONS, "compress": COMPRESS}[key]
            if value not in allowed:
                raise ConfigError(f"plan: {key}={value!r}; use one of {', '.join(allowed)}")
            out[key] = value
            continue
        try:
            out[key] = int(value)
        except ValueError:
            raise ConfigError(f"plan: {key}={value!r} must be a whole number") from None
        if out[key] < (0 if key == "zero" else 1) or (key == "zero" and out[key] > 3):
            raise ConfigError(f"plan: {key}={value} is out of range"
                              + (" (ZeRO stages are 0-3)" if key == "zero" else ""))
    return out


def cut_bounds(text: str) -> tuple[int, ...]:
    """A stage cut's spelling (`2/4/7`: the layer each stage after the first starts at) as
    increasing whole numbers, or a ConfigError."""
    try:
        bounds = tuple(int(v) for v in text.split("/"))
    except ValueError:
        bounds = ()
    if not bounds or any(b < 0 for b in bounds) or list(bounds) != sorted(set(bounds)):
        raise ConfigError(f"plan: cut={text!r}; spell a stage cut as the layer each stage "
                          "after the first starts at, increasing, '/'-separated (cut=2/4/7)")
    return bounds


def recompute_budget(text: str) -> str:
    """`text`, a recompute budget of the plan (the recompute pass's spelling: a share of the
    activations kept, a peak per device, or +bytes above the state), without spaces; a
    ConfigError where it is none of them."""
    from glmc.passes.recompute import Budget
    why = (f"plan: recompute={text!r}; use none, selective, full or a memory budget: a share "
           "of the activations kept (0.5), a peak per device (40GiB) or bytes above the "
           "parameters and optimizer state (+8GiB)")
    try:
        kind = Budget.parse(text).kind
    except ConfigError:
        raise ConfigError(why) from None
    if kind not in ("fraction", "bytes", "above"):  # the rules are spelt as modes
        raise ConfigError(why)
    return text.replace(" ", "")


def as_mix(how: str | Mix) -> Mix:
    """A recompute mode, or a mix of them, as a mix."""
    return ((how, 1.0),) if isinstance(how, str) else how


# ---- pricing the captured step -----------------------------------------------------------------

@dataclass(frozen=True)
class PartCost:
    """One block of the step (a layer, or what comes before or after the layers) on ONE
    sequence, as one rank of a tensor-parallel group of `tp` runs it."""

    name: str
    forward_s: float
    backward_s: float
    update_s: float  #: one step's update of this block's parameters (independent of batch)
    params: int  #: parameters this rank holds (elements)
    saved_bytes: int  #: forward values the backward reads
    out_bytes: int  #: what the block hands to the next one
    tp_bytes: tuple[tuple[str, int], ...]  #: (phase, bytes) of each tensor-parallel all-reduce
    forward_flops: float  #: of the whole block (all tp ranks together)
    backward_flops: float
    overhead_s: float = 0.0  #: kernel launches / op dispatch, forward + backward, per micro-batch
    #: what this block has live at once (forward or backward) beyond what the blocks before
    #: it saved for the backward, at each of its candidate peaks: (bytes per sequence,
    #: workspace per sequence, workspace cap). Per sequence: its own saved values,
    #: temporaries, the gradients flowing through it (liveness over the step's program,
    #: `glmc.analysis.memory.simulate`; weights' gradients left out, the fused LM head's
    #: made in its forward too: the plan counts them by ZeRO stage); and what the fused op
    #: running then allocates inside (a chunk of logits or of the MLP's hidden rows: it
    #: grows with the rows up to a chunk, the cap; -1: no cap). Only the points no other
    #: beats at every micro-batch size are kept; `peak(b)` is their most.
    peaks: tuple[tuple[int, int, int], ...] = ()
    #: what the update allocates beyond the gradients (new parameters and optimizer state
    #: before the old ones are freed, temporaries), this block's share (batch-independent)
    update_bytes: int = 0
    #: under selective recomputation (`glmc.analysis.opcost.selective_keeps`: matmul,
    #: attention and collective outputs kept, the cheap ops between them made again in the
    #: backward): the forward values the backward still reads (`saved_bytes` scaled by the
    #: rule's share of the saved bytes), the recomputed ops' seconds per sequence, their
    #: dispatch per micro-batch, and their FLOPs (the whole group's)
    selective_bytes: int = 0
    selective_s: float = 0.0
    selective_overhead_s: float = 0.0
    selective_flops: float = 0.0
    #: forward values the backward reads that are the same for any micro-batch (the fused LM
    #: head's weight gradient, `glmc.ir.kernels.BATCH_FIXED_OUTPUTS`), per micro-batch
    saved_fixed: int = 0
    #: per sequence, what a zero-bubble schedule's I leaves for the micro-batch's W beside
    #: the saved forward values (which stay to the W): the values of the input-gradient
    #: backward the weight gradients read (the matmuls' output gradients;
    #: `glmc.ir.split.split_backward`'s stash)
    stash_bytes: int = 0
    #: per sequence, the forward values the weight gradients read (the matmuls' inputs):
    #: under recompute, I makes them again and they stay to the W
    stash_forward: int = 0
    #: under full recompute the layer keeps the outputs of the forward tensor-parallel
    #: all-reduces it makes again from (glmc's full rule issues no collective again); False:
    #: it issues them again in its backward (Megatron-LM's checkpointed layers,
    #: `Workload.recomputing_collectives`)
    keeps_collectives: bool = True
    #: the block's work op by op, for what co-running processes of one host cost
    #: (`DeviceKind.corun_extra`): (phase "f", "b" or "u", seconds, of them memory-bound,
    #: bytes that scale with the micro-batch, bytes that do not (parameters)); "f"/"b" per
    #: sequence, "u" (the update) per step with its bytes whole. Empty where the device has
    #: no host to share (GPUs)
    work_ops: tuple[tuple[str, float, float, int, int], ...] = ()

    def corun_extra(self, device: DeviceKind, phases: str, sequences: int) -> float:
        """Seconds this block's `phases` ops take longer on a micro-batch of `sequences`
        (0: per step) while the host's other processes compute too; without `work_ops`
        (priced for a device of its own) all of it at the device's `corun`."""
        if not self.work_ops:
            whole = {"f": sequences * self.forward_s, "b": sequences * self.backward_s,
                     "u": self.update_s}
            return (device.corun - 1) * sum(whole[ph] for ph in phases)
        return device.corun_extra([op[1:] for op in self.work_ops if op[0] in phases],
                                  sequences)

    def peak(self, sequences: int) -> int:
        """The most this block has live at once beyond what the blocks before it saved, for
        a micro-batch of `sequences`."""
        return max((sequences * live + _room(sequences, room, cap)
                    for live, room, cap in self.peaks), default=0)

    def recompute(self, how: str | Mix) -> tuple[float, float]:
        """(seconds per sequence, seconds per micro-batch) this block's backward spends
        making forward values again under recompute `how` (only the repeated layers are
        recomputed, as Megatron-LM does)."""
        if not isinstance(how, str):
            per = [(w, self.recompute(mode)) for mode, w in how]
            return sum(w * s for w, (s, _) in per), sum(w * o for w, (_, o) in per)
        if how == "none" or not _is_layer(self):
            return 0.0, 0.0
        if how == "full":
            return self.forward_s, self.overhead_s / 3
        return self.selective_s, self.selective_overhead_s

    def held(self, how: str | Mix, sequences: int) -> int:
        """Bytes a micro-batch of `sequences` leaves in this block for its backward under
        recompute `how`."""
        return sequences * self.kept(how) + self.saved_fixed

    def kept(self, how: str | Mix) -> int:
        """Bytes per sequence this block holds for its backward under recompute `how`."""
        if not isinstance(how, str):
            return round(sum(w * self.kept(mode) for mode, w in how))
        if how == "none" or not _is_layer(self):
            return self.saved_bytes
        if how == "full":  # kept collectives: those the recomputed ops read, every forward
            # all-reduce but the layer's last, which only joins its output (kept) through the
            # residual add (Llama x4 `tp=4, full`: 63.7 MiB measured, 63.5 so counted)
            forward = [n for phase, n in self.tp_bytes if phase == "forward"]
            return self.out_bytes + self.keeps_collectives * sum(forward[:-1])
        return self.selective_bytes

    def collectives_again(self) -> int:
        """How many times more each forward tensor-parallel all-reduce runs when the layer
        is recomputed in full: 0 where their outputs are kept, 1 where issued again."""
        return int(_is_layer(self) and not self.keeps_collectives)


@dataclass(frozen=True)
class Workload:
    """A captured step, priced per tensor-parallel degree: `parts[t]` are the blocks in
    order, the repeated layer expanded to the model's layer count."""

    layers: int  #: repeated layers (the pipeline's unit); 0 where none were found
    layer_list: str  #: the module path of the list of layers, "" where none
    sequences: int  #: the global batch (the example batch's rows)
    tokens_per_sequence: int
    parts: dict[int, tuple[PartCost, ...]]
    tp_errors: dict[int, str]
    precision: str
    device: str
    capture_s: float
    notes: tuple[str, ...] = ()
    #: the same blocks priced on each other device kind of a heterogeneous cluster
    by_device: dict[str, dict[int, tuple[PartCost, ...]]] = dataclasses.field(
        default_factory=dict)
    #: the blocks as a whole step (no pipeline) compiles them: after the default passes
    #: (fusion, cleanup); `parts` are the captured step's, as pipeline stages run it
    whole: dict[int, tuple[PartCost, ...]] = dataclasses.field(default_factory=dict)

    def parts_on(self, device: str, tp: int, staged: bool = True) -> tuple[PartCost, ...]:
        if not staged and device == self.device and tp in self.whole:
            return self.whole[tp]
        return self.by_device.get(device, self.parts)[tp]

    def recomputing_collectives(self) -> Workload:
        """The same step where a fully recomputed layer issues its forward tensor-parallel
        all-reduces again instead of keeping their outputs, as Megatron-LM's checkpointed
        layers do (the published runs the planner is checked against)."""
        def again(parts: tuple[PartCost, ...]) -> tuple[PartCost, ...]:
            return tuple(dataclasses.replace(c, keeps_collectives=False) for c in parts)
        return dataclasses.replace(
            self, parts={t: again(ps) for t, ps in self.parts.items()},
            whole={t: again(ps) for t, ps in self.whole.items()},
            by_device={d: {t: again(ps) for t, ps in per.items()}
                       for d, per in self.by_device.items()})

    def model_flops(self) -> float:
        """Forward + backward FLOPs of one step (no recompute), from the captured graph."""
        return self.sequences * sum(p.forward_flops + p.backward_flops for p in self.parts[1])

    def layer_forward_flops(self, how: str | Mix) -> float:
        """FLOPs of one step's forward work made again under recompute `how`."""
        flops = {"none": 0.0, "full": sum(p.forward_flops for p in self.parts[1]
                                          if _is_layer(p)),
                 "selective": sum(p.selective_flops for p in self.parts[1] if _is_layer(p))}
        return self.sequences * sum(w * flops[mode] for mode, w in as_mix(how))


def _is_layer(p: PartCost) -> bool:
    return p.name.startswith("layer")


def layer_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The longest list of identical layers (same class, same parameter names and shapes)."""
    best = None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) < 3:
            continue
        kinds = {type(m) for m in mod}
        shapes = {tuple((n, tuple(p.shape)) for n, p in m.named_parameters()) for m in mod}
        if len(kinds) == 1 and len(shapes) == 1 and next(iter(shapes)) and \
                (best is None or len(mod) > len(best[1])):
            best = (name, mod)
    return best


def _one_sequence(batch: Any, rows: int, fake: FakeTensorMode) -> Any:
    """The first row of every tensor whose first dim is the batch's, as a fake CPU tensor."""
    def cut(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        shape = (1, *v.shape[1:]) if v.dim() and v.shape[0] == rows else v.shape
        return torch.zeros(shape, dtype=v.dtype, device="cpu")
    if isinstance(batch, dict):
        return {k: cut(v) for k, v in batch.items()}
    if isinstance(batch, torch.Tensor):
        return cut(batch)
    return type(batch)(cut(v) for v in batch)


def _rows(batch: Any) -> tuple[int, int]:
    """(sequences, tokens per sequence) of the example batch: its first tensor's dims."""
    args, kwargs = split_batch(batch)
    first = next((t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)
                  and t.dim()), None)
    if first is None:
        raise ConfigError("plan: the example batch has no tensor with a batch dimension")
    return first.shape[0], (first.shape[1] if first.dim() > 1 else 1)


def price_workload(model: nn.Module, example_inputs: Any, loss_fn: Any = None,
                   optimizer: Any = None, device: DeviceKind | None = None,
                   precision: str | None = None, tps: Iterable[int] = (1, 2, 4, 8),
                   keep_layers: int = 2, others: Iterable[DeviceKind] = ()) -> Workload:
    """Capture the step on one sequence (clustered layers) and price it per tp degree on
    `device` (and on each of `others`, for heterogeneous clusters)."""
    if device is None:
        from glmc.parallel.cluster import device_kind
        device = device_kind("host")
    precision = precision or device.dtype
    started = time.perf_counter()
    rows, tokens = _rows(example_inputs)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, Any] = {}
    work = _fake_copy(model, fake, _DTYPES[precision], memo)
    found = layer_list(work)
    layers, list_name, notes = 0, "", []
    if found is not None and not any(b.startswith(found[0] + ".") for b in set(
            block_names(n for n, _ in work.named_parameters()).values())):
        found = None  # the pipeline's blocks are not this list's items: capture it whole
    if found is not None:
        list_name, full = found
        layers = len(full)
        parent_name, _, attr = list_name.rpartition(".")
        parent = work.get_submodule(parent_name) if parent_name else work
        setattr(parent, attr, nn.ModuleList(list(full)[:keep_layers]))
        notes.append(f"{layers} identical layers in {list_name}: {keep_layers} captured, the "
                     "rest priced as copies")
    opt = _fresh_optimizer(work, optimizer, memo)
    with fake:
        batch = _one_sequence(example_inputs, rows, fake)
    graph = capture(work, batch, loss_fn, opt)
    parts, errors, whole = {}, {}, {}
    by_device: dict[str, dict[int, tuple[PartCost, ...]]] = {}
    fused = _fused(graph, device, notes, sharded=any(t > 1 for t in tps))
    for t in sorted(set(tps) | {1}):
        try:
            local = _shard(graph, t)
        except GlmcError as e:
            errors[t] = str(e)
            continue
        parts[t] = _expand(_price(local, device, t), list_name, layers, keep_layers)
        whole[t] = parts[t] if fused is None else _expand(
            _price(_shard(fused[t > 1], t), device, t), list_name, layers, keep_layers)
        for other in others:
            if other.name != device.name:
                by_device.setdefault(other.name, {})[t] = _expand(
                    _price(local, other, t), list_name, layers, keep_layers)
    return Workload(layers, list_name, rows, tokens, parts, errors, precision, device.name,
                    time.perf_counter() - started, tuple(notes), by_device, whole)


def price_precisions(model: nn.Module, example_inputs: Any, loss_fn: Any = None,
                     optimizer: Any = None, device: DeviceKind | None = None,
                     precisions: Iterable[str] = (), tps: Iterable[int] = (1, 2, 4, 8),
                     others: Iterable[DeviceKind] = ()) -> list[Workload]:
    """The step priced at each training precision the search may choose (`search` takes the
    list). bf16 and fp16 share one capture where every device runs both at one rate (the
    same bytes, the same matmul peak): they differ only in fp16's loss scaling, which the
    search prices (the overflow check reads every gradient)."""
    if device is None:
        from glmc.parallel.cluster import device_kind
        device = device_kind("host")
    others = list(others)
    out: list[Workload] = []
    for precision in dict.fromkeys(precisions or (device.dtype,)):
        twin = next((w for w in out if {w.precision, precision} <= {"bf16", "fp16"} and all(
            d.profile.peak("bfloat16") == d.profile.peak("float16")
            for d in [device, *others])), None)
        out.append(dataclasses.replace(twin, precision=precision) if twin is not None else
                   price_workload(model, example_inputs, loss_fn, optimizer, device, precision,
                                  tps, others=others))
    return out


def _fused(graph: TrainGraph, device: DeviceKind, notes: list[str], sharded: bool
           ) -> list[TrainGraph] | None:
    """The step after the passes `glmc compile` runs on a whole step before its parallel
    ones (the default pipeline's fusion and cleanup): as one process compiles it and, where
    `sharded`, as a tensor-parallel group does (`tp_pipeline`: the LM head and the MLP left
    for the pass to shard), indexed by `t > 1`. Pipeline stages are captured per stage
    without them. None where fusion fails on the planning copy (noted; the captured step is
    priced instead)."""
    from glmc.parallel.tensor import tp_pipeline
    from glmc.passes import default_pipeline
    traits = _traits(device)
    base = default_pipeline(device="cuda" if device.profile.kind == "cuda" else "cpu")
    ctx = PassContext(traits=traits, profile=device.profile)
    out = []
    for passes in (base, tp_pipeline(base)) if sharded else (base,):
        g = graph.copy()
        try:
            for p in passes:  # on a fusing backend attention is timed on real tensors:
                if p.name == "fusion" and p.attention is None and traits.fuses:
                    p = dataclasses.replace(p, attention=True)  # priced fused instead
                p.run(g, ctx)
        except GlmcError as e:
            notes.append(f"whole-step passes not priced ({e}); the captured step is")
            return None
        out.append(g)
    return out


def _fake_copy(model: nn.Module, fake: FakeTensorMode, dtype: torch.dtype,
               memo: dict[int, Any]) -> nn.Module:
    """A copy of `model` whose parameters and buffers are fake CPU tensors (no memory; a
    model on the meta device plans as one in memory), floating ones in `dtype`, dropout off
    (random ops are not priced, and the tensor-parallel pass refuses them). `memo` maps
    each original tensor to its fake (for the optimizer's copy)."""
    with fake:
        for t in [*model.parameters(), *model.buffers()]:
            kind = dtype if t.is_floating_point() else t.dtype
            f = torch.empty(t.shape, dtype=kind, device="cpu")
            memo[id(t)] = nn.Parameter(f, t.requires_grad) if isinstance(t, nn.Parameter) else f
    work = copy.deepcopy(model, memo)
    for mod in work.modules():
        if isinstance(mod, nn.modules.dropout._DropoutNd):
            mod.p = 0.0
        for name, value in vars(mod).items():
            if "dropout" in name.lower() and isinstance(value, float):
                setattr(mod, name, 0.0)
    return work.train()


def _fresh_optimizer(model: nn.Module, optimizer: Any, memo: dict[int, Any]
                     ) -> torch.optim.Optimizer:
    """The user's optimizer (kind, groups, settings) over the planning copy's parameters:
    a copy through the same memo, holding only the parameters the copy kept."""
    if optimizer is None:
        return resolve_optimizer(model, None)
    live = {id(p) for p in model.parameters()}
    memo[id(optimizer.state)] = defaultdict(dict)  # no state: the step's rule makes its own
    opt = copy.deepcopy(optimizer, memo)
    opt.param_groups = [g for g in opt.param_groups
                        if g.update(params=[p for p in g["params"] if id(p) in live]) or
                        g["params"]]
    for p in [p for p in opt.state if id(p) not in live]:
        del opt.state[p]
    return opt


def _shard(graph: TrainGraph, t: int) -> TrainGraph:
    local = graph.copy()
    if t > 1:
        res = TensorParallelPass(size=t).run(local, PassContext(mesh=MeshSpec((t,), ("tp",))))
        if not res.stats.column and not res.stats.row:
            raise ConfigError(f"tensor_parallel: no weight of this model could be sharded "
                              f"{t} ways (no column/row-parallel linear found)")
    return local


def _traits(device: DeviceKind) -> Any:
    """The backend glmc would run on the device: Inductor's fusion on GPUs, eager on CPUs."""
    from glmc.backends import get_backend
    return get_backend("inductor" if device.profile.kind == "cuda" else "eager").traits()


def _price(graph: TrainGraph, device: DeviceKind, t: int) -> list[PartCost]:
    """Each block of `graph` (one tp rank's program on one sequence) priced on `device`.
    Seconds are split into work (scales with the micro-batch) and per-kernel launch or
    dispatch overhead (paid once per micro-batch)."""
    blocks = step_blocks(graph)
    traits = _traits(device)
    pred = predict(graph, traits, device.profile)
    seconds = pred.time.node_seconds
    launch = dispatch_overhead(device.profile, traits)
    acc = {b: {"f": 0.0, "b": 0.0, "o": 0.0, "out": 0, "ff": 0.0, "bf": 0.0,
               "comm": []} for b in blocks}
    update = 0.0
    work = _WorkOps(graph, device) if device.corun > 1 or device.corun_stream else None
    for n in graph.compute_nodes():
        info = graph.info(n)
        if info.phase is Phase.OPTIMIZER:
            update += seconds.get(n.name, 0.0)
            if work is not None:
                work.add(n, "u", seconds.get(n.name, 0.0), None, op_cost(n))
            continue
        if info.phase not in (Phase.FORWARD, Phase.BACKWARD):
            continue
        block = _block_of(graph, n, blocks)
        a = acc[block]
        fwd = info.phase is Phase.FORWARD
        comm = is_comm(n)
        cost = op_cost(n) if not comm else None
        if comm:
            if info.spec is not None and "all_reduce" in str(n.target):
                a["comm"].append((info.phase.value, info.spec.nbytes))
        elif n.name in seconds:
            a["o"] += launch
            a["f" if fwd else "b"] += max(0.0, seconds[n.name] - launch)
            if work is not None:
                work.add(n, "f" if fwd else "b", max(0.0, seconds[n.name] - launch), block,
                         cost)
        if not comm:
            a["ff" if fwd else "bf"] += cost.flops * t  # the whole group's work
        # what the block hands on: a view holds no new storage; a collective's output does
        # (a tensor-parallel layer's output is its last all-reduce's)
        if fwd and info.spec is not None and not is_view(n):
            users = [graph.info(u) for u in alias_readers(n) if u.op == "call_function"]
            if any(u.phase is Phase.FORWARD and owner(u.module, blocks) not in (block, None)
                   for u in users):
                a["out"] += info.spec.nbytes
    params = _params(graph, blocks)
    total = sum(params.values()) or 1
    saved, saved_fixed, peaks, update_bytes = _live(graph, pred, traits, blocks)
    sel = _selective(graph, blocks, seconds, launch, t)
    stash = _stash(graph, blocks)
    return [PartCost(b, acc[b]["f"], acc[b]["b"], update * params[b] / total, params[b],
                     saved[b], acc[b]["out"], tuple(acc[b]["comm"]), acc[b]["ff"],
                     acc[b]["bf"], acc[b]["o"], peaks[b],
                     update_bytes * params[b] // total,
                     round(saved[b] * sel[b]["share"]), sel[b]["s"], sel[b]["o"],
                     sel[b]["flops"], saved_fixed[b], *stash[b],
                     work_ops=work.of(b, params[b] / total) if work is not None else ())
            for b in blocks]


class _WorkOps:
    """`PartCost.work_ops` of each block, gathered while `_price` walks the step: each op's
    seconds, its memory-bound part (`memory_time`) and its bytes, apart those of the
    parameters (the same for any micro-batch). The update's ops stream the whole optimizer
    state once a step (none of it is in a cache when the next op reads it): their working
    set is all of their bytes together."""

    def __init__(self, graph: TrainGraph, device: DeviceKind) -> None:
        from glmc.analysis.cost import memory_time
        self.memory_time, self.profile = memory_time, device.profile
        self.params = {ph for spec, ph in zip(graph.inputs, graph.placeholders())
                       if spec.role is Role.PARAMETER}
        self.ops: dict[str | None, dict[tuple[str, int, int], list[float]]] = \
            defaultdict(dict)
        self.update_bytes = 0

    def add(self, n: fx.Node, phase: str, seconds: float, block: str | None,
            c: Any) -> None:
        fixed = 0 if phase == "u" else sum(
            value_bytes(a.meta.get("val")) for a in n.all_input_nodes
            if alias_root(a) in self.params)
        memory = min(seconds, self.memory_time(c, self.profile))
        key = (phase, max(0, c.bytes - fixed), fixed) if phase != "u" else ("u", 0, 0)
        if phase == "u":
            self.update_bytes += c.bytes
        acc = self.ops[block].setdefault(key, [0.0, 0.0])
        acc[0] += seconds
        acc[1] += memory

    def of(self, block: str, share: float) -> tuple[tuple[str, float, float, int, int], ...]:
        """The block's ops, and its `share` of the update's (by parameters)."""
        own = [(ph, s, m, b, f) for (ph, b, f), (s, m) in self.ops[block].items()]
        update = [("u", s * share, m * share, self.update_bytes, 0)
                  for s, m in self.ops[None].values()] if share else []
        return tuple(own + update)


def _stash(graph: TrainGraph, blocks: list[str]) -> dict[str, tuple[int, int]]:
    """Per block, the bytes (one sequence) of the I values and of the forward values a
    micro-batch's W reads, as `split_backward` cuts a stage's backward: I is what the
    gradients handed to an earlier block need, W the rest."""
    from glmc.analysis.opcost import value_bytes
    back = [n for n in graph.compute_nodes() if graph.info(n).phase is Phase.BACKWARD]
    inside = set(back)
    block = {n: _block_of(graph, n, blocks) for n in back}
    need = [n for n in back if any(u in inside and block[u] != block[n] for u in n.users)]
    in_i: set = set()
    while need:  # everything the handed-on gradients need, within the backward
        n = need.pop()
        if n not in in_i:
            in_i.add(n)
            need += [a for a in n.all_input_nodes if a in inside]
    out = {b: [0, 0] for b in blocks}
    i_values = {n for n in in_i if any(u in inside and u not in in_i for u in n.users)}
    forward = {alias_root(a) for w in inside - in_i for a in w.all_input_nodes
               if graph.info(alias_root(a)) is not None
               and graph.info(alias_root(a)).phase is Phase.FORWARD}
    for k, values in enumerate((i_values, forward)):
        for n in values:
            val = n.meta.get("val")
            if not isinstance(val, (tuple, list)):
                out[_block_of(graph, n, blocks)][k] += value_bytes(val)
    return {b: (i, f) for b, (i, f) in out.items()}


def _selective(graph: TrainGraph, blocks: list[str], seconds: dict[str, float],
               launch: float, t: int) -> dict[str, dict[str, float]]:
    """Per block, selective recomputation's rule on the captured program (as the recompute
    pass applies it with `budget=selective`): from every forward value the backward reads,
    a value `selective_keeps` is kept, as is what a block hands to the next (the residual
    stream: made again it would live as long as kept), any other is made again from its
    inputs (kept or made again in turn; parameters and batch are held anyway). Returns the
    share of the block's saved bytes the rule keeps, and the recomputed ops' seconds (work
    per sequence, dispatch per micro-batch) and FLOPs (the whole tp group's)."""
    from glmc.analysis.opcost import selective_keeps, value_bytes

    def forward(n: Any) -> bool:
        info = n.meta.get("glmc")
        return n.op == "call_function" and info is not None and info.phase is Phase.FORWARD

    out = {b: {"saved": 0, "kept": 0, "s": 0.0, "o": 0.0, "flops": 0.0} for b in blocks}
    seen: set = set()

    def need(v: Any) -> None:
        if v in seen or not forward(v):
            return
        seen.add(v)
        block = _block_of(graph, v, blocks)
        row = out[block]
        if selective_keeps(v) or any(  # what the block hands to the next: a checkpoint
                forward(u) and _block_of(graph, u, blocks) != block for u in alias_readers(v)):
            row["kept"] += value_bytes(v.meta.get("val"))
            return
        if v.name in seconds:
            row["s"] += max(0.0, seconds[v.name] - launch)
            row["o"] += launch
        row["flops"] += op_cost(v).flops * t
        for a in v.all_input_nodes:
            need(alias_root(a))

    saved = set()
    for n in graph.compute_nodes():
        if graph.info(n).phase is not Phase.BACKWARD:
            continue
        for a in n.all_input_nodes:
            base = alias_root(a)
            if forward(base):
                saved.add(base)
    for v in saved:
        out[_block_of(graph, v, blocks)]["saved"] += value_bytes(v.meta.get("val"))
    for v in sorted(saved, key=lambda n: n.name):
        need(v)
    for row in out.values():
        row["share"] = min(1.0, row["kept"] / row["saved"]) if row["saved"] else 1.0
    return out


def _live(graph: TrainGraph, pred: Any, traits: Any, blocks: list[str]
          ) -> tuple[dict[str, int], dict[str, int], dict[str, tuple[tuple[int, int, int], ...]],
                     int]:
    """From the liveness of the step's program on one sequence (`pred.memory`, over the
    program the backend runs): per block, the forward values its backward reads (the
    activations its forward nodes allocate: views and aliases followed), per sequence and
    apart those the same for any micro-batch (`BATCH_FIXED_OUTPUTS`: the fused LM head's
    weight gradient); its candidate peaks (`PartCost.peaks`): at each node, what is live
    per sequence beyond what the blocks before it saved (weights' gradients left out, fixed
    outputs too: the plan counts them by ZeRO stage) and, apart, the fused op's workspace
    (chunked: it grows with the micro-batch up to a chunk); and what the update holds beyond
    the gradients (all blocks together)."""
    nodes = list(pred.program.nodes)
    fusion = traits.fusion(pred.program) if traits.fusion is not None else None
    inside = workspaces(nodes, fusion)
    fixed = _fixed_outputs(nodes)
    timeline = []  # forward and backward nodes: (block, per sequence, room, cap)
    saved, saved_fixed = dict.fromkeys(blocks, 0), dict.fromkeys(blocks, 0)
    grads = sum(graph.info(ph).spec.nbytes for spec, ph in
                zip(graph.inputs, graph.placeholders())
                if spec.role is Role.PARAMETER and graph.info(ph).spec is not None)
    update, held = 0, 0
    for i, live in pred.memory.timeline:
        n = nodes[i]
        info = n.meta.get("glmc")  # the write-back lowering's own copies carry none
        if n.op != "call_function" or info is None:
            continue
        if info.phase is Phase.OPTIMIZER:
            update = max(update, live["activations"] + live["temporaries"]
                         + live["gradients"] - grads)
        elif info.phase in (Phase.FORWARD, Phase.BACKWARD):
            b = _block_of(graph, n, blocks)
            flat = sum(nbytes for first, last, nbytes in fixed if first <= i <= last)
            acts = live["activations"] - flat  # the fixed outputs are forward values
            if info.phase is Phase.FORWARD:
                saved[b] += max(0, acts - held)
                saved_fixed[b] += sum(nbytes for first, _, nbytes in fixed if first == i)
            held = acts
            room = inside.get(n, 0)
            cap = op_cost(n).workspace_cap if room else None
            timeline.append((b, acts + live["temporaries"] - room, room,
                             -1 if cap is None else cap))
    before, run = {}, 0
    for b in blocks:  # forward order
        before[b], run = run, run + saved[b]
    points: dict[str, list[tuple[int, int, int]]] = {b: [] for b in blocks}
    for b, per_sequence, room, cap in timeline:
        points[b].append((max(0, per_sequence - before[b]), room, cap))
    return saved, saved_fixed, {b: _frontier(points[b]) for b in blocks}, update


def _room(sequences: int, room: int, cap: int) -> int:
    """A fused op's workspace for `sequences` from its one-sequence `room`: it grows with
    the rows up to `cap` (-1: no cap)."""
    return sequences * room if cap < 0 else min(sequences * room, max(room, cap))


def _fixed_outputs(nodes: list[Any]) -> list[tuple[int, int, int]]:
    """(first node index, last reader's index, bytes) of each output that does not grow with
    the batch (`glmc.ir.kernels.BATCH_FIXED_OUTPUTS`)."""
    from glmc.analysis.opcost import value_bytes
    from glmc.ir.kernels import BATCH_FIXED_OUTPUTS
    index = {n: i for i, n in enumerate(nodes)}
    out = []
    for n in nodes:
        if n.target is not operator.getitem or not isinstance(n.args[0], fx.Node):
            continue
        op = n.args[0].target
        name = op._schema.name if isinstance(op, torch._ops.OpOverload) else ""
        if n.args[1] in BATCH_FIXED_OUTPUTS.get(name, ()):
            last = max((index[u] for u in alias_readers(n) if u in index), default=index[n])
            out.append((index[n.args[0]], last, value_bytes(n.meta.get("val"))))
    return out


def _frontier(points: Iterable[tuple[int, int, int]]) -> tuple[tuple[int, int, int], ...]:
    """The candidate peaks (`PartCost.peaks`) no other matches or beats at every micro-batch
    size: per workspace cap, those no other beats in both bytes per sequence and workspace."""
    by_cap: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for live, room, cap in points:
        by_cap[cap].append((live, room))
    out = []
    for cap, group in sorted(by_cap.items()):
        best = -1
        for live, room in sorted(set(group), key=lambda q: (-q[0], -q[1])):
            if room > best:
                out.append((live, room, cap))
                best = room
    return tuple(out)


def _block_of(graph: TrainGraph, n: Any, blocks: list[str]) -> str:
    """The block a node works for: its (forward) module's; a node without one (a collective
    or a sum the tensor-parallel pass added) takes its first input's; glue and the loss go to
    the last block."""
    for _ in range(4):
        info = n.meta.get("glmc")
        if info is None:
            break
        module = info.module if info.phase is Phase.FORWARD else _forward_module(n)
        found = owner(module, blocks)
        if found is not None:
            return found
        inputs = [a for a in n.all_input_nodes if a.op == "call_function"]
        if not inputs:
            break
        n = inputs[0]
    return blocks[-1]


def _forward_module(n: Any) -> str | None:
    from glmc.trace.step import _module_path
    return _module_path(n.meta.get("fwd_nn_module_stack"))


def _params(graph: TrainGraph, blocks: list[str]) -> dict[str, int]:
    out = dict.fromkeys(blocks, 0)
    for spec, ph in zip(graph.inputs, graph.placeholders()):
        t = graph.info(ph).spec
        if spec.role is Role.PARAMETER and t is not None:
            b = owner(spec.target, blocks) or blocks[-1]
            out[b] += math.prod(t.shape)
    return out


def _expand(parts: list[PartCost], list_name: str, layers: int, kept: int
            ) -> tuple[PartCost, ...]:
    """The captured blocks with the kept layers' mean repeated `layers` times; glue before
    the layers becomes "first", after them "last"."""
    if not layers:
        return tuple(dataclasses.replace(p, name=f"layer {i}:{p.name}")
                     for i, p in enumerate(parts))
    prefix = list_name + "."
    kept_parts = [p for p in parts if p.name.startswith(prefix)]
    if len(kept_parts) != kept:  # the blocks are not the list's items: no clustering
        raise ConfigError(f"plan: the blocks of the step are not the items of {list_name}")
    first = [p for p in parts[:parts.index(kept_parts[0])]]
    last = [p for p in parts[parts.index(kept_parts[-1]) + 1:]]
    mean = _mean(kept_parts)
    out = [_merge("first", first)] if first else []
    out += [dataclasses.replace(mean, name=f"layer {i}") for i in range(layers)]
    out += [_merge("last", last)] if last else []
    return tuple(out)


def _mean(parts: list[PartCost]) -> PartCost:
    k = len(parts)
    comm = parts[-1].tp_bytes
    return PartCost("layer", *(sum(getattr(p, f) for p in parts) / k for f in
                               ("forward_s", "backward_s", "update_s")),
                    round(sum(p.params for p in parts) / k),
                    round(sum(p.saved_bytes for p in parts) / k),
                    round(sum(p.out_bytes for p in parts) / k), comm,
                    sum(p.forward_flops for p in parts) / k,
                    sum(p.backward_flops for p in parts) / k,
                    sum(p.overhead_s for p in parts) / k,
                    _frontier(q for p in parts for q in p.peaks),
                    round(sum(p.update_bytes for p in parts) / k),
                    round(sum(p.selective_bytes for p in parts) / k),
                    *(sum(getattr(p, f) for p in parts) / k for f in
                      ("selective_s", "selective_overhead_s", "selective_flops")),
                    *(round(sum(getattr(p, f) for p in parts) / k)
                      for f in ("saved_fixed", "stash_bytes", "stash_forward")),
                    work_ops=_work_ops(parts, 1 / k))


def _merge(name: str, parts: list[PartCost]) -> PartCost:
    return PartCost(name, sum(p.forward_s for p in parts), sum(p.backward_s for p in parts),
                    sum(p.update_s for p in parts), sum(p.params for p in parts),
                    sum(p.saved_bytes for p in parts), sum(p.out_bytes for p in parts),
                    tuple(c for p in parts for c in p.tp_bytes),
                    sum(p.forward_flops for p in parts), sum(p.backward_flops for p in parts),
                    sum(p.overhead_s for p in parts), _merged_peaks(parts),
                    sum(p.update_bytes for p in parts),
                    *(sum(getattr(p, f) for p in parts) for f in
                      ("selective_bytes", "selective_s", "selective_overhead_s",
                       "selective_flops", "saved_fixed", "stash_bytes",
                       "stash_forward")), work_ops=_work_ops(parts, 1.0))


def _work_ops(parts: list[PartCost], scale: float) -> tuple[tuple[str, float, float, int, int],
                                                            ...]:
    """The `work_ops` of `parts` together, seconds times `scale` (1/k: their mean)."""
    acc: dict[tuple[str, int, int], list[float]] = {}
    for p in parts:
        for phase, seconds, memory, per_seq, fixed in p.work_ops:
            a = acc.setdefault((phase, per_seq, fixed), [0.0, 0.0])
            a[0] += seconds * scale
            a[1] += memory * scale
    return tuple((ph, s, m, b, f) for (ph, b, f), (s, m) in acc.items())


def _merged_peaks(parts: list[PartCost]) -> tuple[tuple[int, int], ...]:
    """The peaks of consecutive blocks as one: each block's on top of what the blocks before
    it in the group saved."""
    out, run = [], 0
    for p in parts:
        out += [(run + live, room, cap) for live, room, cap in p.peaks]
        run += p.saved_bytes
    return _frontier(out)
