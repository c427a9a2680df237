"""`ort`: the step's forward and backward lowered to ONNX once per compile, run by ONNX
Runtime; the optimizer update run by torch's kernels in place.

    step graph (after glmc's passes) --split_update--> front (forward, backward) + update
    front --glmc.compiler.onnx_lowering--> step.onnx --> InferenceSession, IO binding every step
    update --write-back form--> ATen's fused Adam/AdamW (`_fused_adamw_`) on the user's tensors

Guarantees: the same ATen program as `eager` (glmc's fused ops and the fused attention's
backward decomposed to plain ATen first), the forward and backward executed by ONNX Runtime's
kernels; fp32 losses and state match eager to ~1e-6 relative (tests/test_ort.py). The update
is not ONNX Runtime's: its CPU kernels ran it as one elementwise node after another (~1,800
nodes per step on GLM small, ~15% of the step), where torch's fused kernel makes one pass per
tensor; the fusion pass picks that kernel here (`traits().fused_update`). Nothing is copied
through Python: inputs are bound by pointer (`bind_input(..., buffer_ptr=tensor.data_ptr())`,
zero-copy), parameters and optimizer state are updated where they live (bound once), and the
state ONNX Runtime computes itself (BatchNorm's running statistics) is written straight into
buffers this backend owns (two sets taking turns, each bound once), which the runtime points
the user's tensors at (`CompiledStep.adopt`): the user's module and optimizer always hold the
current values (their `state_dict()` and checkpoints need no sync). The loss and the
gradients handed to the update are fresh tensors each step. A step that cannot be cut (no
update) runs whole in ONNX Runtime, its state written into the buffer sets the same way.

Not guaranteed / by design:
* No per-op fallback: an op that does not lower to ONNX is a typed `ExportError` at compile
  time listing every such op with its source line (`glmc check --backend ort` lists them).
* Random ops (dropout) draw their masks from ONNX Runtime's generator, not torch's: a step
  with dropout trains, but its losses do not reproduce eager's (a warning and a report
  fallback entry say so). torch.manual_seed does not seed them.
* bf16: ONNX Runtime's CPU kernels lack most bf16 ops; each node type the session rejects
  runs in fp32 (inputs cast up, result cast back to bf16) and is listed in the report.
* CUDA (`CUDAExecutionProvider` with tensors on a GPU): the code path binds device pointers;
  it is untested here (no onnxruntime-gpu build on the test machine) — partial.
* State outputs ONNX Runtime writes are overwritten by the call after next: whoever calls
  the step keeps them by adopting them (the runtime does) or copies them before then. A
  reference the user took to such a buffer's storage before a step holds old values after
  it; the buffer object itself is always current.
"""
from __future__ import annotations

import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.fx as fx
from glmc.backends.base import Backend, StepFn, step_device

from glmc.analysis.phases import CallSite, Instrument, KernelCall, phase_map, sync_for
from glmc.compiler.inplace import inplace_module
from glmc.errors import ConfigError, ExportError, Offense
from glmc.ir.graph import RANDOM_OPS, OutputKind, TrainGraph, op_name
from glmc.ir.split import UpdateSplit, split_update
from glmc.ir.target import BackendTraits

#: outputs written into this backend's buffer sets (the runtime adopts them)
_STATE = (OutputKind.PARAM, OutputKind.BUFFER, OutputKind.STATE)
#: the exporter's default (20) has ops onnxruntime 1.19's CPU EP lacks (ReduceMax-20)
_OPSET = 18
#: bf16 -> fp32 fallback rounds of session creation before giving up
_MAX_FALLBACK_ROUNDS = 64


class OrtBackend(Backend):
    """ONNX Runtime (CPU EP; CUDA EP code path, untested). Functional: `traits().inplace` is
    False, the runtime writes new state back."""

    name = "ort"

    def __init__(self, providers: list[str] | None = None) -> None:
        self._providers = providers
        self._checked: tuple[TrainGraph, list[Offense]] | None = None
        self._notes: list[Offense] = []  #: what runs differently from eager (report)

    def traits(self) -> BackendTraits:
        # fused_update: the update runs in torch (see `_front`), as ATen's fused kernel
        return BackendTraits(self.name, fusion=None, early_writeback=False, inplace=False,
                             fused_update=True)

    def supports(self, node: fx.Node) -> str | None:
        return None  # decided for the whole step by `unsupported` (the exporter's registry)

    def unsupported(self, graph: TrainGraph) -> list[Offense]:
        """Every op of `graph` that does not lower to ONNX (after glmc's decompositions), with
        source lines; traced on fake tensors (seconds)."""
        if self._checked is not None and self._checked[0] is graph:
            return self._checked[1]
        from glmc.compiler.onnx_lowering import (example_inputs, onnx_offenses, onnx_ready,
                                                 require_onnx)
        require_onnx(f"backend '{self.name}'")
        g = onnx_ready(_front(graph)[0])
        offenses = onnx_offenses(g, example_inputs(g), extra_decompositions=True)
        self._checked = (graph, offenses)
        return offenses

    per_op_fallback = False
    unsupported_message = ("op(s) of the step do not lower to ONNX (no per-op fallback on ONNX "
                           "Runtime); run the step without the pass named below, change the "
                           "model, or use backend='inductor':")

    def notes(self) -> list[Offense]:
        return list(self._notes)

    def _compile(self, gm: fx.GraphModule, graph: TrainGraph) -> StepFn:
        from glmc.compiler.onnx_lowering import example_inputs, export_onnx, onnx_ready

        front, split = _front(TrainGraph(gm, graph.inputs, graph.outputs, graph.meta))
        step = onnx_ready(front)
        self._notes = _random_notes(step)
        with tempfile.TemporaryDirectory(prefix="glmc-ort-") as tmp:
            path = export_onnx(step, example_inputs(step), Path(tmp) / "step.onnx",
                               extra_decompositions=True, where=f"backend '{self.name}'",
                               opset=_OPSET)
            import onnx
            model = onnx.load(str(path))
        device = step_device(step)
        session, fp32_ops = _session(model, self._providers_for(device))
        self._notes += [Offense(f"{op}: ONNX Runtime's CPU kernels have no bf16 {op}; it runs "
                                "in fp32 (inputs cast up, result cast back to bf16)", "<step>")
                        for op in fp32_ops]
        runner = _Runner(session, step, device)
        return runner if split is None else _Hybrid(runner, split)

    def _providers_for(self, device: torch.device) -> list[str]:
        import onnxruntime as ort
        if self._providers is not None:
            return self._providers
        if device.type == "cuda":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise ConfigError(f"backend '{self.name}': the step's tensors are on {device} "
                                  "but this onnxruntime has no CUDAExecutionProvider; install "
                                  "onnxruntime-gpu or train on the CPU")
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        return ["CPUExecutionProvider"]


def _front(graph: TrainGraph) -> tuple[TrainGraph, UpdateSplit | None]:
    """What ONNX Runtime runs: the step before its optimizer update (`split_update`), or the
    whole step where nothing can be cut. ONNX Runtime's CPU kernels run an update as one
    elementwise node after another over every tensor (~15% of GLM small's step, 15.7M
    parameters); torch's fused Adam is one pass per tensor."""
    split = split_update(graph)
    return (graph, None) if split is None else (split.front, split)


def _random_notes(graph: TrainGraph) -> list[Offense]:
    randoms = sorted({op_name(n) for n in graph.compute_nodes() if op_name(n) in RANDOM_OPS})
    if not randoms:
        return []
    text = (f"{', '.join(randoms)}: masks are drawn by ONNX Runtime's generator, not torch's "
            "(torch.manual_seed does not seed them); losses differ from eager's")
    warnings.warn(f"backend 'ort': {text}", stacklevel=4)
    return [Offense(text, "<step>")]


# ---- the session ------------------------------------------------------------------------------

def _session(model: Any, providers: list[str]) -> tuple[Any, list[str]]:
    """An InferenceSession of `model`; node types ONNX Runtime has no kernel for in bf16 are
    rewritten to run in fp32 (glmc.backends.ort.bf16), one round per rejected type."""
    import onnxruntime as ort
    from glmc.backends.ort.bf16 import function_ops_in_fp32, missing_kernel, run_in_fp32

    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()  # as many threads as torch uses
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3  # warnings about unused initializers are noise here
    # no spinning: ONNX Runtime's idle pool threads otherwise keep both cores busy after a
    # run, while torch runs the update and the user's loop (interleaved on 2 cores: the CNN's
    # eager step took 55 ms next to a spinning session, 29 ms next to this one; ORT's own step
    # 94 -> 63 ms on the CNN, 1145 -> 1086 ms on GLM small)
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    fp32_ops: list[str] = []
    for _ in range(_MAX_FALLBACK_ROUNDS):
        try:
            return ort.InferenceSession(model.SerializeToString(), options,
                                        providers=providers), fp32_ops
        except Exception as e:  # onnxruntime's NOT_IMPLEMENTED has no own Python type
            op = missing_kernel(str(e))
            if op is None:
                raise
            if op not in fp32_ops and run_in_fp32(model, op):
                fp32_ops.append(op)
                continue
            expanded = function_ops_in_fp32(model)  # `op` came from a function's body
            if not expanded:
                raise
            fp32_ops += expanded
    raise ExportError(f"backend 'ort': more than {_MAX_FALLBACK_ROUNDS} op types lack "
                      "kernels for the step's dtypes")


# ---- running a step ---------------------------------------------------------------------------

class _Runner:
    """Runs the session with IO binding, state resident in buffers this runner owns.

    Two buffer sets take turns: a call reads the state from one (the user's tensors point at
    it, see `CompiledStep.adopt`) and writes the new state into the other, which the runtime
    then adopts — no copy of the weights or optimizer state per step. Each set has its own
    IOBinding, so in a steady loop nothing is rebound but the batch (and the loss, a fresh
    tensor the caller may keep). A set that overlaps the call's inputs (e.g. a caller that did
    not adopt the last outputs) is skipped, so outputs never alias inputs."""

    adopt = True

    def __init__(self, session: Any, graph: TrainGraph, device: torch.device) -> None:
        self.session = session
        self.device = device
        self.in_names = [i.name for i in session.get_inputs()]
        self.out_names = [o.name for o in session.get_outputs()]
        out_vals = [a.meta["val"] for a in _output_args(graph)]
        self.out_specs = [(tuple(v.shape), v.dtype) for v in out_vals]
        self.state = [spec.kind in _STATE for spec in graph.outputs]
        self.bindings = [session.io_binding(), session.io_binding()]
        self.bound: list[list[tuple | None]] = [[None] * len(self.in_names) for _ in range(2)]
        self.sets: list[list[torch.Tensor | None] | None] = [None, None]
        self.turn = 0

    def _bind(self, bind: Any, name: str, t: torch.Tensor) -> None:
        kind = "cuda" if t.device.type == "cuda" else "cpu"
        bind(name, kind, t.device.index or 0, _numpy_dtype(t.dtype), list(t.shape),
             t.data_ptr())

    def _output_set(self, j: int) -> list[torch.Tensor | None]:
        """Fresh state buffers for binding `j`, bound as its outputs."""
        bufs: list[torch.Tensor | None] = []
        for name, state, (shape, dtype) in zip(self.out_names, self.state, self.out_specs):
            if state:
                buf = torch.empty(shape, dtype=dtype, device=self.device)
                self._bind(self.bindings[j].bind_output, name, buf)
                bufs.append(buf)
            else:
                bufs.append(None)
        self.sets[j] = bufs
        return bufs

    def _choose(self, read: set[int]) -> int:
        """The buffer set this call writes: one that no input lives in, this turn's first."""
        order = (self.turn, 1 - self.turn)
        for j in order:
            bufs = self.sets[j]
            if bufs is not None and not any(b is not None and b.numel() and b.data_ptr() in read
                                            for b in bufs):
                return j
        j = next((j for j in order if self.sets[j] is None), self.turn)
        self._output_set(j)  # both sets being read happens only to a caller that kept neither
        return j

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        held = []  # copies made for this call: alive until the run returns
        read = set()
        for t in inputs:
            if t.numel():
                read.add(t.data_ptr())
        j = self._choose(read)
        binding, bound = self.bindings[j], self.bound[j]
        for i, (name, t) in enumerate(zip(self.in_names, inputs)):
            if not t.is_contiguous() or t.device != self.device:
                t = t.to(self.device).contiguous()  # a copy this step only
                held.append(t)
            key = (t.data_ptr(), t.dtype, tuple(t.shape))
            if key != bound[i]:
                self._bind(binding.bind_input, name, t)
                bound[i] = key
        outs = []
        for name, buf, (shape, dtype) in zip(self.out_names, self.sets[j], self.out_specs):
            if buf is None:  # the loss: a fresh tensor, the caller may keep it
                buf = torch.empty(shape, dtype=dtype, device=self.device)
                self._bind(binding.bind_output, name, buf)
            outs.append(buf)
        self.session.run_with_iobinding(binding)
        self.turn = 1 - j
        return outs


class _Hybrid:
    """The forward and backward on ONNX Runtime (`_Runner`), then the optimizer update by
    torch's kernels in place on the state (the update's write-back form,
    `glmc.compiler.inplace.inplace_module`: ATen's fused Adam/AdamW runs as `_fused_adamw_`). The
    parameters and optimizer state stay in the user's tensors (updated in place; ONNX Runtime
    reads them by pointer, bound once); only the front's own state outputs (buffers such as
    BatchNorm's running stats) take turns in the runner's buffer sets."""

    adopt = True

    def __init__(self, front: _Runner, split: UpdateSplit) -> None:
        from glmc.ir.writeback import writeback_pairs
        self.front = front
        self.split = split
        self.update = inplace_module(split.update)  # boxed: `update(args)` clears args
        replaces = dict(writeback_pairs(split.update))  # update output -> the input it updates
        #: the update's state inputs (updated in place: they are its state outputs), and each
        #: update output's index among them (None: an output the write-back form returns)
        self.state_inputs = list(replaces.values())
        self.sources = [list(replaces).index(k) if k in replaces else None
                        for k in range(len(split.update.outputs))]
        self.instrument = _HybridInstrument(self)
        self.calls: list | None = None  #: KernelCalls of the two parts, while profiled

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        split = self.split
        t0 = time.perf_counter()
        front = self.front([inputs[i] for i in split.front_inputs])
        args = [inputs[i] if part == "input" else front[i] for part, i in split.update_inputs]
        held = [args[j] for j in self.state_inputs]
        t1 = time.perf_counter()
        with torch.no_grad():
            rest = iter(self.update(args))
        if self.calls is not None:
            self.instrument.sync()
            self.calls += [KernelCall(0, t0, t1 - t0), KernelCall(1, t1, time.perf_counter() - t1)]
        new = [held[j] if j is not None else next(rest) for j in self.sources]
        return [front[i] if part == "front" else new[i] for part, i in split.outputs]


class _HybridInstrument(Instrument):
    """The per-phase profile of a cut step: two calls, ONNX Runtime's (forward and backward,
    one opaque call: split between them by the cost model's predicted time of their nodes)
    and the update's (torch's kernels: all optimizer time)."""

    method = ("ort: ONNX Runtime's forward+backward call timed whole, split between the two "
              "by predicted node times; the update (torch's kernels) timed whole")

    def __init__(self, hybrid: _Hybrid) -> None:
        self.hybrid = hybrid
        front, update = hybrid.split.front.gm, hybrid.split.update.gm
        self.phase_of = {**phase_map(front), **phase_map(update)}
        self.sync = sync_for(front)

    def sites(self) -> list[CallSite]:
        split = self.hybrid.split
        update = [n for n in split.update.graph.nodes if n.op == "call_function"]
        ops = sorted({op_name(n) for n in update if op_name(n) != "getitem"})
        return [CallSite("onnxruntime: forward + backward",
                         [n.name for n in split.front.compute_nodes()]),
                CallSite(f"torch update: {', '.join(ops[:3])}", [n.name for n in update])]

    @contextmanager
    def hooked(self, calls: list[KernelCall]) -> Iterator[None]:
        self.hybrid.calls = calls
        try:
            yield
        finally:
            self.hybrid.calls = None


def _output_args(graph: TrainGraph) -> list[fx.Node]:
    out = next(n for n in reversed(graph.graph.nodes) if n.op == "output")
    args = out.args[0]
    return list(args) if isinstance(args, (tuple, list)) else [args]


def _numpy_dtype(dtype: torch.dtype) -> Any:
    import numpy as np
    table = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64,
             torch.int64: np.int64, torch.int32: np.int32, torch.int8: np.int8,
             torch.uint8: np.uint8, torch.bool: np.bool_, torch.int16: np.int16}
    if dtype not in table:
        raise ConfigError(f"backend 'ort': a step input or output is {dtype}, which ONNX "
                          "Runtime's Python binding cannot bind (no numpy dtype); keep the "
                          "step's inputs and state in fp32/fp16")
    return table[dtype]
