"""`inductor`: compiles the whole step with TorchInductor (C++/OpenMP on CPU, Triton on CUDA).

Guarantees: the same ATen program as `eager`, fused by Inductor; parameters, buffers and
optimizer state are updated in place inside the generated kernels. Ops without an Inductor
lowering run as ATen fallback kernels inside the compiled step and are listed as fallbacks.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from glmc.backends.base import ARTIFACT_DIR, Backend, StepFn

from glmc.analysis.phases import CallSite, Instrument, KernelCall
from glmc.errors import BackendError
from glmc.ir.graph import REMAT, Phase, TrainGraph, comm_ops
from glmc.ir.target import BackendTraits


class InductorBackend(Backend):
    name = "inductor"

    def traits(self) -> BackendTraits:
        from glmc.backends.inductor.model import FusionGroups
        return BackendTraits(self.name, fusion=FusionGroups, early_writeback=True,
                             fused_update=True)

    def supports(self, node: fx.Node) -> str | None:
        from torch._decomp import core_aten_decompositions
        from torch._inductor.decomposition import decompositions
        from torch._inductor.lowering import lowerings

        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            return None
        if target.namespace == "glmc":
            from glmc.ir.kernels import ELEMENTWISE
            if target._schema.name.split("::")[-1] in ELEMENTWISE:
                return None  # lowered to ATen before compiling
            return "glmc fused op: runs as its own (chunked) kernel inside the step"
        if target in lowerings or target in decompositions or target in core_aten_decompositions():
            return None
        if target in (torch.ops.aten._fused_adamw.tensor_lr, torch.ops.aten._fused_adam.tensor_lr):
            return None  # ATen's fused kernel, run in place (glmc.ir.kernels.in_place_fused_updates)
        if target.overloadpacket in lowerings:
            return None
        return "no Inductor lowering; runs as an ATen fallback kernel"

    def _compile(self, gm: fx.GraphModule, graph: TrainGraph) -> StepFn:
        from torch._inductor.compile_fx import compile_fx

        from glmc.ir.kernels import ELEMENTWISE, in_place_fused_updates, lower_to_aten
        # glmc's elementwise fused ops become ATen again so Inductor fuses them with their
        # neighbours; what their backward saves was fixed when the step was derived
        gm = lower_to_aten(gm, only=ELEMENTWISE)
        # ATen's fused optimizer kernels update the state in place (functionalized by
        # AOTAutograd, re-inplaced by Inductor): no new parameter/state tensors, no copies
        in_place_fused_updates(gm)
        _split_alpha(gm)
        _views_as_reshapes(gm)
        _cross_entropy_backward(gm)
        artifact = _artifact_path(graph)
        loaded = _load_artifact(artifact)
        if loaded is not None:
            compiled = loaded
        else:
            # fallback_random: draw dropout masks with ATen's generator, exactly as eager does
            with torch.no_grad(), _phase_barrier(gm, _has_recompute(graph)), \
                    _cacheable(gm) as example:
                compiled = compile_fx(gm, example, config_patches=_patches(graph)) \
                    if artifact is None else _compile_artifact(gm, example, graph, artifact)

        def run(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
            with torch.no_grad():
                return list(compiled(*inputs))
        run.instrument = InductorInstrument(compiled, gm)
        inner = _boxed(getattr(compiled, "_compiled_fn", compiled), gm)
        if inner is not None:
            def boxed(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
                with torch.no_grad():
                    return list(inner(inputs))  # clears `inputs`
            run.boxed = boxed
        return run


class InductorInstrument(Instrument):
    """Per-kernel timing of an Inductor-compiled step (see glmc.analysis.phases).

    The generated wrapper looks its kernels up as module globals on every call (`cpp_fused_*`,
    Triton kernels, `extern_kernels.mm`, `torch.ops.aten.*` fallbacks); while hooked they are
    replaced by timing wrappers. Call sites come from the provenance comments Inductor writes
    before each call (`# [Provenance debug handles] name:handle`) and its provenance mapping
    (handle -> post-grad nodes -> the nodes of the graph glmc handed it)."""

    method = ("inductor: every kernel call of the generated wrapper timed; call site -> FX "
              "nodes from Inductor's provenance tracking; a call computing nodes of several "
              "phases (horizontal fusion) split by the cost model's predicted node times")

    def __init__(self, compiled: Any, gm: fx.GraphModule) -> None:
        from glmc.analysis.phases import phase_map, sync_for
        self.compiled = compiled
        self.phase_of = phase_map(gm)
        self.sync = sync_for(gm)
        self._sites: list[CallSite] | None = None

    def sites(self) -> list[CallSite]:
        if self._sites is None:
            self._sites = _call_sites(getattr(self.compiled, "source_code", "") or "",
                                      getattr(self.compiled, "inductor_provenance_mapping_str",
                                              None))
            self._sites.append(CallSite("(not attributed)", []))
        return self._sites

    @contextmanager
    def hooked(self, calls: list[KernelCall]) -> Iterator[None]:
        sites = self.sites()
        module = _wrapper_globals(self.compiled)
        if module is None:
            raise BackendError("inductor: the compiled step exposes no wrapper module to time "
                               "(a cached or AOT artifact); the per-phase profile needs a "
                               "Python wrapper")
        cursor = [0]
        sync = self.sync

        def timed(name: str, fn: Callable) -> Callable:
            def call(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                out = fn(*a, **k)
                sync()
                seconds = time.perf_counter() - t0
                j = cursor[0]
                while j < len(sites) - 1 and sites[j].name != name:
                    j += 1
                if j < len(sites) - 1:
                    cursor[0] = j + 1
                calls.append(KernelCall(j, t0, seconds))
                return out
            return call

        saved = dict(module)
        for key, value in saved.items():
            if key.startswith(("cpp_fused", "triton_")) and callable(value):
                module[key] = timed(key, value)
            elif key.startswith(("cpp_fused", "triton_")) and hasattr(value, "run"):
                module[key] = _Attr(value, {"run": timed(key, value.run)})
        if "extern_kernels" in saved:
            module["extern_kernels"] = _Prefixed(saved["extern_kernels"], "extern_kernels.",
                                                 timed)
        module["torch"] = _Attr(torch, {"ops": _Ops(timed)})
        if "aten" in saved:
            module["aten"] = _Namespace(torch.ops.aten, "aten", timed)
        try:
            yield
        finally:
            module.update(saved)


class _Attr:
    """`obj` with some attributes replaced."""

    def __init__(self, obj: Any, replaced: dict[str, Any]) -> None:
        self._obj, self._replaced = obj, replaced

    def __getattr__(self, name: str) -> Any:
        return self._replaced[name] if name in self._replaced else getattr(self._obj, name)


class _Prefixed:
    """`obj` whose callable attributes are timed under `prefix + name`."""

    def __init__(self, obj: Any, prefix: str, timed: Callable) -> None:
        self._obj, self._prefix, self._timed = obj, prefix, timed

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._obj, name)
        return self._timed(self._prefix + name, value) if callable(value) else value


class _Namespace:
    """`torch.ops.<ns>` whose op overloads are timed as `<ns>.<op>.<overload>`."""

    def __init__(self, ns: Any, name: str, timed: Callable) -> None:
        self._ns, self._name, self._timed = ns, name, timed

    def __getattr__(self, op: str) -> Any:
        packet = getattr(self._ns, op)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            return packet
        return _Prefixed(packet, f"{self._name}.{op}.", self._timed)


class _Ops:
    def __init__(self, timed: Callable) -> None:
        self._timed = timed

    def __getattr__(self, ns: str) -> Any:
        return _Namespace(getattr(torch.ops, ns), ns, self._timed)


def _wrapper_globals(compiled: Any) -> dict[str, Any] | None:
    fn = getattr(compiled, "current_callable", None)
    fn = getattr(fn, "__func__", fn)
    return getattr(fn, "__globals__", None)


def _call_sites(source: str, mapping: Any) -> list[CallSite]:
    """The wrapper's kernel calls in program order, each with the nodes (of the graph given to
    Inductor) it computes."""
    import json
    import re
    if isinstance(mapping, str):
        mapping = json.loads(mapping)
    mapping = mapping or {}
    to_post = mapping.get("cppCodeToPost", {}) or {}
    to_post = {**to_post, **(mapping.get("tritonCodeToPost", {}) or {})}
    to_pre = mapping.get("postToPre", {}) or {}
    body = source[source.find("def call("):] if "def call(" in source else ""
    sites = []
    for m in re.finditer(r"# \[Provenance debug handles\] (\S+):(\d+)", body):
        name, handle = m.group(1), m.group(2)
        posts = to_post.get(f"{name}:{handle}", [])
        nodes = [pre for p in posts for pre in to_pre.get(p, [p])]
        sites.append(CallSite(name.removeprefix("torch.ops."), nodes))
    return sites


def _artifact_path(graph: TrainGraph) -> Any:
    """Where the compiled step of `graph` is kept between processes (the step cache entry
    the trainer names in `graph.meta[ARTIFACT_DIR]`), or None: one file per CPU vector ISA
    (the kernels are built for it) and write-back form."""
    directory = graph.meta.get(ARTIFACT_DIR)
    if directory is None:
        return None
    from pathlib import Path

    from glmc.backends.base import step_device
    device = step_device(graph)
    where = "cuda" if device.type == "cuda" else torch.backends.cpu.get_cpu_capability().lower()
    return Path(directory) / f"inductor-{where}.bin"


def _load_artifact(path: Any) -> Any:
    """The compiled step saved at `path` (Inductor's CompiledArtifact), or None when there is
    none or it does not load (another torch wrote it: compiled again and replaced)."""
    if path is None or not path.is_file():
        return None
    from torch._inductor import CompiledArtifact, config
    # Inductor checks each vector ISA the CPU reports by building and loading a probe library
    # in a subprocess (~1.3 s, every process); the process that wrote the artifact found them
    # all usable, so when this CPU reports the same ones the check is skipped
    candidates = _isa_candidates()
    trusted = candidates is not None and \
        candidates == _read_json(path.with_suffix(".isa.json")).get("valid")
    try:
        with config.patch({"cpp.vec_isa_ok": True} if trusted else {}):
            return CompiledArtifact.load(path=str(path), format="binary")
    except Exception:  # a stale or partial artifact: compile as if it were not there
        return None


def _isa_candidates() -> list[str] | None:
    """The vector ISAs Inductor would check on this x86 CPU (those its flags report), or
    None elsewhere."""
    import platform
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    from torch._inductor import cpu_vec_isa as v
    flags = v.x86_isa_checker()
    return [str(i) for i in v.supported_vec_isa_list
            if all(f in flags for f in str(i).split())]


def _read_json(path: Any) -> dict[str, Any]:
    import json
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _compile_artifact(gm: fx.GraphModule, example: list[Any], graph: TrainGraph,
                      path: Any) -> Any:
    """Compile with `standalone_compile` (what `compile_fx` does, and savable) and keep the
    artifact at `path` (written beside, then renamed: a concurrent reader sees all or none)."""
    import os

    from torch._inductor import standalone_compile
    compiled = standalone_compile(gm, example, dynamic_shapes="from_tracing_context",
                                  options={"config_patches": _patches(graph)})
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        compiled.save(path=str(tmp), format="binary")
        if _isa_candidates() is not None:  # which of the CPU's ISAs Inductor found usable
            import json

            from torch._inductor.cpu_vec_isa import valid_vec_isa_list
            path.with_suffix(".isa.json").write_text(json.dumps(
                {"valid": [str(i) for i in valid_vec_isa_list()]}))
        os.replace(tmp, path)
    except OSError:  # a read-only cache: the step still runs, the next process compiles
        tmp.unlink(missing_ok=True)
    return compiled


def _boxed(compiled: Any, gm: fx.GraphModule) -> Any:
    """The boxed callable inside what `compile_fx` returned: AOTAutograd's runtime wrapper,
    which takes the inputs as a list and clears it, so Inductor's code frees each input after
    its last read (`compile_fx` itself returns `aot_module_simplified`'s unboxed `forward`,
    whose argument tuple keeps every input alive to the end). None where it is not found
    (another torch) or where `forward` would add the module's own parameters or buffers."""
    if any(True for _ in gm.parameters()) or any(True for _ in gm.buffers()):
        return None
    fn = compiled
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
        if getattr(fn, "__qualname__", "").endswith("runtime_wrapper"):
            return fn
    return None


@contextmanager
def _cacheable(gm: fx.GraphModule) -> Iterator[list[torch.Tensor]]:
    """The example inputs of `gm`'s placeholders, made in a fake mode with a shape
    environment, inside a tracing context holding that mode: Inductor's FX graph cache needs
    one to key a graph (without it every compile bypassed the cache: 'No shape env'), so a
    second process compiling the same step loads the kernels instead of generating them."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    vals = [ph.meta["val"] for ph in gm.graph.nodes if ph.op == "placeholder"]
    with mode:
        example = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                   if isinstance(v, torch.Tensor) else v for v in vals]
    with tracing(TracingContext(mode)):
        yield example


def _has_recompute(graph: TrainGraph) -> bool:
    return any(TrainGraph.info(n).created_by == "recompute" or n.meta.get(REMAT)
               for n in graph.compute_nodes())


def _patches(graph: TrainGraph) -> dict[str, object]:
    # provenance tracking: the wrapper names the FX nodes of each kernel call (compile-time
    # only; glmc.analysis.phases reads it for the per-phase profile)
    patches: dict[str, object] = {"fallback_random": True,
                                  "trace.provenance_tracking_level": 1}
    if _has_recompute(graph):
        # Inductor's reorderings move the backward's recomputed copies back into the forward
        # and undo the plan: locality reordering moves producers next to their consumers
        # (GLM small, budget 0.5: 368 MiB measured with it, 298 MiB without; 310 predicted);
        # its peak-memory reordering ranks orders by its own estimate, which does not know the
        # copies are meant late (held-out GLM 2x256, budget min: in-step 41.6 -> 33.1 MiB
        # without it; the rest came from horizontal fusion, `_phase_barrier`)
        patches["reorder_for_locality"] = False
        patches["reorder_for_peak_memory"] = False
    if any(n.target in comm_ops() for n in graph.compute_nodes()):
        # Inductor's scheduler otherwise puts every wait right after its collective (checked
        # in the output code: the gradient buckets' reduce-scatters then block the backward);
        # its own passes restore glmc's placement: waits as late, collectives as early as
        # dependencies allow
        patches["reorder_for_compute_comm_overlap"] = True
        patches["reorder_for_compute_comm_overlap_passes"] = ["sink_waits", "raise_comms"]
    return patches


#: the key under which a node's glmc phase reaches Inductor's post-grad graph: AOTAutograd's
#: retrace copies a node's `custom` metadata to the nodes it becomes (torch.fx.proxy)
_PHASE_KEY = "glmc_phase"


@contextmanager
def _phase_barrier(gm: fx.GraphModule, on: bool) -> Iterator[None]:
    """While Inductor compiles `gm` (with `on`): no kernel fuses forward nodes with backward
    ones. One step graph holds both phases (torch's partitioner would have split them); a
    recomputed copy reads the same inputs as the forward node it copies, so Inductor's
    horizontal fusion put both into one forward kernel and kept the copy alive until the
    backward — recomputation undone (held-out GLM 2x256, budget min: in-step 33.1 -> 25.1
    MiB measured with the barrier, 25.2 predicted). Each node's phase travels as `custom`
    metadata; the refusal is an `InductorChoices` handler installed for this compile only."""
    if not on:
        yield
        return
    from torch._inductor.choices import InductorChoices
    from torch._inductor.virtualized import V

    for n in gm.graph.nodes:
        info = n.meta.get("glmc")
        if n.op == "call_function" and info is not None and info.phase is not None:
            # a new dict: the node's metadata is shared (shallowly) with the step's graph
            n.meta = {**n.meta, "custom": {**n.meta.get("custom", {}),
                                           _PHASE_KEY: info.phase.value}}

    def phases(snode: Any) -> set[str]:
        out = set()
        for s in snode.get_nodes():
            for origin in getattr(getattr(s, "node", None), "origins", ()) or ():
                phase = origin.meta.get("custom", {}).get(_PHASE_KEY)
                if phase is not None:
                    out.add(phase)
        return out

    crossing = {Phase.FORWARD.value, Phase.BACKWARD.value}

    class PhaseBarrier(InductorChoices):
        @staticmethod
        def can_fuse(scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
            if crossing <= phases(node1) | phases(node2):
                return False
            return InductorChoices.can_fuse(scheduler, node1, node2, shared_data_score)

    with V.set_choices_handler(PhaseBarrier()):
        yield


def _views_as_reshapes(gm: fx.GraphModule) -> None:
    """aten.view -> aten.reshape (the same values; a view wherever the strides allow).

    The captured `view`s were valid for ATen's layouts, but Inductor may lay a value out
    differently: its cat decomposition turns `cat([empty(0), k])` (transformers' KV cache,
    built in training too) into `k.clone()`, which keeps k's transposed strides where ATen's
    cat is contiguous, and the `view` of that then fails (GPT-2, T5). The step is functional
    — nothing writes through these views — so reshape is exact and costs nothing where a view
    works.
    """
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
    gm.recompile()


def _cross_entropy_backward(gm: fx.GraphModule) -> int:
    """log_softmax_backward(nll_loss_backward(...)): the row sum of the gradient computed from
    the loss's arguments instead of summed over the classes, and the one-hot term added at the
    targets instead of compared against every class.

    `_log_softmax_backward_data(g, out, dim)` is `g - exp(out) * g.sum(dim)`; when g comes from
    `nll_loss_backward`, each row of g holds one non-zero, at the row's target:
    `-(grad_output [/ total_weight] [* weight[target]])`, and none on an ignored row — so the
    sum is that value, computed per row (the same operations in the same order as torch's
    decomposition of `nll_loss_backward`; adding the zeros was exact). Inductor's
    C++ backend vectorized that class-dim sum across rows and walked the vocabulary one
    element at a time (Llama, vocab 32000 x 1024 rows: the loss kernel took 196 ms against 138
    ms for torch.compile's two). The gradient is then `-(exp(out) * row)` with the row's value
    added at its target by `index_put(accumulate=True)` — `value - y` and `-y + value` are the
    same IEEE sum — rather than `g`
    materialized per class: Inductor built it from a 64-bit arange compared with the target
    in the innermost loop (the same Llama loss kernel: 123 -> 47-70 ms, torch.compile's two
    84-113 ms). Compiled, the result was bit-identical to the compiled original on AVX2 hosts;
    on an AVX-512 host a few elements differ by 1-2 ulp (Inductor's two kernels need not
    evaluate the same operations on the same code path; tested to 4 ulp). Returns how many
    were rewritten.
    """
    from glmc.backends.inductor.model import cross_entropy_grad
    aten = torch.ops.aten
    count = 0
    for node in list(gm.graph.nodes):
        g = cross_entropy_grad(node) if node.op == "call_function" else None
        if g is None:
            continue
        out, gval = node.args[1], g.meta["val"]
        grad_out, _, target, weight, reduction, ignore, total = g.args
        tval = target.meta["val"]
        graph = gm.graph
        with graph.inserting_before(node):
            keep = graph.call_function(aten.ne.Scalar, (target, ignore))
            safe = graph.call_function(aten.where.ScalarOther, (keep, target, 0))
            scale = graph.call_function(aten.div.Tensor, (grad_out, total)) \
                if reduction == 1 else grad_out  # 1: mean
            if weight is not None:
                picked_w = graph.call_function(aten.index.Tensor, (weight, [safe]))
                scale = graph.call_function(aten.mul.Tensor, (scale, picked_w))
            value = graph.call_function(aten.neg.default, (scale,))
            picked = graph.call_function(aten.where.ScalarOther, (keep, value, 0.0))
            row = graph.call_function(aten.unsqueeze.default, (picked, 1))
            prob = graph.call_function(aten.exp.default, (out,))
            scaled = graph.call_function(aten.mul.Tensor, (prob, row))
            # g - scaled without g: -scaled everywhere, then g's one non-zero per row added
            # at the target (value - p*row == -(p*row) + value in IEEE arithmetic); the
            # dense one-hot compare per class is gone from the kernel's inner loop
            base = graph.call_function(aten.neg.default, (scaled,))
            rows = graph.call_function(aten.arange.default, (gval.shape[0],),
                                       {"dtype": torch.int64, "device": gval.device})
            column = safe if tval.dtype == torch.int64 else graph.call_function(
                aten._to_copy.default, (safe,), {"dtype": torch.int64})
            grad = graph.call_function(aten.index_put.default,
                                       (base, [rows, column], picked, True))
        grad.meta = dict(node.meta)
        node.replace_all_uses_with(grad)
        graph.erase_node(node)
        if not g.users:  # the dense one-hot gradient: nothing reads it now
            graph.erase_node(g)
        _scatter_after_padding(graph, grad)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _scatter_after_padding(graph: fx.Graph, grad: fx.Node) -> bool:
    """`slice_backward(view(index_put(base, [rows, column], v, True)))` -> `index_put(
    slice_backward(view(base)), [*row's coordinates in the padded tensor, column], v, True)`.

    A causal LM's loss reads `logits[:, :-1]`, so its gradient is padded back to the logits'
    shape by `slice_backward`. With the scatter first, Inductor realizes the scattered
    gradient and then its padded copy: two logits-sized buffers (GLM small's step on
    Inductor: 241.4 MiB in-step peak, 209.7 with this rewrite). Padding first leaves the
    scatter to write into the padded buffer itself; each element receives the same
    additions, so the values are unchanged."""
    from glmc.backends.inductor.model import padded_by
    aten = torch.ops.aten
    found = padded_by(grad)
    if found is None:
        return False
    view, pad, dim, start = found
    base, (rows, column), picked, _ = grad.args
    lead = list(view.meta["val"].shape)[:-1]
    with graph.inserting_before(pad):
        padded = graph.call_function(aten.slice_backward.default, (
            graph.call_function(view.target, (base, view.args[1])), *pad.args[1:]))
        index, inner = [], 1  # the row's coordinate along each leading dim, last fastest
        for k in reversed(range(len(lead))):
            i = graph.call_function(aten.remainder.Scalar, (
                graph.call_function(aten.div.Scalar_mode, (rows, inner),
                                    {"rounding_mode": "floor"}), lead[k]))
            index.insert(0, graph.call_function(aten.add.Scalar, (i, start)) if k == dim else i)
            inner *= lead[k]
        scattered = graph.call_function(aten.index_put.default,
                                        (padded, [*index, column], picked, True))
    scattered.meta = dict(pad.meta)
    pad.replace_all_uses_with(scattered)
    for n in (pad, view, grad):
        graph.erase_node(n)
    return True


def _split_alpha(gm: fx.GraphModule) -> None:
    """add/sub(a, b, alpha=k) -> add/sub(a, mul(b, k)).

    Inductor 2.13's CPU pattern matcher folds `add(mm(x, y), b, alpha=k)` into
    `addmm(b, x, y)` and drops `alpha` (silently wrong: SGD weight decay on a Linear weight
    showed it). Spelling the scale out keeps its rewrite correct.
    """
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        alpha = node.kwargs.get("alpha", 1)
        if node.target not in (aten.add.Tensor, aten.sub.Tensor) or alpha == 1:
            continue
        with gm.graph.inserting_before(node):
            scaled = gm.graph.call_function(aten.mul.Tensor, (node.args[1], alpha))
        scaled.meta = dict(node.args[1].meta) if isinstance(node.args[1], fx.Node) else {}
        node.args = (node.args[0], scaled)
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "alpha"}
    gm.graph.lint()
    gm.recompile()
