"""Cluster descriptions for the planner: which devices, how many per node, and the links.

A cluster is spelled `NODESxPER_NODE:DEVICE`, groups joined by `+` for heterogeneous clusters:

    >>> Cluster.parse("128x8:a100-80g").devices
    1024
    >>> [g.device.name for g in Cluster.parse("2x8:h100-80g+2x8:a100-40g").groups]
    ['h100-80g', 'a100-40g']

Each `DeviceKind` carries a compute profile (`glmc.analysis.profiles`: achievable matmul and
bandwidth figures, each with its source), the memory a rank may use, and the default links inside
and between nodes (`glmc.analysis.comm.LINKS`, overridable as in `glmc comm`). `local` is this
machine: its processes share the calibrated host CPU, and its memory is split between them.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from typing import Any

from glmc.analysis.comm import LINKS, LinkProfile, cached_link, get_link
from glmc.analysis.cost import get_profile
from glmc.analysis.profiles import DeviceProfile, _interp
from glmc.errors import ConfigError

GiB = 1024 ** 3

def dtype_name(precision: str) -> str:
    """The profiles' name of a training precision's compute dtype ("bf16" -> "bfloat16")."""
    return {"bf16": "bfloat16", "fp16": "float16"}.get(precision, "float32")


@dataclass(frozen=True)
class DeviceKind:
    """One kind of device: its compute profile, the memory one rank may use, its links."""

    name: str
    profile: DeviceProfile
    memory_bytes: int
    intra: LinkProfile  #: between the devices of one node
    inter: LinkProfile  #: between nodes (per device)
    dtype: str  #: the fastest training precision it has ("bf16", "fp16" or "fp32")
    source: str
    #: the part of its profile's compute each process gets: processes that outnumber a
    #: host's cores share them (4 processes on 2 cores: 0.5)
    share: float = 1.0
    #: the training precisions the planner chooses from where none is given (`dtype` first);
    #: fp32 is not among a GPU's: without TF32 its matmuls run at a sixteenth of the half-
    #: precision rate; CPUs train in fp32 (bf16 is fast only on some)
    precisions: tuple[str, ...] = ()
    #: how much longer its compute takes while the other processes of its host compute too
    #: (`LinkProfile.corun`, measured with the link); 1: a device of its own; and its memory
    #: traffic, by working set (`LinkProfile.corun_stream`; empty: `corun`)
    corun: float = 1.0
    corun_stream: tuple[tuple[int, float], ...] = ()
    #: what each blocking collective or send/receive costs beyond its own time where the
    #: processes outnumber the cores (`LinkProfile.wake_s`, measured with the link)
    wake_s: float = 0.0

    def corun_extra(self, ops: Any, sequences: int) -> float:
        """Seconds `ops` (`PartCost.work_ops`-style (seconds per sequence, of them memory-
        bound, bytes per sequence, bytes fixed); `sequences` 0: per-step ops, taken once)
        take longer while the host's other processes compute too: compute at `corun`, the
        memory-bound seconds at the streaming slowdown of the op's working set."""
        if self.corun <= 1 and not self.corun_stream:
            return 0.0
        b = max(1, sequences)
        extra = 0.0
        for seconds, memory, per_seq, fixed in ops:
            stream = _interp(self.corun_stream, b * per_seq + fixed) if self.corun_stream \
                else self.corun
            extra += b * ((self.corun - 1) * (seconds - memory) + (stream - 1) * memory)
        return extra

    @property
    def searched(self) -> tuple[str, ...]:
        return self.precisions or (self.dtype,)

    @property
    def torch_dtype(self) -> str:
        return dtype_name(self.dtype)

    @property
    def peak_flops(self) -> float:
        """The datasheet's dense matmul peak at `dtype` (what MFU is relative to)."""
        return self.profile.peak(self.torch_dtype)


def _kinds() -> dict[str, DeviceKind]:
    return {
        "a100-40g": DeviceKind("a100-40g", get_profile("a100-40g"), 40 * GiB, LINKS["nvlink3"],
                               LINKS["infiniband-hdr"], "fp16", "NVIDIA A100 datasheet",
                               precisions=("fp16", "bf16")),
        "a100-80g": DeviceKind("a100-80g", get_profile("a100"), 80 * GiB, LINKS["nvlink3"],
                               LINKS["infiniband-hdr"], "fp16", "NVIDIA A100 datasheet",
                               precisions=("fp16", "bf16")),
        "h100-80g": DeviceKind("h100-80g", get_profile("h100"), 80 * GiB, LINKS["nvlink4"],
                               LINKS["infiniband-ndr"], "bf16", "NVIDIA H100 datasheet",
                               precisions=("bf16", "fp16")),
        "h200": DeviceKind("h200", get_profile("h200"), 141 * 10 ** 9, LINKS["nvlink4"],
                           LINKS["infiniband-ndr"], "bf16", "NVIDIA H200 datasheet (141 GB)",
                           precisions=("bf16", "fp16")),
        "kunpeng920": DeviceKind("kunpeng920", get_profile("kunpeng920"), 256 * GiB,
                                 LINKS["hccs"], LINKS["roce-200g"], "fp32",
                                 "Kunpeng 920-6426 (WikiChip); one socket per device, "
                                 "8 x 32 GB DDR4 per socket assumed"),
    }


DEVICE_KINDS = tuple(_kinds()) + ("host",)


def device_kind(name: str, per_node: int = 1) -> DeviceKind:
    """A device kind by name; `host` is this machine's calibrated CPU shared by `per_node`
    processes (each gets its share of the memory and of the cores' throughput is what the
    calibration measured with that many threads)."""
    kinds = _kinds()
    if name in kinds:
        return kinds[name]
    if name in ("host", "local"):
        return _host(per_node)
    raise ConfigError(f"cluster: unknown device profile {name!r}; known: "
                      f"{', '.join(DEVICE_KINDS)}")


def _host(per_node: int) -> DeviceKind:
    """This machine running `per_node` processes: each with the host profile calibrated at
    one thread when there are several (torchrun sets OMP_NUM_THREADS=1), slowed by the
    share of a core it gets where the processes outnumber the cores, its share of 80% of
    the memory, and the gloo link the last run of that many processes measured (else a
    loopback guess)."""
    import torch
    threads = torch.get_num_threads()
    if per_node > 1:
        torch.set_num_threads(1)
    try:
        profile = get_profile("host")
    finally:
        torch.set_num_threads(threads)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    measured = cached_link("gloo", per_node) if per_node > 1 else None
    lk = measured or LINKS["loopback"]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)
    share = min(1.0, cores / max(1, per_node))
    return DeviceKind("host", profile, int(mem * 0.8) // max(1, per_node), lk, lk, "fp32",
                      "this machine, calibrated (glmc.analysis.calibration); link "
                      + (measured.source if measured else "not measured yet (a guess: run "
                         "glmc compile --nproc N once to measure it)")
                      + (f"; {per_node} processes share {cores} cores" if share < 1 else "")
                      + (f"; computing together slows each {measured.corun:.2f}x"
                         if measured and measured.corun > 1 else "")
                      + ("; memory traffic together " + ", ".join(
                          f"{f:.2f}x at {b / 2**20:g} MiB" for b, f in measured.corun_stream)
                         if measured and measured.corun_stream else "")
                      + (f"; each blocking collective waits {measured.wake_s * 1e3:.1f} ms for "
                         "a core" if measured and measured.wake_s else ""),
                      share, corun=measured.corun if measured else 1.0,
                      corun_stream=measured.corun_stream if measured else (),
                      wake_s=measured.wake_s if measured else 0.0)


@dataclass(frozen=True)
class NodeGroup:
    nodes: int
    per_node: int
    device: DeviceKind

    @property
    def devices(self) -> int:
        return self.nodes * self.per_node


_GROUP = re.compile(r"(\d+)x(\d+):([A-Za-z0-9_.-]+)")


@dataclass(frozen=True)
class Cluster:
    """Groups of identical nodes. Links: each group's device defaults, or `intra`/`inter`."""

    groups: tuple[NodeGroup, ...]

    @staticmethod
    def parse(spec: str, intra: Any = None, inter: Any = None, nproc: int | None = None
              ) -> "Cluster":
        """`NxG:DEVICE[+NxG:DEVICE...]`, or `local` (one node of `nproc` host processes)."""
        spec = spec.strip()
        if spec == "local":
            n = nproc or 1
            groups = (NodeGroup(1, n, device_kind("host", n)),)
        else:
            groups = []
            for part in spec.split("+"):
                m = _GROUP.fullmatch(part.strip())
                if m is None:
                    raise ConfigError(f"cluster: cannot read {part!r}; spell a cluster "
                                      "NODESxPER_NODE:DEVICE (e.g. 128x8:a100-80g), groups "
                                      "joined by '+', or 'local'")
                nodes, per_node = int(m[1]), int(m[2])
                if nodes < 1 or per_node < 1:
                    raise ConfigError(f"cluster: {part!r} has no devices")
                groups.append(NodeGroup(nodes, per_node, device_kind(m[3], per_node)))
            groups = tuple(groups)
        if intra is not None or inter is not None:
            groups = tuple(replace(g, device=replace(
                g.device, intra=get_link(intra) if intra else g.device.intra,
                inter=get_link(inter) if inter else g.device.inter)) for g in groups)
        if len({g.per_node for g in groups}) > 1:
            raise ConfigError("cluster: every group must have the same devices per node (a "
                              "tensor-parallel group stays inside one node)")
        return Cluster(groups)

    @property
    def devices(self) -> int:
        return sum(g.devices for g in self.groups)

    @property
    def per_node(self) -> int:
        return self.groups[0].per_node

    @property
    def heterogeneous(self) -> bool:
        return len({g.device.name for g in self.groups}) > 1

    def spelling(self) -> str:
        return "+".join(f"{g.nodes}x{g.per_node}:{g.device.name}" for g in self.groups)
