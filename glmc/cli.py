"""The `glmc` command line. Exit codes: 0 ok, 1 failure (short message), 2 usage error."""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from glmc.errors import GlmcError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="glmc", description="Compile PyTorch training steps.")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compile", help="capture, optimize, compile and run N training steps",
                       description="FILE defines `model` and `example_inputs` (optionally "
                       "`loss_fn`, `optimizer`) or `workload()` returning them.")
    c.add_argument("file", metavar="FILE")
    c.add_argument("--backend", default="inductor", help="eager | inductor (default inductor)")
    c.add_argument("--passes", default=None, help='pipeline, e.g. "cleanup"')
    c.add_argument("--disable", action="append", default=[], help="skip a pass by name")
    c.add_argument("--memory-budget", default=None, help="recompute budget (fraction or bytes)")
    c.add_argument("--precision", default=None, help="fp32 | bf16 | fp16 | auto")
    c.add_argument("--fusion", action=argparse.BooleanOptionalAction, default=None,
                   help="the fusion pass (attention, norms, gated MLP, LM head+loss, "
                        "optimizer); on in the default pipeline, --no-fusion turns it off")
    c.add_argument("--steps", type=int, default=10, help="training steps to run (default 10)")
    c.add_argument("--report-dir", default=None,
                   help="write report.json, report.html and graphs/ (the step after each pass)")
    c.add_argument("--profile", default=None,
                   help="cost-model device: host (default, calibrated) | generic-cpu "
                        "(no measurement) | h100 | h200 | a100 | kunpeng920")
    c.add_argument("--profile-guided", action="store_true",
                   help="time every node on real tensors instead of the cost formulas")
    c.add_argument("--export-dir", default=None,
                   help="export the optimized step here (Python + safetensors)")
    c.add_argument("--export-onnx", action="store_true",
                   help="with --export-dir: also write step.onnx (needs the onnx extra)")
    c.add_argument("--strict", action="store_true", help="fail on ops the backend cannot take")
    c.add_argument("--debug", action="store_true", help="print tracebacks")
    k = sub.add_parser("check", help="list every op the backend cannot take, with source lines")
    k.add_argument("file", metavar="FILE")
    k.add_argument("--backend", default="inductor")
    k.add_argument("--debug", action="store_true")
    r = sub.add_parser("report", help="print a saved report's summary and re-render report.html")
    r.add_argument("dir", metavar="DIR")
    r.add_argument("--debug", action="store_true")
    cal = sub.add_parser("calibrate", help="measure this CPU again for the cost model and cache it")
    cal.add_argument("--debug", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        commands = {"compile": _compile, "check": _check, "report": _report,
                    "calibrate": _calibrate}
        return commands[args.command](args)
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


def _calibrate(args: argparse.Namespace) -> int:
    from glmc.calibration import calibrate
    from glmc.profiles import describe_profile
    print(describe_profile(calibrate(force=True)))
    return 0


def _compile(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    import glmc
    from glmc.capture import split_batch
    from glmc.workload import load_workload

    if args.steps < 0:
        raise glmc.ConfigError("--steps must be >= 0")
    work = load_workload(args.file)
    trainer = glmc.optimize(work.model, work.example_inputs, loss_fn=work.loss_fn,
                            optimizer=work.optimizer, backend=args.backend, passes=args.passes,
                            memory_budget=args.memory_budget, precision=args.precision, fusion=args.fusion,
                            strict=args.strict, disable=tuple(args.disable),
                            profile=args.profile, profile_guided=args.profile_guided,
                            dump_dir=str(Path(args.report_dir) / "graphs") if args.report_dir
                            else None)
    batch_args, batch_kwargs = split_batch(work.example_inputs)
    losses = []
    bar = tqdm(range(args.steps), desc=f"glmc[{args.backend}]", unit="step",
               disable=not sys.stderr.isatty())
    for i in bar:
        loss = trainer.step(*batch_args, **batch_kwargs).item()
        losses.append(loss)
        bar.set_postfix(loss=f"{loss:.6f}")
        print(f"step {i:4d}  loss {loss:.6f}")
    print(trainer.report.summary())
    if args.report_dir:
        for path in trainer.write_report(args.report_dir):
            print(f"report: {path}")
    if args.export_onnx and not args.export_dir:
        raise glmc.ConfigError("--export-onnx needs --export-dir DIR")
    if args.export_dir:
        for path in trainer.export(args.export_dir, onnx=args.export_onnx):
            print(f"exported: {path}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from glmc.report import load, summary
    from glmc.report_html import render_html

    data = load(args.dir)
    print(summary(data))
    out = Path(args.dir)
    html = (out if out.is_dir() else out.parent) / "report.html"
    html.write_text(render_html(data))
    print(f"report: {html}")
    return 0


def _check(args: argparse.Namespace) -> int:
    from glmc.backends import get_backend
    from glmc.capture import capture
    from glmc.workload import load_workload

    work = load_workload(args.file)
    graph = capture(work.model, work.example_inputs, work.loss_fn, work.optimizer)
    offenses = get_backend(args.backend).unsupported(graph)
    if not offenses:
        print(f"{args.file}: every op is supported by backend '{args.backend}'")
        return 0
    print(f"{args.file}: {len(offenses)} op(s) backend '{args.backend}' cannot compile "
          "(they run as eager fallbacks):")
    for o in offenses:
        print(o)
    return 1


if __name__ == "__main__":
    sys.exit(main())
