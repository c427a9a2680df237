"""`tvm`: the whole functional step imported into TVM Relax once per compile, built, and run by
Relax's virtual machine.

    step graph (after glmc's passes) --glmc.compiler.onnx_lowering decompositions + training fixes-->
    core ATen --torch.export--> ExportedProgram --relax.frontend.torch--> IRModule
    --tvm.compile(target)--> Executable --relax.VirtualMachine--> step(inputs) -> outputs

Guarantees: the same ATen program as `eager` (glmc's fused ops, the fused attention's backward
and `convolution_backward` decomposed to plain ATen first, as for ONNX Runtime), compiled by
TVM's default Relax pipeline for the target (legalize to TIR, operator fusion, FuseTIR; on
CUDA DLight schedules); fp32 losses and state match eager to rtol 1e-4 (tests/test_tvm.py).
Inputs are handed to TVM by DLPack (zero-copy; a non-contiguous tensor is copied for this
call); outputs come back by DLPack too (TVM allocates them each call). The runtime points the
user's tensors at the new state (`CompiledStep.adopt`): state stays resident in TVM's arrays
between steps, nothing is copied, and the user's module always holds the current values.

Training semantics: TVM's PyTorch frontend is written for inference. Its converters for ops
with saved statistics or indices (`native_layer_norm`, `native_group_norm`, training batch
norm, `max_pool2d_with_indices`) return placeholders (zeros, or only the first output) for
the values a backward reads. This backend therefore decomposes those ops to plain ATen before
the import (`_TRAINING_DECOMPOSITIONS`), so no inference-only converter is ever used.

Not guaranteed / by design:
* Random ops: the frontend turns dropout into the identity and `randn` into a constant drawn at
  import time; TVM has no training RNG here. A step with dropout (p > 0) or other random ops
  is a typed `ExportError` naming each op with its source line — never a silent change.
* No per-op fallback: an op the frontend has no converter for is a typed `ExportError` listing
  every such op with its source line (`glmc check FILE --backend tvm`).
* Targets: in process the step runs where its tensors live — the host CPU (`llvm`, with
  LLVM's name for this CPU as `mcpu`) or CUDA. Other targets (aarch64 / Kunpeng 920) are
  built ahead of time by glmc.tvm_export for another machine.
* Speed: the default pipeline does not tile or parallelize CPU loops (no tuning); expect it to
  be slower than Inductor on a CPU (benchmarks/bench_tvm.py).
"""
from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.fx as fx
from glmc.backends.base import Backend, StepFn, step_device

from glmc.compiler.onnx_lowering import export_step_program, lower_to_reshapes
from glmc.errors import ConfigError, ExportError, Offense
from glmc.ir.graph import RANDOM_OPS, TrainGraph, op_name
from glmc.ir.target import BackendTraits

aten = torch.ops.aten

#: named targets (`--target NAME`); any other target is a TVM target dict or string
TARGETS: dict[str, dict[str, Any]] = {
    "aarch64": {"kind": "llvm", "mtriple": "aarch64-linux-gnu"},
    "kunpeng920": {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "tsv110"},
    "x86_64": {"kind": "llvm", "mtriple": "x86_64-linux-gnu"},
    "cuda": {"kind": "cuda"},
    "h100": {"kind": "cuda", "arch": "sm_90"},
    "h200": {"kind": "cuda", "arch": "sm_90"},
    "a100": {"kind": "cuda", "arch": "sm_80"},
}

#: ops whose TVM converter computes only the inference result (placeholders for the saved
#: statistics / indices the backward reads): decomposed to plain ATen before the import
_TRAINING_DECOMPOSITIONS = (
    aten.native_layer_norm.default,  # converter: the output only, not mean / rstd
    aten.native_group_norm.default,
    aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit_functional.default,
    aten.native_batch_norm.default,
    aten.max_pool2d_with_indices.default,  # indices: zeros_like(output)
    aten.max_pool2d_with_indices_backward.default,  # no converter
    aten.max_pool3d_with_indices.default,
    aten.var_mean.correction,  # no converter
)


def require_tvm(where: str = "backend 'tvm'") -> None:
    import importlib.util
    if importlib.util.find_spec("tvm") is None:
        raise ConfigError(f"{where}: needs Apache TVM (pip install 'glmc[tvm]', i.e. "
                          "apache-tvm==0.27.0.post1)")


def resolve_target(target: Any = None, device: torch.device | None = None) -> Any:
    """A `tvm.target.Target` from a name in TARGETS, a TVM target dict or string; None: where
    the step's tensors are (the host CPU as LLVM names it, or the CUDA device's arch)."""
    import tvm
    if target is None:
        target = _device_target(device or torch.device("cpu"))
    elif isinstance(target, str) and target.lower() in TARGETS:
        target = TARGETS[target.lower()]
    elif isinstance(target, str) and target.lower() in ("host", "cpu", "llvm"):
        target = _device_target(torch.device("cpu"))
    try:
        return tvm.target.Target(target)
    except Exception as e:  # TVM's own error types for a malformed target
        raise ConfigError(f"backend 'tvm': target {target!r} is not a TVM target ({e}); use "
                          f"one of {', '.join(TARGETS)}, host, or a dict such as "
                          '{"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "tsv110"}'
                          ) from e


def _device_target(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return {"kind": "cuda", "arch": f"sm_{major}{minor}"}
    from tvm.target import codegen
    return {"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu()}


class TvmBackend(Backend):
    """Apache TVM (Relax). Functional: `traits().inplace` is False, the runtime writes new
    state back. `target`: see `resolve_target` (default: where the step's tensors are).
    `schedules=False` builds with TVM's default CPU pipeline instead of glmc's schedule rules
    (one thread, no tiling: for comparison and for isolating a schedule bug)."""

    name = "tvm"

    def __init__(self, target: Any = None, schedules: bool = True) -> None:
        self._target = target
        self.schedules = schedules
        self._checked: tuple[TrainGraph, list[Offense]] | None = None
        self.target: Any = None  #: the tvm Target of the last compile

    def __repr__(self) -> str:  # the same on every rank (ranks compare their options)
        return f"TvmBackend(target={self._target!r}, schedules={self.schedules})"

    def traits(self) -> BackendTraits:
        return BackendTraits(self.name, fusion=None, early_writeback=False, inplace=False)

    def supports(self, node: fx.Node) -> str | None:
        return None  # decided for the whole step by `unsupported` (the frontend's converters)

    def unsupported(self, graph: TrainGraph) -> list[Offense]:
        """Random ops (TVM has no training RNG) and every op TVM's PyTorch frontend has no
        converter for after glmc's decompositions, with source lines (fake tensors: seconds)."""
        if self._checked is not None and self._checked[0] is graph:
            return self._checked[1]
        require_tvm(f"backend '{self.name}'")
        from glmc.compiler.onnx_lowering import missing_ops
        step = TrainGraph(lower_to_reshapes(graph.gm), graph.inputs, graph.outputs,
                          graph.meta)
        offenses = random_offenses(step)
        try:
            decomposed = _fake_decompose(step)
        except Exception as e:  # e.g. a real constant in the graph: the compile will tell
            warnings.warn(f"backend '{self.name}': could not check the step against TVM's "
                          f"frontend ahead of time ({type(e).__name__}: {e})", stacklevel=2)
            return offenses
        known = converters()
        offenses += missing_ops(step, decomposed, lambda t: t.__name__ in known,
                                missing="no converter in TVM's PyTorch frontend",
                                register="a converter (custom_convert_map)")
        self._checked = (graph, offenses)
        return offenses

    per_op_fallback = False
    unsupported_message = ("op(s) of the step do not import into TVM Relax (no per-op fallback "
                           "on TVM); change the model, run without the pass named below, or "
                           "use backend='inductor':")

    def check(self, graph: TrainGraph) -> None:
        """Random ops fail at once: TVM's frontend has no training RNG."""
        require_tvm(f"backend '{self.name}'")
        randoms = random_offenses(graph)
        if randoms:
            raise ExportError(f"backend '{self.name}': the step has random ops; TVM's "
                              "frontend turns dropout into the identity (no training RNG), "
                              "which would train another model. Set dropout to 0 (or "
                              "model.eval() for the dropout modules) or use backend='inductor':",
                              randoms)

    def _compile(self, gm: fx.GraphModule, graph: TrainGraph) -> StepFn:
        import tvm
        from tvm import relax

        step = TrainGraph(lower_to_reshapes(gm), graph.inputs, graph.outputs, graph.meta)
        device = step_device(step)
        self.target = resolve_target(self._target, device)
        if (self.target.kind.name == "cuda") != (device.type == "cuda"):
            raise ConfigError(f"backend '{self.name}': target {self.target.kind.name} cannot "
                              f"run a step whose tensors are on {device}; build for other "
                              "targets with glmc.tvm_export.export_tvm")
        executable = build(relax_module(step), self.target, self.schedules)
        dev = tvm.cuda(device.index or 0) if device.type == "cuda" else tvm.cpu()
        return _Runner(relax.VirtualMachine(executable, dev))


# ---- the lowering -----------------------------------------------------------------------------

def decompositions() -> dict[Any, Any]:
    """The ONNX lowering's table (core ATen, glmc's ops, fused attention and convolution
    backward) plus torch's decompositions of the ops whose TVM converters are inference-only."""
    from glmc.backends.tvm.ops import DECOMPOSITIONS
    from torch._decomp import decomposition_table

    from glmc.compiler.onnx_lowering import lowering_decompositions
    table = lowering_decompositions(extra_decompositions=True)
    for op in _TRAINING_DECOMPOSITIONS:
        table[op] = decomposition_table[op]
    table.update(DECOMPOSITIONS)
    return table


def build(module: Any, target: Any, schedules: bool = True) -> Any:
    """`tvm.compile` for `target`. On CPUs (LLVM): TVM's default Relax pipeline with glmc's
    schedule rules (`glmc.backends.tvm.schedules`) after legalization (`schedules=False`:
    without them). On CUDA: DLight's GPU
    rules, without its GEMV rule, which fails on a fused reduction of the backward
    (`assert s_loops` in dlight/analysis/gemv.py); Matmul, Reduction, GeneralReduction and
    Fallback schedule every kernel."""
    import tvm
    if target.kind.name == "llvm" and schedules:
        from glmc.backends.tvm.schedules import pipeline as cpu_pipeline
        return tvm.compile(module, target=target, relax_pipeline=cpu_pipeline(target))
    if target.kind.name != "cuda":
        return tvm.compile(module, target=target)
    from tvm import relax
    from tvm.relax.backend.cuda import pipeline as cuda
    from tvm.s_tir import dlight as dl

    @tvm.transform.module_pass(opt_level=0)
    def pipeline(mod: Any, _ctx: Any) -> Any:
        legalize = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                    relax.transform.FoldConstant(), relax.transform.FuseOps(),
                    relax.transform.FuseTIR(),
                    dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.Reduction(),
                                            dl.gpu.GeneralReduction(), dl.gpu.Fallback())]
        with target:
            return tvm.transform.Sequential(
                cuda.library_dispatch_passes(target) + legalize
                + cuda.dataflow_lower_passes(target) + cuda.finalize_passes(target))(mod)

    return tvm.compile(module, target=target, relax_pipeline=pipeline)


def _fake_decompose(step: TrainGraph) -> fx.GraphModule:
    """The step decomposed as `relax_module` does, on fake tensors, traced node by node so
    every leaf op's `original_aten` is the step's own op it came from (its source line)."""
    import torch.fx.traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    from glmc.compiler.onnx_lowering import example_inputs
    with fx_traceback.preserve_node_meta(), torch.no_grad():
        return make_fx(fx.Interpreter(step.gm).run, decomposition_table=decompositions(),
                       tracing_mode="fake")(*example_inputs(step))


def converters() -> frozenset[str]:
    """The ATen op names (`add.Tensor`) TVM's exported-program frontend converts."""
    from glmc.backends.tvm.ops import CONVERTERS
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter
    return frozenset(ExportedProgramImporter().create_convert_map()) | frozenset(CONVERTERS)


def relax_module(step: TrainGraph) -> Any:
    """The (ATen-lowered) functional step as a Relax IRModule whose `main` takes the step's
    inputs in signature order and returns its outputs as a tuple."""
    from glmc.backends.tvm.ops import CONVERTERS
    from tvm.relax.frontend.torch import from_exported_program

    from glmc.compiler.onnx_lowering import _decompose, example_inputs

    inputs = example_inputs(step)
    decomposed = _decompose(step.gm, [t.clone() for t in inputs], fake=False,
                            table=decompositions())

    program = export_step_program(decomposed, inputs)
    # already core ATen: the frontend's own decomposition pass would only re-trace
    return from_exported_program(program, run_ep_decomposition=False,
                                 custom_convert_map=CONVERTERS)


def random_offenses(graph: TrainGraph) -> list[Offense]:
    """One offense per random op of the step (dropout with p > 0, randn...), with its line."""
    out = []
    for n in graph.compute_nodes():
        if op_name(n) in RANDOM_OPS and not _dropout_off(n):
            info = TrainGraph.info(n)
            out.append(Offense(f"{op_name(n)}: TVM has no training RNG (its frontend makes "
                               "dropout the identity)", info.source or info.module or n.name))
    return out


def _dropout_off(node: fx.Node) -> bool:
    return op_name(node) == "native_dropout" and len(node.args) > 1 and node.args[1] == 0.0


# ---- running a step ---------------------------------------------------------------------------

class _Runner:
    """Calls the VM's `main` on the inputs (DLPack, zero-copy) and returns its outputs as torch
    tensors (DLPack, TVM's memory kept alive by the tensors). Every call's outputs are arrays
    the VM allocates anew (an unchanged state output is its input array), so the runtime adopts
    them (`CompiledStep.adopt`): the state stays in TVM's arrays between steps, no copy."""

    adopt = True

    def __init__(self, vm: Any) -> None:
        share_threads()
        self.vm = vm
        self.main = vm["main"]

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        outs = self.main(*[to_tvm(t) for t in inputs])
        return [torch.from_dlpack(o) for o in outs]


def share_threads() -> None:
    """TVM's kernels run on as many threads as torch's (`torch.get_num_threads()`), unless
    the user set TVM_NUM_THREADS. TVM's own default is half the CPUs (it assumes two
    hyperthreads per core), which halves its speed on VMs that expose one thread per core.
    TVM reads the variable when its thread pool starts, at the first parallel kernel."""
    os.environ.setdefault("TVM_NUM_THREADS", str(torch.get_num_threads()))


def to_tvm(t: torch.Tensor) -> Any:
    import tvm
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()  # a copy for this call only
    try:
        return tvm.runtime.from_dlpack(t)
    except Exception:  # e.g. an offset view TVM finds misaligned: hand it a fresh copy
        return tvm.runtime.from_dlpack(t.clone())
