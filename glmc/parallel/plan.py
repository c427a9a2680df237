"""The parallel plan: how one training step is spread over processes, in one frozen object.

torchtitan's `ParallelDims` is the model. Every parallel option of glmc — processes, data
parallelism and its ZeRO stage, pipeline stages, microbatches and schedule, gradient buckets,
compression, the nodes' topology — is a field here, validated once (`ParallelPlan.problems`),
with the command line's flags generated from the fields (`add_arguments` / `from_args`: one flag
per field, the same name) and a spelling that parses back to an equal plan:

    >>> plan = ParallelPlan.parse("nproc=4,pp=2,microbatches=8,schedule=interleaved")
    >>> ParallelPlan.parse(plan.spelling()) == plan
    True

The runtime picks its strategy from `plan.strategy` ("single", "data" or "pipeline"); the
degrees of the mesh come from `plan.degrees(world)` (`{"pp": S, "dp": world // S}`; tensor
parallelism adds its own dim there, inside the pipeline's). The planner returns a plan
object too.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from glmc.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbh1")
COMPRESS_METHODS = ("bf16", "fp16", "sign", "topk", "powersgd")
HIERARCHICAL = ("auto", "on", "off")


def _cli(help: str, metavar: str | None = None, type: Callable | None = None,
         choices: Iterable[str] | None = None, flag: bool = False) -> dict:
    return {"cli": {"help": help, "metavar": metavar, "type": type,
                    "choices": tuple(choices) if choices else None, "flag": flag}}


@dataclass(frozen=True)
class StepOptions:
    """The other options of a compile that the plan's rules read (never changed by the plan):
    the backend, the dtype policy, an explicit pass pipeline, disabled passes, CUDA graphs,
    and whether the step is exported."""

    backend: str = "inductor"
    precision: str | None = None
    passes: str | None = None
    disable: tuple[str, ...] = ()
    cuda_graphs: bool = False
    export: bool = False


@dataclass(frozen=True)
class ParallelPlan:
    """How a step runs over processes. Defaults: one process (`strategy == "single"`)."""

    nproc: int | None = field(default=None, metadata=_cli(
        "train on N local processes (glmc launches them through torchrun; FILE's batch is "
        "the global batch, split over the ranks): data parallel, or pipelined with --pp",
        "N", int))
    zero: int | None = field(default=None, metadata=_cli(
        "ZeRO stage when data parallel: 0 all-reduce, 1 shard optimizer state, 2 and "
        "gradients, 3 and parameters (default 0; under torchrun this option turns data "
        "parallelism on; with --pp: 0 or 1)", "S", int))
    pp: int | None = field(default=None, metadata=_cli(
        "pipeline parallel over S stages, one process each (with --nproc S; --nproc k*S: k "
        "data-parallel replicas of the pipeline); the partition pass chooses the cut by "
        "predicted cost", "S", int))
    tp: int | None = field(default=None, metadata=_cli(
        "tensor parallel over T processes (with --nproc T): attention heads and the MLP's "
        "hidden dim sharded Megatron-style, found from the step's graph (the tensor_parallel "
        "pass); --nproc k*T: k data-parallel replicas (ZeRO 0-3); with --pp S: every "
        "pipeline stage on T processes (--nproc S*T)", "T", int))
    tp_plan: str | None = field(default=None, metadata=_cli(
        "with --tp: pin weights by name, GLOB:column|row|replicate;... (fnmatch globs)",
        "PINS", str))
    tp_choose: str | None = field(default=None, metadata=_cli(
        "with --tp: layout (shard every attention, MLP, LM head and embedding the pass "
        "finds; default) or time (keep whole the ones the cost model predicts slower "
        "sharded on this link)", "HOW", str, choices=("layout", "time")))
    sequence_parallel: bool = field(default=False, metadata=_cli(
        "with --tp: sequence parallelism, activations between the blocks (norms, residual "
        "adds) sharded over the tokens, reduce-scatter/all-gather instead of all-reduce",
        flag=True))
    microbatches: int | None = field(default=None, metadata=_cli(
        "with --pp: microbatches per step (must divide the batch; default S)", "M", int))
    schedule: str = field(default="1f1b", metadata=_cli(
        "with --pp: pipeline schedule (interleaved: 2 virtual stages per rank; default 1f1b)",
        None, str, SCHEDULES))
    cut: str | None = field(default=None, metadata=_cli(
        "with --pp: where each stage after the first starts, in layers of the model's list "
        "of identical layers (0: the blocks before them are the first stage; the layer "
        "count: the blocks after them are the last), '/'-separated, e.g. 1/2/4 (glmc plan's "
        "spelling); default: the partition pass cuts by predicted cost", "CUT", str))
    accumulate: int = field(default=1, metadata=_cli(
        "micro-batches per step (gradient accumulation): one process, running sums and one "
        "update; data parallel, one collective per bucket per step; with --pp, K times the "
        "microbatches of one step", "K", int))
    bucket_mb: float | None = field(default=None, metadata=_cli(
        "gradient bucket size in MiB for data parallelism (default 25)", "M", float))
    overlap: bool = field(default=True, metadata=_cli(
        "overlap gradient communication with the backward", flag=True))
    timeout_s: float = field(default=300.0, metadata=_cli(
        "seconds before a collective that does not complete fails the step", "S", float))
    compress: str | None = field(default=None, metadata=_cli(
        "compress the data-parallel gradient traffic (error feedback on): "
        "bf16|fp16|sign|topk|powersgd", "METHOD", str))
    compress_rank: int | None = field(default=None, metadata=_cli(
        "powersgd: rank of the approximation (default 4)", "R", int))
    compress_ratio: float | None = field(default=None, metadata=_cli(
        "topk: fraction of the gradient sent (default 0.01)", "F", float))
    compress_block: int | None = field(default=None, metadata=_cli(
        "sign: one scale per B gradient elements instead of one per tensor (64: 21:1 on the "
        "wire and within 2%% of uncompressed in benchmarks/bench_compression.py)", "B", int))
    compress_warmup: int | None = field(default=None, metadata=_cli(
        "send the first N steps' gradients uncompressed (PowerSGD's start_powerSGD_iter)",
        "N", int))
    nodes: int | None = field(default=None, metadata=_cli(
        "the ranks run on K nodes, numbered node by node (a K x ranks-per-node mesh; default: "
        "torchrun's LOCAL_WORLD_SIZE, else one node)", "K", int))
    hierarchical: str | None = field(default=None, metadata=_cli(
        "on several nodes, all-reduce gradients inside each node, across nodes, inside "
        "again; auto (default): where predicted faster", None, str, HIERARCHICAL))
    intra_link: str | None = field(default=None, metadata=_cli(
        "link profile inside a node for that prediction: a name (nvlink4, infiniband-ndr, "
        "roce-200g, ethernet-25g) or ALPHAus:BETAGBps[:CALLus]", "LINK", str))
    inter_link: str | None = field(default=None, metadata=_cli(
        "link profile between nodes (default infiniband-ndr)", "LINK", str))

    # ---- what the plan is -----------------------------------------------------------------

    @property
    def strategy(self) -> str:
        """"pipeline" (--pp), "data" (a ZeRO stage, or several processes without --pp), or
        "single"."""
        if self.pp is not None:
            return "pipeline"
        if self.zero is not None or (self.nproc or 1) > 1 or self.tp is not None:
            return "data"
        return "single"

    def degrees(self, world: int) -> dict[str, int]:
        """The size of each mesh dim over `world` processes: pipeline stages and the
        data-parallel replicas of each."""
        pp = self.pp or 1
        if world % pp:
            raise ConfigError(f"plan: {world} processes do not divide into {pp} pipeline "
                              f"stages; use a multiple of {pp}")
        if self.tp is not None:
            if world % (self.tp * pp):
                raise ConfigError(f"plan: {world} processes do not divide into {pp} pipeline "
                                  f"stage(s) of tensor-parallel groups of {self.tp}; use a "
                                  f"multiple of {self.tp * pp}")
            return {"pp": pp, "dp": world // (pp * self.tp), "tp": self.tp}
        return {"pp": pp, "dp": world // pp}

    def for_rank(self) -> "ParallelPlan":
        """The plan each launched process runs: without `nproc` (it is one of them), data
        parallel with ZeRO 0 unless a stage or a pipeline was asked for."""
        zero = self.zero if self.zero is not None or self.pp is not None else 0
        return dataclasses.replace(self, nproc=None, zero=zero)

    def compress_options(self) -> dict[str, Any] | None:
        """The compress pass's options (glmc.passes.compress), or None."""
        if self.compress is None:
            return None
        out: dict[str, Any] = {"method": self.compress}
        for key, opt in (("compress_rank", "rank"), ("compress_ratio", "ratio"),
                         ("compress_block", "block"), ("compress_warmup", "warmup_steps")):
            if getattr(self, key) is not None:
                out[opt] = getattr(self, key)
        return out

    def data_parallel(self) -> dict[str, Any] | None:
        """The data-parallel options (`glmc.parallel.data.Parallel`'s fields) of this plan,
        or None where it has no data parallelism of whole steps."""
        if self.strategy != "data":
            return None
        out: dict[str, Any] = {"zero": self.zero or 0, "accumulate": self.accumulate,
                               "overlap": self.overlap, "timeout_s": self.timeout_s}
        for key in ("bucket_mb", "nodes", "hierarchical", "intra_link", "inter_link", "tp",
                    "tp_plan", "tp_choose"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.sequence_parallel:
            out["tp_sequence"] = True
        if self.compress is not None:
            out["compress"] = self.compress_options()
        return out

    # ---- validation: every rule in one place ----------------------------------------------

    def validate(self, step: StepOptions | None = None) -> "ParallelPlan":
        problems = self.problems(step)
        if problems:
            raise ConfigError("plan: " + "; ".join(problems))
        return self

    def problems(self, step: StepOptions | None = None) -> list[str]:
        """Every rule the plan breaks, alone and with the step's other options, as messages
        that name the option (spelled as its command-line flag) and say how to fix it."""
        out = self._value_problems() + self._data_problems() + self._tensor_problems()
        out += self._pipeline_problems(step or StepOptions())
        if step is not None and step.export and self.strategy != "single":
            out.append("--export-dir / --export-ort-training: exporting a data-parallel or "
                       "pipelined step is not supported yet; export from one process")
        return out

    def _value_problems(self) -> list[str]:
        out = []
        for f in dataclasses.fields(self):
            v, kind = getattr(self, f.name), f.metadata["cli"]["type"]
            if v is None or kind not in (int, float):
                continue
            if isinstance(v, bool) or not isinstance(v, int if kind is int else (int, float)):
                what = "a whole number" if kind is int else "a number"
                out.append(f"{_flag(f.name)}: must be {what}, got {v!r}")
            elif f.name == "zero":
                if v not in (0, 1, 2, 3):
                    out.append(f"--zero: {v} is not a ZeRO stage; use 0, 1, 2 or 3")
            elif v <= 0:
                out.append(f"{_flag(f.name)}: must be positive, got {v}")
        if self.schedule not in SCHEDULES:
            out.append(f"--schedule: unknown schedule {self.schedule!r}; use "
                       f"{', '.join(SCHEDULES)}")
        if self.hierarchical is not None and self.hierarchical not in HIERARCHICAL:
            out.append(f"--hierarchical: must be auto, on or off, got {self.hierarchical!r}")
        if self.compress is not None and self.compress not in COMPRESS_METHODS:
            out.append(f"--compress: unknown method {self.compress!r}; use "
                       f"{', '.join(COMPRESS_METHODS)}")
        return out

    def _data_problems(self) -> list[str]:
        out = []
        data = self.strategy != "single"
        if self.bucket_mb is not None and not data:
            out.append("--bucket-mb needs --nproc or --zero (it sizes the gradient buckets "
                       "sent between ranks)")
        if self.compress is not None and not data:
            out.append("--compress needs --nproc or --zero (it compresses the gradient "
                       "traffic between ranks)")
        for key in ("compress_rank", "compress_ratio", "compress_block", "compress_warmup"):
            if self.compress is None and getattr(self, key) is not None:
                out.append(f"{_flag(key)} needs --compress METHOD")
        if self.compress_block is not None and self.compress not in (None, "sign"):
            out.append("--compress-block needs --compress sign")
        topology = (self.nodes, self.hierarchical, self.intra_link, self.inter_link)
        if any(v is not None for v in topology) and not data:
            out.append("--nodes / --hierarchical / --intra-link / --inter-link need --nproc "
                       "or --zero (they shape the gradient all-reduce between ranks)")
        if self.nproc is not None and self.nodes is not None and self.nproc % self.nodes:
            out.append(f"--nodes {self.nodes} does not divide --nproc {self.nproc}")
        if self.hierarchical == "on" and (self.compress or (self.zero or 0) >= 2):
            out.append("--hierarchical on needs --zero 0 or 1 and no --compress (compressed "
                       "buckets travel as one flat collective each)")
        if self.compress in ("sign", "topk", "powersgd") and (self.zero or 0) >= 2:
            out.append(f"--compress {self.compress} needs --zero 0 or 1 (stages 2-3 "
                       "reduce-scatter the gradients); use bf16/fp16 there")
        for key in ("intra_link", "inter_link"):
            link = getattr(self, key)
            if link is not None:
                from glmc.analysis.comm import get_link
                try:
                    get_link(link)
                except ConfigError as e:
                    out.append(f"{_flag(key)}: {e}")
        return out

    def _tensor_problems(self) -> list[str]:
        if self.tp is None:
            return [f"{flag} needs --tp" for flag, v in (("--tp-plan", self.tp_plan),
                                                          ("--tp-choose", self.tp_choose),
                                                          ("--sequence-parallel",
                                                           self.sequence_parallel or None))
                    if v is not None]
        out = []
        if isinstance(self.tp, int) and self.tp < 2:
            out.append(f"--tp: must be 2 or more processes, got {self.tp}")
        if self.tp_choose not in (None, "layout", "time"):
            out.append(f"--tp-choose: {self.tp_choose!r}; use layout or time")
        if self.nproc is not None and isinstance(self.tp, int) and self.tp > 0 and \
                self.nproc % self.tp:
            out.append(f"--tp {self.tp} with --nproc {self.nproc}: the processes form groups "
                       f"of {self.tp} (the groups are data-parallel replicas); use a multiple "
                       f"of {self.tp}")
        if self.zero and self.nproc is not None and isinstance(self.tp, int) and \
                self.nproc <= self.tp:
            out.append(f"--tp {self.tp} --zero {self.zero} with --nproc {self.nproc}: ZeRO "
                       "shards over data-parallel replicas and there are none; use --nproc "
                       f"{2 * self.tp} (dp=2 x tp={self.tp}) or drop --zero")
        if self.compress is not None and self.nproc is not None and \
                isinstance(self.tp, int) and self.nproc <= self.tp:
            out.append(f"--tp {self.tp} --compress with --nproc {self.nproc}: compression "
                       "applies to the gradients sent between data-parallel replicas and "
                       f"there are none; use --nproc {2 * self.tp} or drop --compress")
        if self.nodes is not None:
            out.append("--tp with --nodes: not supported yet (tensor parallelism with "
                       "data-parallel replicas, ZeRO 0-3, accumulation and compression, or "
                       "inside pipeline stages)")
        if self.pp is not None and isinstance(self.tp, int) and isinstance(self.pp, int):
            if self.nproc is not None and self.nproc % (self.pp * self.tp):
                out.append(f"--tp {self.tp} --pp {self.pp}: tensor-parallel pipeline stages "
                           f"run on a multiple of {self.pp * self.tp} processes (pp x tp, "
                           f"times the data-parallel replicas); got --nproc {self.nproc}")
            if self.compress is not None:
                out.append(f"--tp {self.tp} --pp {self.pp}: --compress with tensor-parallel "
                           "pipeline stages is not supported yet; drop it")
        return out

    def _pipeline_problems(self, step: StepOptions) -> list[str]:
        out = []
        if self.pp is None:
            if self.microbatches is not None or self.schedule != "1f1b" or self.cut:
                out.append("--microbatches / --schedule / --cut need --pp")
            return out
        if (self.zero or 0) > 1:
            out.append(f"--pp {self.pp} --zero {self.zero}: a pipeline stage sums its "
                       "gradients over the microbatches before any reduction, so only the "
                       "optimizer state is sharded with a pipeline: use --zero 1 (or 0)")
        if self.nproc is not None and self.nproc % self.pp:
            out.append(f"--pp {self.pp}: --nproc must be a multiple of {self.pp} (the "
                       "processes beyond one pipeline are its data-parallel replicas)")
        if step.precision not in (None, "bf16", "fp16"):
            out.append(f"--pp: --precision {step.precision}: pipeline stages take bf16 or "
                       "fp16 (auto measures a whole step)")
        ignored = [flag for flag, v in (("--passes", step.passes),
                                        ("--disable", step.disable or None),
                                        ("--cuda-graphs", step.cuda_graphs or None),
                                        ("--compress", self.compress)) if v is not None]
        if ignored:
            out.append(f"--pp: {', '.join(ignored)} cannot apply to pipeline stages yet (each "
                       "stage is captured as its own forward, backward and update graphs, not "
                       "as one whole step for glmc's passes); drop "
                       f"{'it' if len(ignored) == 1 else 'them'} or train without --pp")
        if step.backend not in ("eager", "inductor"):
            out.append(f"--pp: --backend {step.backend} runs functional steps; pipeline stages "
                       "update their state in place: use --backend inductor (default) or eager")
        return out

    # ---- spelling and the command line ------------------------------------------------------

    def spelling(self) -> str:
        """`key=value,...` for the fields that differ from their defaults ("" for one
        process); `ParallelPlan.parse` reads it back to an equal plan."""
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                        if getattr(self, f.name) != f.default)

    @classmethod
    def parse(cls, text: str) -> "ParallelPlan":
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            key, eq, raw = item.partition("=")
            key = key.strip().replace("-", "_")
            if not eq or key not in fields:
                raise ConfigError(f"plan: cannot read {item!r}; expected key=value with a key "
                                  f"of {', '.join(fields)}")
            values[key] = _coerce(key, raw.strip(), fields[key])
        return cls(**values)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field (`--zero`, `--bucket-mb`, ...), its help from the field."""
        for f in dataclasses.fields(cls):
            cli = f.metadata["cli"]
            if cli["flag"]:
                parser.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction,
                                    default=None, help=cli["help"])
            else:
                parser.add_argument(_flag(f.name), type=cli["type"], default=None,
                                    metavar=cli["metavar"], choices=cli["choices"],
                                    help=cli["help"])

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ParallelPlan":
        """The plan of the flags `add_arguments` made (a flag not given keeps the default)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                      if getattr(args, f.name, None) is not None})

    def flags(self) -> list[str]:
        """The command-line flags that give this plan (the launcher passes them on)."""
        out = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v == f.default:
                continue
            if f.metadata["cli"]["flag"]:
                out.append(_flag(f.name) if v else "--no-" + _flag(f.name)[2:])
            else:
                out += [_flag(f.name), str(v)]
        return out


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _coerce(key: str, raw: str, f: dataclasses.Field) -> Any:
    if raw.lower() == "none":
        return None
    kind = f.metadata["cli"]["type"]
    try:
        if f.metadata["cli"]["flag"]:
            if raw.lower() not in ("true", "false"):
                raise ValueError(raw)
            return raw.lower() == "true"
        return kind(raw) if kind is not None else raw
    except ValueError:
        raise ConfigError(f"plan: {key}={raw!r} is not a valid "
                          f"{getattr(kind, '__name__', 'bool')}") from None
