"""Pricing one parallel plan of a priced workload, and the search over all of them.

`evaluate(point, workload, cluster)` predicts a plan's step time (broken down), its per-device
peak memory (by category), throughput and FLOP/s; `search` enumerates the space (degrees that
divide the cluster, the layers and the batch; ZeRO stages; sequences per micro-batch;
schedules; recompute) and ranks the plans that fit by step time. The model of each term is in
`glmc.parallel.planner`'s docstring.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from glmc.analysis.comm import choose_allreduce, collective_seconds
from glmc.errors import ConfigError
from glmc.parallel.cluster import Cluster, DeviceKind, dtype_name
from glmc.parallel.planner import (_STATE, BUCKETS, MICROBATCHES, RECOMPUTE, SEARCHED_COMPRESS,
                                   Mix, PartCost, PlanPoint, Workload, _is_layer, as_mix)
from glmc.passes.partition import balanced_cut

_MB = 2**20


@dataclass(frozen=True)
class PricedPlan:
    point: PlanPoint
    step_s: float
    breakdown: dict[str, float]  #: seconds: compute, recompute, tp, p2p, bubble, dp, update
    memory: dict[str, int]  #: bytes on the busiest device, by category
    fits: bool
    tokens_per_s: float
    model_tflops: float  #: per device: forward + backward FLOPs / step time
    hardware_tflops: float  #: per device, recomputed forward work included
    mfu: float
    stage_parts: tuple[int, ...]  #: blocks per stage (first and last glue included)
    stage_devices: tuple[str, ...] = ()  #: each pipeline stage's device kind
    notes: tuple[str, ...] = ()  #: why it does not fit beyond device memory
    rank_peaks: tuple[int, ...] = ()  #: each pipeline rank's predicted peak bytes

    @property
    def peak_bytes(self) -> int:
        return sum(self.memory.values())

    @property
    def utilisation(self) -> float:
        """The share of the step a device computes (not idle in the bubble nor waiting on
        communication)."""
        busy = self.breakdown["compute"] + self.breakdown["recompute"] + \
            self.breakdown["update"]
        return busy / self.step_s if self.step_s else 0.0

    def describe(self) -> str:
        """The step's breakdown and the memory on the busiest device, one line each."""
        t = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.breakdown.items() if v)
        m = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in self.memory.items() if v)
        return (f"step {self.step_s * 1e3:.1f} ms ({t}); device busy {self.utilisation:.1%}\n"
                f"  memory per device {self.peak_bytes / 2**30:.2f} GiB ({m})"
                + "".join(f"\n  {note}" for note in self.notes))

    def to_dict(self) -> dict[str, Any]:
        return {"spelling": self.point.spelling(), "step_seconds": self.step_s,
                "tokens_per_second": self.tokens_per_s,
                "model_tflops_per_device": self.model_tflops,
                "hardware_tflops_per_device": self.hardware_tflops, "mfu": self.mfu,
                "peak_bytes_per_device": self.peak_bytes, "fits": self.fits,
                "utilisation": self.utilisation,
                "breakdown_seconds": dict(self.breakdown), "memory_bytes": dict(self.memory),
                "stage_blocks": list(self.stage_parts),
                "stage_devices": list(self.stage_devices),
                "rank_peak_bytes": list(self.rank_peaks),
                "runtime_gaps": self.point.runtime_gaps(), "notes": list(self.notes)}


# ---- one plan ----------------------------------------------------------------------------------

def evaluate(p: PlanPoint, work: Workload, cluster: Cluster, overlap: bool = True,
             cut: str | None = None, buckets: tuple[int, ...] = ()) -> PricedPlan:
    """Predict plan `p` of `work` on `cluster` (see glmc.parallel.planner). `overlap`: the
    data-parallel gradient synchronisation overlaps the last micro-batch's backward (glmc's
    runtime buckets it); False: it follows the backward (Megatron-LM of 2021). `cut`:
    "equal" prices an equal split of the layers over heterogeneous stages instead of the cut
    balanced on each stage's device. `buckets`: bucket sizes (MB) to try instead of
    `p.bucket` where they matter (data-parallel replicas, no pipeline); the fastest that
    fits is the plan's."""
    _check_point(p, work, cluster)
    devs = _stage_devices(p, cluster)
    m = work.sequences // (p.dp * p.microbatch)
    chunks, bounds = _chunks(p, work, devs, cut)
    if p.pp > 1:
        p = dataclasses.replace(p, cut=bounds)
    ranks = [[c for i, c in enumerate(chunks) if i % p.pp == r] for r in range(p.pp)]
    hows, targets, unmet = _recompute_mixes(p, ranks, chunks[-1], work, m, devs, cluster)
    per_rank = [_rank_costs(p, chunk_list, chunks[-1], devs[r], cluster, how)
                for r, (chunk_list, how) in enumerate(zip(ranks, hows))]
    bubble = _bubble(p, [sum(costs) for costs in per_rank])
    updates = [sum(c.update_s for ch in chunk_list for c in ch) / (p.dp if p.zero else 1)
               for chunk_list in ranks]
    slow, contention = _host_sharing(p, per_rank, updates, bubble, devs, ranks, m)
    dev = devs[0]
    dp_link = _ring_link(dev, p, cluster)
    comp, rec, tp, p2p = (m * x for x in per_rank[slow])
    window = comp + rec + p2p + bubble + updates[slow]
    stretch = (window + contention) / window if window else 1.0
    tried = []
    for bucket in _bucket_choices(p, buckets, overlap, ranks, work):
        q = dataclasses.replace(p, bucket=bucket)
        sync, update = _sync_and_update(q, ranks, hows, dp_link, work, m, overlap, cluster,
                                        dev, stretch)
        breakdown = {"compute": comp, "recompute": rec, "tp_comm": tp, "p2p": p2p,
                     "bubble": bubble, "contention": contention, **sync, "update": update}
        memories = [_memory(q, chunk_list, r, chunks[-1], work, m, how, _staging(devs[r]))
                    for r, (chunk_list, how) in enumerate(zip(ranks, hows))]
        fits = not unmet and all(  # a budget's mix met at p.bucket: this bucket may not
            sum(mem.values()) <= min(devs[r].memory_bytes, 1.001 * targets[r])
            for r, mem in enumerate(memories))
        memory = max(memories, key=lambda mem: sum(mem.values()))
        tried.append((not fits, sum(breakdown.values()), sum(memory.values()), bucket, q,
                      breakdown, memory, fits, tuple(sum(mem.values()) for mem in memories)))
    _, step, _, _, p, breakdown, memory, fits, rank_peaks = min(tried, key=lambda t: t[:4])
    tokens = work.sequences * work.tokens_per_sequence
    model = work.model_flops()
    hardware = model + work.layer_forward_flops(_mean_mix(ranks, hows))
    n = p.devices
    peak = sum(d.profile.peak(dtype_name(work.precision)) for d in devs) / len(devs)
    return PricedPlan(p, step, breakdown, memory, fits, tokens / step,
                      model / step / n / 1e12, hardware / step / n / 1e12,
                      model / step / n / peak, tuple(sum(len(ch) for ch in r) for r in ranks),
                      tuple(d.name for d in devs), tuple(
                          f"does not fit: recompute={p.recompute} allows rank {r} "
                          f"{target / 2**20:,.2f} MiB, below the least peak recompute reaches "
                          f"there, {least / 2**20:,.2f} MiB (the recompute pass refuses it)"
                          for r, target, least in unmet), rank_peaks)


def _rank_costs(p: PlanPoint, chunk_list: list, last: tuple, dev: DeviceKind,
                cluster: Cluster, how: str | Mix) -> tuple[float, float, float, float]:
    """One micro-batch on one pipeline rank under recompute `how`: compute, recompute (both
    at the device's full speed: `evaluate` adds what sharing a host's cores costs), tensor-
    parallel all-reduces (not overlapped; a fully recomputed layer's forward ones twice
    where it issues them again, `PartCost.keeps_collectives`) and
    sends/receives to the neighbouring stages; where the processes outnumber the cores each
    blocking one also waits `dev.wake_s` for a core."""
    b = p.microbatch
    pp_link = dev.intra if p.dp * p.tp * p.pp <= cluster.per_node else dev.inter
    comp = sum(b * (c.forward_s + c.backward_s) + c.overhead_s
               for ch in chunk_list for c in ch)
    rec = sum(b * per_seq + per_mb for ch in chunk_list for c in ch
              for per_seq, per_mb in (c.recompute(how),))
    tp_link = _spanning(dev, p.tp, cluster.per_node)
    again = dict(as_mix(how)).get("full", 0.0)
    tp = sum((collective_seconds("all_reduce", nbytes * b, p.tp, tp_link) + dev.wake_s)
             * (1 + again * c.collectives_again() * (phase == "forward"))
             for ch in chunk_list for c in ch for phase, nbytes in c.tp_bytes)
    p2p = 0.0
    for ch in chunk_list:  # each chunk but the model's last sends its output forward and
        if ch is not last:  # receives its gradient back, per micro-batch
            nbytes = ch[-1].out_bytes * b
            p2p += 2 * (pp_link.latency_s + dev.wake_s + nbytes / pp_link.bandwidth)
    return comp, rec, tp, p2p


def _host_sharing(p: PlanPoint, per_rank: list, updates: list[float], bubble: float,
                  devs: list[DeviceKind], ranks: list, m: int) -> tuple[int, float]:
    """The pipeline rank whose work sets the step (the longest per micro-batch, with what
    co-running costs it) and the seconds sharing a host adds to it (`contention`).
    Processes that outnumber the cores (`share` < 1) wait for one: the computing part of
    the step lasts at least as long as the host takes for every rank's busy time under fair
    sharing, though the schedule alone may leave cores idle (a pipeline's bubble frees them
    for the busy stages); a tensor-parallel group's all-reduces stop all of its ranks at
    once, so they absorb nothing. Processes computing at once slow each other (a VM's
    cores, caches, memory bandwidth: `DeviceKind.corun_extra`, op by op, so a stage
    streaming logits slows more than one of small layers) for the share of the step the
    ranks compute together (replicas all of it, a pipeline's stages less its bubble)."""
    busy = [m * (c + r) + u for (c, r, _, _), u in zip(per_rank, updates)]

    def window(r: int) -> float:
        comp, rec, _, p2p = per_rank[r]
        return m * (comp + rec + p2p) + bubble + updates[r]

    def together(r: int) -> float:
        return min(1.0, sum(busy) / len(busy) / window(r)) if window(r) else 0.0
    slow = max(range(p.pp), key=lambda r: sum(per_rank[r]))
    extra = [(0.0, 0.0)] * p.pp
    if p.devices > 1 and any(d.corun > 1 or d.corun_stream for d in devs):
        extra = [_corun_extras(p, chunk_list, devs[r], per_rank[r][1])
                 for r, chunk_list in enumerate(ranks)]
        t = together(slow)
        slow = max(range(p.pp), key=lambda r: sum(per_rank[r]) + t * extra[r][0])
    contention = 0.0
    share = min(d.share for d in devs)
    if share < 1:
        contention = max(0.0, _shared(busy * (p.dp * p.tp), p.devices * share) - window(slow))
    slower = m * extra[slow][0] + extra[slow][1]
    if slower:  # the cores' sharing is the rank's work too, slowed alike
        contention += together(slow) * slower * (1 + contention / busy[slow])
    return slow, contention


def _corun_extras(p: PlanPoint, chunk_list: list, dev: DeviceKind, rec_mb: float
                  ) -> tuple[float, float]:
    """(per micro-batch, per step) seconds one pipeline rank's work takes longer while the
    host's other processes compute too: its blocks' ops (`PartCost.corun_extra`), the
    recomputed forward as its forward slows, dispatch at the compute figure, the update."""
    blocks = [c for ch in chunk_list for c in ch]
    b = p.microbatch
    forward = sum(c.corun_extra(dev, "f", b) for c in blocks)
    forward_s = sum(b * c.forward_s for c in blocks)
    per_mb = (forward + sum(c.corun_extra(dev, "b", b) for c in blocks)
              + (rec_mb * forward / forward_s if forward_s else 0.0)
              + (dev.corun - 1) * sum(c.overhead_s for c in blocks))
    update = sum(c.corun_extra(dev, "u", 0) for c in blocks) / (p.dp if p.zero else 1)
    return per_mb, update


def _shared(busy: list[float], cores: float) -> float:
    """When processes with `busy` seconds of single-core work each, all started together,
    finish on `cores` cores shared fairly (the OS scheduler's processor sharing): while k run,
    each gets min(1, cores / k) of a core."""
    t = done = 0.0
    for i, w in enumerate(sorted(busy)):
        t += (w - done) / min(1.0, cores / (len(busy) - i))
        done = w
    return t


def _bubble(p: PlanPoint, per_mb: list[float]) -> float:
    """The pipeline's fill and drain on its slowest rank: one micro-batch through every other
    stage ((pp - 1) x its time where the stages are balanced), a third of that under ZB-H1
    (weight gradients fill it), 1/virtual interleaved."""
    if p.pp == 1:
        return 0.0
    scale = {"1f1b": 1.0, "gpipe": 1.0, "zbh1": 1 / 3, "interleaved": 1 / p.virtual}
    return scale[p.schedule] * (sum(per_mb) - max(per_mb))


def _stage_devices(p: PlanPoint, cluster: Cluster) -> list[DeviceKind]:
    """Each pipeline stage's device kind: ranks are numbered group by group, node by node,
    and a stage is dp x tp consecutive ranks."""
    if not cluster.heterogeneous:
        return [cluster.groups[0].device] * p.pp
    starts, at = [], 0
    for g in cluster.groups:
        starts.append((at, at + g.devices, g.device))
        at += g.devices
    per_stage = p.dp * p.tp
    out = []
    for s in range(p.pp):
        lo, hi = s * per_stage, (s + 1) * per_stage - 1
        kinds = {d.name: d for a, b, d in starts if a <= lo < b or a <= hi < b}
        if len(kinds) > 1:
            raise ConfigError(f"plan: pipeline stage {s} (ranks {lo}-{hi}) spans two device "
                              f"kinds ({', '.join(kinds)}); choose pp so that each stage's "
                              "dp x tp ranks lie in one group")
        out.append(next(iter(kinds.values())))
    return out


def _chunks(p: PlanPoint, work: Workload, devs: list[DeviceKind], cut: str | None
            ) -> tuple[tuple[tuple[PartCost, ...], ...], tuple[int, ...]]:
    """The model's blocks cut into pp x virtual chunks, each priced on its stage's device,
    and the cut in the plan's spelling (`PlanPoint.cut`; the point's own where it has one)."""
    chunks = p.pp * p.virtual
    if len({d.name for d in devs}) == 1:
        per_stage = [work.parts_on(devs[0].name, p.tp, p.pp > 1)] * chunks
    elif p.virtual > 1:
        raise ConfigError("plan: interleaved stages on a heterogeneous cluster are not "
                          "priced yet; use 1f1b, gpipe or zbh1")
    else:
        per_stage = [work.parts_on(d.name, p.tp) for d in devs]
    parts = per_stage[0]
    glue = int(bool(parts) and parts[0].name == "first")  # the spelling counts layers
    if p.cut:
        bounds = [b + glue for b in p.cut]
        if len(bounds) != chunks - 1 or not all(0 < b < len(parts) for b in bounds):
            raise ConfigError(
                f"plan: cut={'/'.join(map(str, p.cut))} does not cut {len(parts) - glue - 1} "
                f"layers and the glue around them into {chunks} non-empty stages: give "
                f"{chunks - 1} increasing starts from {1 - glue} to {len(parts) - glue - 1}")
    elif len(per_stage) == chunks and per_stage.count(parts) == chunks:
        bounds = _split(parts, chunks, _cut_mode(p), p.microbatch)
    elif cut == "equal":
        bounds = _equal_layers(parts, p.pp) or \
            list(balanced_cut([[1.0] * len(parts)] * p.pp, [0.0] * len(parts), p.pp))
    else:
        times = [[_seconds(c, _cut_mode(p), p.microbatch) for c in ps] for ps in per_stage]
        bounds = list(balanced_cut(times, [0.0] * len(parts), p.pp))
    edges = [0, *bounds, len(parts)]
    return (tuple(tuple(per_stage[s][i:j]) for s, (i, j) in enumerate(zip(edges, edges[1:]))),
            tuple(b - glue for b in bounds))


def _equal_layers(parts: tuple[PartCost, ...], chunks: int) -> list[int]:
    """Bounds that give every chunk the same number of identical layers (glue riding on the
    first and last), or [] where the layers do not divide."""
    layers = [i for i, c in enumerate(parts) if _is_layer(c) and c.name[6:].isdigit()]
    if chunks < 2 or not layers or len(layers) % chunks:
        return []
    per = len(layers) // chunks
    return [layers[0] + k * per for k in range(1, chunks)]


def _seconds(c: PartCost, recompute: str, b: int) -> float:
    """One micro-batch of `b` sequences through block `c` under recompute `recompute`."""
    per_seq, per_mb = c.recompute(recompute)
    return b * (c.forward_s + c.backward_s + per_seq) + c.overhead_s + per_mb


def _mean_mix(ranks: list, hows: list[str | Mix]) -> str | Mix:
    """The ranks' recompute over all layers: one mode where every rank has it, else each
    mode's share weighted by the layers each rank holds."""
    if len(set(hows)) == 1:
        return hows[0]
    layers = [sum(_is_layer(c) for ch in chunk_list for c in ch) for chunk_list in ranks]
    shares: dict[str, float] = {}
    for n, how in zip(layers, hows):
        for mode, w in as_mix(how):
            shares[mode] = shares.get(mode, 0.0) + w * n / max(1, sum(layers))
    return tuple(shares.items())


def persistent_bytes(memory: dict[str, int]) -> int:
    """What a plan's device holds all step (`_memory`'s categories): parameters, optimizer
    state and compression residuals — what the recompute pass counts as persistent."""
    return memory["parameters"] + memory["optimizer"] + memory.get("compression", 0)


def _cut_mode(p: PlanPoint) -> str:
    """The recompute mode the stages are cut for: the plan's, or under a memory budget
    (resolved per rank after the cut) none."""
    return p.recompute if p.recompute in RECOMPUTE else "none"


def _recompute_mixes(p: PlanPoint, ranks: list, last: tuple, work: Workload, m: int,
                     devs: list[DeviceKind], cluster: Cluster
                     ) -> tuple[list[str | Mix], list[float], list[tuple[int, float, int]]]:
    """Each pipeline rank's recompute: the plan's mode (none, selective, full: the recompute
    pass's rules, which it runs as they are); or under a memory budget (the recompute pass's
    spelling, `Budget`) the cheapest mix of none, selective and full that meets the budget's
    peak on that rank — on the lower hull of the three modes' (peak, recompute seconds)
    points (a fully recomputed layer's forward all-reduces counted twice where it issues
    them again).
    A share of the activations and +bytes count from the rank's parameters and optimizer
    state, what the pass counts as persistent (a pipeline stage's +bytes also from its
    gradients, as `glmc.parallel.pipeline.stage_budgets` does). Also returns each rank's
    target (bytes; inf without a budget) and (rank, target, least peak) where the budget is
    below the least peak recompute reaches (priced at that least; the pass refuses such a
    budget, so the plan does not fit)."""
    if p.recompute in RECOMPUTE:
        return [p.recompute] * len(ranks), [math.inf] * len(ranks), []
    from glmc.passes.recompute import Budget
    budget = Budget.parse(p.recompute)
    out: list[str | Mix] = []
    targets: list[float] = []
    unmet: list[tuple[int, float, int]] = []
    for r, chunk_list in enumerate(ranks):
        points = []
        for mode in RECOMPUTE:
            mem = _memory(p, chunk_list, r, last, work, m, mode, _staging(devs[r]))
            _, rec, tp, _ = _rank_costs(p, chunk_list, last, devs[r], cluster, mode)
            points.append((sum(mem.values()), m * (rec + tp), mode, mem))

        def peak(how: str | Mix, r: int = r, chunk_list: list = chunk_list) -> int:
            return sum(_memory(p, chunk_list, r, last, work, m, how,
                               _staging(devs[r])).values())
        least = min(pt[0] for pt in points)
        none = points[0][3]
        target = budget.target(sum(none.values()), persistent_bytes(none) + (
            none["gradients"] if budget.kind == "above" and p.pp > 1 else 0))
        out.append(_hull_mix([pt[:3] for pt in points], max(target, least), peak))
        targets.append(target)
        if target < least:
            unmet.append((r, target, least))
        elif budget.kind == "fraction" and len(chunk_list) > 1:  # the pass takes its share
            unmet += _stage_shares(p, chunk_list, r, last, work, m, budget,  # stage by stage
                                   _staging(devs[r]))
    return out, targets, unmet


def _stage_shares(p: PlanPoint, chunk_list: list, rank: int, last: tuple, work: Workload,
                  m: int, budget: Any, staged: bool) -> list[tuple[int, float, int]]:
    """(rank, target, least peak) for each of an interleaved rank's stages whose own share
    of its activations recompute cannot reach (a stage of the head alone recomputes
    nothing): the runtime applies a fraction to every stage (`stage_budgets`)."""
    out = []
    for ch in chunk_list:
        mems = [_memory(p, [ch], rank, last, work, m, mode, staged) for mode in RECOMPUTE]
        target = budget.target(sum(mems[0].values()), persistent_bytes(mems[0]))
        least = min(sum(mem.values()) for mem in mems)
        if target < least:
            out.append((rank, target, least))
    return out


def _hull_mix(points: list[tuple[int, float, str]], target: float,
              peak: Callable[[str | Mix], int] | None = None) -> str | Mix:
    """The mix of recompute modes at peak `target` on the lower convex hull of the modes'
    (peak bytes, recompute seconds) `points`: the two hull points either side of it in
    proportion, the one with the most memory where it is under target, the least where
    none reaches it. `peak`: a mix's true peak — where the rank's peak is not its
    activations alone (the update, the head's logits) the peak falls faster than the
    proportion along the segment, so the least share of the costlier mode that meets
    `target` is searched (the recompute pass stops making values again there too)."""
    hull: list[tuple[int, float, str]] = []
    for pt in sorted(points, key=lambda x: (-x[0], x[1])):  # most memory first
        if hull and pt[0] == hull[-1][0]:  # as much memory, no less time
            continue
        while hull and pt[1] <= hull[-1][1]:  # as cheap with less memory: it dominates
            hull.pop()
        while len(hull) >= 2:  # the last hull point lies on or above the chord: not convex
            (ma, ta, _), (mb, tb, _) = hull[-2], hull[-1]
            if tb < ta + (pt[1] - ta) * (ma - mb) / (ma - pt[0]):
                break
            hull.pop()
        hull.append(pt)
    if target >= hull[0][0]:
        return hull[0][2]
    for (ma, _, a), (mb, _, b) in zip(hull, hull[1:]):
        if mb <= target:
            w = (ma - target) / (ma - mb)
            if peak is not None:
                w = _least_share(a, b, w, target, peak)
            return b if w >= 1.0 else ((a, 1.0 - w), (b, w))
    return hull[-1][2]


def _least_share(a: str, b: str, w: float, target: float,
                 peak: Callable[[str | Mix], int]) -> float:
    """The least share of mode `b` (mixed with `a`, at most `w`) whose peak meets `target`
    (the peak falls as the share grows), to 0.1%."""
    less = w - 1e-3
    if less <= 0 or peak(((a, 1.0 - less), (b, less))) > target:
        return w  # the proportion is as good as it gets
    lo, hi = 0.0, w
    for _ in range(10):
        mid = (lo + hi) / 2
        if peak(((a, 1.0 - mid), (b, mid))) <= target:
            hi = mid
        else:
            lo = mid
    return hi


def _slowest(cluster: Cluster) -> DeviceKind:
    return min((g.device for g in cluster.groups),
               key=lambda d: d.profile.peak(d.torch_dtype))


def _check_point(p: PlanPoint, work: Workload, cluster: Cluster) -> None:
    if p.devices != cluster.devices:
        raise ConfigError(f"plan: dp x tp x pp = {p.dp} x {p.tp} x {p.pp} = {p.devices} "
                          f"devices, but the cluster {cluster.spelling()} has {cluster.devices}")
    if p.tp not in work.parts:
        why = work.tp_errors.get(p.tp, f"tp={p.tp} was not priced")
        raise ConfigError(f"plan: tp={p.tp} cannot shard this model: {why}")
    if p.tp > cluster.per_node and p.tp % cluster.per_node:
        raise ConfigError(f"plan: tp={p.tp} spans nodes of {cluster.per_node} devices "
                          "unevenly; use a multiple of the devices per node, or at most "
                          f"{cluster.per_node}")
    if work.sequences % (p.dp * p.microbatch):
        raise ConfigError(f"plan: the global batch of {work.sequences} sequences does not "
                          f"split into dp={p.dp} x microbatch={p.microbatch}")
    if (p.schedule == "interleaved") != (p.virtual > 1) and p.pp > 1:
        raise ConfigError("plan: virtual > 1 goes with schedule=interleaved, and only there")
    blocks = len(work.parts[p.tp])
    if p.pp * p.virtual > blocks:
        raise ConfigError(f"plan: pp={p.pp} x virtual={p.virtual} stages need as many blocks; "
                          f"the model has {blocks}")


@functools.lru_cache(maxsize=512)
def _split(parts: tuple[PartCost, ...], chunks: int, recompute: str, b: int
           ) -> tuple[int, ...]:
    """The bounds of contiguous chunks: identical layers evenly (the glue before and after
    rides on the first and last chunk, as Megatron-LM places embedding and head) where that
    is within 5% of balanced; otherwise the cut `passes.partition.balanced_cut` finds for
    the predicted times (e.g. fewer layers beside a large LM head)."""
    def seconds(c: PartCost) -> float:
        return _seconds(c, recompute, b)
    bounds = _equal_layers(parts, chunks)
    if bounds:
        per_chunk = [sum(seconds(c) for c in parts[i:j])
                     for i, j in zip([0, *bounds], [*bounds, len(parts)])]
        if max(per_chunk) > 1.05 * sum(per_chunk) / chunks:
            bounds = []
    if chunks > 1 and not bounds:
        times = [[seconds(c) for c in parts]] * chunks
        bounds = list(balanced_cut(times, [0.0] * len(parts), chunks))
    return tuple(bounds)


def _bucket_choices(p: PlanPoint, buckets: tuple[int, ...], overlap: bool, ranks: list,
                    work: Workload) -> tuple[int, ...]:
    """The bucket sizes (MB) worth pricing for `p`: several only where the bucket changes
    something — data-parallel replicas without a pipeline, synchronised bucket by bucket
    (overlapped) or holding a bucket whole (ZeRO 2-3) — and of those only the ones below the
    busiest rank's gradient bytes and the first that holds them all (the larger ones cut the
    same single bucket)."""
    if not buckets or p.dp == 1 or p.pp > 1 or (not overlap and p.zero < 2):
        return (p.bucket,)
    _, gb, _ = _STATE[work.precision]
    total = max(sum(c.params for ch in chunk_list for c in ch) for chunk_list in ranks) * gb
    sizes = sorted(buckets)
    holding = [b for b in sizes if b * _MB >= total][:1]
    return tuple(b for b in sizes if b * _MB < total) + tuple(holding)


def _ring_link(dev: DeviceKind, p: PlanPoint, cluster: Cluster) -> Any:
    """The link of a data-parallel ring (its ranks `cluster.per_node // tp` to a node)."""
    return _spanning(dev, p.dp, max(1, cluster.per_node // p.tp))


def _spanning(dev: DeviceKind, ranks: int, per_node: int) -> Any:
    """The link of a ring of `ranks`, `per_node` of them to a node: inside a node, the
    node's; spanning nodes, NCCL's ring crosses each node boundary once, so of its ranks - 1
    steps one per node pays the inter-node latency and the others the intra-node one, at the
    inter-node bandwidth (one NIC per device, as DGX-class nodes)."""
    if ranks <= per_node:
        return dev.intra
    nodes = -(-ranks // per_node)
    latency = (nodes * dev.inter.latency_s + (ranks - nodes) * dev.intra.latency_s) / \
        max(1, ranks - 1)
    return dataclasses.replace(dev.inter, name=f"{dev.inter.name} ring over {nodes} nodes",
                               latency_s=latency)


def _all_reduce(nbytes: int, p: PlanPoint, link: Any, cluster: Cluster) -> float:
    """A data-parallel all-reduce: one ring (`_ring_link`), or where the group spans nodes
    the faster of the ring and the hierarchical one (inside each node, across, inside
    again)."""
    flat = collective_seconds("all_reduce", nbytes, p.dp, link)
    if p.dp * p.tp <= cluster.per_node:
        return flat
    per_node = max(1, cluster.per_node // p.tp)
    dev = _slowest(cluster)
    c = choose_allreduce(nbytes, p.dp // per_node, per_node, dev.intra, dev.inter)
    return min(flat, c.hierarchical_seconds)


def _sync_and_update(p: PlanPoint, ranks: list, hows: list, link: Any, work: Workload, m: int,
                     overlap: bool, cluster: Cluster, dev: DeviceKind,
                     stretch: float = 1.0) -> tuple[dict[str, float], float]:
    """Exposed data-parallel synchronisation (by collective kind: what the rank waits for),
    the compute its overlapped collectives slow (`comm_contention`, where they share the
    cores: gloo), the compression's own ops (`compress`) and the update (fp16's loss
    scaling included), on the rank where they take longest. `stretch`: how much sharing the
    cores lengthens the compute that hides the synchronisation."""
    worst: tuple[float, dict[str, float], float] = (-1.0, {}, 0.0)
    pb, gb, _ = _STATE[work.precision]
    wire, traffic, gathers = _compression(p, gb)
    seen = set()  # ranks whose blocks cost alike (a pipeline's middle stages) give one answer
    for chunk_list, how in zip(ranks, hows):
        blocks = [c for ch in chunk_list for c in ch]
        alike = (how, *((_is_layer(c), c.forward_s, c.backward_s, c.overhead_s, c.update_s,
                         c.params, c.selective_s, c.selective_overhead_s) for c in blocks))
        if alike in seen:
            continue
        seen.add(alike)
        kinds: dict[str, float] = {}
        overlapped = squeeze = 0.0
        if p.dp > 1:
            kind = "all_reduce" if p.zero <= 1 else "reduce_scatter"  # stage 1 all-reduces too
            kind = "all_gather" if gathers else kind

            @functools.lru_cache(maxsize=None)  # buckets but the last are one size
            def seconds(nbytes: int, kind: str = kind) -> float:
                sent = int(nbytes * wire / gb)  # a bucket of dense gradients, compressed
                if kind == "all_reduce":
                    return _all_reduce(sent, p, link, cluster)
                if kind == "all_gather":  # every rank's compressed bucket, to every rank
                    return collective_seconds("all_gather_into_tensor", sent * p.dp, p.dp,
                                              link)
                return collective_seconds(f"{kind}_tensor", sent, p.dp, link)

            def packing(nbytes: int) -> float:  # the compress pass's ops on one bucket
                return stretch * traffic * (nbytes / gb) / dev.profile.bandwidth_at(nbytes) \
                    if traffic else 0.0
            # the last micro-batch's backward produces the buckets, in reverse block order,
            # each compressed (where asked) before its collective; without overlap, one
            # collective on all gradients after it (Megatron-LM's contiguous buffer of 2021)
            times = [stretch * _backward_s(c, p, how) for c in reversed(blocks)]
            done = list(itertools.accumulate(times))  # backward seconds when block i is done
            jobs = []
            for i, nbytes, count in (
                    _bucket_runs([c.params for c in reversed(blocks)], gb, int(p.bucket * _MB))
                    if overlap else [(len(blocks) - 1, sum(c.params for c in blocks) * gb, 1)]):
                pack = packing(nbytes)
                jobs.append((done[i] + squeeze + pack, seconds(nbytes), count, pack))
                squeeze += count * pack
            kinds[kind], overlapped = _drain(jobs, sum(times) + squeeze, link.progress)
            gather = 0.0
            if p.zero == 3:  # each bucket's parameters gathered before its forward and its
                for phase in ("forward", "backward"):  # backward, the next one prefetched
                    order = blocks if phase == "forward" else blocks[::-1]
                    gather += m * _prefetched(order, p, link, phase, stretch, pb)
            elif p.zero:  # after the update: the new parameters all-gathered, exposed
                gather = collective_seconds("all_gather_into_tensor",
                                            sum(c.params for c in blocks) * pb, p.dp, link)
            if gather:
                kinds["all_gather"] = gather
            if dev.wake_s:  # each collective waited for, once more for a core
                waits = sum(job[2] for job in jobs) + (2 * m * sum(
                    run[2] for run in _bucket_runs([c.params for c in blocks], pb,
                                                   int(p.bucket * _MB))) if p.zero == 3
                    else int(p.zero > 0))
                kinds["wake"] = dev.wake_s * waits
        kinds = {f"dp_{k}": v for k, v in kinds.items()}
        if link.contention and overlapped:
            kinds["comm_contention"] = link.contention * overlapped
        if squeeze:
            kinds["compress"] = squeeze
        update = sum(c.update_s for c in blocks) / (p.dp if p.zero else 1)
        if p.precision == "fp16":  # loss scaling: the overflow check reads every gradient
            grads = sum(c.params for c in blocks) * gb // (p.dp if p.zero >= 2 else 1)
            update += grads / dev.profile.bandwidth_at(grads) + dev.profile.op_overhead_s
        if sum(kinds.values()) + update > worst[0]:
            worst = (sum(kinds.values()) + update, kinds, update)
    return worst[1], worst[2]


def _compression(p: PlanPoint, gb: int) -> tuple[float, float, bool]:
    """Per dense gradient element (`gb` bytes): the bytes compression `p.compress` sends, the
    bytes its ops move in memory (`passes.compress`: error feedback's add and residual, the
    cast or the packing, and back), and whether its collective is an all-gather (sign: the
    ranks' packed signs and scales, unpacked and summed by each)."""
    if p.compress == "none" or p.dp == 1:
        return float(gb), 0.0, False
    if p.compress in ("bf16", "fp16"):  # e = g + r (12), e -> 16 bits (6), r = e - low (10),
        return 2.0, 34.0, False  # low -> fp32 after the all-reduce (6)
    if p.compress == "sign":  # e = g + r (12), |e| mean and packed signs (4 + 4), r (8);
        return 1 / 8, 28.0 + 12.0 * p.dp, True  # each rank's signs unpacked, scaled, summed
    raise ConfigError(f"plan: compress={p.compress} is not priced yet (its wire size depends "
                      "on each matrix's shape or the top-k ratio, which the plan's blocks do "
                      "not carry); price none, bf16, fp16 or sign")


def _backward_s(c: PartCost, p: PlanPoint, how: str | Mix) -> float:
    """One micro-batch's backward through block `c` (what it recomputes under `how`
    included)."""
    per_seq, per_mb = c.recompute(how)
    return p.microbatch * (c.backward_s + per_seq) + c.overhead_s * 2 / 3 + per_mb


def _buckets(params: list[int], elem: int, cap: int) -> Iterator[tuple[int, int]]:
    """(index of the block that closes it, bytes) of each ZeRO bucket (`cap` bytes at most,
    at least one block; a block larger than a bucket fills several) over blocks of `params`
    elements of `elem` bytes, in the order they are reduced or gathered."""
    for i, nbytes, count in _bucket_runs(params, elem, cap):
        yield from itertools.repeat((i, nbytes), count)


def _bucket_runs(params: list[int], elem: int, cap: int) -> Iterator[tuple[int, int, int]]:
    """`_buckets` as runs: (block index, bytes, how many such buckets in a row) — a block
    larger than a bucket (a 175B model's layer in 25 MB buckets: ~120) is one run."""
    held = 0
    for i, n in enumerate(params):
        n *= elem
        if held and held + n > cap:
            yield i - 1, held, 1
            held = 0
        if n > cap:  # whole buckets while more than one is left
            yield i, cap, (n - 1) // cap
            n -= cap * ((n - 1) // cap)
        held += n
    if held:
        yield len(params) - 1, held, 1


def _drain(jobs: list[tuple[float, float, int, float]], window: float, progress: float
           ) -> tuple[float, float]:
    """Collectives `jobs` on one link while `window` seconds of compute run: runs of `count`
    alike collectives ((the first ready at, seconds alone, count, seconds between their
    readiness), in issue order), one at a time, each at `progress` of its own speed beside the
    compute (the cores it shares) and at full speed after it. Returns (seconds the rank waits
    past the window, seconds a collective ran beside the compute)."""
    t = beside = 0.0
    for first, alone, count, gap in jobs:
        # each of a run ready no later than the one ahead of it is done: back to back, one job
        runs = [(first, alone * count)] if gap <= alone else \
            [(first + k * gap, alone) for k in range(count)]
        for ready, seconds in runs:
            t = max(t, ready)
            if t < window:
                during = min(window - t, seconds / progress)
                beside += during
                t += during + (seconds - during * progress)
            else:
                t += seconds
    return max(0.0, t - window), beside


def _prefetched(order: list[PartCost], p: PlanPoint, link: Any, phase: str,
                stretch: float, elem: int) -> float:
    """Exposed ZeRO-3 all-gathers of one pass over `order`: the first bucket's whole, each
    later one beyond what the previous bucket's compute hides (at the link's `progress`)."""
    exposed, prev = 0.0, None
    gather = functools.lru_cache(maxsize=None)(
        lambda nbytes: collective_seconds("all_gather_into_tensor", nbytes, p.dp, link))
    for i, nbytes, count in _bucket_runs([c.params for c in order], elem, int(p.bucket * _MB)):
        g = gather(nbytes)
        hidden = 0.0 if prev is None else link.progress * stretch * sum(
            p.microbatch * (c.forward_s if phase == "forward" else c.backward_s)
            for c in order[prev + 1:i + 1])
        exposed += max(0.0, g - hidden) + (count - 1) * g  # a run's later ones: nothing between
        prev = i
    return exposed


def _staging(dev: DeviceKind) -> bool:
    """Whether its collectives stage their buffers: gloo (CPU) copies a reduce-scatter's
    input and an all-gather's output (`glmc.analysis.opcost._comm_staging`); NCCL does not."""
    return dev.profile.kind == "cpu"


def _memory(p: PlanPoint, chunk_list: list, rank: int, last: tuple, work: Workload, m: int,
            how: str | Mix, staged: bool = False) -> dict[str, int]:
    """Bytes on a device of pipeline rank `rank` at its busiest moment, by category: the
    state by precision and ZeRO stage, and the most of (a) the activations of the
    micro-batches in flight with one block at its own peak (`PartCost.peak`, forward
    or backward; under full recompute a layer keeps only its output and comes back whole in
    its backward, under selective what `PartCost.kept` says) and the gradients by then,
    (b) the update's transient, or (c) with gradient compression, a bucket's compression
    beside the gradients. `staged`: an all-gather in flight holds a copy of its output
    (gloo). ZB-H1 also keeps what a micro-batch's W reads from its I (`PartCost.stash_bytes`;
    recomputed, the forward values too) for the micro-batches waiting for their W. The
    model's last chunk (head and loss) starts its backward right after its forward: one
    micro-batch in flight."""
    pb, gb, ob = _STATE[work.precision]
    params = sum(c.params for ch in chunk_list for c in ch)
    flight = _in_flight(p, rank, m)

    held_by = {id(c): c.held(how, p.microbatch) for ch in chunk_list for c in ch}

    def kept(c: PartCost) -> int:  # one micro-batch's
        return held_by[id(c)]
    held = sum((1 if ch is last and p.schedule in ("1f1b", "interleaved") else flight) * kept(c)
               for ch in chunk_list for c in ch)
    waiting = _waiting_w(p, rank, m)  # past their I, waiting for their W
    # past its I: what it saved (recomputed: at least the forward values W reads) and I's
    # values W reads, to the W (the runtime's I frees none of the saved values); the first
    # stage hands no gradient on: its backward is all W
    swap = sum(p.microbatch * c.stash_bytes + max(0, p.microbatch * c.stash_forward - kept(c))
               for ch in chunk_list for c in ch) if rank else 0
    grad_shard = p.dp if p.zero >= 2 else 1
    accumulating = m > 1  # earlier micro-batches' gradients are held
    # glmc's ZeRO buckets (passes.shard): stage 3 holds a bucket of whole parameters and
    # prefetches the next; stages 2-3 reduce-scatter each bucket of whole gradients; after a
    # stage 1-2 update the new parameters are all-gathered whole
    bucket = int(p.bucket * _MB) if p.dp > 1 else 0
    gathered = min(2 * bucket, params * pb) + staged * min(bucket, params * pb) \
        if p.zero == 3 else 0
    unsharded = min(bucket, params * gb) if p.zero >= 2 else 0
    all_grads = params * gb // grad_shard + unsharded  # every gradient made, one bucket whole
    best = (-1, 0, 0, 0)  # (total, activations, working, gradients)
    for ch in chunk_list:
        after = 0  # this micro-batch's values the chunk's later blocks saved
        grads_after = 0
        for c in reversed(ch):
            grads_after += c.params * gb
            acts = held - after - kept(c) + max(0, waiting - 1) * swap
            work_set = c.peak(p.microbatch) + gathered
            if accumulating:
                grads = all_grads
            else:  # the backward so far: buckets reduce-scattered but the one filling
                whole = min(unsharded, grads_after)
                grads = (grads_after - whole) // grad_shard + whole
            if acts + work_set + grads > best[0]:
                best = (acts + work_set + grads, acts, work_set, grads)
            after += kept(c)
    if waiting:  # between actions: every micro-batch held, `waiting` of them past their I
        quiet = held + waiting * swap
        if quiet + all_grads > best[0]:
            best = (quiet + all_grads, quiet, 0, all_grads)
    update = sum(c.update_bytes for ch in chunk_list for c in ch) // (p.dp if p.zero else 1)
    if p.zero in (1, 2) and p.dp > 1:
        update += params * pb
    grads = params * gb // grad_shard
    if update + grads > best[0]:
        best = (update + grads, 0, update, grads)
    if p.compress != "none" and p.dp > 1:  # compressing a bucket (passes.compress): e = g + r,
        # what was sent, and the new residual, fp32 each, beside the old residual and the
        # gradients (measured for bf16; the other methods' transients priced alike)
        squeeze = 3 * 4 * min(bucket, params * gb) // gb
        if grads + squeeze > best[0]:
            best = (grads + squeeze, 0, squeeze, grads)
    out = {"parameters": params * pb // (p.dp if p.zero == 3 else 1),
           "gradients": best[3],
           "optimizer": params * ob // (p.dp if p.zero >= 1 else 1),
           "activations": best[1],
           "working": best[2]}
    if p.compress != "none" and p.dp > 1:  # error feedback: each bucket's fp32 residual
        out["compression"] = params * 4
    return out


def _waiting_w(p: PlanPoint, rank: int, m: int) -> int:
    """Micro-batches rank `rank` holds between their I and their W at most: torch's ZB-H1
    order (the runtime's) defers up to rank + 1 of them, at its busiest moment (0 for the
    schedules without a split backward)."""
    return min(m, rank + 1) if p.schedule == "zbh1" and p.pp > 1 else 0


def _in_flight(p: PlanPoint, rank: int, m: int) -> float:
    """Micro-batches whose activations rank `rank` holds at once."""
    if p.pp == 1:
        return 1
    if p.schedule == "gpipe":
        return m
    if p.schedule == "interleaved":  # Megatron-LM: pp (1 + (pp - 1) / (pp v)) on rank 0
        return min(m, p.pp - rank + (p.pp - 1) / p.virtual)
    if p.schedule == "zbh1":  # torch's ZB-H1 order (the runtime's): every rank, the last
        return min(m, p.pp)  # too, keeps up to pp micro-batches' values until their W
    return min(m, p.pp - rank)


# ---- the search --------------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def points(work: Workload, cluster: Cluster, fixed: dict[str, Any] | None = None
           ) -> Iterator[PlanPoint]:
    """Every plan of the space that `fixed` (a partial spelling) allows."""
    fixed = fixed or {}
    n = cluster.devices
    blocks = {t: len(parts) for t, parts in work.parts.items()}
    compress = (fixed["compress"],) if "compress" in fixed else SEARCHED_COMPRESS
    for tp in sorted(work.parts):  # a tensor-parallel group across nodes only where fixed
        if n % tp or (tp > cluster.per_node and fixed.get("tp") != tp):
            continue
        for pp in _divisors(n // tp):
            dp = n // (tp * pp)
            if pp > max(1, work.layers or blocks[tp]) or not _aligned(cluster, pp, dp * tp):
                continue
            if work.sequences % dp:
                continue
            for b in sorted(set(MICROBATCHES) | {work.sequences // dp}):
                if (work.sequences // dp) % b:
                    continue
                m = work.sequences // (dp * b)
                for schedule, virtual in _schedules(pp, m, work.layers or blocks[tp]):
                    if virtual > 1 and cluster.heterogeneous:
                        continue
                    for zero in ((0, 1) if pp > 1 else (0, 1, 2, 3)) if dp > 1 else (0,):
                        for rec, squeeze in itertools.product(
                                (fixed["recompute"],) if "recompute" in fixed else RECOMPUTE,
                                compress if dp > 1 and (pp == 1 or "compress" in fixed)
                                else ("none",)):
                            pt = PlanPoint(dp, tp, pp, zero, b, schedule, virtual, rec,
                                           work.precision,
                                           fixed.get("bucket", PlanPoint.bucket), squeeze,
                                           fixed.get("cut", ()) if pp > 1 else ())
                            if all(getattr(pt, k) == v for k, v in fixed.items()):
                                yield pt


def _aligned(cluster: Cluster, pp: int, per_stage: int) -> bool:
    """On a heterogeneous cluster every stage lies in one group of devices."""
    if not cluster.heterogeneous:
        return True
    return pp > 1 and all(g.devices % per_stage == 0 for g in cluster.groups)


def _schedules(pp: int, m: int, layers: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1), ("zbh1", 1)]
    for v in range(2, 9):
        if layers % (pp * v) == 0 and m % pp == 0:
            out.append(("interleaved", v))
    return out


def search(work: Workload | list[Workload], cluster: Cluster,
           fixed: dict[str, Any] | None = None, overlap: bool = True) -> list[PricedPlan]:
    """Every allowed plan priced, those that fit first, each group by step time. `work`: the
    step priced at one precision, or at each the search may choose (`price_precisions`;
    `Workload.recomputing_collectives` for Megatron-LM's full recompute)."""
    fixed = dict(fixed or {})
    works = work if isinstance(work, list) else [work]
    priced_at = ", ".join(w.precision for w in works)
    if "precision" in fixed:
        works = [w for w in works if w.precision == fixed["precision"]]
        if not works:
            raise ConfigError(f"plan: the workload was priced at {priced_at}; price it at "
                              f"{fixed['precision']} (precision=...) to plan that")
    if len(works) > 1:
        return sorted((p for w in works for p in search(w, cluster, fixed, overlap)),
                      key=lambda r: (not r.fits, r.step_s, r.peak_bytes))
    work = works[0]
    if fixed.get("tp", 0) > cluster.per_node:
        import warnings
        warnings.warn(f"glmc plan: tp={fixed['tp']} spans nodes of {cluster.per_node} devices: "
                      "its all-reduces, on the critical path, cross the inter-node link "
                      "(priced so: expect it slow; keep tp within a node)", stacklevel=3)
    buckets = () if "bucket" in fixed else BUCKETS
    priced = [evaluate(pt, work, cluster, overlap, buckets=buckets)
              for pt in _fixed_points(work, cluster, fixed)]
    if not priced:
        why = "".join(f"; tp={t}: {e}" for t, e in sorted(work.tp_errors.items()))
        raise ConfigError(f"plan: no plan of {cluster.devices} devices matches "
                          f"{_spell(fixed) or 'the search space'} for a global batch of "
                          f"{work.sequences} sequences and tp in {sorted(work.parts)}{why}")
    return sorted(priced, key=lambda r: (not r.fits, r.step_s, r.peak_bytes))


def _fixed_points(work: Workload, cluster: Cluster, fixed: dict[str, Any]
                  ) -> list[PlanPoint]:
    """`points`, plus the exact plan `fixed` spells where it is outside the search space
    (ZeRO-2/3 with pipelining, GPipe, more virtual stages): --fix prices any of them."""
    found = list(points(work, cluster, fixed))
    if not found and set(fixed) >= {"dp", "tp", "pp", "microbatch"}:
        defaults = {"zero": 0, "schedule": "1f1b", "virtual": 1, "recompute": "none",
                    "precision": work.precision, "compress": "none"}
        pt = PlanPoint(**{**defaults, **fixed})
        evaluate(pt, work, cluster)  # raises a typed error where the plan is impossible
        found = [pt]
    return found


def _spell(fixed: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in fixed.items())


def explain(plans: list[PricedPlan], top: int = 3) -> list[str]:
    """Why the first plan beats the next ones: the terms where they differ most."""
    if not plans:
        return []
    best = plans[0]
    lines = []
    for other in plans[1:top + 1]:
        diffs = {k: other.breakdown.get(k, 0.0) - best.breakdown.get(k, 0.0)
                 for k in set(best.breakdown) | set(other.breakdown)}
        worst = sorted(diffs.items(), key=lambda kv: -abs(kv[1]))[:2]
        terms = ", ".join(f"{k} {v * 1e3:+.1f} ms" for k, v in worst)
        lines.append(f"{other.point.spelling()}: {other.step_s / best.step_s:.3f}x the step "
                     f"time ({terms})" + ("" if other.fits else "; does not fit"))
    return lines
