"""The `glmc` command line. Exit codes: 0 ok, 1 failure (short message), 2 usage error.

Every option is checked with glmc's own parsers before FILE is loaded (a real model can take
minutes to build), so a typo exits 2 at once, as argparse's own errors do. With `--export-onnx`
the compiled step is checked against the ONNX exporter before any training step runs.
"""
from __future__ import annotations

import argparse
import re
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from glmc.version import __version__
from glmc.errors import GlmcError

if TYPE_CHECKING:
    from glmc.frontend.workload import Workload

_BUDGET_HELP = ("adds the recompute pass with this budget for the step's peak memory: a fraction "
                "(0.5: state + half of the memory the step needs on top of it), a size of the "
                "whole peak (2GiB, 500MB, 1e9 bytes), a size above the state (+64MiB), min "
                "(the smallest reachable peak) or selective (the peak of keeping matmul, "
                "attention and collective outputs and recomputing the cheap ops between "
                "them) or full (every layer made again from its input in its backward, as "
                "Megatron-LM's full recomputation); with --pp the peak per rank, each stage planned with the "
                "microbatches its schedule keeps in flight")


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from glmc.analysis.profiles import BUILTIN
    from glmc.backends import BACKENDS
    from glmc.passes import PRECISIONS

    backends = " | ".join(BACKENDS)
    p = argparse.ArgumentParser(prog="glmc", description="Compile PyTorch training steps.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compile", help="capture, optimize, compile and run N training steps",
                       description="FILE defines `model` and `example_inputs` (optionally "
                       "`loss_fn`, `optimizer`) or `workload()` returning them.")
    _step_args(c, backends, PRECISIONS)
    c.add_argument("--steps", type=_steps, default=10, metavar="N",
                   help="training steps to run (default 10)")
    c.add_argument("--report-dir", default=None, metavar="DIR",
                   help="write report.json, report.html and graphs/ (the step after each pass)")
    c.add_argument("--phases", type=_steps, default=0, metavar="N",
                   help="after the steps, N more (training) steps with every kernel call "
                        "timed: forward/backward/optimizer time in the summary and report, "
                        "and phases-trace.json (Perfetto) in --report-dir")
    c.add_argument("--phases-reference", action="store_true",
                   help="with --phases: time torch.compile (compiled model + loss, eager "
                        "optimizer) on a copy of the model in the same loop, phase by phase")
    c.add_argument("--profile", default=None, metavar="NAME",
                   help="cost-model device: host (default: this CPU, calibrated) or a "
                        f"built-in profile: {' | '.join(BUILTIN)} (generic-cpu: fixed "
                        "figures, no measurement)")
    c.add_argument("--profile-guided", action="store_true",
                   help="time every node on real tensors instead of the cost formulas")
    c.add_argument("--export-dir", default=None, metavar="DIR",
                   help="export the optimized step here (Python + safetensors)")
    c.add_argument("--export-onnx", action="store_true",
                   help="with --export-dir: also write step.onnx (needs the onnx extra); the "
                        "step is checked against the exporter before training")
    c.add_argument("--export-ort-training", default=None, metavar="DIR",
                   help="after training, write ONNX Runtime on-device training artifacts "
                        "(training/eval/optimizer models, checkpoint, train.py) here")
    c.add_argument("--export-tvm", default=None, metavar="DIR",
                   help="after training, build the step with Apache TVM for --target and write "
                        "step.so, state.safetensors and a torch-free run_tvm.py here")
    c.add_argument("--target", default=None, metavar="T",
                   help="with --export-tvm: kunpeng920 (default) | aarch64 | x86_64 | host | "
                        "cuda | h100 | h200 | a100, or a TVM target as JSON, e.g. "
                        '\'{"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "tsv110"}\'')
    c.add_argument("--strict", action="store_true", help="fail on ops the backend cannot take")
    _cache_arg(c, "off")
    _clip_arg(c)
    c.add_argument("--cuda-graphs", action="store_true",
                   help="CUDA: record the whole step once as a CUDA graph and replay it "
                        "(partial: not yet run on a GPU)")
    _parallel_args(c)
    c.add_argument("--debug", action="store_true", help="print tracebacks")
    t = _train_parser(sub, backends, PRECISIONS)
    k = sub.add_parser("check", help="list every op the backend (or the ONNX export) cannot "
                                     "take, with source lines")
    _step_args(k, backends, PRECISIONS)
    k.add_argument("--export", choices=["onnx"], default=None,
                   help="also optimize the step (with the pipeline options) and list the ops "
                        "the ONNX exporter cannot take")
    _check_tp_args(k)
    k.add_argument("--debug", action="store_true")
    r = sub.add_parser("report", help="print a saved report's summary and re-render report.html")
    r.add_argument("dir", metavar="DIR")
    r.add_argument("--debug", action="store_true")
    cal = sub.add_parser("calibrate", help="measure this CPU again for the cost model and cache it")
    cal.add_argument("--debug", action="store_true")
    from glmc.analysis.comm import comm_arguments
    cm = comm_arguments(sub.add_parser(
        "comm", help="predict a gradient all-reduce at cluster scale: flat vs hierarchical"))
    cm.add_argument("--debug", action="store_true")
    from glmc.frontend.planning import add_plan_parser
    pl = add_plan_parser(sub)
    return p, {"compile": c, "train": t, "check": k, "report": r, "calibrate": cal, "plan": pl}


def _step_args(c: argparse.ArgumentParser, backends: str, precisions: tuple[str, ...]) -> None:
    """FILE, the backend and the pass pipeline: what every command that compiles a step takes."""
    c.add_argument("file", metavar="FILE")
    c.add_argument("--backend", default="inductor", metavar="NAME",
                   help=f"{backends} (default inductor)")
    _pipeline_args(c, precisions)


def _train_parser(sub: Any, backends: str, precisions: tuple[str, ...]) -> Any:
    """`glmc train`: the step options of `glmc compile` (no exports) and its own."""
    t = sub.add_parser("train", help="train over real data with checkpoints, resume and live "
                                     "metrics",
                       description="FILE as for `glmc compile`; data from --data (a token "
                       "file) or the FILE's `data` iterable.")
    _step_args(t, backends, precisions)
    t.add_argument("--steps", type=_steps, default=100, metavar="N",
                   help="train until step N (default 100)")
    t.add_argument("--report-dir", default=None, metavar="DIR",
                   help="write report.json, report.html and metrics.jsonl here")
    t.add_argument("--profile", default=None, metavar="NAME", help="cost-model device")
    t.add_argument("--strict", action="store_true", help="fail on ops the backend cannot take")
    _cache_arg(t, "default")
    _clip_arg(t)
    from glmc.frontend.train import add_arguments
    add_arguments(t)
    _parallel_args(t)
    t.add_argument("--debug", action="store_true", help="print tracebacks")
    return t


def _clip_arg(c: argparse.ArgumentParser) -> None:
    c.add_argument("--clip-grad-norm", type=float, default=None, metavar="X",
                   help="clip the gradients to global 2-norm X inside the step (as "
                        "torch.nn.utils.clip_grad_norm_; one process or data parallel)")


def _cache_arg(c: argparse.ArgumentParser, default: str) -> None:
    c.add_argument("--step-cache", default=default, metavar="DIR",
                   help="warm start: keep the optimized step in DIR and reuse it when the "
                        "model, batch shapes, optimizer and options are the same ('default': "
                        "~/.cache/glmc/steps, or $GLMC_STEP_CACHE; 'off' disables; default "
                        f"{default}); a reused step's report lists no passes")


def _parallel_args(c: argparse.ArgumentParser) -> None:
    """Options of data and pipeline parallelism (`glmc compile`): one flag per field of the
    parallel plan, generated from it (glmc.parallel.plan.ParallelPlan)."""
    from glmc.parallel.plan import ParallelPlan
    ParallelPlan.add_arguments(c)
    c.add_argument("--plan", dest="plan_spelling", default=None, metavar="SPELLING",
                   help="run a plan `glmc plan` printed (dp=..,tp=..,pp=..,zero=..,"
                        "microbatch=..,schedule=..,virtual=..,recompute=..,precision=..) "
                        "instead of the flags above, or auto: the top plan for this machine's "
                        "--nproc processes (glmc plan --cluster local)")


def _pipeline_args(c: argparse.ArgumentParser, precisions: tuple[str, ...]) -> None:
    from glmc.passes import registry

    passes = registry()
    c.add_argument("--passes", default=None, metavar="PIPELINE",
                   help='passes and their options, e.g. "cleanup,recompute{budget=0.5}"; '
                        f"registered passes: {', '.join(passes)}")
    c.add_argument("--disable", action="append", default=[], metavar="PASS",
                   help=f"skip a pass by name ({', '.join(passes)})")
    c.add_argument("--memory-budget", default=None, metavar="B", help=_BUDGET_HELP)
    c.add_argument("--precision", default=None, metavar="POLICY",
                   help=f"{' | '.join(precisions)}: adds the precision pass")
    c.add_argument("--fusion", action=argparse.BooleanOptionalAction, default=None,
                   help="the fusion pass (attention, norms, gated MLP, LM head+loss, "
                        "optimizer); on in the default pipeline, --no-fusion turns it off")


def _steps(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def main(argv: list[str] | None = None) -> int:
    parser, commands = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "plan_spelling", None):
        from glmc.frontend.planning import apply_plan
        try:
            argv = apply_plan(args, sys.argv[1:] if argv is None else list(argv))
        except GlmcError as e:
            commands[args.command].error(f"--plan: {e}")  # exits 2
        except Exception as e:  # planning failed inside torch: short message unless --debug
            if args.debug:
                traceback.print_exc()
            print(f"glmc: internal error while planning: {type(e).__name__}: {e} (rerun with "
                  "--debug)", file=sys.stderr)
            return 1
    if args.command in ("compile", "train"):
        from glmc.parallel.plan import ParallelPlan
        args.plan = ParallelPlan.from_args(args)
    problems = _usage_problems(args)
    if problems:
        commands[args.command].error("\n  ".join(problems))  # exits 2
    if args.command in ("compile", "train") and args.plan.nproc is not None:
        return _launch(args, sys.argv[1:] if argv is None else list(argv))
    try:
        run = {"compile": _compile, "check": _check, "report": _report,
               "calibrate": _calibrate, "comm": _comm, "train": _train, "plan": _plan}
        return run[args.command](args)
    except GlmcError as e:
        if args.debug:
            traceback.print_exc()
        print(f"glmc: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # an internal failure: short message unless --debug
        if args.debug:
            traceback.print_exc()
        print(f"glmc: internal error: {type(e).__name__}: {e} (rerun with --debug)",
              file=sys.stderr)
        return 1
    finally:
        _leave_process_group()


def _plan(args: argparse.Namespace) -> int:
    from glmc.frontend.planning import run_plan
    return run_plan(args)


def _leave_process_group() -> None:
    """Close a process group glmc opened (data parallel), so a failed rank exits cleanly."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _usage_problems(args: argparse.Namespace) -> list[str]:
    """Every usage error of the options, found by glmc's own parsers without loading FILE."""
    if args.command not in ("compile", "check", "train"):
        return []
    from glmc.analysis.cost import get_profile
    from glmc.backends import get_backend
    from glmc.passes import parse_pipeline, registry
    from glmc.passes.recompute import Budget

    problems: list[str] = []

    def check(label: str, parse: Callable[[], object]) -> bool:
        try:
            parse()
            return True
        except GlmcError as e:
            problems.append(f"{label}{e}")
            return False

    check("--backend: ", lambda: get_backend(args.backend))
    budget = args.memory_budget
    if budget is not None and not check("--memory-budget: ", lambda: Budget.parse(budget)):
        budget = None
    precision = args.precision
    if precision is not None and \
            not check("", lambda: parse_pipeline("", precision=precision)):
        precision = None
    check("", lambda: [Budget.parse(p.budget) for p in parse_pipeline(  # budget= in --passes
        args.passes, memory_budget=budget, precision=precision, fusion=args.fusion)
        if p.name == "recompute"])
    unknown = [d for d in args.disable if d not in registry()]
    if unknown:
        problems.append(f"--disable: unknown pass(es) {', '.join(unknown)}; known: "
                        f"{', '.join(registry())}")
    if getattr(args, "clip_grad_norm", None) is not None and \
            args.plan.strategy == "pipeline":
        problems.append("--clip-grad-norm with --pp: pipelines do not clip yet (one process "
                        "and data parallel do)")
    if args.command == "train":
        from glmc.frontend.train import usage_problems
        from glmc.parallel.plan import StepOptions
        problems += usage_problems(args)
        problems += args.plan.problems(StepOptions(backend=args.backend,
                                                   precision=args.precision,
                                                   passes=args.passes,
                                                   disable=tuple(args.disable)))
    if args.command == "compile":
        if args.profile is not None and args.profile.lower() not in ("host", "cpu"):
            check("--profile: ", lambda: get_profile(args.profile))  # host would calibrate
        if args.export_onnx and not args.export_dir:
            problems.append("--export-onnx needs --export-dir DIR")
        out = Path(args.export_dir) if args.export_dir else None
        if out is not None and out.exists() and not out.is_dir():
            problems.append(f"--export-dir: {out} exists and is not a directory")
        from glmc.parallel.plan import StepOptions
        step = StepOptions(backend=args.backend, precision=args.precision, passes=args.passes,
                           disable=tuple(args.disable), cuda_graphs=args.cuda_graphs,
                           export=bool(args.export_dir or args.export_ort_training))
        problems += args.plan.problems(step)  # every parallel rule: the plan owns them
        problems += _tvm_problems(args)
        ort_dir = Path(args.export_ort_training) if args.export_ort_training else None
        if ort_dir is not None and ort_dir.exists() and not ort_dir.is_dir():
            problems.append(f"--export-ort-training: {ort_dir} exists and is not a directory")
    return problems


def _comm(args: argparse.Namespace) -> int:
    from glmc.analysis.comm import predict_allreduce
    print(predict_allreduce(args))
    return 0


def _tvm_target(text: str | None) -> object:
    """--target: a name (glmc.backends.tvm.backend.TARGETS, host) or a TVM target as JSON."""
    import json
    if text is None:
        return "kunpeng920"
    return json.loads(text) if text.lstrip().startswith("{") else text


def _tvm_problems(args: argparse.Namespace) -> list[str]:
    if args.target is not None and not args.export_tvm:
        return ["--target needs --export-tvm DIR (a step trained here runs where its tensors "
                "are; --target builds it for another machine)"]
    if not args.export_tvm:
        return []
    if Path(args.export_tvm).exists() and not Path(args.export_tvm).is_dir():
        return [f"--export-tvm: {args.export_tvm} exists and is not a directory"]
    try:
        from glmc.backends.tvm.backend import require_tvm, resolve_target
        require_tvm("--export-tvm")
        resolve_target(_tvm_target(args.target))
    except (GlmcError, ValueError) as e:  # ValueError: JSON that does not parse
        return [f"--target: {e}"]
    return []


def _calibrate(args: argparse.Namespace) -> int:
    from glmc.analysis.calibration import calibrate
    from glmc.analysis.profiles import describe_profile
    print(describe_profile(calibrate(force=True)))
    return 0


def _launch(args: argparse.Namespace, argv: list[str]) -> int:
    """`glmc compile FILE --nproc N ...`: N local processes through torchrun, each running
    this command without --nproc (and with --zero, which turns data parallelism on)."""
    import subprocess

    rest, skip = [], False
    for a in argv:  # the launcher's own options stay here
        if skip:
            skip = False
        elif a in ("--nproc", "--max-restarts"):
            skip = True
        elif not a.startswith(("--nproc=", "--max-restarts=")):
            rest.append(a)
    zero = args.plan.for_rank().zero
    if zero != args.plan.zero:  # data parallel: each rank runs a ZeRO stage
        rest += ["--zero", str(zero)]
    restarts = getattr(args, "max_restarts", 0)  # glmc train --max-restarts
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.plan.nproc}", f"--max-restarts={restarts}", "-m", "glmc",
           *rest]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace")
    assert proc.stderr is not None
    for chunk in _without_launcher_noise(proc.stderr):
        sys.stderr.write(chunk)
        sys.stderr.flush()
    rc = proc.wait()
    if rc:
        print(f"glmc: error: {args.plan.nproc} processes were launched and at least one failed "
              f"(exit status {rc}); each rank's own error is above", file=sys.stderr)
    return rc


def _without_launcher_noise(lines: Any) -> Any:
    """The processes' stderr as it comes, less torchrun's own report of a failed child (its
    log lines, the launcher's traceback and its 'Failures' box between two rules of '='):
    the ranks' errors (a typed glmc error, or a real traceback) already say what failed."""
    held: list[str] = []  #: a traceback being read: the launcher's is dropped when it ends
    rules = 0  #: rules of the launcher's box still to skip past
    for line in lines:
        if held:
            held.append(line)
            if line.startswith((" ", "\t")):
                continue
            block, held = "".join(held), []
            if "torch/distributed/run.py" in block or "distributed.elastic" in block:
                rules = 2 if "ChildFailedError" in block else 0
                continue
            yield block
        elif rules:
            rules -= line.startswith("=" * 20)
        elif line.startswith("Traceback (most recent call last):"):
            held = [line]
        elif not _LAUNCHER_LOG.match(line):
            yield line
    if held:
        yield "".join(held)


#: torchrun's own log lines ("E1201 04:53:00.123000 123 .../elastic/...")
_LAUNCHER_LOG = re.compile(r"^[EWI]\d{4} [\d:.]+ \d+ .*(elastic|torch/distributed/run)")


def _step_cache(args: argparse.Namespace) -> str | None:
    return None if args.step_cache in ("off", "none", "") else args.step_cache


def _train(args: argparse.Namespace) -> int:
    from glmc.frontend.train import train
    return train(args)


def _compile(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from glmc.frontend.api import optimize
    from glmc.export.artifacts import check_onnx_export, require_onnx
    from glmc.frontend.workload import load_workload
    from glmc.trace.capture import split_batch

    if args.export_onnx:
        require_onnx()  # before the model loads
    work = load_workload(args.file)
    plan = args.plan
    if plan.strategy == "pipeline":
        from glmc.parallel.pipeline import train_cli
        return train_cli(work, args.steps, plan, args.report_dir, args.memory_budget,
                         args.backend, args.precision, bool(args.fusion))
    trainer = optimize(work.model, work.example_inputs, loss_fn=work.loss_fn,
                            optimizer=work.optimizer, backend=args.backend, passes=args.passes,
                            memory_budget=args.memory_budget, precision=args.precision,
                            fusion=args.fusion, strict=args.strict,
                            disable=tuple(args.disable), profile=args.profile,
                            profile_guided=args.profile_guided, progress=_rank() == 0,
                            parallel=plan.data_parallel() if plan.strategy == "data" else
                            (plan if plan.accumulate > 1 else None),
                            cuda_graphs=args.cuda_graphs, step_cache=_step_cache(args),
                            clip_grad_norm=args.clip_grad_norm,
                            dump_dir=str(Path(args.report_dir) / "graphs") if args.report_dir
                            and _rank() == 0 else None)
    from glmc.frontend.planning import plan_choice
    trainer.report.plan = plan_choice(getattr(args, "plan_spelling", None))
    if args.export_onnx:
        check_onnx_export(trainer)  # an export that cannot succeed fails before training
    batch_args, batch_kwargs = split_batch(work.example_inputs)
    bar = tqdm(range(args.steps), desc=f"glmc[{args.backend}]", unit="step",
               disable=not sys.stderr.isatty() or _rank() != 0)
    lead = _rank() == 0  # one rank speaks for all; the loss is the global batch's
    # each rank of a data-parallel run traces its last step (compute vs communication)
    trace_at = args.steps - 1 if args.report_dir and plan.strategy == "data" else None
    for i in bar:
        if i == trace_at:
            loss = _traced_step(trainer, batch_args, batch_kwargs, Path(args.report_dir))
        else:
            loss = trainer.step(*batch_args, **batch_kwargs).item()
        bar.set_postfix(loss=f"{loss:.6f}")
        if lead:
            print(f"step {i:4d}  loss {loss:.6f}", flush=True)
    if args.phases > 0:
        prof = trainer.profile_phases(*batch_args, steps=args.phases,
                                      reference=args.phases_reference, **batch_kwargs)
        if args.report_dir and lead:
            print(f"report: {prof.write_trace(Path(args.report_dir) / 'phases-trace.json')}")
    if not lead:
        return 0
    print(trainer.report.summary())
    if args.report_dir:
        for path in trainer.write_report(args.report_dir):
            print(f"report: {path}")
    if args.export_dir:
        for path in trainer.export(args.export_dir, onnx=args.export_onnx):
            print(f"exported: {path}")
    if args.export_ort_training:
        from glmc.export.artifacts import export_ort_training
        for path in export_ort_training(trainer, args.export_ort_training):
            print(f"exported: {path}")
    if args.export_tvm:
        from glmc.export.artifacts import export_tvm
        for path in export_tvm(trainer, args.export_tvm, _tvm_target(args.target)):
            print(f"exported: {path}")
    return 0


def _traced_step(trainer: Any, args: tuple, kwargs: dict, out: Path) -> float:
    """One step under torch.profiler, written as this rank's Chrome/Perfetto trace."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss = trainer.step(*args, **kwargs).item()
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out / f"trace-rank{_rank()}.json"))
    return loss


def _rank() -> int:
    """This process's rank under torchrun (0 on one process)."""
    import os
    return int(os.environ.get("RANK", "0"))


def _report(args: argparse.Namespace) -> int:
    from glmc.report.html import render_html
    from glmc.report.summary import load, summary

    data = load(args.dir)
    print(summary(data))
    out = Path(args.dir)
    html = (out if out.is_dir() else out.parent) / "report.html"
    html.write_text(render_html(data))
    print(f"report: {html}")
    return 0


def _check(args: argparse.Namespace) -> int:
    from glmc.backends import get_backend
    from glmc.export.artifacts import require_onnx
    from glmc.frontend.workload import load_workload
    from glmc.trace.capture import capture

    if args.export == "onnx":
        require_onnx()  # before the model loads
    work = load_workload(args.file)
    graph = capture(work.model, work.example_inputs, work.loss_fn, work.optimizer)
    offenses = get_backend(args.backend).unsupported(graph)
    if not offenses:
        print(f"{args.file}: every op is supported by backend '{args.backend}'")
    else:
        how = "no per-op fallback: compiling fails with an ExportError" \
            if args.backend in ("ort", "tvm") else "they run as eager fallbacks"
        print(f"{args.file}: {len(offenses)} op(s) backend '{args.backend}' cannot compile "
              f"({how}):")
        for o in offenses:
            print(o)
    export_ok = _check_onnx(args, work) if args.export == "onnx" else True
    tp_ok = _check_tp(args, work) if args.tp is not None else True
    return 0 if not offenses and export_ok and tp_ok else 1


def _check_tp_args(k: argparse.ArgumentParser) -> None:
    k.add_argument("--tp", type=int, default=None, metavar="N",
                   help="also shard the step N ways (the tensor_parallel pass, no processes "
                        "needed) and list the ops without a sharding rule, with source lines")
    k.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: sequence parallelism too")
    k.add_argument("--tp-plan", default="", metavar="'GLOB:KIND;...'",
                   help="with --tp: parameter pins (column|row|replicate)")
    k.add_argument("--strict", action="store_true",
                   help="with --tp: ops without a sharding rule fail the check (exit 1)")
    k.add_argument("--tp-choose", default="layout", choices=("layout", "time"),
                   help="with --tp: shard every unit the pass finds (layout), or only those "
                        "the cost model predicts faster sharded on --tp-link (time)")
    k.add_argument("--tp-link", default="nvlink4", metavar="LINK",
                   help="with --tp: the link tp's collectives cross, for the cost model (a "
                        "profile name or ALPHAus:BETAGBps; default nvlink4)")


def _check_tp(args: argparse.Namespace, work: Workload) -> bool:
    """Shard a fresh capture of the step `--tp` ways on a mesh of no processes and list the
    ops that run on whole operands (no sharding rule); bad sizes are the pass's typed
    errors. False under --strict when there are such ops."""
    from glmc.compiler.passmanager import PassContext
    from glmc.ir.graph import MeshSpec
    from glmc.passes.tensor_parallel import WHOLE_META, TensorParallelPass
    from glmc.trace.capture import capture

    graph = capture(work.model, work.example_inputs, work.loss_fn, work.optimizer)
    result = TensorParallelPass(size=args.tp, plan=args.tp_plan,
                                sequence=args.sequence_parallel, choose=args.tp_choose,
                                link=args.tp_link).run(
        graph, PassContext(mesh=MeshSpec((args.tp,), ("tp",))))
    st = result.stats
    print(f"{args.file}: tp={args.tp}: {st.column} column- and {st.row} row-parallel weights, "
          f"{st.replicated} parameters replicated; collectives per step {st.collectives}")
    for name, placement in st.placements.items():
        print(f"  {name}: {placement}")
    print(f"cost model (this host's profile, link {args.tp_link}; per step): unit, layout, "
          "compute the shards save, their collectives, MiB saved per rank")
    for unit, layout, saved, comm, mib in st.units:
        print(f"  {unit}: {layout}, saves {saved} ms, costs {comm} ms, {mib} MiB")
    whole = graph.meta[WHOLE_META]
    if not whole:
        print(f"{args.file}: every op has a sharding rule")
        return True
    print(f"{args.file}: {len(whole)} op(s) without a sharding rule run on whole operands "
          f"({'fails --strict' if args.strict else 'replicated; --strict fails on them'}):")
    for o in whole:
        print(o)
    return not args.strict


def _check_onnx(args: argparse.Namespace, work: Workload) -> bool:
    """Optimize the step as `glmc compile` would and list what the ONNX exporter cannot take."""
    from glmc.frontend.api import optimize
    from glmc.export.artifacts import onnx_export_offenses, random_ops

    trainer = optimize(work.model, work.example_inputs, loss_fn=work.loss_fn,
                            optimizer=work.optimizer, backend=args.backend, passes=args.passes,
                            memory_budget=args.memory_budget, precision=args.precision,
                            fusion=args.fusion, disable=tuple(args.disable), predict=False,
                            measure=False)
    offenses = onnx_export_offenses(trainer)
    if not offenses:
        print(f"{args.file}: the ONNX exporter takes every op of the optimized step")
    else:
        print(f"{args.file}: {len(offenses)} op(s) of the optimized step the ONNX exporter "
              "cannot take (--export-onnx would fail):")
        for o in offenses:
            print(o)
    random = random_ops(trainer.graph)
    if random:
        print(f"note: the step has random ops ({', '.join(random)}); step.onnx draws their "
              "masks from ONNX Runtime's generator, so its losses differ from torch's")
    return not offenses


if __name__ == "__main__":
    sys.exit(main())
