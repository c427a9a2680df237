"""Memory model: liveness over the step's execution order, and measured peak memory.

Predicted side (`simulate`): every non-view node allocates its output storage when it runs;
views, `getitem` and in-place ops alias their input's storage; a storage is freed right after
the last node that reads it (through any alias) — which is what both the eager backend (fx
frees a value after its last use) and Inductor (buffers are freed after their last kernel) do.
Inputs and constants are live for the whole step. On a fusing backend, pointwise ops inlined
into their consumers never allocate, and their inputs stay live until the consumer runs.

Live bytes are split into parameters (and buffers/constants), optimizer state, inputs (the
batch), activations (forward values read by the backward), gradients (backward values read by
the optimizer) and temporaries (everything else).

Measured side (`measure_peak`): peak bytes of a real step from the c10 allocator — on CPU every
allocation and free recorded by torch.profiler's memory events (Inductor's buffers included),
with the process's peak RSS as a cross-check; on CUDA `torch.cuda.max_memory_allocated`.
"""
from __future__ import annotations

import contextlib
import operator
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx

from glmc.cost import is_view, kind_of
from glmc.ir import Phase, Role

CATEGORIES = ("parameters", "optimizer_state", "inputs", "activations", "gradients",
              "temporaries")

_INLINE_READS = 4  # Inductor realizes a pointwise buffer read by this many consumers or more
_POINTWISE_LIKE = {"_to_copy", "clone", "copy", "where", "masked_fill", "native_dropout_backward"}


# ---- Inductor-style fusion groups -------------------------------------------------------------


class FusionGroups:
    """Which pointwise nodes a fusing backend inlines into their consumers.

    A pointwise node is inlined when every consumer (looking through views) is itself a
    pointwise op, a reduction or an in-place copy into a step input, and it has fewer than
    `_INLINE_READS` consumers — Inductor's defaults. Everything else is a kernel that writes its
    output buffer.
    """

    def __init__(self, graph: fx.Graph) -> None:
        self._inlined: set[fx.Node] = set()
        for n in reversed(graph.nodes):  # consumers are decided before their producers
            if n.op == "call_function" and self._fusible(n) and self._consumers_fuse(n):
                self._inlined.add(n)

    @staticmethod
    def _pointwise(n: fx.Node) -> bool:
        from glmc.ir import op_name
        return kind_of(n) == "pointwise" or op_name(n) in _POINTWISE_LIKE

    def _fusible(self, n: fx.Node) -> bool:
        return self._pointwise(n) and isinstance(n.meta.get("val"), torch.Tensor)

    def _consumers(self, n: fx.Node) -> list[fx.Node]:
        out = []
        for u in n.users:
            if is_view(u) and not _mutates(u):
                out.extend(self._consumers(u))
            else:
                out.append(u)
        return out

    def _consumers_fuse(self, n: fx.Node) -> bool:
        users = self._consumers(n)
        if not users or len(users) >= _INLINE_READS:
            return False
        for u in users:
            if u.op != "call_function":
                return False
            if _mutates(u):
                if u.args[1] is not n and u.args[1] not in n.users:
                    return False
                continue
            if not (self._pointwise(u) or kind_of(u) == "reduction" or _generated(u)):
                return False
        return True

    def inlined(self, n: fx.Node) -> bool:
        return n in self._inlined

    def reads(self, n: fx.Node) -> list[fx.Node]:
        """The materialized nodes (inputs, kernels) a kernel rooted at `n` reads."""
        seen, out, stack = set(), [], list(n.all_input_nodes)
        while stack:
            a = stack.pop()
            if a in seen:
                continue
            seen.add(a)
            if a in self._inlined:
                stack.extend(a.all_input_nodes)
            elif is_view(a) and not _mutates(a) and a.target is not operator.getitem:
                stack.extend(a.all_input_nodes[:1])
            else:
                out.append(a)
        return out

    def kernel_cost(self, n: fx.Node, c: Any) -> Any:
        from glmc.cost import OpCost, value_bytes
        read = sum(value_bytes(a.meta.get("val")) for a in self.reads(n))
        return OpCost(c.kind, c.flops, read, c.bytes_written, c.dtype, c.name)


def _generated(n: fx.Node) -> bool:
    """Inductor decomposes this op into pointwise ops and reductions, so producers fuse into it."""
    from torch._inductor.decomposition import decompositions
    from torch._inductor.lowering import fallbacks
    t = n.target
    return (isinstance(t, torch._ops.OpOverload) and t in decompositions and t not in fallbacks
            and kind_of(n) != "matmul")


def fusion_groups(graph: fx.Graph) -> FusionGroups:
    return FusionGroups(graph)


def _mutates(n: fx.Node) -> bool:
    t = n.target
    return isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable


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


def _storage_bytes(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        try:
            return int(v.untyped_storage().nbytes())
        except Exception:  # symbolic or storage-less tensors
            return v.numel() * v.element_size()
    return 0


def simulate(graph: fx.Graph, fused: bool = False) -> MemoryEstimate:
    """Predicted live bytes after each node of the *lowered* step (see module docstring)."""
    groups = FusionGroups(graph) if fused else None
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    # storage of each value: a key (producer node, output index) and its size
    storage: dict[fx.Node, list[tuple[fx.Node, int]]] = {}
    size: dict[tuple[fx.Node, int], int] = {}
    for n in nodes:
        val = n.meta.get("val")
        if n.op in ("placeholder", "get_attr") or (n.op == "call_function" and not is_view(n)):
            if groups is not None and groups.inlined(n):
                storage[n] = []
                continue
            if isinstance(val, (tuple, list)):
                keys = [(n, i) for i in range(len(val))]
                for i, v in enumerate(val):
                    size[(n, i)] = _storage_bytes(v)
            else:
                keys = [(n, 0)]
                size[(n, 0)] = _storage_bytes(val)
            storage[n] = keys
        elif n.op == "call_function":  # a view, getitem or in-place op: aliases its base
            base = n.args[0] if n.args else None
            if n.target is operator.getitem and isinstance(base, fx.Node):
                parent = storage.get(base, [])
                idx = n.args[1]
                storage[n] = [parent[idx]] if isinstance(idx, int) and idx < len(parent) \
                    else list(parent)
            else:
                storage[n] = list(storage.get(base, [])) if isinstance(base, fx.Node) else []
        else:
            storage[n] = []

    def read_set(n: fx.Node) -> list[tuple[fx.Node, int]]:
        ins = groups.reads(n) if groups is not None and n.op == "call_function" else \
            n.all_input_nodes
        keys = []
        for a in ins:
            keys.extend(storage.get(a, []))
        return keys

    last_use: dict[tuple[fx.Node, int], int] = {}
    readers: dict[tuple[fx.Node, int], list[fx.Node]] = {}
    for n in nodes:
        if groups is not None and groups.inlined(n):
            continue  # its reads happen in the consumer's kernel
        for k in read_set(n):
            last_use[k] = max(last_use.get(k, -1), index[n])
            readers.setdefault(k, []).append(n)

    category = {k: _category(k[0], readers.get(k, [])) for k in size}
    persistent = {k for k in size if k[0].op in ("placeholder", "get_attr")}
    live = {c: 0 for c in CATEGORIES}
    for k in persistent:
        live[category[k]] += size[k]
    frees: dict[int, list[tuple[fx.Node, int]]] = {}
    for k in size:
        if k in persistent:
            continue
        end = last_use.get(k, index[k[0]])  # never read: freed right after it is produced
        frees.setdefault(end, []).append(k)

    timeline: list[tuple[int, dict[str, int]]] = []
    peak, peak_i = sum(live.values()), 0
    for i, n in enumerate(nodes):
        if n.op == "call_function" and storage.get(n):
            for k in storage[n]:
                if k[0] is n and k not in persistent:
                    live[category[k]] += size[k]
        total = sum(live.values())
        timeline.append((i, dict(live)))
        if total > peak:
            peak, peak_i = total, i
        for k in frees.get(i, []):
            live[category[k]] -= size[k]
    at_peak = timeline[peak_i][1] if timeline else dict(live)
    peak_node = nodes[peak_i] if nodes else None
    info = peak_node.meta.get("glmc") if peak_node is not None else None
    live_at_peak = [k for k in size if k not in persistent and index[k[0]] <= peak_i
                    <= last_use.get(k, index[k[0]])]
    live_at_peak.sort(key=lambda k: -size[k])
    largest = [(k[0].name, size[k], category[k],
                getattr(k[0].meta.get("glmc"), "source", None)) for k in live_at_peak[:12]]
    return MemoryEstimate(peak, peak_node.name if peak_node is not None else "",
                          getattr(info, "source", None),
                          sum(size[k] for k in persistent), at_peak, timeline, fused, largest)


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


@dataclass
class Measurement:
    """Peak bytes allocated during one call above what was live before it, and its time."""

    peak_bytes: int  #: from the allocator (c10 on CPU, CUDA caching allocator on GPU)
    seconds: float
    rss_peak_bytes: int | None = None  #: CPU only: peak RSS growth during the call
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak_bytes, "seconds": self.seconds,
                "rss_peak_bytes": self.rss_peak_bytes, "source": self.source}


def measure_peak(fn: Callable[[], Any], device: str = "cpu") -> tuple[Any, Measurement]:
    """Run `fn()` once and measure the peak bytes it allocates above the live baseline."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        return result, Measurement(torch.cuda.max_memory_allocated() - base, seconds,
                                   None, "torch.cuda.max_memory_allocated")
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    rss_before = _reset_peak_rss()
    t0 = time.perf_counter()
    with _quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU],
                                         profile_memory=True) as prof:
        result = fn()
    seconds = time.perf_counter() - t0
    rss_peak = _peak_rss()
    deltas: list[tuple[int, int]] = []

    def walk(events: Any) -> None:
        for e in events:
            if e.tag == _EventType.Allocation and str(e.extra_fields.device) == "cpu":
                deltas.append((e.start_time_ns, int(e.extra_fields.alloc_size)))
            walk(e.children)
    walk(prof.profiler.kineto_results.experimental_event_tree())
    deltas.sort(key=lambda d: d[0])
    live = peak = 0
    for _, d in deltas:
        live += d
        peak = max(peak, live)
    rss = rss_peak - rss_before if rss_peak is not None and rss_before is not None else None
    return result, Measurement(peak, seconds, rss,
                               "c10 CPU allocator (torch.profiler memory events)")


@contextlib.contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """Kineto prints start/stop lines from C++ straight to fd 2; keep them out of the user's
    terminal. Python exceptions raised meanwhile still carry their messages."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            sys.stderr.flush()
            os.dup2(null.fileno(), 2)
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _status_kb(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak_rss() -> int | None:
    """Reset the kernel's peak-RSS mark (Linux clear_refs) and return the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _status_kb("VmRSS")


def _peak_rss() -> int | None:
    return _status_kb("VmHWM")
