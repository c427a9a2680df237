"""Communication cost: an alpha-beta model of each collective, and how much of it the compute
hides.

One collective of `B` bytes (the full buffer: the all-reduced tensor, the gathered output, the
reduce-scatter input) over `N` ranks on a link of latency `alpha` and bandwidth `beta` takes,
with ring algorithms (what gloo and NCCL use for large buffers):

    all_reduce                 2 (N-1) alpha + 2 (N-1)/N  B / beta
    all_gather, reduce_scatter   (N-1) alpha +   (N-1)/N  B / beta

Links come from datasheets (NVLink, InfiniBand, Ethernet) or from timing this host's process
group once (`measure_link`, like the compute calibration). `estimate_comm` replays the step in
program order: compute advances a clock by each node's predicted time; a collective starts when
it is issued and the link is free (one collective at a time per link); a wait blocks until its
collective ends — that blocking is the *exposed* communication, the rest overlaps compute.
Overlap is not free where collectives share the CPU with compute (gloo): each second of compute
that overlaps a collective in flight takes `1 + contention` seconds (the link's measured
`contention`), reported apart as `contention_seconds`.

A measured link (`measure_link`) carries each collective kind's own fit: on a host, gloo's
all-gather and reduce-scatter are not the all-reduce's figures halved.
"""
from __future__ import annotations

import dataclasses
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from glmc.errors import ConfigError
from glmc.ir.graph import TrainGraph, comm_ops


@dataclass(frozen=True)
class LinkProfile:
    """One link between the ranks of a mesh dim: latency per message step and bytes/s."""

    name: str
    latency_s: float
    bandwidth: float
    source: str
    #: fixed cost of issuing one collective (a kernel launch, a gloo call), paid once per
    #: collective whatever its ring steps: what makes one collective cheaper than three
    call_s: float = 0.0
    #: per collective kind, its own measured (latency per ring step, bandwidth): one kind's
    #: fit does not predict another's on a host (gloo's all-gather and reduce-scatter are
    #: not half an all-reduce there); kinds not listed use the link's figures
    kinds: tuple[tuple[str, float, float], ...] = ()
    #: per collective kind, the timed points ((bytes, seconds), ...) on `ranks` ranks: at that
    #: rank count a collective's time is read off them (log-log interpolation; past the
    #: largest, that point plus the fitted bandwidth), not off the two-figure fit, which a
    #: host's caches bend (gloo's 32 MiB all-gather took 8.6x its 8 MiB one)
    points: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
    ranks: int = 0
    #: compute time lost per second of communication it overlaps (0: overlap is free, as
    #: with a GPU's copy engines; processes sharing CPU cores with gloo's threads lose some)
    contention: float = 0.0
    #: the share of its own speed a collective keeps while compute runs beside it (1: a GPU's
    #: copy engines; gloo's threads on cores the processes' compute also wants get less)
    progress: float = 1.0
    #: how much longer a rank's compute takes while the other ranks of its host compute at
    #: once, one core each (a virtual machine's cores, shared caches): 1 for devices of their
    #: own (GPUs). `corun` for compute in a core's cache (matmuls); `corun_stream`, by
    #: working set (bytes, factor), for memory traffic (shared cache and memory bandwidth);
    #: empty: `corun` for both
    corun: float = 1.0
    corun_stream: tuple[tuple[int, float], ...] = ()
    #: where the ranks outnumber the host's cores: what each blocking collective costs beyond
    #: its own time while the ranks compute between them (a waiting process wakes to find
    #: the cores taken and waits for a time slice); 0 otherwise
    wake_s: float = 0.0

    def timed(self, kind: str, nbytes: int, ranks: int) -> float | None:
        """The time of `kind` on `nbytes` read off the timed points (None: not timed at
        `ranks` ranks)."""
        import math
        pts = dict(self.points).get(kind) if ranks == self.ranks else None
        if not pts:
            return None
        if nbytes <= pts[0][0]:
            return pts[0][1]
        for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
            if nbytes <= b1:
                f = math.log(nbytes / b0) / math.log(b1 / b0)
                return math.exp(math.log(t0) + f * math.log(t1 / t0))
        _, _, bandwidth = self.figures(kind)
        share = _FACTORS[kind][1](ranks)
        return pts[-1][1] + share * (nbytes - pts[-1][0]) / bandwidth

    def figures(self, kind: str) -> tuple[float, float, float]:
        """(call, latency per ring step, bandwidth) of one collective kind on this link."""
        for k, latency, bandwidth in self.kinds:
            if k == kind:
                return 0.0, latency, bandwidth
        return self.call_s, self.latency_s, self.bandwidth

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "latency_us": self.latency_s * 1e6,
                "bandwidth_GBps": self.bandwidth / 1e9, "call_us": self.call_s * 1e6,
                "source": self.source,
                "kinds": {k: {"latency_us": a * 1e6, "bandwidth_GBps": b / 1e9}
                          for k, a, b in self.kinds},
                "timed_ms": {k: {str(b): t * 1e3 for b, t in pts} for k, pts in self.points},
                "ranks": self.ranks, "contention": self.contention,
                "progress": self.progress, "corun": self.corun,
                "corun_stream": {str(b): f for b, f in self.corun_stream},
                "wake_s": self.wake_s}


#: per-direction figures from the vendors' datasheets (bus bandwidth a ring can use)
LINKS = {
    "nvlink4": LinkProfile("nvlink4", 3e-6, 450e9, "NVIDIA H100/H200 SXM datasheet: NVLink 4, "
                           "900 GB/s bidirectional per GPU"),
    "infiniband-ndr": LinkProfile("infiniband-ndr", 5e-6, 50e9, "NVIDIA ConnectX-7 datasheet: "
                                  "NDR 400 Gb/s per port"),
    "roce-200g": LinkProfile("roce-200g", 8e-6, 25e9, "200 GbE RoCE (e.g. Huawei Ascend/Kunpeng "
                             "clusters' 200G NICs)"),
    "ethernet-25g": LinkProfile("ethernet-25g", 30e-6, 3.125e9, "25 GbE, TCP"),
    "nvlink3": LinkProfile("nvlink3", 3e-6, 300e9, "NVIDIA A100 SXM4 datasheet: NVLink 3, "
                           "600 GB/s bidirectional per GPU"),
    "infiniband-hdr": LinkProfile("infiniband-hdr", 5e-6, 25e9, "NVIDIA ConnectX-6 datasheet: "
                                  "HDR 200 Gb/s per port, one port per GPU (DGX A100: 8)"),
    "hccs": LinkProfile("hccs", 2e-6, 30e9, "Huawei Kunpeng 920: Hydra links between sockets "
                        "(240 Gb/s per direction, product brief)"),
    "loopback": LinkProfile("loopback", 40e-6, 2e9, "gloo over loopback TCP on one host "
                            "(glmc's measured order of magnitude; calibrate with glmc comm)",
                            60e-6),
}

#: ring factors: (latency steps, bandwidth share) as functions of the group size
_FACTORS = {
    "all_reduce": (lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n),
    "all_gather_into_tensor": (lambda n: n - 1, lambda n: (n - 1) / n),
    "reduce_scatter_tensor": (lambda n: n - 1, lambda n: (n - 1) / n),
}


def collective_seconds(kind: str, nbytes: int, ranks: int, link: LinkProfile) -> float:
    """The alpha-beta time of one collective on `nbytes` (the full buffer)."""
    if ranks <= 1:
        return 0.0
    timed = link.timed(kind, nbytes, ranks)
    if timed is not None:
        return timed
    steps, share = _FACTORS[kind]
    call, latency, bandwidth = link.figures(kind)
    return call + steps(ranks) * latency + share(ranks) * nbytes / bandwidth


_NUMBER = r"\d+(?:\.\d*)?(?:e[-+]?\d+)?"
#: a link given by its figures: "ALPHAus:BETAGBps[:CALLus]"
_FIGURES = re.compile(rf"(?P<alpha>{_NUMBER})us:(?P<beta>{_NUMBER})GBps(?::(?P<call>{_NUMBER})us)?")


def link_figures(link: LinkProfile) -> str:
    """`link`'s alpha-beta figures as `get_link` reads them back ("ALPHAus:BETAGBps:CALLus";
    its timed points are not carried): how a pass option names a measured link."""
    return (f"{link.latency_s * 1e6:.6f}us:{link.bandwidth / 1e9:.6f}GBps:"
            f"{link.call_s * 1e6:.6f}us")


def get_link(spec: Any) -> LinkProfile:
    """A link profile: a LinkProfile, a name from LINKS, or figures spelled
    "ALPHAus:BETAGBps[:CALLus]" (latency per ring step, bandwidth, cost of one collective
    call; e.g. "200us:0.05GBps" for a slow simulated inter-node link)."""
    if isinstance(spec, LinkProfile):
        return spec
    if spec in LINKS:
        return LINKS[spec]
    m = _FIGURES.fullmatch(str(spec))
    if m is not None and float(m["beta"]) > 0:
        return LinkProfile(str(spec), float(m["alpha"]) * 1e-6, float(m["beta"]) * 1e9,
                           "given figures", float(m["call"] or 0.0) * 1e-6)
    raise ConfigError(f"link: unknown link profile {spec!r}; known: {', '.join(LINKS)}, or "
                      "figures spelled ALPHAus:BETAGBps[:CALLus] (e.g. 200us:0.05GBps:50us), "
                      "or one measured by glmc.analysis.comm.measure_link")


@dataclass
class CommEstimate:
    """Predicted communication of one rank's step."""

    link: dict[str, Any]
    ranks: int
    collectives: int
    bytes_by_kind: dict[str, int]
    comm_seconds: float  #: the collectives' own time, back to back
    exposed_seconds: float  #: the part the step waits for
    compute_seconds: float
    timeline: list[dict[str, Any]] = field(default_factory=list)  #: per collective
    #: compute as contiguous spans of one phase, split at collectives and waits:
    #: {"phase", "start_s", "end_s"}; a wait that blocks shows as a gap
    compute_spans: list[dict[str, Any]] = field(default_factory=list)
    #: collective node name -> the node during which it is predicted to finish (its wait, if
    #: the step blocks for it): what lives only while a collective is in flight ends there
    done_at: dict[str, str] = field(default_factory=dict)
    #: compute time lost to the collectives it overlaps (the link's `contention`)
    contention_seconds: float = 0.0

    @property
    def step_seconds(self) -> float:
        return self.compute_seconds + self.exposed_seconds + self.contention_seconds

    def to_dict(self) -> dict[str, Any]:
        return {"link": self.link, "ranks": self.ranks, "collectives": self.collectives,
                "bytes_by_kind": self.bytes_by_kind, "comm_seconds": self.comm_seconds,
                "exposed_seconds": self.exposed_seconds,
                "compute_seconds": self.compute_seconds,
                "contention_seconds": self.contention_seconds,
                "step_seconds": self.step_seconds,
                "timeline": self.timeline, "compute_spans": self.compute_spans}


def _full_bytes(n: fx.Node, kind: str) -> int:
    """The collective's full buffer: its output for a gather, its input otherwise."""
    v = n.meta.get("val") if kind == "all_gather_into_tensor" else n.args[0].meta.get("val")
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


class _Queue:
    """The collectives issued on one link, in order: one at a time, each at a rate of its own
    speed (`progress` while compute runs beside it, 1 while the rank only waits)."""

    def __init__(self) -> None:
        self.entries: list[list[Any]] = []  #: [node, seconds left alone, timeline entry]
        self.at = 0.0  #: the link is simulated up to here (the compute clock)
        self.done_at: dict[str, str] = {}

    def left(self, upto: fx.Node | None = None) -> float:
        """Seconds alone the collectives up to `upto` (all: None) still need."""
        total = 0.0
        for node, rest, _ in self.entries:
            total += rest
            if node is upto:
                break
        return total

    def advance(self, until: float, rate: float, at: fx.Node) -> None:
        while self.entries and self.at < until:
            node, rest, entry = head = self.entries[0]
            entry.setdefault("start_s", self.at)
            step = min(rest / rate, until - self.at)
            head[1] -= step * rate
            self.at += step
            if head[1] <= 1e-12:
                self.entries.pop(0)
                entry["end_s"] = self.at
                self.done_at.setdefault(node.name, at.name)
        self.at = max(self.at, until)


def estimate_comm(graph: fx.Graph, node_seconds: dict[str, float], ranks: int,
                  link: LinkProfile, groups: dict[str, tuple[int, LinkProfile]] | None = None
                  ) -> CommEstimate:
    """Replay the step (see the module docstring); `node_seconds`: predicted compute time of
    each node by name (glmc.analysis.cost). `groups`: (ranks, link) of the collectives over a
    mesh dim by its name (a hierarchical all-reduce's "local" and "node"); the rest use `ranks` and
    `link`. One link is busy with one collective at a time; beside compute it keeps the
    link's `progress` of its speed, and the compute loses `contention` per second of it."""
    ops = comm_ops()
    clock = comm = exposed = contended = 0.0
    queue = _Queue()
    volume: dict[str, int] = {}
    timeline: list[dict[str, Any]] = []
    spans: list[dict[str, Any]] = []
    for n in graph.nodes:
        kind = ops.get(n.target) if n.op == "call_function" else None
        if kind is None:
            t = node_seconds.get(n.name, 0.0)
            if queue.entries and link.contention:  # slowed by the collectives beside it
                lost = link.contention * min(t, queue.left() / link.progress)
                contended += lost
                t += lost
            queue.advance(clock + t, link.progress, n)
            info = n.meta.get("glmc")
            phase = info.phase.value if info is not None else "other"
            if t and spans and spans[-1]["phase"] == phase and spans[-1]["end_s"] == clock:
                spans[-1]["end_s"] = clock + t
            elif t:
                spans.append({"phase": phase, "start_s": clock, "end_s": clock + t})
            clock += t
            continue
        if kind == "wait_tensor":
            target = n.args[0]
            waited = queue.left(target) if any(e[0] is target for e in queue.entries) else 0.0
            queue.advance(clock + waited, 1.0, n)
            queue.done_at.setdefault(target.name, n.name)
            exposed += waited
            clock += waited
            for entry in timeline:
                if entry["node"] == target.name:
                    entry["wait_s"] = clock
            continue
        nbytes = _full_bytes(n, kind)
        volume[kind] = volume.get(kind, 0) + nbytes
        info = n.meta.get("glmc")
        comm_info = info.comm if info is not None else None
        dim = comm_info.mesh_dim if comm_info is not None else None
        # a sub-group's collective (hierarchical all-reduce) runs over its own ranks
        n_ranks = comm_info.group_size if comm_info is not None and comm_info.group_size \
            else ranks
        n_ranks, on = (groups or {}).get(dim, (n_ranks, link))
        seconds = collective_seconds(kind, nbytes, n_ranks, on)
        comm += seconds
        timeline.append({"node": n.name, "kind": kind, "bytes": nbytes, "issue_s": clock,
                         "phase": info.phase.value if info is not None else None})
        queue.entries.append([n, seconds, timeline[-1]])
    queue.advance(clock + queue.left(), 1.0, n)  # never waited for: ends after the step
    compute = sum(node_seconds.values())
    return CommEstimate(link.to_dict(), ranks, len(timeline), volume, comm, exposed, compute,
                        timeline, spans, queue.done_at, contended)


def chrome_trace(comm: dict[str, Any], rank: int = 0) -> dict[str, Any]:
    """A predicted step (`CommEstimate.to_dict()`) as a Chrome / Perfetto trace: compute spans
    on one track, each collective on another, from its start to its end."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "thread_name", "pid": rank, "tid": 0, "args": {"name": "compute"}},
        {"ph": "M", "name": "thread_name", "pid": rank, "tid": 1,
         "args": {"name": "communication"}}]
    for s in comm["compute_spans"]:
        events.append({"ph": "X", "name": s["phase"], "pid": rank, "tid": 0,
                       "ts": s["start_s"] * 1e6, "dur": (s["end_s"] - s["start_s"]) * 1e6})
    for c in comm["timeline"]:
        events.append({"ph": "X", "name": c["kind"], "pid": rank, "tid": 1,
                       "ts": c["start_s"] * 1e6, "dur": (c["end_s"] - c["start_s"]) * 1e6,
                       "args": {"bytes": c["bytes"], "node": c["node"],
                                "issued_us": c["issue_s"] * 1e6}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"predicted_by": "glmc.analysis.comm", "link": comm["link"]}}


#: buffer sizes each collective kind is timed at (bytes of its full buffer)
_SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 32 << 20)
_KINDS = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor")


#: seconds a link measured on this host by the last run (cached) is reused for: the timing
#: takes ~2 s per start on 2 CPU ranks, and a test suite starts many
LINK_FRESH_S = 3600.0


def measure_link(group: Any = None, device: str = "cpu", reps: int = 5,
                 fresh_s: float = LINK_FRESH_S) -> LinkProfile:
    """This host's link between the ranks of `group`: each collective kind timed at
    `_SIZES` (median of `reps`) and fitted to its ring formula (least squares on relative
    error), the all-reduce's fit as the link's own figures; and how much compute an
    overlapped all-reduce costs (`contention`). Every rank of the group must call it; each
    gets the same profile (rank 0's figures, broadcast). For the whole world on CPU, the link
    the last run on as many ranks measured is reused while younger than `fresh_s` seconds
    (0: always measure)."""
    import torch.distributed as dist

    n = dist.get_world_size(group)
    if n == 1:
        return LinkProfile("none", 0.0, float("inf"), "one rank: nothing is communicated")
    src = dist.get_global_rank(group, 0) if group is not None else 0
    cached = [None]
    if group is None and device == "cpu" and dist.get_rank() == 0:
        try:  # whatever the cache holds, rank 0 must reach the broadcast
            cached[0] = _fresh_link(dist.get_backend(group), n, fresh_s)
        except Exception:  # noqa: BLE001 (an unreadable cache: measure instead)
            cached[0] = None
    dist.broadcast_object_list(cached, src=src, group=group)
    if cached[0] is not None:
        return dataclasses.replace(cached[0], source=cached[0].source.split("; cached")[0]
                                   + "; reused from this host's last run")
    # nothing fresh: every rank times the collectives together, rank 0's figures are kept
    # `reps` rounds of every kind at every size: a burst of another guest's work on a shared
    # host lands on one round of several sizes, not on every rep of one size
    samples: dict[tuple[str, int], list[float]] = {(k, b): [] for k in _KINDS for b in _SIZES}
    for r in range(reps):
        for kind, nbytes in samples:
            samples[kind, nbytes] += timed_collective(kind, nbytes, n, group, device, 1,
                                                      warm=r == 0)
    timed = {kind: [statistics.median(samples[kind, b]) for b in _SIZES] for kind in _KINDS}
    contention, progress = _contention(timed["all_reduce"][-1], group, device)
    corun, stream = _corun(group, device)
    wake = _wake(group, device)
    backend = dist.get_backend(group)
    kinds = tuple((kind, *_fit(kind, n, list(_SIZES), timed[kind])) for kind in _KINDS)
    link = [LinkProfile(f"measured-{backend}", kinds[0][1], kinds[0][2],
                        f"timed {', '.join(_KINDS)} of {', '.join(map(str, _SIZES))} B on {n} "
                        f"ranks ({backend}), median of {reps} rounds", kinds=kinds,
                        contention=contention, progress=progress, corun=corun,
                        corun_stream=stream, wake_s=wake,
                        points=tuple((k, tuple(zip(_SIZES, timed[k]))) for k in _KINDS),
                        ranks=n)]
    dist.broadcast_object_list(link, src=src, group=group)
    if group is None and dist.get_rank() == 0:
        _save_link(link[0], backend, n)
    return link[0]


def _fresh_link(backend: str, ranks: int, fresh_s: float) -> LinkProfile | None:
    """The cached link of `ranks` ranks if measured less than `fresh_s` seconds ago with
    today's sizes and kinds."""
    try:
        age = time.time() - _link_path(backend, ranks).stat().st_mtime
    except OSError:
        return None
    link = cached_link(backend, ranks) if age < fresh_s else None
    points = dict(link.points) if link is not None else {}
    if link is None or set(points) != set(_KINDS) or \
            any(tuple(b for b, _ in points[k]) != _SIZES for k in _KINDS):
        return None
    return link


def _timed(kind: str, nbytes: int, n: int, group: Any, device: str, reps: int) -> float:
    """Median seconds of one `kind` collective on an `nbytes` full buffer."""
    return statistics.median(timed_collective(kind, nbytes, n, group, device, reps))


def timed_collective(kind: str, nbytes: int, n: int, group: Any, device: str,
                     reps: int, warm: bool = True) -> list[float]:
    """Seconds of each of `reps` `kind` collectives on an `nbytes` full buffer (after one
    warm-up where `warm`), each started together on every rank (a barrier before it). Timed as the
    compiled step runs them: torch's functional collectives, each allocating its output
    (on gloo a fresh 32 MB output costs 1.5-2x the in-place collective: its pages are
    touched anew) and averaging where they reduce."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc
    numel = max(n, nbytes // 4 // n * n)
    full = torch.zeros(numel, device=device)
    part = torch.zeros(numel // n, device=device)
    grp = group if group is not None else dist.group.WORLD
    collective = {
        "all_reduce": lambda: fc.all_reduce(full, "avg", grp),
        "reduce_scatter_tensor": lambda: fc.reduce_scatter_tensor(full, "avg", 0, grp),
        "all_gather_into_tensor": lambda: fc.all_gather_tensor(part, 0, grp)}[kind]

    def call() -> None:
        fc.wait_tensor(collective())
    if warm:  # connections, buffers
        call()
    times = []
    for _ in range(reps):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        call()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def _fit(kind: str, n: int, sizes: list[int], times: list[float]) -> tuple[float, float]:
    """(latency per ring step, bandwidth) of `t = steps(n) a + share(n) B / b` fitted to the
    timed points, each weighted by 1/t (relative error: small and large buffers alike)."""
    import numpy as np
    steps, share = _FACTORS[kind]
    w = 1 / np.asarray(times)
    design = np.stack([np.ones(len(sizes)), np.asarray(sizes, dtype=float)], 1) * w[:, None]
    (a, b), *_ = np.linalg.lstsq(design, np.asarray(times) * w, rcond=None)
    return max(float(a), 1e-7) / steps(n), share(n) / max(float(b), 1e-15)


def _contention(comm_s: float, group: Any, device: str) -> tuple[float, float]:
    """(compute time lost per second a collective runs beside it, the share of its own speed
    the collective keeps meanwhile): a matmul loop about half as long as the all-reduce
    (`comm_s`) timed alone and with the all-reduce in flight, and how long the all-reduce is
    waited for after it. Measured on CPU ranks only (gloo shares their cores); a GPU's
    collectives run on their own engines: (0, 1) there."""
    import torch.distributed as dist
    if device != "cpu":
        return 0.0, 1.0
    a = torch.full((192, 192), 0.5, device=device)  # no draw from the user's generator
    t0 = time.perf_counter()
    for _ in range(5):
        a @ a
    each = max((time.perf_counter() - t0) / 5, 1e-7)
    count = max(1, int(comm_s / 2 / each))
    buf = torch.zeros(_SIZES[-1] // 4, device=device)

    def run(overlap: bool) -> tuple[float, float]:
        dist.barrier(group=group)
        t0 = time.perf_counter()
        work = dist.all_reduce(buf, group=group, async_op=True) if overlap else None
        for _ in range(count):
            a @ a
        t1 = time.perf_counter()
        if work is not None:
            work.wait()
        return t1 - t0, time.perf_counter() - t1
    # interleaved pairs (alone, overlapped), each pair's loss its own: another guest's
    # burst on a shared host lands on both halves of a pair, not on all of one kind (the
    # OS's scheduling makes single runs vary 3x; one calibration measured no contention)
    pairs = [(run(False)[0], run(True)) for _ in range(_PAIRS)]
    lost = statistics.median(max(0.0, c - alone) / max(c, 1e-9) for alone, (c, _) in pairs)
    # a collective done inside the loop kept at least comm_s / (the loop's time)
    progress = statistics.median((comm_s - w) / max(c, 1e-9) for _, (c, w) in pairs)
    return min(1.0, lost), min(1.0, max(0.05, progress))  # lost 1: overlap hides nothing


#: interleaved (alone, together) pairs each host-sharing probe times; the median pair's
#: figure is kept
_PAIRS = 11


#: working sets (bytes) the co-running probe streams over: a core's own caches to past a
#: host's last-level cache
_STREAM_SIZES = (2**18, 2**20, 2**22, 2**24, 2**26)


def _corun(group: Any, device: str) -> tuple[float, tuple[tuple[int, float], ...]]:
    """How much longer rank 0's work takes while other ranks work at once: (for matmuls in
    a core's cache, and by working set for a streaming elementwise pass over each of
    `_STREAM_SIZES`). Each probe is timed with rank 0 running it alone (the others wait in a
    barrier) and with as many ranks as the host has cores running it together (more would
    measure their sharing of cores, which the planner models apart), in interleaved pairs;
    the median pair's ratio, at least 1 (the medians of 7 alone then 7 together had ranged
    1.0-1.7 over a day's calibrations on one host). A pipeline on 2 processes of one host
    showed why one figure is not enough: the stage of small layers ran at its calibrated
    speed beside the other, the stage streaming 4 MiB of logits per sequence 1.24-1.33x
    slower. CPU ranks only."""
    import os

    import torch.distributed as dist
    if device != "cpu":
        return 1.0, ()
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)
    a = torch.full((256, 256), 0.5, device=device)  # no draw from the user's generator
    buffers = [(torch.zeros(size // 8, device=device), torch.empty(size // 8, device=device),
                max(4, 2**26 // size)) for size in _STREAM_SIZES]

    def matmuls() -> None:
        for _ in range(16):
            a @ a

    def streams(x: torch.Tensor, y: torch.Tensor, reps: int) -> Any:
        def run() -> None:  # reads x, writes y: `size` bytes in all, `reps` times
            for _ in range(reps):
                torch.add(x, 1.0, out=y)
        return run
    probes = [matmuls, *(streams(*b) for b in buffers)]

    def once(runs: bool) -> list[float]:
        took = []
        for probe in probes:
            dist.barrier(group=group)
            t0 = time.perf_counter()
            if runs:
                probe()
            took.append(time.perf_counter() - t0)
        dist.barrier(group=group)
        return took
    for probe in probes:  # warm-up
        probe()
    ratios = []
    for _ in range(_PAIRS):
        together, alone = once(rank < min(n, cores)), once(rank == 0)
        ratios.append([t / max(a_, 1e-9) for t, a_ in zip(together, alone)])
    if rank != 0:
        return 1.0, ()  # rank 0's figures are the link's (broadcast with it)
    factors = [max(1.0, statistics.median(r[i] for r in ratios)) for i in range(len(probes))]
    return factors[0], tuple(zip(_STREAM_SIZES, factors[1:]))


def _wake(group: Any, device: str) -> float:
    """Where the ranks outnumber the host's cores (CPU ranks only): what a blocking
    collective costs beyond its own time while every rank computes the same work between
    collectives — the median over interleaved triples of (matmuls, a 4-byte all-reduce)
    minus the same matmuls alone minus the all-reduce timed idle, per collective, with ~5 ms
    of compute (alone) between collectives (4 processes on 2 cores: 6-11 ms with 2-20 ms
    between them, against 0.4 ms idle); 0 where every rank has a core. There the same probe
    reads a share of the compute (the ranks' arrival spread: 1.6-21% within hours on an AMD
    EPYC host, rank 0's view, the ranks' mean or the least-waiting rank's alike) that the
    step's tensor-parallel plans did not pay: priced with it they came out 1.11-1.50x of
    measured where the other plans were 0.90-1.17x (docs/planner.md), so it is not
    measured."""
    import os

    import torch.distributed as dist
    if device != "cpu":
        return 0.0
    cores = torch.tensor([len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                          else (os.cpu_count() or 1)])
    # one decision for every rank (ranks bound to different cores count differently; a rank
    # skipping the probe would leave the others in its barrier)
    dist.all_reduce(cores, op=dist.ReduceOp.MIN, group=group)
    if dist.get_world_size(group) <= int(cores):
        return 0.0
    a = torch.full((256, 256), 0.5, device=device)  # no draw from the user's generator
    x = torch.zeros(1, device=device)
    reps = 8

    def loop(matmuls: int, comm: bool) -> float:
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(reps):
            for _ in range(matmuls):
                a @ a
            if comm:
                dist.all_reduce(x, group=group)
        return (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    for _ in range(8):
        a @ a
    k = max(1, int(0.005 / max((time.perf_counter() - t0) / 8, 1e-7)))  # ~5 ms between
    # interleaved triples, each its own estimate (a burst lands on one triple)
    triples = [(loop(k, True), loop(k, False), loop(0, True)) for _ in range(_PAIRS)]
    # rank 0's figure is the link's (broadcast with it)
    return max(0.0, statistics.median(t - alone - idle for t, alone, idle in triples))


#: how links are timed; a cache written another way is measured again (2: functional
#: collectives allocating their output, as the step runs them; 3: with `corun`; 4: with
#: `wake_s`; 5: the host-sharing probes in interleaved pairs; 6: `corun_stream`; 7: `skew`;
#: 8: `skew` over 33 triples for one run (80a3d2a), then no `skew`)
_LINK_METHOD = 8


def _link_path(backend: str, ranks: int) -> Any:
    from glmc.analysis.calibration import cache_dir, machine_info
    cpu = re.sub(r"[^A-Za-z0-9]+", "-", str(machine_info()["cpu"]))[:40]
    return cache_dir() / f"link{_LINK_METHOD}-{backend}-{ranks}-{cpu}.json"


def _save_link(link: LinkProfile, backend: str, ranks: int) -> None:
    """Keep this host's measured link for the planner (`glmc plan --cluster local`)."""
    import json
    try:
        path = _link_path(backend, ranks)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"name": link.name, "latency_s": link.latency_s,
                                    "bandwidth": link.bandwidth, "source": link.source,
                                    "call_s": link.call_s, "kinds": link.kinds,
                                    "contention": link.contention,
                                    "progress": link.progress, "points": link.points,
                                    "corun": link.corun, "wake_s": link.wake_s,
                                    "corun_stream": link.corun_stream,
                                    "ranks": link.ranks,
                                    "date": time.strftime("%Y-%m-%d")}))
    except OSError:
        pass  # a read-only cache costs the planner its measured link, nothing else


def cached_link(backend: str, ranks: int) -> LinkProfile | None:
    """The link the last run of `ranks` local processes measured on this host, if any."""
    import json
    try:
        d = json.loads(_link_path(backend, ranks).read_text())
        return LinkProfile(d["name"], d["latency_s"], d["bandwidth"],
                           f"{d['source']}; cached {d['date']}", d.get("call_s", 0.0),
                           kinds=tuple(tuple(k) for k in d.get("kinds", ())),
                           points=tuple((k, tuple((int(b), float(t)) for b, t in pts))
                                        for k, pts in d.get("points", ())),
                           ranks=int(d.get("ranks", 0)), contention=d.get("contention", 0.0),
                           progress=d.get("progress", 1.0), corun=d.get("corun", 1.0),
                           corun_stream=tuple((int(b), float(f))
                                              for b, f in d.get("corun_stream", ())),
                           wake_s=d.get("wake_s", 0.0))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def measure_waits(run: Any) -> tuple[Any, float | None]:
    """`run()`'s result and the seconds it spent blocked in collective waits: the durations
    of `wait_tensor` calls, from the legacy (non-Kineto) profiler's CPU events — quiet, unlike
    Kineto's start/stop lines — or torch.profiler where that is unavailable. None where the
    user's own profiler runs on this thread (a second one cannot start: the step runs
    unmeasured)."""
    if torch.autograd._profiler_enabled():
        return run(), None
    try:
        from torch._C._profiler import _ExperimentalConfig
        from torch.autograd import (ProfilerConfig, ProfilerState, _disable_profiler_legacy,
                                    _enable_profiler_legacy)
    except ImportError:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = run()
        return out, sum(e.cpu_time_total for e in prof.key_averages()
                        if e.key.endswith("wait_tensor")) / 1e6
    config = ProfilerConfig(ProfilerState.CPU, False, False, False, False, False,
                            _ExperimentalConfig())
    _enable_profiler_legacy(config)
    try:
        out = run()
    finally:
        records = _disable_profiler_legacy()
    waited = 0.0
    for thread in records:
        stack: list[Any] = []  # pops carry no name: they close the latest push
        for e in thread:
            if e.kind() == "push":
                stack.append(e)
            elif e.kind() == "pop" and stack:
                push = stack.pop()
                if push.name().endswith("wait_tensor"):
                    waited += push.cpu_elapsed_us(e) / 1e6
    return out, waited


def count_wire_bytes(run: Any) -> tuple[Any, dict[str, int]]:
    """`run()`'s result and the bytes this rank handed to each kind of collective while it
    ran: the input tensors of torch's functional collectives, counted as they are called
    (inside `torch.cond` branches too, so only the branch taken counts)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = comm_ops()
    counted: dict[str, int] = {}

    class _Count(TorchDispatchMode):
        supports_higher_order_operators = True

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            if func is torch.ops.higher_order.cond:  # run the branch taken, still counting
                pred, on_true, on_false, operands = args
                with self:
                    return (on_true if bool(pred) else on_false)(*operands)
            if isinstance(func, torch._ops.HigherOrderOperator):
                return NotImplemented
            kind = ops.get(func)
            if kind is not None and kind != "wait_tensor" and isinstance(args[0], torch.Tensor):
                t = args[0]
                counted[kind] = counted.get(kind, 0) + t.numel() * t.element_size()
            return func(*args, **(kwargs or {}))

    with _Count():
        out = run()
    return out, counted


def has_comm(graph: TrainGraph) -> bool:
    ops = comm_ops()
    return any(n.target in ops for n in graph.compute_nodes())


# ---- topology: flat ring vs hierarchical all-reduce ------------------------------------------

@dataclass(frozen=True)
class AllReduceChoice:
    """The predicted time of one all-reduce of `nbytes` over `nodes` x `per_node` ranks, as one
    flat ring (its slowest link sets the pace: the inter-node one) and hierarchically:
    reduce-scatter inside each node, all-reduce of the 1/per_node shards across nodes,
    all-gather inside each node."""

    nbytes: int
    nodes: int
    per_node: int
    flat_seconds: float
    hierarchical_seconds: float
    parts: dict[str, float]  #: the hierarchical algorithm's three collectives

    @property
    def best(self) -> str:
        return "hierarchical" if self.hierarchical_seconds < self.flat_seconds else "flat"


def choose_allreduce(nbytes: int, nodes: int, per_node: int, intra: LinkProfile,
                     inter: LinkProfile) -> AllReduceChoice:
    n = nodes * per_node
    flat = collective_seconds("all_reduce", nbytes, n, inter if nodes > 1 else intra)
    parts = {"reduce_scatter (in node)": collective_seconds("reduce_scatter_tensor", nbytes,
                                                            per_node, intra),
             "all_reduce (across nodes)": collective_seconds("all_reduce", nbytes // per_node,
                                                             nodes, inter),
             "all_gather (in node)": collective_seconds("all_gather_into_tensor", nbytes,
                                                        per_node, intra)}
    return AllReduceChoice(nbytes, nodes, per_node, flat, sum(parts.values()), parts)


def comm_arguments(ap: Any) -> Any:
    """The options of `glmc comm` (cluster-scale all-reduce prediction) on parser `ap`."""
    ap.add_argument("--nodes", type=int, default=128)
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--params", type=float, default=10e9, help="parameters (gradient elements)")
    ap.add_argument("--bytes-per-param", type=int, default=2, help="2: bf16 gradients")
    ap.add_argument("--intra", default="nvlink4", choices=sorted(LINKS))
    ap.add_argument("--inter", default="infiniband-ndr", choices=sorted(LINKS))
    return ap


def predict_allreduce(a: Any) -> str:
    """`glmc comm`: one data-parallel gradient all-reduce per step at cluster scale, flat ring
    vs hierarchical (one NIC per GPU, as DGX-class nodes), with the formulas used."""
    out = []
    print = out.append  # noqa: A001 (the lines are returned)
    intra, inter = LINKS[a.intra], LINKS[a.inter]
    nbytes = int(a.params * a.bytes_per_param)
    c = choose_allreduce(nbytes, a.nodes, a.per_node, intra, inter)
    n = a.nodes * a.per_node
    print(f"all-reduce of {nbytes / 1e9:.1f} GB over {a.nodes} nodes x {a.per_node} = {n} ranks")
    for link in (intra, inter):
        print(f"  link {link.name}: alpha {link.latency_s * 1e6:.1f} us, beta "
              f"{link.bandwidth / 1e9:.1f} GB/s ({link.source})")
    print("  formulas: all_reduce 2(N-1) alpha + 2(N-1)/N B/beta; reduce_scatter and "
          "all_gather (N-1) alpha + (N-1)/N B/beta; + call per collective (0 for these links)")
    print(f"  flat ring over {n} ranks on {inter.name}: {c.flat_seconds:.3f} s")
    for name, t in c.parts.items():
        print(f"  hierarchical: {name}: {t:.3f} s")
    print(f"  hierarchical total: {c.hierarchical_seconds:.3f} s -> {c.best} "
          f"({max(c.flat_seconds, c.hierarchical_seconds) / min(c.flat_seconds, c.hierarchical_seconds):.1f}x)")
    return "\n".join(out)
