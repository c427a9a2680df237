"""Memory model: liveness over the step's execution order, and measured peak memory.

Predicted side (`simulate`): every non-view node allocates its output storage when it runs;
views, `getitem` and in-place ops alias their input's storage; a storage is freed right after
the last node that reads it (through any alias) — which is what both the eager backend (fx
frees a value after its last use) and Inductor (buffers are freed after their last kernel) do.
Inputs and constants are live for the whole step. An op that allocates and frees buffers inside
(glmc's kernels: a chunk of logits, the temporaries of a norm's body; `OpCost.workspace` from
the cost rules) holds them on top of what is live while it runs. On a fusing backend
(`BackendTraits.fusion`, e.g. Inductor's, in glmc.backends.inductor.model), ops inlined into
their consumers never allocate, and their inputs stay live until the consumer runs; the
backend's `kernel_cost` says what workspace its kernels keep.

Live bytes are split into parameters (and buffers/constants), optimizer state, inputs (the
batch), activations (forward values read by the backward), gradients (backward values read by
the optimizer) and temporaries (everything else).

Measured side (`measure_peak`), independent of the prediction: the in-step peak of a real step
from the allocator — on CPU every c10 allocation and free recorded by the profiler's memory
events (Inductor's buffers included), on CUDA `torch.cuda.max_memory_allocated` — and the
persistent part as the storage bytes of the real tensors the step reads.
"""
from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx as fx

from glmc.analysis.cost import is_view, op_cost
from glmc.ir.graph import Phase, Role, comm_ops
from glmc.ir.target import EAGER, BackendTraits, FusionModel

CATEGORIES = ("parameters", "optimizer_state", "inputs", "activations", "gradients",
              "temporaries")


# ---- liveness ---------------------------------------------------------------------------------


@dataclass
class MemoryEstimate:
    peak_bytes: int
    peak_node: str
    peak_source: str | None
    persistent_bytes: int  #: inputs and constants, live for the whole step
    at_peak: dict[str, int]  #: live bytes per category at the peak
    timeline: list[tuple[int, dict[str, int]]] = field(repr=False)  #: (node index, per category)
    fused: bool = False
    #: the largest non-persistent tensors live at the peak: (node, bytes, category, source)
    largest_at_peak: list[tuple[str, int, str, str | None]] = field(default_factory=list)

    @property
    def transient_bytes(self) -> int:
        """Peak minus what is live for the whole step (activations + gradients + temporaries)."""
        return self.peak_bytes - self.persistent_bytes

    @property
    def left_bytes(self) -> int:
        """What the graph leaves live above its inputs when it ends (its new outputs)."""
        end = sum(self.timeline[-1][1].values()) if self.timeline else self.persistent_bytes
        return end - self.persistent_bytes

    def to_dict(self, points: int = 400) -> dict[str, Any]:
        step = max(1, len(self.timeline) // points)
        peak_i = max(range(len(self.timeline)), key=lambda i: sum(self.timeline[i][1].values()),
                     default=0)
        picked = sorted(set(range(0, len(self.timeline), step)) | {peak_i}) if self.timeline else []
        return {"peak_bytes": self.peak_bytes, "peak_node": self.peak_node,
                "peak_source": self.peak_source, "persistent_bytes": self.persistent_bytes,
                "transient_bytes": self.transient_bytes, "at_peak": self.at_peak,
                "fused": self.fused,
                "largest_at_peak": [list(t) for t in self.largest_at_peak],
                "timeline": [[self.timeline[i][0], self.timeline[i][1]] for i in picked]}


def storage_bytes(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        try:
            return int(v.untyped_storage().nbytes())
        except Exception:  # symbolic or storage-less tensors
            return v.numel() * v.element_size()
    return 0


Key = tuple[fx.Node, int]  #: one storage: (producer node, output index)


def simulate(graph: fx.Graph, traits: BackendTraits = EAGER,
             consumed: Iterable[fx.Node] = (),
             done_at: dict[str, str] | None = None,
             input_bytes: dict[fx.Node, int] | None = None) -> MemoryEstimate:
    """Predicted live bytes after each node of the *lowered* step (see module docstring) on
    the backend described by `traits` (its fusion model decides which ops own a buffer).
    `consumed`: placeholders the caller hands over (`glmc.compiler.inplace.run_inplace`'s `consume`),
    freed after their last read instead of living for the whole graph (live from the start
    until then). `done_at`: by collective, the node during which the communication model
    predicts it finishes (`CommEstimate.done_at`); without it a collective counts as in
    flight until its wait. `input_bytes`: the bytes of these placeholders instead of their
    storage's (inputs that are views of one storage the graph cannot see: the caller counts
    the storage once)."""
    fusion = traits.fusion(graph) if traits.fusion is not None else None
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    storage, size = _storages(nodes, fusion)
    size.update({(ph, 0): b for ph, b in (input_bytes or {}).items()})
    last_use, readers = _last_uses(nodes, index, storage, fusion)
    category = {k: _category(k[0], readers.get(k, [])) for k in size}
    _staging(nodes, index, storage, size, last_use, category, done_at or {})
    consumed = set(consumed)
    persistent = {k for k in size if k[0].op in ("placeholder", "get_attr")
                  and k[0] not in consumed}
    frees: dict[int, list[Key]] = {}
    for k in size:
        if k not in persistent:  # never read: freed right after it is produced
            frees.setdefault(last_use.get(k, index[k[0]]), []).append(k)
    live = {c: 0 for c in CATEGORIES}
    for k in persistent:
        live[category[k]] += size[k]
    workspace = workspaces(nodes, fusion)
    timeline, peak_i = _timeline(nodes, storage, size, category, persistent, frees, live,
                                 workspace)
    peak = sum(timeline[peak_i][1].values()) if timeline else sum(live.values())
    live_at_peak = sorted((k for k in size if k not in persistent
                           and index[k[0]] <= peak_i <= last_use.get(k, index[k[0]])),
                          key=lambda k: -size[k])
    largest = [(k[0].name, size[k], category[k], _source(k[0])) for k in live_at_peak[:12]]
    peak_node = nodes[peak_i] if nodes else None
    return MemoryEstimate(peak, peak_node.name if peak_node is not None else "",
                          _source(peak_node) if peak_node is not None else None,
                          sum(size[k] for k in persistent),
                          timeline[peak_i][1] if timeline else dict(live), timeline,
                          traits.fuses, largest)


def _source(n: fx.Node) -> str | None:
    return getattr(n.meta.get("glmc"), "source", None)


def _storages(nodes: list[fx.Node], fusion: FusionModel | None
              ) -> tuple[dict[fx.Node, list[Key]], dict[Key, int]]:
    """The storages each node's value lives in, and the size of every storage."""
    storage: dict[fx.Node, list[Key]] = {}
    size: dict[Key, int] = {}
    for n in nodes:
        val = n.meta.get("val")
        if n.op in ("placeholder", "get_attr") or (n.op == "call_function" and not is_view(n)):
            if fusion is not None and fusion.inlined(n):
                storage[n] = []  # computed inside its consumer's kernel: no buffer
                continue
            vals = list(val) if isinstance(val, (tuple, list)) else [val]
            storage[n] = [(n, i) for i in range(len(vals))]
            size.update({(n, i): storage_bytes(v) for i, v in enumerate(vals)})
        elif n.op == "call_function":  # a view, getitem or in-place op: aliases its base
            storage[n] = _aliased(n, storage)
        else:
            storage[n] = []
    return storage, size


def _aliased(n: fx.Node, storage: dict[fx.Node, list[Key]]) -> list[Key]:
    base = n.args[0] if n.args else None
    if not isinstance(base, fx.Node):
        return []
    parent = storage.get(base, [])
    if n.target is operator.getitem:
        idx = n.args[1]
        return [parent[idx]] if isinstance(idx, int) and idx < len(parent) else list(parent)
    return list(parent)


def _staging(nodes: list[fx.Node], index: dict[fx.Node, int], storage: dict, size: dict,
             last_use: dict, category: dict, done_at: dict[str, str]) -> None:
    """A collective's in-flight temporary (`OpCost.workspace` of a comm op, e.g. gloo's
    staging copy) as a storage of its own, live from the collective to its wait — or, for
    the kinds that free it when the transfer ends (`_FREED_AT_END`), to the node during
    which it is predicted to end (`done_at`)."""
    by_name = {n.name: n for n in nodes}
    for n in nodes:
        kind = comm_ops().get(n.target) if n.op == "call_function" else None
        if kind in (None, "wait_tensor"):
            continue
        staged = op_cost(n).workspace
        wait = next((u for u in n.users if comm_ops().get(u.target) == "wait_tensor"), None)
        if staged and wait is not None:
            k, end = (n, -1), index[wait]
            if kind in _FREED_AT_END and done_at.get(n.name) in by_name:
                end = max(index[n], min(end, index[by_name[done_at[n.name]]]))
            size[k], last_use[k], category[k] = staged, end, "temporaries"
            storage[n] = [*storage.get(n, []), k]


#: collectives whose staging copy is freed when the transfer ends, not at the wait: gloo's
#: all-gather (its reduce-scatter keeps the copy until the wait) — a 25 MB all-gather's
#: staging dropped ~100-300 ms after the issue, long before a wait placed 700 ms later, while
#: a reduce-scatter's stayed to its wait (malloc counters sampled on 2 gloo ranks, torch 2.13)
_FREED_AT_END = ("all_gather_into_tensor",)

#: collectives that read their input while in flight (until their wait); all_reduce works on
#: its own copy
_HOLDS_INPUT = ("reduce_scatter_tensor", "all_gather_into_tensor")


def _last_uses(nodes: list[fx.Node], index: dict[fx.Node, int],
               storage: dict[fx.Node, list[Key]], fusion: FusionModel | None
               ) -> tuple[dict[Key, int], dict[Key, list[fx.Node]]]:
    """Index of the last node reading each storage, and the nodes that read it."""
    last_use: dict[Key, int] = {}
    readers: dict[Key, list[fx.Node]] = {}
    for n in nodes:
        if fusion is not None and fusion.inlined(n):
            continue  # its reads happen in the consumer's kernel
        ins = fusion.reads(n) if fusion is not None and n.op == "call_function" \
            else n.all_input_nodes
        if comm_ops().get(n.target) == "wait_tensor" and isinstance(n.args[0], fx.Node) and \
                comm_ops().get(n.args[0].target) in _HOLDS_INPUT:
            ins = [*ins, *n.args[0].all_input_nodes]  # the collective reads until it ends
        for a in ins:
            for k in storage.get(a, []):
                last_use[k] = max(last_use.get(k, -1), index[n])
                readers.setdefault(k, []).append(n)
    return last_use, readers


def workspaces(nodes: list[fx.Node], fusion: FusionModel | None) -> dict[fx.Node, int]:
    """Bytes each kernel allocates and frees inside (cost rules; the backend's say on its own
    kernels)."""
    out = {}
    for n in nodes:
        if n.op != "call_function" or is_view(n) or (fusion is not None and fusion.inlined(n)):
            continue
        if n.target in comm_ops():
            continue  # in flight until the wait: a storage of its own (`_staging`)
        c = op_cost(n)
        if fusion is not None:
            c = fusion.kernel_cost(n, c)
        if c.workspace:
            out[n] = c.workspace
    return out


def _timeline(nodes: list[fx.Node], storage: dict[fx.Node, list[Key]], size: dict[Key, int],
              category: dict[Key, str], persistent: set[Key], frees: dict[int, list[Key]],
              live: dict[str, int], workspace: dict[fx.Node, int]
              ) -> tuple[list[tuple[int, dict[str, int]]], int]:
    """Live bytes per category after each node is allocated (before its frees; its workspace
    counted as temporaries), and the index of the peak."""
    timeline: list[tuple[int, dict[str, int]]] = []
    peak, peak_i = sum(live.values()), 0
    for i, n in enumerate(nodes):
        if n.op in ("call_function", "placeholder"):  # a consumed input lives until freed
            for k in storage.get(n, []):
                if k[0] is n and k not in persistent:
                    live[category[k]] += size[k]
        now = dict(live)
        if n in workspace:
            now["temporaries"] += workspace[n]
        timeline.append((i, now))
        if sum(now.values()) > peak:
            peak, peak_i = sum(now.values()), i
        for k in frees.get(i, []):
            live[category[k]] -= size[k]
    return timeline, peak_i


def _phase(n: fx.Node) -> Phase | None:
    info = n.meta.get("glmc")
    return info.phase if info is not None else None


def _category(producer: fx.Node, readers: list[fx.Node]) -> str:
    info = producer.meta.get("glmc")
    if producer.op == "get_attr":
        return "parameters"
    if producer.op == "placeholder":
        role = info.role if info is not None else Role.INPUT
        if role in (Role.PARAMETER, Role.BUFFER, Role.CONSTANT):
            return "parameters"
        if role is Role.OPTIMIZER_STATE:
            return "optimizer_state"
        return "inputs"
    phase = info.phase if info is not None else None
    reader_phases = {_phase(r) for r in readers}
    if phase is Phase.FORWARD and (Phase.BACKWARD in reader_phases
                                   or Phase.OPTIMIZER in reader_phases):
        return "activations"
    if phase is Phase.BACKWARD and Phase.OPTIMIZER in reader_phases:
        return "gradients"
    return "temporaries"


# ---- measured ---------------------------------------------------------------------------------


class MeasurementUnavailable(RuntimeError):
    """The measurement cannot be taken here (e.g. the user's own profiler is running); the
    caller should run the step unmeasured."""


@dataclass
class Measurement:
    """Memory and time of one real call of a step.

    `peak_bytes`: the peak allocated during the call above what was live before it (the
    in-step peak; from the allocator). `persistent_bytes`: the bytes of the state tensors the
    step read (parameters, buffers, optimizer state, batch), counted once per storage from the
    real tensors — measured independently of the model's prediction. None when not given.
    """

    peak_bytes: int
    seconds: float
    source: str = ""
    persistent_bytes: int | None = None
    persistent_tensors: int = 0

    @property
    def total_peak_bytes(self) -> int | None:
        """The whole step's peak: its state plus the in-step peak."""
        return None if self.persistent_bytes is None else self.persistent_bytes + self.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak_bytes, "in_step_peak_bytes": self.peak_bytes,
                "persistent_bytes": self.persistent_bytes,
                "total_peak_bytes": self.total_peak_bytes, "seconds": self.seconds,
                "source": self.source,
                "persistent_source": (f"storage bytes of the {self.persistent_tensors} "
                                      "tensors the step read" if self.persistent_bytes
                                      is not None else None)}


def state_bytes(tensors: Iterable[Any]) -> tuple[int, int]:
    """(bytes, tensors): the storage bytes of `tensors`, each storage counted once (tied
    weights, views of one buffer)."""
    seen: set[tuple[str, int]] = set()
    total = count = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        count += 1
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key in seen and storage.data_ptr() != 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total, count


def measure_peak(fn: Callable[[], Any], device: str = "cpu",
                 state: Sequence[Any] | None = None) -> tuple[Any, Measurement]:
    """Run `fn()` once and measure the peak bytes it allocates above the live baseline.

    `state`: the tensors the step reads (its inputs); their storage bytes become the measured
    persistent part. Nothing global is changed: no file descriptors are redirected and no
    kernel state (peak RSS marks) is reset.
    """
    persistent, count = state_bytes(state) if state is not None else (None, 0)
    if device != "cuda" and torch.autograd._profiler_enabled():
        raise MeasurementUnavailable(
            "memory: cannot measure the step's peak while another profiler runs on this "
            "thread (the allocator events come from a profiler); the step was not run")
    if device == "cuda":
        result, peak, seconds, source = _measure_cuda(fn)
    else:
        result, peak, seconds, source = _measure_cpu(fn)
    return result, Measurement(peak, seconds, source, persistent, count)


def _measure_cuda(fn: Callable[[], Any]) -> tuple[Any, int, float, str]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return result, torch.cuda.max_memory_allocated() - base, seconds, \
        "torch.cuda.max_memory_allocated"


def _measure_cpu(fn: Callable[[], Any]) -> tuple[Any, int, float, str]:
    """Every c10 CPU allocation and free during `fn()`, from the profiler's memory events.

    The legacy (non-Kineto) profiler records the same allocator events as torch.profiler
    without Kineto's start/stop lines, which C++ prints straight to the process's stderr (only
    an fd redirect could hide them); torch.profiler is the fallback where it is unavailable.
    """
    try:
        from torch._C._profiler import _ExperimentalConfig
        from torch.autograd import (ProfilerConfig, ProfilerState, _disable_profiler_legacy,
                                    _enable_profiler_legacy)
    except ImportError:
        return _measure_cpu_kineto(fn)
    config = ProfilerConfig(ProfilerState.CPU, False, True, False, False, False,
                            _ExperimentalConfig())
    t0 = time.perf_counter()
    _enable_profiler_legacy(config)
    try:
        result = fn()
    finally:
        records = _disable_profiler_legacy()
    seconds = time.perf_counter() - t0
    start = records[0][0] if records and records[0] else None
    deltas = [(start.cpu_elapsed_us(e), int(e.cpu_memory_usage()))
              for thread in records for e in thread
              if e.kind() == "memory_alloc"] if start is not None else []
    return result, _peak_of(deltas), seconds, \
        "c10 CPU allocator (profiler memory events)"


def _measure_cpu_kineto(fn: Callable[[], Any]) -> tuple[Any, int, float, str]:
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    seconds = time.perf_counter() - t0
    deltas: list[tuple[float, int]] = []

    def walk(events: Any) -> None:
        for e in events:
            if e.tag == _EventType.Allocation and str(e.extra_fields.device) == "cpu":
                deltas.append((e.start_time_ns, int(e.extra_fields.alloc_size)))
            walk(e.children)
    walk(prof.profiler.kineto_results.experimental_event_tree())
    return result, _peak_of(deltas), seconds, \
        "c10 CPU allocator (torch.profiler memory events)"


def _peak_of(deltas: list[tuple[float, int]]) -> int:
    """The highest running sum of allocation deltas, in time order."""
    live = peak = 0
    for _, d in sorted(deltas, key=lambda x: x[0]):
        live += d
        peak = max(peak, live)
    return peak


def stage_saved_bytes(stage: Any) -> int:
    """New bytes one forward of a pipeline stage (`glmc.ir.program.Stage`) leaves behind (what
    it saves for the backward, and what it sends): the liveness simulation at the forward's
    end, above its inputs — saved views of parameters or received values share their storage
    and add nothing."""
    return simulate(stage.forward.graph).left_bytes
