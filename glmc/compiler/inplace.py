"""The in-place form of a step and running it: the write-back module (new state copied into
the inputs, `inplace_module`), compiling it with a backend (`compile_inplace`), and running a
step against a live module and optimizer (`run_inplace`, `run_step`). The compiled objects
are cached beside the graph, never in `graph.meta`."""
from __future__ import annotations

import weakref

from typing import Any, Iterable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from glmc.errors import ConfigError
from glmc.ir.graph import OutputKind, Role, TrainGraph
from glmc.trace.optim import ensure_state




Values = dict[tuple[Role, str], torch.Tensor]  #: step inputs by (role, target)

#: compiled objects made from a graph, keyed on its fx module (weakly: they go with it) —
#: `graph.meta` holds data only; a copy of the graph (a new module) carries none of them
_INPLACE: "weakref.WeakKeyDictionary[fx.GraphModule, fx.GraphModule]" = \
    weakref.WeakKeyDictionary()
_COMPILED: "weakref.WeakKeyDictionary[fx.GraphModule, Any]" = weakref.WeakKeyDictionary()


def state_values(module: nn.Module, optimizer: torch.optim.Optimizer) -> Values:
    """The state a step reads, by (role, target): parameters, buffers, optimizer state and
    learning rates (float64 scalars, as `glmc.runtime.trainer` passes them)."""
    ensure_state(optimizer)
    names = {id(p): n for n, p in module.named_parameters()}
    values: Values = {(Role.PARAMETER, n): p.detach() for n, p in module.named_parameters()}
    values.update({(Role.BUFFER, n): b for n, b in module.named_buffers()})
    for gi, group in enumerate(optimizer.param_groups):
        values[(Role.HYPERPARAM, f"lr:{gi}")] = torch.tensor(float(group["lr"]),
                                                             dtype=torch.float64)
        for p in group["params"]:
            for key, t in optimizer.state[p].items():
                if isinstance(t, torch.Tensor) and id(p) in names:
                    values[(Role.OPTIMIZER_STATE, f"{key}:{names[id(p)]}")] = t
    return values


def batch_values(batch: Sequence[torch.Tensor]) -> Values:
    return {(Role.INPUT, f"input:{i}"): t for i, t in enumerate(batch)}


def gather(graph: TrainGraph, *sources: Values) -> list[torch.Tensor]:
    """The graph's inputs in signature order, each from the first source that has it."""
    out = []
    for spec in graph.inputs:
        key = (spec.role, spec.target)
        found = next((s[key] for s in sources if key in s), None)
        if found is None:
            raise ConfigError(f"program: no value for input {spec.role.value} {spec.target!r}")
        out.append(found)
    return out


def write_back(graph: TrainGraph, outputs: Sequence[torch.Tensor], module: nn.Module,
               optimizer: torch.optim.Optimizer) -> dict[tuple[OutputKind, str], torch.Tensor]:
    """Copies new parameters, buffers and optimizer state into the user's tensors; returns the
    other outputs (loss, sent values, saved values, gradients) by (kind, target)."""
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    rest = {}
    with torch.no_grad():
        for spec, value in zip(graph.outputs, outputs):
            if spec.kind is OutputKind.PARAM:
                params[spec.target].copy_(value)
            elif spec.kind is OutputKind.BUFFER:
                buffers[spec.target].copy_(value)
            elif spec.kind is OutputKind.STATE:
                key, _, name = spec.target.partition(":")
                optimizer.state[params[name]][key].copy_(value)
            else:
                rest[(spec.kind, spec.target)] = value
    return rest


def run_inplace(graph: TrainGraph, *sources: Values,
                consume: Iterable[Role | tuple[Role, str]] = ()
                ) -> dict[tuple[OutputKind, str], torch.Tensor]:
    """Run `graph` on its inputs from `sources` (`gather`) in its write-back form
    (`glmc.ir.writeback.lower_writeback`, made once and cached beside the graph): each new parameter,
    buffer and optimizer-state value is copied into the tensor it was read from as soon as the
    old value's last read is done, so an update holds one parameter's new values at a time,
    not a whole stage's. The inputs of the roles in `consume` are taken out of `sources` and
    handed to the graph alone (fx's boxed calling convention), so each is freed after its
    last read inside the graph — a backward frees its saved activations as it goes, an update
    each gradient; a (role, target) key in `consume` takes that one input. Returns the other
    outputs (loss, sent, saved values, gradients) by (kind, target)."""
    from glmc.ir.writeback import STATE_KINDS
    compiled = compiled_step(graph)
    gm = inplace_module(graph) if compiled is None else None
    args = gather(graph, *sources)
    consume = set(consume)
    for spec in graph.inputs:
        if spec.role in consume or (spec.role, spec.target) in consume:
            for source in sources:
                source.pop((spec.role, spec.target), None)
    with torch.no_grad():  # copies into leaf parameters
        if compiled is not None:
            call = _conform(graph, args)
            args.clear()  # the compiled step holds the only references (when boxed)
            outs = compiled.boxed(call) if compiled.boxed is not None else compiled(call)
        else:
            outs = gm(args)  # clears `args`: the graph holds the only references
    kept = [spec for spec in graph.outputs if spec.kind not in STATE_KINDS]
    return {(spec.kind, spec.target): v for spec, v in zip(kept, outs)}


def compile_inplace(graph: TrainGraph, backend: Any) -> None:
    """Compile `graph`'s write-back form with `backend` (a glmc Backend that updates state in
    place: eager, Inductor) once and cache it beside the graph: `run_inplace` then runs the
    compiled step instead of the fx module (a copy of the graph does not carry it)."""
    _COMPILED[graph.gm] = backend.compile(graph, inplace=True)


def compiled_step(graph: TrainGraph) -> Any:
    """The backend's compiled write-back form of `graph` (`compile_inplace`), or None."""
    return _COMPILED.get(graph.gm)


def _conform(graph: TrainGraph, args: list[torch.Tensor]) -> list[torch.Tensor]:
    """`args` with every value the graph takes over (saved, received, gradients: not state,
    which must be written in place) in the layout its placeholder was compiled for: a compiled
    step checks its inputs' strides, and a gradient may arrive expanded or as a view."""
    from glmc.ir.writeback import NOT_STATE
    out = []
    for ph, spec, t in zip(graph.placeholders(), graph.inputs, args):
        want = ph.meta.get("val")
        if spec.role in NOT_STATE and isinstance(want, torch.Tensor) and \
                isinstance(t, torch.Tensor) and not _same_layout(t, want):
            t = torch.empty_strided(want.shape, want.stride(), dtype=t.dtype,
                                    device=t.device).copy_(t)
        out.append(t)
    return out


def _same_layout(t: torch.Tensor, want: torch.Tensor) -> bool:
    return tuple(t.shape) == tuple(want.shape) and all(
        a == b for a, b, n in zip(t.stride(), want.stride(), t.shape) if n > 1)


def inplace_module(graph: TrainGraph) -> fx.GraphModule:
    """`graph`'s early write-back form with fx's boxed calling convention (`gm(args)` clears
    `args`), made once and cached beside the graph: what `run_inplace` runs and what
    `glmc.planning.schedule.predicted_peaks` simulates. ATen's fused optimizer kernels in it run in
    place on the state (`glmc.ir.kernels.in_place_fused_updates`)."""
    from torch.fx.graph import _BoxedCodeGen

    from glmc.ir.writeback import lower_writeback
    gm = _INPLACE.get(graph.gm)
    if gm is None:
        gm = lower_writeback(graph, fused_in_place=True)
        gm.graph.set_codegen(_BoxedCodeGen())
        gm.recompile()
        _INPLACE[graph.gm] = gm
    return gm


def run_step(graph: TrainGraph, module: nn.Module, optimizer: torch.optim.Optimizer,
             batch: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One step of a (bound) step graph on `batch`, updating `module` and `optimizer`;
    returns the loss."""
    inputs = gather(graph, state_values(module, optimizer), batch_values(batch))
    rest = write_back(graph, graph.gm(*inputs), module, optimizer)
    return rest.get((OutputKind.LOSS, ""))
