"""Find the first node of a step whose value TVM computes differently from torch.

    .venv/bin/python tools/tvm_bisect.py examples/mlp.py [--no-fusion] [--tol 1e-3]

Captures FILE's step (glmc's default pipeline, or without fusion), decomposes it as the TVM
backend does, makes every intermediate tensor an output, builds it for the host and runs it
and torch on the same random inputs; prints the first node that differs (and its inputs).
A debugging aid for new TVM frontend converters (backends/tvm_ops.py).
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--no-fusion", action="store_true")
    ap.add_argument("--tol", type=float, default=1e-3)
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    import tvm
    from glmc.backends.tvm.backend import decompositions, to_tvm
    from glmc.backends.tvm.ops import CONVERTERS
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program

    import glmc
    from glmc.compiler.onnx_lowering import _decompose, example_inputs
    from glmc.compiler.onnx_lowering import lower_to_reshapes as _lower
    from glmc.frontend.workload import load_workload
    from glmc.ir.graph import TrainGraph

    w = load_workload(a.file)
    trainer = glmc.optimize(w.model, w.example_inputs, loss_fn=w.loss_fn, optimizer=w.optimizer,
                            backend="eager", fusion=not a.no_fusion, predict=False, measure=False)
    g = trainer.graph
    step = TrainGraph(_lower(g.gm), g.inputs, g.outputs, g.meta)
    torch.manual_seed(0)
    vals = [torch.randn(t.shape, dtype=t.dtype) if t.dtype.is_floating_point else t
            for t in example_inputs(step)]
    vals = [v.abs() * 1e-2 if v.dim() == 0 and v.dtype.is_floating_point else v for v in vals]
    dec = _decompose(step.gm, [v.clone() for v in vals], fake=False, table=decompositions())
    nodes = [n for n in dec.graph.nodes if n.op == "call_function"
             and isinstance(n.meta.get("val"), torch.Tensor)]
    out = next(n for n in dec.graph.nodes if n.op == "output")
    out.args = (tuple(nodes),)
    dec.recompile()

    class _All(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.step = dec

        def forward(self, *xs):
            return tuple(self.step(*xs))

    mod = from_exported_program(torch.export.export(_All(), tuple(vals)),
                                run_ep_decomposition=False, custom_convert_map=CONVERTERS)
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    got = [torch.from_dlpack(o) for o in vm["main"](*[to_tvm(v) for v in vals])]
    want = dec(*vals)
    for n, x, y in zip(nodes, got, want):
        bad = x.dtype != y.dtype or x.shape != y.shape or (
            x.numel() and not torch.allclose(x.double(), y.double(), rtol=a.tol, atol=a.tol))
        if bad:
            print(f"first difference: {n.format_node()}\n  tvm {x.dtype} {tuple(x.shape)} "
                  f"{x.flatten()[:4].tolist()}\n  torch {y.dtype} {tuple(y.shape)} "
                  f"{y.flatten()[:4].tolist()}")
            for arg in n.all_input_nodes:
                print(f"  input: {arg.format_node()}")
            return 1
    print(f"all {len(nodes)} values agree (tol {a.tol})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
