"""The step built by TVM ahead of time for another machine: aarch64 (Kunpeng 920), CUDA.

`write_tvm(graph, inputs, out, target)` writes into the directory `out`:

* `step.so` — the functional step compiled by TVM for `target` and linked by `cc` (for an
  aarch64 target on another host: `aarch64-linux-gnu-gcc`, found on PATH). CUDA targets embed
  the kernels (compiled by nvcc) in it; `step.cu` is their generated source.
* `state.safetensors` — every input of the step: parameters and buffers under their names in
  the model (as its state_dict), optimizer state as `optimizer_state/exp_avg:NAME`, learning
  rates as `hyperparam/lr:G` (float64 0-d), the example batch as `input/input:I`.
* `signature.json` — inputs (role, target, key, dtype, shape) in the step's order, outputs
  (kind, target), the target, and `feeds`: which output replaces which input after each step.
* `run_tvm.py` — runs N steps with TVM's runtime, numpy and safetensors only (no torch, no
  glmc): `python run_tvm.py --steps 5 [--device cuda] [--save]` prints the losses as JSON;
  `--save` writes the trained state back into `state.safetensors` (a later run resumes from
  it; `safetensors.torch.load_file` + `model.load_state_dict(..., strict=False)` brings the
  weights back into torch).

    export_tvm(trainer, "out/", target="kunpeng920")    # glmc.export.artifacts.export_tvm
    qemu-aarch64 -L SYSROOT SYSROOT/usr/bin/python3.11 out/run_tvm.py --steps 3

Only fp32/fp16 steps (numpy has no bf16) without random ops (backends/tvm.py) export.
The optimizer state is the trainer's at export time (a fresh trainer: zero moments, step 0).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from glmc.backends.tvm.backend import (build, random_offenses, relax_module, require_tvm,
                                       resolve_target)

from glmc.errors import ConfigError, ExportError
from glmc.ir.graph import InputSpec, OutputKind, Role, TrainGraph

#: files a TVM export writes (a new export into the same directory replaces them all)
TVM_EXPORT_FILES = ("step.so", "step.cu", "state.safetensors", "signature.json", "run_tvm.py")
_STATE = (OutputKind.PARAM, OutputKind.BUFFER, OutputKind.STATE)
_NUMPY = {torch.float32: "float32", torch.float16: "float16", torch.float64: "float64",
          torch.int64: "int64", torch.int32: "int32", torch.bool: "bool", torch.uint8: "uint8",
          torch.int8: "int8"}
#: a cross compiler for targets whose triple is not this machine's
_CROSS_CC = {"aarch64": "aarch64-linux-gnu-gcc"}

_RUNNER = '''"""Run the TVM-built training step: python run_tvm.py --steps N [--device cpu|cuda]
[--save]. Needs Apache TVM's runtime (pip install apache-tvm), numpy and safetensors; prints
the losses as JSON; --save writes the trained state back into state.safetensors."""
import argparse
import json
import os
from pathlib import Path

# TVM's thread pool defaults to half the CPUs (it assumes two hyperthreads per core)
os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count() or 1))
import numpy as np  # noqa: E402
import tvm  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402
from tvm import relax  # noqa: E402

HERE = Path(__file__).resolve().parent


def run(steps, device="cpu", save=False):
    sig = json.loads((HERE / "signature.json").read_text())
    data = load_file(str(HERE / "state.safetensors"))
    dev = tvm.cuda(0) if device == "cuda" else tvm.cpu()
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(HERE / "step.so")), dev)
    args = [tvm.runtime.tensor(data[spec["key"]], dev) for spec in sig["inputs"]]
    losses = []
    for _ in range(steps):
        outs = vm["main"](*args)
        losses.append(float(outs[sig["loss"]].numpy()))
        for o, i in sig["feeds"]:  # new parameters / state are the next step's inputs
            args[i] = outs[o]
    if save:
        save_file({spec["key"]: np.ascontiguousarray(a.numpy())
                   for spec, a in zip(sig["inputs"], args)}, str(HERE / "state.safetensors"))
    return losses


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--save", action="store_true", help="write the trained state back")
    a = ap.parse_args()
    print(json.dumps(run(a.steps, a.device, a.save)))
'''


def write_tvm(graph: TrainGraph, inputs: list[torch.Tensor], out: Path, target: Any,
              cc: str | None = None) -> list[Path]:
    """Build `graph` (ATen; glmc ops are lowered here) for `target` and write the files of the
    module docstring into `out` (an existing directory). Returns the paths written."""
    require_tvm("export_tvm")
    randoms = random_offenses(graph)
    if randoms:
        raise ExportError("export_tvm: the step has random ops, which TVM's frontend turns "
                          "into the identity (no training RNG); export with dropout off:",
                          randoms)
    tgt = resolve_target(target)
    from glmc.compiler.onnx_lowering import lower_to_reshapes as _lower
    step = TrainGraph(_lower(graph.gm), graph.inputs, graph.outputs, graph.meta)
    executable = build(relax_module(step), tgt)
    written = [out / "step.so", out / "state.safetensors", out / "signature.json",
               out / "run_tvm.py"]
    executable.export_library(str(out / "step.so"), **_linker(tgt, cc))
    if tgt.kind.name == "cuda":
        (out / "step.cu").write_text(_cuda_source(executable))
        written.append(out / "step.cu")
    _write_state(graph, inputs, out / "state.safetensors")
    (out / "signature.json").write_text(json.dumps(_signature(graph, inputs, tgt), indent=1))
    (out / "run_tvm.py").write_text(_RUNNER)
    return written


def _linker(target: Any, cc: str | None) -> dict[str, Any]:
    """`export_library`'s options: the cross compiler for a foreign triple, else TVM's own."""
    host = target.host if target.kind.name == "cuda" and target.host is not None else target
    triple = str(host.attrs.get("mtriple", "")) if hasattr(host, "attrs") else ""
    arch = triple.split("-")[0]
    import platform
    if cc is None and arch and arch != platform.machine():
        cc = _CROSS_CC.get(arch)
        if cc is None or shutil.which(cc) is None:
            raise ConfigError(f"export_tvm: linking for {triple} needs a cross compiler "
                              f"({cc or arch + '-linux-gnu-gcc'}, e.g. apt-get install "
                              f"gcc-{arch}-linux-gnu) or cc=...")
    if cc is None:
        return {}
    from tvm.support import cc as tvm_cc
    return {"fcompile": tvm_cc.cross_compiler(cc)}


def _cuda_source(executable: Any) -> str:
    sources = []
    pending = list(executable.mod.imports)
    while pending:
        m = pending.pop()
        pending += list(m.imports)
        if m.kind == "cuda":
            sources.append(m.inspect_source("cu") or m.inspect_source())
    return "\n".join(sources)


def _key(spec: InputSpec) -> str:
    """An input's name in state.safetensors: a parameter's or buffer's name in the model."""
    if spec.role in (Role.PARAMETER, Role.BUFFER):
        return spec.target
    return f"{spec.role.value}/{spec.target}"


def _write_state(graph: TrainGraph, inputs: list[torch.Tensor], path: Path) -> None:
    from safetensors.numpy import save_file
    arrays = {}
    for spec, t in zip(graph.inputs, inputs):
        if t.dtype not in _NUMPY:
            raise ConfigError(f"export_tvm: input {spec.target!r} is {t.dtype}, which numpy "
                              "cannot hold; export an fp32 or fp16 step")
        arrays[_key(spec)] = t.detach().cpu().contiguous().numpy()
    save_file(arrays, str(path))


def _signature(graph: TrainGraph, inputs: list[torch.Tensor], target: Any) -> dict[str, Any]:
    where = {spec.target: i for i, spec in enumerate(graph.inputs)}
    feeds = [[o, where[spec.target]] for o, spec in enumerate(graph.outputs)
             if spec.kind in _STATE and spec.target in where]
    loss = next(o for o, spec in enumerate(graph.outputs) if spec.kind is OutputKind.LOSS)
    return {"target": str(target), "loss": loss, "feeds": feeds,
            "inputs": [{"role": s.role.value, "target": s.target, "key": _key(s),
                        "dtype": _NUMPY[t.dtype], "shape": list(t.shape)}
                       for s, t in zip(graph.inputs, inputs)],
            "outputs": [{"kind": s.kind.value, "target": s.target} for s in graph.outputs]}
