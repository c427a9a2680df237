"""Where a compiled step's time goes: forward, backward and optimizer, measured per kernel.

`profile_phases(trainer, batch)` runs a few steps of the compiled step with every kernel call
timed (host wall clock around the call, after a device sync on CUDA) and adds up the time per
training phase:

* **inductor**: the generated wrapper calls its kernels (C++/Triton kernels, ATen extern
  kernels such as `mm`, fallback ops such as flash attention) one by one from Python; the
  backend compiles with Inductor's provenance tracking, which names, before every call site,
  the FX nodes it computes. Each call's time goes to the phases of those nodes (glmc's
  `Phase` metadata). Inductor fuses horizontally across phases (one C++ kernel may compute a
  forward mask and a backward reduction); such a call's time is split in proportion to the
  cost model's predicted time of its nodes, and the kernel is listed as mixed.
* **eager**: every node of the step is one call; timed by an FX interpreter.

What is not inside a kernel call (the wrapper's allocations and Python, the runtime's input
gathering) is reported as `other`: the step's wall time minus the kernels. A chrome trace
(`chrome://tracing`, Perfetto) of the profiled steps, one event per kernel call with its
phase split, is written by `PhaseProfile.write_trace`.
"""
from __future__ import annotations

import json
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx

from glmc.errors import ConfigError
from glmc.ir.graph import TrainGraph

PHASES = ("forward", "backward", "optimizer")


@dataclass
class CallSite:
    """One kernel call of the compiled step: its name and the step nodes it computes."""

    name: str
    nodes: list[str]


@dataclass
class KernelCall:
    site: int  #: index into the step's call sites
    start: float  #: perf_counter seconds
    seconds: float


class Instrument:
    """A backend's view of its compiled step as kernel calls (see `sites`, `hooked`)."""

    #: what the attribution rests on, one line for the report
    method: str = ""
    #: step node name -> phase ("forward", "backward", "optimizer")
    phase_of: dict[str, str]

    def sites(self) -> list[CallSite]:
        raise NotImplementedError

    @contextmanager
    def hooked(self, calls: list[KernelCall]) -> Iterator[None]:
        """Inside: every kernel call of the step appends one KernelCall to `calls`."""
        raise NotImplementedError
        yield


@dataclass
class PhaseProfile:
    """Per-phase time of one compiled step (seconds per step, medians over the profiled
    steps), and its kernels."""

    backend: str
    steps: int
    step_seconds: float  #: median wall time of a profiled step (kernel timing included)
    phases: dict[str, float]  #: forward/backward/optimizer/other -> seconds
    kernels: list[dict[str, Any]]  #: per call-site name: seconds, calls, phase split
    method: str
    trace: list[dict[str, Any]] = field(default_factory=list, repr=False)
    #: torch.compile of the same model with the same optimizer class and hyperparameters,
    #: timed in the same loop (interleaved): its compiled forward, `loss.backward()` and eager
    #: `optimizer.step()`, plus "step" (None unless asked for)
    reference: dict[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "steps": self.steps,
                "step_seconds": self.step_seconds, "phases": self.phases,
                "top_kernels": self.kernels[:15], "method": self.method,
                "reference": self.reference}

    def top(self, phase: str, k: int = 5) -> list[dict[str, Any]]:
        """The `k` kernels that spend most of `phase`'s time."""
        rows = [r for r in self.kernels if r["phases"].get(phase)]
        rows.sort(key=lambda r: -r["seconds"] * r["phases"][phase])
        return rows[:k]

    def table(self) -> str:
        lines = [f"per-phase profile ({self.backend}, median of {self.steps} steps):"]
        for p in (*PHASES, "other"):
            t = self.phases.get(p, 0.0)
            share = t / self.step_seconds if self.step_seconds else 0.0
            lines.append(f"  {p:<10} {t * 1e3:9.2f} ms  {share:6.1%}")
        lines.append(f"  {'step':<10} {self.step_seconds * 1e3:9.2f} ms")
        if self.reference:
            ref = self.reference
            lines.append("  torch.compile reference (same loop): " + ", ".join(
                f"{p} {ref[p] * 1e3:.2f} ms" for p in (*PHASES, "step") if p in ref))
        return "\n".join(lines)

    def write_trace(self, path: str | Path) -> Path:
        """Chrome trace-event JSON of the profiled steps (chrome://tracing, ui.perfetto.dev)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"traceEvents": self.trace, "displayTimeUnit": "ms"}))
        return path


def profile_phases(trainer: Any, *args: Any, steps: int = 3, reference: bool = False,
                   **kwargs: Any) -> PhaseProfile:
    """Run `steps` training steps of `trainer` on this batch with every kernel call timed;
    the per-phase profile of its compiled step (also stored on its compile record, so the
    report shows it). These steps train as usual (the state advances). `reference`: also
    time torch.compile on a copy of the model (the user's model is not touched), one of its
    steps after each of glmc's."""
    if steps < 1:
        raise ConfigError(f"profile_phases: steps={steps}; give at least 1")
    entry = trainer.entry_for(*args, **kwargs)
    if entry is None:  # not compiled for these shapes yet: one (untimed) step compiles it
        trainer.step(*args, **kwargs)
        entry = trainer.entry_for(*args, **kwargs)
    instrument = getattr(entry.step, "instrument", None) if entry is not None else None
    if instrument is None:
        backend = entry.step.backend if entry is not None else "pieces"
        raise ConfigError(f"profile_phases: the {backend} step cannot be timed per kernel "
                          "(inductor, eager and ort can); run the per-phase profile on those")
    sites = instrument.sites()
    weights = _phase_weights(sites, instrument.phase_of, entry.record.node_seconds)
    ref = TorchLoop.copy_of(trainer) if reference else None
    if ref is not None:
        for _ in range(2):  # compile, then one warm step
            ref.step(args, kwargs)
        ref.times.clear()
    walls: list[float] = []
    per_step: list[list[KernelCall]] = []
    for _ in range(steps):
        calls: list[KernelCall] = []
        with instrument.hooked(calls):
            t0 = time.perf_counter()
            trainer.step(*args, **kwargs)
            walls.append(time.perf_counter() - t0)
        per_step.append(calls)
        if ref is not None:
            ref.step(args, kwargs)
    profile = _summarize(entry.step.backend, sites, weights, walls, per_step,
                         instrument.method)
    profile.reference = ref.phases() if ref is not None else None
    entry.record.phases = profile.to_dict()
    return profile


class TorchLoop:
    """The usual PyTorch training loop on `model` — `torch.compile(model + loss)` (or eager
    with `compile_forward=False`), `loss.backward()`, `optimizer.step()` (compiled with
    `compile_update`) — each phase timed, device-synchronised on CUDA. The per-phase profile's
    torch.compile reference and the step benchmark's torch contenders."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any,
                 compile_forward: bool = True, compile_update: bool = False) -> None:
        from glmc.trace.capture import LossModule
        self.model, self.optimizer = model, optimizer
        wrapper = LossModule(model, loss_fn)
        self.forward = torch.compile(wrapper) if compile_forward else wrapper
        self.update = torch.compile(optimizer.step) if compile_update else optimizer.step
        self.sync = torch.cuda.synchronize if any(
            p.is_cuda for p in model.parameters()) else (lambda: None)
        self.times: list[tuple[float, float, float]] = []

    @classmethod
    def copy_of(cls, trainer: Any) -> "TorchLoop":
        """torch.compile on a deep copy of the trainer's model, with an optimizer of the same
        class, groups and hyperparameters (state of its own)."""
        import copy
        model, opt = trainer.model, trainer.optimizer
        twin = copy.deepcopy(model)
        by_id = {id(p): n for n, p in model.named_parameters()}
        params = dict(twin.named_parameters())
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [params[by_id[id(p)]] for p in g["params"]]}
                  for g in opt.param_groups]
        return cls(twin, type(opt)(groups), trainer.loss_fn)

    def step(self, args: tuple, kwargs: dict) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        (loss,) = self.forward(*args, **dict(kwargs))
        self.sync()
        t1 = time.perf_counter()
        loss.backward()
        self.sync()
        t2 = time.perf_counter()
        self.update()
        self.sync()
        self.times.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        return loss.detach()

    def phases(self) -> dict[str, float]:
        """Medians of the steps timed since `times` was last cleared, and of their sum."""
        f, b, o = (statistics.median(x) for x in zip(*self.times))
        return {"forward": f, "backward": b, "optimizer": o,
                "step": statistics.median(sum(t) for t in self.times)}


def phase_map(gm: fx.GraphModule) -> dict[str, str]:
    """Node name -> phase of every computed node of a step graph (glmc metadata)."""
    return {n.name: TrainGraph.info(n).phase.value for n in gm.graph.nodes
            if n.op == "call_function" and n.meta.get("glmc") is not None}


def _phase_weights(sites: list[CallSite], phase_of: dict[str, str],
                   predicted: dict[str, float]) -> list[dict[str, float]]:
    """Each site's split over phases: its nodes' predicted seconds per phase (a token weight
    for nodes the cost model has no figure for), normalised."""
    out = []
    for site in sites:
        acc: dict[str, float] = {}
        for name in site.nodes:
            phase = phase_of.get(name)
            if phase not in PHASES:
                continue
            acc[phase] = acc.get(phase, 0.0) + max(predicted.get(name, 0.0), 1e-9)
        total = sum(acc.values())
        out.append({p: v / total for p, v in acc.items()} if total else {"other": 1.0})
    return out


def _summarize(backend: str, sites: list[CallSite], weights: list[dict[str, float]],
               walls: list[float], per_step: list[list[KernelCall]],
               method: str) -> PhaseProfile:
    phase_steps: list[dict[str, float]] = []
    by_name: dict[str, dict[str, Any]] = {}
    trace: list[dict[str, Any]] = []
    origin = per_step[0][0].start if per_step and per_step[0] else 0.0
    for calls in per_step:
        acc = {p: 0.0 for p in (*PHASES, "other")}
        for c in calls:
            split = weights[c.site]
            for p, w in split.items():
                acc[p] = acc.get(p, 0.0) + c.seconds * w
            name = sites[c.site].name
            row = by_name.setdefault(name, {"kernel": name, "seconds": 0.0, "calls": 0,
                                            "split": {}})
            row["seconds"] += c.seconds / len(per_step)
            row["calls"] += 1
            for p, w in split.items():
                row["split"][p] = row["split"].get(p, 0.0) + c.seconds * w
            trace.append({"name": name, "ph": "X", "pid": 0, "tid": 0,
                          "ts": (c.start - origin) * 1e6, "dur": c.seconds * 1e6,
                          "cat": max(split, key=split.get),
                          "args": {k: round(v, 3) for k, v in split.items()}})
        phase_steps.append(acc)
    wall = statistics.median(walls)
    phases = {p: statistics.median(s[p] for s in phase_steps) for p in (*PHASES, "other")}
    phases["other"] += max(0.0, wall - sum(phases.values()))
    kernels = []
    for row in by_name.values():
        total = sum(row["split"].values()) or 1.0
        row["phases"] = {p: round(v / total, 3) for p, v in row["split"].items()}
        row["calls"] //= len(per_step)
        del row["split"]
        kernels.append(row)
    kernels.sort(key=lambda r: -r["seconds"])
    return PhaseProfile(backend, len(walls), wall, phases, kernels, method, trace)


# ---- instruments ------------------------------------------------------------------------------

class InterpreterInstrument(Instrument):
    """The eager step: one call per FX node, timed by running the graph through an
    interpreter while hooked (the plain GraphModule otherwise)."""

    method = "eager: each ATen op of the step timed on its own (exact phases)"

    def __init__(self, gm: fx.GraphModule, holder: dict[str, Callable]) -> None:
        self.gm, self.holder = gm, holder
        self.nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
        self.phase_of = phase_map(gm)

    def sites(self) -> list[CallSite]:
        return [CallSite(getattr(n.target, "__name__", str(n.target)), [n.name])
                for n in self.nodes]

    @contextmanager
    def hooked(self, calls: list[KernelCall]) -> Iterator[None]:
        index = {n: i for i, n in enumerate(self.nodes)}
        sync = sync_for(self.gm)

        class Timed(fx.Interpreter):
            def run_node(self, n: fx.Node) -> Any:
                if n not in index:
                    return super().run_node(n)
                t0 = time.perf_counter()
                out = super().run_node(n)
                sync()
                calls.append(KernelCall(index[n], t0, time.perf_counter() - t0))
                return out

        plain = self.holder["run"]
        self.holder["run"] = lambda *inputs: Timed(self.gm).run(*inputs)
        try:
            yield
        finally:
            self.holder["run"] = plain


def sync_for(gm: fx.GraphModule) -> Callable[[], None]:
    """What waits for a step's kernels: a CUDA sync for a step on CUDA, nothing on CPU."""
    cuda = any(isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_cuda
               for n in gm.graph.nodes if n.op == "placeholder")
    return torch.cuda.synchronize if cuda else (lambda: None)
