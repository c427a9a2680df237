"""The Trainer: runs compiled training steps against the user's own module and optimizer.

The user's `nn.Module` and `torch.optim` instance stay the source of truth: every step reads
parameters, buffers, optimizer state and the current learning rate from them, and the compiled
step updates those very tensors in place. A batch whose shapes, dtypes or devices differ from
those seen before is captured and compiled again (one cache entry per signature).
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from glmc.analysis.cost import get_profile, measure_node_times
from glmc.analysis.memory import MeasurementUnavailable, measure_peak
from glmc.analysis.predict import Prediction, predict
from glmc.backends import CompiledStep, get_backend
from glmc.backends.base import ARTIFACT_DIR
from glmc.compiler.passmanager import Need, Pass, PassContext, PassManager, PassRecord
from glmc.errors import CaptureError, ConfigError, GraphBreakError, InputError, Offense
from glmc.ir.graph import Role, TrainGraph
from glmc.ir.writeback import copy_back, writeback_pairs
from glmc.parallel.data import DataParallel
from glmc.passes import parse_pipeline, with_pass
from glmc.report.summary import CompileRecord, Report
from glmc.runtime.cudagraph import GraphedStep, check_cuda_graphs
from glmc.runtime.pieces import PieceStep, fallback_warning
from glmc.runtime.strategy import (SingleProcess, model_device, pipeline_plan,
                                   pipeline_trainer_for, strategy_for)
from glmc.trace.capture import Batch, batch_leaves, capture_step, describe, split_batch
from glmc.trace.optim import ensure_state, resolve_optimizer, rule_for
from glmc.trace.valuestats import record_value_stats

#: the calls (the first compiles, the second measures memory) whose collective waits are
#: measured; the others are timed
_WAIT_CALLS = (3, 5, 7)


@dataclass
class _Entry:
    graph: TrainGraph
    step: CompiledStep
    getters: list[Callable[[list[torch.Tensor]], torch.Tensor]]  #: batch leaves -> input
    record: CompileRecord
    pipeline: list[Pass] = field(default_factory=list)  #: the passes this entry ran
    pieces: PieceStep | None = None  #: the model breaks into several graphs (glmc.runtime.pieces)
    micro: CompiledStep | None = None  #: a micro-batch's step under gradient accumulation
    micro_graph: TrainGraph | None = None  #: its program (glmc.parallel.data.micro_program)
    writeback: list[tuple[int, int]] = field(default_factory=list)  #: (output, input) pairs
    #: the step's state outputs are taken over, not copied (CompiledStep.adopt): input index ->
    #: the nn.Parameter behind a parameter input (its detached alias is what the step reads)
    owners: dict[int, torch.Tensor] | None = None
    graphed: GraphedStep | None = None  #: the step as one CUDA graph (glmc.runtime.cudagraph)
    calls: int = 0
    retried: bool = False  #: compiled again because a pass asked after measurement
    model_flops: float | None = None  #: the step's matmul FLOPs, counted on first use (metrics)


@dataclass
class TrainerOptions:
    backend: Any = "inductor"  #: a registered name, or a Backend instance (non-default options)
    passes: str | list[Pass] | None = None
    disable: frozenset[str] = frozenset()
    memory_budget: Any = None
    precision: str | None = None
    fusion: bool | None = None  #: None: the default pipeline's choice (on)
    strict: bool = False
    max_cache: int = 8
    profile: Any = None  #: cost-model device profile: None (host/GPU default), name, DeviceProfile
    predict: bool = True  #: predict step time and memory after capture and after each pass
    measure: bool = True  #: measure the peak memory of the second step of every compile
    profile_guided: bool = False  #: time every node on real tensors instead of the formulas
    dump_dir: str | None = None  #: write the step's Python after capture and after each pass
    #: a step saved by glmc.save_graph to use instead of capturing the example batch's shapes
    graph_path: str | None = None
    #: data parallel: every batch given to `step` (and the example) holds only this rank's
    #: rows already (a data source that reads just them); the loss is still the global batch's
    local_batches: bool = False
    #: warm start: a directory of optimized steps keyed by what they depend on
    #: (glmc.runtime.stepcache); "default" is ~/.cache/glmc/steps (GLMC_STEP_CACHE); None: off
    step_cache: str | None = None
    #: gradient clipping by global 2-norm inside the step (glmc.passes.clip); None: off
    clip_grad_norm: float | None = None
    progress: bool = False  #: say on stderr what the compile is doing (capture, passes, backend)
    #: data parallelism over torch.distributed (glmc.parallel.data.Parallel, a ZeRO stage, or a dict)
    parallel: Any = None
    #: CPU steps: glibc malloc keeps freed memory, so a step's buffers are not page-faulted in
    #: again every step (glmc.runtime.hostalloc; process-wide, measured 24-26% faster steps)
    retain_memory: bool = True
    #: CUDA: the whole step recorded once as a CUDA graph and replayed (glmc.runtime.cudagraph; partial:
    #: not yet run on a GPU)
    cuda_graphs: bool = False


@dataclass
class Trainer:
    model: nn.Module
    example: Batch
    loss_fn: Any
    optimizer: torch.optim.Optimizer
    options: TrainerOptions = field(default_factory=TrainerOptions)
    report: Report = field(default_factory=Report)
    scaler_state: dict[str, torch.Tensor] | None = None  #: loss scale + tracker (fp16)
    _cache: dict[Any, _Entry] = field(default_factory=dict)
    #: how the step is spread over processes (glmc.runtime.strategy; from options.parallel)
    strategy: SingleProcess | DataParallel = field(default_factory=SingleProcess)

    def __post_init__(self) -> None:
        rule_for(self.optimizer)  # fail early on an unsupported optimizer
        self._pipeline = parse_pipeline(self.options.passes, self.options.memory_budget,
                                        self.options.precision, self.options.fusion,
                                        self._device)
        if self.options.cuda_graphs:
            check_cuda_graphs(self._device, self.options.parallel)
        self._backend = get_backend(self.options.backend)
        self._traits = self._backend.traits()
        if self.options.retain_memory and self._device == "cpu":
            # before the strategy times the link: its collectives' outputs then come from the
            # heap as the step's do (gloo: a fresh 32 MiB output faulted in page by page took
            # 2-4x a 16 MiB one; priced so, ZeRO-3's gathers were predicted ~2x their time)
            from glmc.runtime.hostalloc import retain_freed_memory
            retain_freed_memory()
        self.strategy = strategy_for(self.options.parallel, self._device)
        self.strategy.check_same(self.model, self.example, self.options)
        # a size or fraction: stage-3 gathers planned with activations; "min" and the
        # rules ("selective", "full") keep the rule (every bucket gathered again), whose
        # smallest peak the joint plan may miss
        budget = self.options.memory_budget
        budgeted = budget is not None and str(budget).strip().lower() not in (
            "min", "selective", "full")
        for p in self.strategy.passes(budgeted):
            self._pipeline = with_pass(self._pipeline, p)
        self._pipeline = self.strategy.pipeline(self._pipeline)
        if self.options.clip_grad_norm is not None:  # after accumulation's running sums
            from glmc.passes.clip import ClipPass
            self._pipeline = with_pass(self._pipeline, ClipPass(self.options.clip_grad_norm))
        self._entry(self._micro_batches(self._local(self.example))[-1])

    # -- public ---------------------------------------------------------------------------------

    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One training step on this batch; returns the (detached) loss."""
        with self.strategy.guard():
            return self._step(args, kwargs)

    def _profiled_anywhere(self, entry: _Entry) -> bool:
        """Whether the user's own profiler runs on this or another rank, so that the CPU
        peak (read from profiler events) cannot be measured: every rank measures or none does
        (the ranks' peaks are compared afterwards, collectively). Warns in the record."""
        busy = self._device != "cuda" and torch.autograd._profiler_enabled()
        if self.strategy.largest(int(busy)) == 0:
            return False
        entry.record.warnings.append("memory not measured: another profiler runs on this "
                                     "thread or on another rank's")
        return True

    def _step(self, args: tuple, kwargs: dict) -> torch.Tensor:
        micro = self._micro_batches(self._local(self._normalize(args, kwargs)))
        batch = micro[-1]
        entry = self._entry(batch)
        if entry.micro is not None:  # gradient accumulation: all but the last micro-batch
            self.strategy.start_step(entry.graph)
            for mb in micro[:-1]:
                leaves = _leaves(mb)
                sums = _run(entry.micro, [get(leaves) for get in entry.getters], mb)
                self.strategy.carry(entry.micro_graph, sums)
        if entry.pieces is not None:
            t0 = time.perf_counter()
            loss = entry.pieces(batch)
            entry.record.step_seconds.append(time.perf_counter() - t0)
            return loss
        leaves = _leaves(batch)
        inputs = [get(leaves) for get in entry.getters]
        entry.calls += 1
        measured = ran = False
        step = entry.graphed or entry.step
        if self.options.measure and entry.calls == 2 and \
                not self._profiled_anywhere(entry):
            try:
                outs, m = measure_peak(lambda: step(inputs), self._device, state=inputs)
                entry.record.measured = m.to_dict()
                measured = True
            except MeasurementUnavailable as e:  # e.g. the user's own profiler is running
                entry.record.warnings.append(f"memory not measured: {e}")
        if not measured and self.options.measure and self.strategy.measures_comm and \
                entry.calls in _WAIT_CALLS:  # the communication the step waits for, from
            # profiler events: the median of a few steps (the OS's scheduling varies it)
            outs, waited = self.strategy.time_waits(lambda: _run(entry.step, inputs, batch))
            meas = entry.record.measured or {}
            if waited is None:  # the user's profiler runs on some rank
                entry.record.warnings.append(
                    f"communication waits not measured on call {entry.calls}: another "
                    "profiler runs on this thread")
            else:
                samples = [*meas.get("exposed_comm_samples", []), waited]
                entry.record.measured = {**meas, "exposed_comm_samples": samples,
                                         "exposed_comm_seconds": statistics.median(samples)}
            ran, measured = True, waited is not None and entry.record.measured is not None
        if not (measured or ran):
            t0 = time.perf_counter()
            outs = _run(step, inputs, batch)
            if self._device == "cuda":
                torch.cuda.synchronize()
            entry.record.step_seconds.append(time.perf_counter() - t0)
        if entry.graphed is not None:
            pass  # its write-back is part of the recorded graph
        elif entry.owners is not None:
            _adopt(entry.writeback, inputs, outs, entry.owners)
        elif not entry.step.inplace:
            copy_back(entry.writeback, inputs, outs)
        if measured:
            self._check_prediction(entry.record)
            self._check_budget(batch, entry)
        self._notify_optimizer()
        return outs[0].detach()

    def profile_phases(self, *args: Any, steps: int = 3, reference: bool = False,
                       **kwargs: Any) -> Any:
        """Train `steps` steps on this batch with every kernel call of the compiled step timed:
        forward, backward and optimizer time (glmc.analysis.phases.PhaseProfile; also in the report).
        `reference=True`: torch.compile on a copy of the model timed in the same loop."""
        from glmc.analysis.phases import profile_phases
        return profile_phases(self, *args, steps=steps, reference=reference, **kwargs)

    def entry_for(self, *args: Any, **kwargs: Any) -> _Entry | None:
        """The compiled entry this batch runs (None before its first step)."""
        batch = self._micro_batches(self._local(self._normalize(args, kwargs)))[-1]
        return self._cache.get(self._key(batch))

    def _notify_optimizer(self) -> None:
        """Run `optimizer.step()` with no gradients: it updates nothing (glmc keeps gradients
        inside the step), but runs the user's step hooks and lets LR schedulers see a step."""
        if all(p.grad is None for g in self.optimizer.param_groups for p in g["params"]):
            self.optimizer.step()

    @property
    def graph(self) -> TrainGraph:
        """The optimized step graph of the most recent compile (None when the model breaks
        into several graphs and was compiled in pieces: see glmc.runtime.pieces)."""
        return next(reversed(self._cache.values())).graph

    def export(self, directory: str, onnx: bool = False, ort_training: bool = False,
               tvm: bool = False, target: Any = "kunpeng920") -> list[str]:
        """Write the optimized step as runnable Python + safetensors (and ONNX, ONNX Runtime
        training artifacts, or a TVM build for `target` in `directory/tvm`, if asked)."""
        from glmc.export.artifacts import export_step, export_tvm
        written = export_step(self, directory, onnx=onnx, ort_training=ort_training)
        if tvm:
            written += export_tvm(self, str(Path(directory) / "tvm"), target)
        return written

    def write_report(self, directory: str) -> list[str]:
        """report.json and the self-contained report.html (see glmc.report.summary)."""
        return [str(p) for p in self.report.write(directory)]

    def _local(self, batch: Batch) -> Batch:
        """This rank's slice of the global batch (the batch itself on one process, or when
        the data source reads only this rank's rows: `local_batches`)."""
        return batch if self.options.local_batches else self.strategy.local(batch)

    def _micro_batches(self, batch: Batch) -> list[Batch]:
        return self.strategy.micro_batches(batch)

    @property
    def parallel(self) -> DataParallel | None:
        """This rank's data-parallel state (its strategy), or None on one process."""
        return self.strategy if isinstance(self.strategy, DataParallel) else None

    @property
    def _device(self) -> str:
        return model_device(self.model)

    def _check_prediction(self, record: CompileRecord) -> None:
        """One warning per part of the memory model (whole peak, in-step, state) that misses
        the measurement by more than 15%."""
        errors = record.to_dict()["errors"]
        for key, what in (("peak_memory", "peak memory"), ("transient_memory", "in-step memory"),
                          ("persistent_memory", "state memory")):
            err = errors.get(key)
            if err is not None and abs(err) > 0.15:
                record.warnings.append(
                    f"predicted {what} is {err * 100:+.0f}% off the measured on this machine; "
                    "memory-budgeted passes plan with the prediction")

    # -- compile cache --------------------------------------------------------------------------

    def _key(self, batch: Batch) -> tuple:
        leaves = _leaves(batch)
        spec = tuple((tuple(t.shape), t.dtype, t.device) for t in leaves)
        rule = rule_for(self.optimizer)
        guards = tuple(rule.guard(g) for g in self.optimizer.param_groups)
        return spec, guards

    def _entry(self, batch: Batch) -> _Entry:
        key = self._key(batch)
        entry = self._cache.get(key)
        if entry is None:
            entry = self._compile(batch)
            if len(self._cache) >= self.options.max_cache:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = entry
        return entry

    def _check_budget(self, batch: Batch, entry: _Entry) -> None:
        """Passes that plan on predicted memory see the measured peak (`Pass.after_measure`,
        e.g. recompute against its budget) and may ask to be run again with other options;
        the step is then compiled once more with those passes. The runtime reads no pass's
        stats and sets no pass's options: each pass decides from its own."""
        measured = entry.record.measured.get("total_peak_bytes")
        if measured is None:
            return
        # every rank decides on the same peak: recompiling on one rank alone would hang the others
        measured = self.strategy.largest(measured)
        pipeline, again = [], False
        for p, rec in zip(entry.pipeline, entry.record.history):
            verdict = p.after_measure(rec.stats, measured, entry.retried)
            if verdict.note:
                entry.record.warnings.append(verdict.note)
            pipeline.append(verdict.rerun or p)
            again |= verdict.rerun is not None
        if again and not entry.retried:
            key = self._key(batch)
            self._cache[key] = self._compile(batch, pipeline)
            self._cache[key].retried = True

    def _say(self, text: str) -> None:
        if self.options.progress:
            print(f"glmc: {text}", file=sys.stderr, flush=True)

    def _compile(self, batch: Batch, pipeline: list[Pass] | None = None) -> _Entry:
        t0 = time.perf_counter()
        key = self._cache_key(batch) if pipeline is None else None
        graph = self._cached_step(key)
        if graph is not None:
            return self._compile_graph(batch, graph, [], t0, f"hit {key}")
        self._say(f"capturing the training step for batch {describe(batch)} ...")
        try:
            with self.strategy.full_parameters(self.model, self.optimizer):
                graph = self._saved_graph(batch) or capture_step(self.model, batch,
                                                                  self.loss_fn, self.optimizer)
        except CaptureError as e:
            if batch is not self.example and self._key(batch)[0] != self._key(self.example)[0]:
                raise InputError(
                    f"step: the batch {describe(batch)} differs from example_inputs "
                    f"{describe(self.example)} and the model cannot run on it:\n{e}") from e
            if isinstance(e, GraphBreakError) and not self.options.strict:
                return self._pieces_entry(batch, e, time.perf_counter() - t0)
            raise
        return self._compile_graph(batch, graph, pipeline or self._pipeline, t0, key)

    def _cache_key(self, batch: Batch) -> str | None:
        """The step cache key of `batch`'s step, or None when the cache is off or does not
        apply (a saved graph, a parallel or accumulating strategy)."""
        if self.options.step_cache is None or self.options.graph_path is not None or \
                type(self.strategy) is not SingleProcess:
            return None
        from glmc.runtime.stepcache import step_key
        spelled = ",".join(p.spelling() for p in self._pipeline)
        return step_key(self.model, batch, self.loss_fn, self.optimizer,
                        f"{spelled}|{sorted(self.options.disable)}|{self._backend.name}|"
                        f"{self._device}|{self.options.strict}")

    def _cache_dir(self) -> Path:
        from glmc.runtime.stepcache import default_dir
        d = self.options.step_cache
        return default_dir() if d in (None, "default") else Path(d)

    def _cached_step(self, key: str | None) -> TrainGraph | None:
        if key is None:
            return None
        from glmc.runtime.stepcache import load
        t0 = time.perf_counter()
        graph = load(self._cache_dir(), key, self._device)
        if graph is not None:
            self._say(f"loaded the optimized step from the step cache ({self._cache_dir() / key})"
                      f" in {time.perf_counter() - t0:.1f} s")
        return graph

    def _cached_predictions(self, record: CompileRecord, cached: dict | None,
                            cache: str | None) -> None:
        """A cache hit's predictions come from beside the cached step (the cost model is not
        run again); a stored step gets this compile's predictions beside it."""
        from glmc.runtime.stepcache import store_extra
        if cached is not None and self.options.predict:
            record.predicted = cached.get("predicted")
            record.predicted_captured = cached.get("predicted_captured")
            record.node_seconds = dict(cached.get("node_seconds") or {})
        elif cache is not None and cache.startswith("stored ") and record.predicted:
            store_extra(self._cache_dir(), cache.split()[1],
                        {"predicted": record.predicted,
                         "predicted_captured": record.predicted_captured,
                         "node_seconds": record.node_seconds,
                         "fallbacks": [{"op": f.reason, "where": f.location}
                                       for f in record.fallbacks]})

    def _compile_graph(self, batch: Batch, graph: TrainGraph, pipeline: list[Pass],
                       t0: float, cache: str | None) -> _Entry:
        """Passes (none for a cached step), prediction, backend compile of a captured step;
        `cache`: its step-cache key to store it under after the passes, or "hit KEY"."""
        t1 = time.perf_counter()
        predictions: list[Prediction] = []
        observe: Callable[[TrainGraph], dict[str, Any]] | None = None
        cached = None  # a cached step's predictions, stored beside it
        if cache is not None and cache.startswith("hit "):
            from glmc.runtime.stepcache import load_extra
            cached = load_extra(self._cache_dir(), cache.split()[1])
        if self.options.predict and cached is None:
            profile = get_profile(self.options.profile, self._device)
            leaves = _leaves(batch)

            def predict_step(g: TrainGraph) -> dict[str, Any]:
                node_times = None
                if self.options.profile_guided:
                    node_times = measure_node_times(g.gm, [get(leaves) for get in self._getters(g)])
                predictions.append(predict(g, self._traits, profile, node_times,
                                           self.strategy.link, self.strategy.world))
                return predictions[-1].brief()
            observe = predict_step
        manager = PassManager(pipeline, self.options.disable, observe=observe,
                              dump_dir=self.options.dump_dir)
        if any(Need.VALUE_STATS in p.needs() for p in pipeline if p.name not in manager.disabled):
            leaves = _leaves(batch)
            graph.meta["value_stats"] = record_value_stats(
                graph.gm, [get(leaves) for get in self._getters(graph)])
        nodes_captured = len(graph.graph.nodes)
        if pipeline:
            self._say(f"captured {nodes_captured} nodes in {t1 - t0:.1f} s; running passes "
                      f"{', '.join(p.spelling() for p in pipeline)} ...")
        manager.run(graph, PassContext(self._traits, self.options.profile, self.strategy.spec,
                                       self.strategy.agree))
        if cache is not None and not cache.startswith("hit "):
            from glmc.runtime.stepcache import store
            why = store(self._cache_dir(), cache, graph)
            cache = f"stored {cache}" if why is None else f"not stored: {why}"
        self.strategy.check_collectives(graph)
        self.strategy.install(graph, self.model, self.optimizer)
        runnable = self.strategy.bind(graph)
        if cache is not None and cache.startswith(("hit ", "stored ")):  # the backend keeps
            runnable.meta[ARTIFACT_DIR] = str(self._cache_dir() / cache.split()[1])  # its own
        getters = self._getters(graph)
        t2 = time.perf_counter()
        self._say(f"passes done in {t2 - t1:.1f} s; compiling with {self._backend.name} ...")
        known = None  # a cached step's fallbacks: no per-op check on a warm start
        if cached is not None and cached.get("fallbacks") is not None:
            known = [Offense(f["op"], f["where"]) for f in cached["fallbacks"]]
        compiled = self._backend.compile(runnable, strict=self.options.strict,
                                         inplace=self._traits.inplace, fallbacks=known)
        self._say(f"{self._backend.name} compile done in {compiled.compile_seconds:.1f} s")
        record = CompileRecord(
            batch=describe(batch), backend=self._backend.name, capture_seconds=t1 - t0,
            passes_seconds=t2 - t1, backend_seconds=compiled.compile_seconds,
            nodes_captured=nodes_captured, nodes_final=len(graph.graph.nodes),
            history=list(manager.history), fallbacks=list(compiled.fallbacks),
            predicted_captured=predictions[0].to_dict() if predictions else None,
            predicted=predictions[-1].to_dict() if predictions else None,
            node_seconds=dict(predictions[-1].time.node_seconds) if predictions else {},
            step_cache=cache)
        self._cached_predictions(record, cached, cache)
        if self.options.retain_memory and self._device == "cpu":
            from glmc.runtime.hostalloc import retain_freed_memory
            record.host_memory = retain_freed_memory()
        self.report.compiles.append(record)
        micro, micro_graph = None, None
        if self.strategy.wants_micro_program(graph):
            micro_graph = self.strategy.micro_program(runnable)
            micro = self._backend.compile(micro_graph, strict=self.options.strict)
        owners = None  # with cuda_graphs, state is copied back inside the graph: addresses stay
        graphed = GraphedStep(compiled, graph) if self.options.cuda_graphs else None
        if graphed is None and compiled.adopt and self.strategy.adopts_state:
            params = dict(self.model.named_parameters(remove_duplicate=False))
            owners = {i: params[s.target] for i, s in enumerate(graph.inputs)
                      if s.role is Role.PARAMETER}
        return _Entry(graph, compiled, getters, record, list(pipeline or self._pipeline),
                      writeback=writeback_pairs(graph), owners=owners, micro=micro,
                      micro_graph=micro_graph, graphed=graphed)

    def _pieces_entry(self, batch: Batch, error: GraphBreakError, seconds: float) -> _Entry:
        """The model breaks into several graphs: compile the pieces (glmc.runtime.pieces), say so in
        one warning and in the report, with the passes that could not run."""
        limited = [p.spelling() for p in self._pipeline
                   if Need.STEP in p.needs() and p.name not in self.options.disable]
        message = fallback_warning(error, limited)
        warnings.warn(f"glmc: {message}", stacklevel=3)
        history = [PassRecord(p.name, p.options(), False, None, 0.0, 0, 0,
                              skipped=Need.STEP in p.needs()) for p in self._pipeline]
        record = CompileRecord(
            batch=describe(batch), backend=self._backend.name, capture_seconds=seconds,
            passes_seconds=0.0, backend_seconds=0.0, nodes_captured=0, nodes_final=0,
            history=history, fallbacks=list(error.offenses), warnings=[message])
        self.report.compiles.append(record)
        pieces = PieceStep(self.model, self.loss_fn, self.optimizer, self._backend.name)
        return _Entry(None, None, [], record, [], pieces=pieces)  # type: ignore[arg-type]

    def _saved_graph(self, batch: Batch) -> TrainGraph | None:
        """The saved step (options.graph_path) for the example batch's shapes, checked against
        the model and optimizer it will train; None for other shapes (captured as usual)."""
        if self.options.graph_path is None or self._key(batch) != self._key(self.example):
            return None
        from glmc.export.serialize import load_graph
        graph = load_graph(self.options.graph_path, device=self._device)
        ensure_state(self.optimizer)
        inputs = [get(_leaves(batch)) for get in self._getters(graph)]
        for spec, ph, value in zip(graph.inputs, graph.placeholders(), inputs):
            want = TrainGraph.info(ph).spec
            if want is not None and (tuple(value.shape), value.dtype) != (want.shape, want.dtype):
                raise InputError(f"optimize: the saved step's input '{spec.target}' is "
                                 f"{list(want.shape)} {want.dtype}, the model's is "
                                 f"{list(value.shape)} {value.dtype}; save the step of this model")
        return graph

    def _getters(self, graph: TrainGraph) -> list[Callable[[list[torch.Tensor]], torch.Tensor]]:
        scaling = graph.meta.get("loss_scaling")
        if scaling is not None and self.scaler_state is None:
            self.scaler_state = scaling.initial_state(self._device)
        getters = input_getters(graph, self.model, self.optimizer, self.scaler_state)
        return self.strategy.getters(graph, getters)

    # -- state ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The trainer's own state (the loss scaler's scale and growth tracker under fp16); the
        model and optimizer keep theirs in their own state_dicts."""
        if self.scaler_state is None:
            return {}
        return {"loss_scaler": {k: v.detach().clone() for k, v in self.scaler_state.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        scaler = state.get("loss_scaler")
        if scaler is None:
            return
        if self.scaler_state is None:
            raise InputError("load_state_dict: the state has a loss scaler, but this trainer "
                             "does not use loss scaling (precision fp16)")
        if set(scaler) != set(self.scaler_state):
            raise InputError(f"load_state_dict: loss scaler keys {sorted(scaler)} differ from "
                             f"{sorted(self.scaler_state)}")
        for k, v in scaler.items():
            self.scaler_state[k].copy_(v)

    @property
    def loss_scale(self) -> float | None:
        """The current loss scale (reads it from the device), or None without loss scaling."""
        return None if self.scaler_state is None else float(self.scaler_state["loss_scale"])

    # -- input checking -------------------------------------------------------------------------

    def _normalize(self, args: tuple, kwargs: dict) -> Batch:
        ex_args, ex_kwargs = self.example
        if ex_kwargs:
            if args:
                raise InputError("step: example_inputs was a dict; call step(**batch)")
            if set(kwargs) != set(ex_kwargs):
                raise InputError(f"step: batch keys {sorted(kwargs)} differ from example_inputs "
                                 f"keys {sorted(ex_kwargs)}")
            batch: Batch = ((), {k: kwargs[k] for k in ex_kwargs})
        else:
            if kwargs:
                raise InputError("step: example_inputs was a tuple; call step(*batch)")
            if len(args) != len(ex_args):
                raise InputError(f"step: got {len(args)} batch elements, example_inputs had "
                                 f"{len(ex_args)}")
            batch = (tuple(args), {})
        for t, e in zip(_leaves(batch), _leaves(self.example)):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"step: batch elements must be tensors, got {type(t).__name__}")
            if t.dim() != e.dim() or t.dtype != e.dtype:
                raise InputError(f"step: batch element of shape {tuple(t.shape)} {t.dtype} does "
                                 f"not match example_inputs' {tuple(e.shape)} {e.dtype}; pass "
                                 "tensors with the same rank and dtype")
        return batch


def input_getters(graph: TrainGraph, model: nn.Module, opt: torch.optim.Optimizer,
                  scaler: dict[str, torch.Tensor] | None = None
                  ) -> list[Callable[[list[torch.Tensor]], torch.Tensor]]:
    """For each step input, a function of the batch leaves that returns the tensor to pass:
    the user's parameters, buffers, optimizer state and lr, the scaler state, the batch."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    unknown = [s.target for s in graph.inputs if (s.role is Role.PARAMETER and s.target not in
               params) or (s.role is Role.BUFFER and s.target not in buffers)]
    if unknown:
        raise InputError(f"step: the model has no parameter or buffer named {unknown[:5]}; "
                         "the step was captured from a different model")
    lr_cache: dict[float, torch.Tensor] = {}

    def lr_tensor(gi: int) -> Callable[[list[torch.Tensor]], torch.Tensor]:
        def get(_: list[torch.Tensor]) -> torch.Tensor:
            lr = float(opt.param_groups[gi]["lr"])
            if lr not in lr_cache:
                lr_cache.clear()
                lr_cache[lr] = torch.tensor(lr, dtype=torch.float64)
            return lr_cache[lr]
        return get

    def state(key: str, p: torch.Tensor) -> Callable[[list[torch.Tensor]], torch.Tensor]:
        return lambda _: opt.state[p][key]

    def leaf(i: int) -> Callable[[list[torch.Tensor]], torch.Tensor]:
        return lambda leaves: leaves[i]

    getters = []
    for spec in graph.inputs:
        if spec.role is Role.PARAMETER:
            p = params[spec.target].detach()
            getters.append(lambda _, p=p: p)
        elif spec.role is Role.BUFFER:
            b = buffers[spec.target]
            getters.append(lambda _, b=b: b)
        elif spec.role is Role.OPTIMIZER_STATE:
            key, _, name = spec.target.partition(":")
            getters.append(state(key, params[name]))
        elif spec.role is Role.HYPERPARAM:
            getters.append(lr_tensor(int(spec.target.split(":")[1])))
        elif spec.role in (Role.ACCUMULATOR, Role.COMM_STATE):  # glmc.parallel.data keeps these
            getters.append(lambda _, t=spec.target: _no_accumulator(t))
        elif spec.role is Role.SCALER:
            if scaler is None:
                raise ConfigError("step: the step uses loss scaling but no scaler state is kept")
            t = scaler[spec.target]
            getters.append(lambda _, t=t: t)
        else:
            getters.append(leaf(int(spec.target.split(":")[1])))
    ensure_state(opt)
    return getters


def _no_accumulator(target: str) -> torch.Tensor:
    raise ConfigError(f"step: the step takes {target!r}, state of data parallelism, but runs "
                      "without glmc.parallel.data")


def _run(step: CompiledStep, inputs: list[torch.Tensor], batch: Batch) -> list[torch.Tensor]:
    """Run a compiled step; a kernel rejecting the batch's values (a label out of range, an
    index past an embedding) is an InputError. The state is untouched: such checks fail in the
    forward, before any new state exists, and write-back happens only after."""
    try:
        return step(inputs)
    except (RuntimeError, IndexError) as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "out of bounds" not in text and "out of range" not in text:
            raise
        raise InputError(f"step: the step failed on the batch {describe(batch)}: {text}; check "
                         "the batch's values (e.g. labels within [0, number of classes), "
                         "token ids within the vocabulary)") from e


def _adopt(pairs: list[tuple[int, int]], inputs: list[torch.Tensor],
           outputs: list[torch.Tensor], owners: dict[int, torch.Tensor]) -> None:
    """Point the tensors a step read its state from at the new state it returned (no copy):
    the optimizer-state, buffer and scaler tensors themselves, and for a parameter both the
    alias the step reads and the nn.Parameter. Identities stay (the optimizer's state dict,
    tied modules and user references to the module's tensors see the new values); storage
    taken before the step (e.g. `w = p.detach()`) keeps the old values, as after
    `load_state_dict(assign=True)`. An output returned twice is copied for its second owner."""
    seen: set[int] = set()
    with torch.no_grad():
        for k, i in pairs:
            new = outputs[k]
            if new is inputs[i] or new.data_ptr() == inputs[i].data_ptr():
                continue
            if new.numel() and new.data_ptr() in seen:
                new = new.clone()
            seen.add(new.data_ptr())
            inputs[i].data = new
            owner = owners.get(i)
            if owner is not None:
                owner.data = new


_leaves = batch_leaves


def make_trainer(model: nn.Module, example_inputs: Any, *, loss_fn: Any = None,
                 optimizer: torch.optim.Optimizer | None = None, **options: Any) -> Any:
    """A Trainer for the step, or — when `parallel` is a pipeline plan (a `ParallelPlan` or
    its spelling with `pp`) — a PipelineTrainer over the processes of the default group."""
    pipe = pipeline_plan(options.get("parallel"))
    if pipe is not None:
        return pipeline_trainer_for(model, example_inputs, loss_fn, optimizer, pipe, options)
    batch = split_batch(example_inputs)
    for t in _leaves(batch):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"optimize: example_inputs must hold tensors only, got "
                             f"{type(t).__name__}")
    optimizer = resolve_optimizer(model, optimizer)
    known = {f.name for f in dataclasses.fields(TrainerOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"optimize: unknown option(s) {unknown}; known: {sorted(known)}")
    return Trainer(model, batch, loss_fn, optimizer, TrainerOptions(**options))
