"""Export of the optimized training step.

`export_step(trainer, dir)` writes:

* `step.py` — the step as readable Python (the ATen fx graph after every pass) plus a runner:
  `python step.py --steps 5` loads the state and batch, runs 5 steps and prints the losses.
  It needs torch and safetensors only, not glmc.
* `state.safetensors` — parameters, buffers, optimizer state and learning rates, keyed by the
  step's input names ("layers.0.wq.weight", "exp_avg:layers.0.wq.weight", "lr:0");
  `batch.safetensors` — the example batch; `constants.safetensors` — tensors baked into the graph.
* `signature.json` — the step's inputs and outputs in order, with roles.
* with `onnx=True`, `step.onnx` — the same functional step as an ONNX model (ATen ops decomposed
  to the core set first), saved at IR version 10 so onnxruntime >= 1.19 loads it;
  `python step.py --onnx` runs it with onnxruntime. Random ops (dropout) draw from ONNX
  Runtime's generator there, so only dropout-free steps reproduce torch's losses (a warning
  says so).

An export that cannot succeed fails before anything is written: `onnx_export_offenses(trainer)`
lists every op torch's ONNX exporter has no function for (on fake tensors, in seconds), and
`export_step` raises `OnnxExportError` with them. The files are written into a temporary
directory next to `dir` and moved into place at the end, so a failed export leaves nothing.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.fx as fx

from glmc.errors import ConfigError, ExportError, GlmcError, Offense
from glmc.ir import RANDOM_OPS, Role, TrainGraph, op_name

#: every file an export may write; a new export into the same directory replaces them all
EXPORT_FILES = ("step.py", "signature.json", "state.safetensors", "batch.safetensors",
                "constants.safetensors", "step.onnx")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


#: the export's typed error (kept under this name for callers of glmc.export)
OnnxExportError = ExportError


_ALLOWED_GLOBALS = {"inf": "from math import inf", "nan": "from math import nan",
                    "NoneType": "NoneType = type(None)", "torch": "import torch",
                    "device": "from torch import device", "fx_pytree": None, "pytree": None}

_RUNNER = '''

class Step(torch.nn.Module):
    """The functional step: inputs in signature order -> (loss, new state...)."""

    def __init__(self, constants):
        super().__init__()
        for name, value in constants.items():
            self.register_buffer(name, value)

    forward = forward


def load(directory=HERE):
    from safetensors.torch import load_file
    directory = Path(directory)
    sig = json.loads((directory / "signature.json").read_text())
    state = load_file(directory / "state.safetensors")
    batch = load_file(directory / "batch.safetensors")
    consts_file = directory / "constants.safetensors"
    consts = load_file(consts_file) if consts_file.exists() else {}
    return Step(consts), sig, state, batch


def run(steps, directory=HERE, seed=None, use_onnx=False, save=False):
    """Run `steps` training steps from the saved state; returns the losses."""
    step, sig, state, batch = load(directory)
    names = [i["target"] for i in sig["inputs"]]
    session = None
    if use_onnx:
        import onnxruntime
        session = onnxruntime.InferenceSession(str(Path(directory) / "step.onnx"),
                                               providers=["CPUExecutionProvider"])
        feed_names = [i.name for i in session.get_inputs()]
    losses = []
    with torch.no_grad():
        for i in range(steps):
            if seed is not None:
                torch.manual_seed(seed + i)
            inputs = [state[n] if n in state else batch[n] for n in names]
            if session is not None:
                outs = session.run(None, {k: t.numpy() for k, t in zip(feed_names, inputs)})
                outs = [torch.from_numpy(o) for o in outs]
            else:
                outs = step(*inputs)
            for spec, value in zip(sig["outputs"], outs):
                if spec["kind"] == "loss":
                    losses.append(float(value))
                else:
                    state[spec["target"]] = value
    if save:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in state.items()},
                  str(Path(directory) / "state.safetensors"))
    return losses


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="Run the exported glmc training step.")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=None, help="torch.manual_seed(seed + i) per step")
    ap.add_argument("--onnx", action="store_true", help="run step.onnx with onnxruntime")
    ap.add_argument("--save", action="store_true", help="write the trained state back")
    a = ap.parse_args()
    print(json.dumps(run(a.steps, seed=a.seed, use_onnx=a.onnx, save=a.save)))
'''


def _step_inputs(trainer: Any) -> list[torch.Tensor]:
    entry = next(reversed(trainer._cache.values()))
    from glmc.capture import batch_leaves
    leaves = batch_leaves(trainer.example)
    return [get(leaves) for get in entry.getters]


def export_step(trainer: Any, directory: str, onnx: bool = False) -> list[str]:
    from glmc.kernels import lower_to_aten

    graph: TrainGraph = trainer.graph
    graph = TrainGraph(lower_to_aten(graph.gm), graph.inputs, graph.outputs, graph.meta)
    inputs = _step_inputs(trainer)
    randoms = random_ops(graph)
    if onnx:
        require_onnx()
        offenses = onnx_offenses(graph, inputs)
        if offenses:
            raise _unsupported(offenses)
        if randoms:
            warnings.warn(f"export: the step has random ops ({', '.join(randoms)}); step.onnx "
                          "draws their masks from ONNX Runtime's generator, so its losses differ "
                          "from torch's (step.py --seed reproduces torch's); export with dropout "
                          "off for matching losses", stacklevel=3)
    out = Path(directory)
    with _staging(out) as tmp:
        written = _write(graph, inputs, randoms, tmp, onnx)
    return [str(out / p.name) for p in written]


def _write(graph: TrainGraph, inputs: list[torch.Tensor], randoms: list[str], out: Path,
           onnx: bool) -> list[Path]:
    from safetensors.torch import save_file

    state, batch = {}, {}
    for spec, value in zip(graph.inputs, inputs):
        dest = batch if spec.role is Role.INPUT else state
        dest[spec.target] = value.detach().clone().contiguous()  # no shared storage in files
    written = [out / "step.py", out / "signature.json", out / "state.safetensors",
               out / "batch.safetensors"]
    (out / "step.py").write_text(_source(graph))
    save_file(state, str(out / "state.safetensors"))
    save_file(batch, str(out / "batch.safetensors"))
    consts = _constants(graph)
    if consts:
        save_file(consts, str(out / "constants.safetensors"))
        written.append(out / "constants.safetensors")
    sig = {"inputs": [{"role": s.role.value, "target": s.target} for s in graph.inputs],
           "outputs": [{"kind": s.kind.value, "target": s.target} for s in graph.outputs],
           "random_ops": randoms}
    (out / "signature.json").write_text(json.dumps(sig, indent=1))
    if onnx:
        export_onnx(graph, inputs, out / "step.onnx")
        written.append(out / "step.onnx")
    return written


def random_ops(graph: TrainGraph) -> list[str]:
    return sorted({op_name(n) for n in graph.compute_nodes() if op_name(n) in RANDOM_OPS})


@contextlib.contextmanager
def _staging(out: Path) -> Iterator[Path]:
    """A fresh directory next to `out` to write into; when the body succeeds it becomes `out`
    (or its files replace an earlier export's in `out`), when it fails it is removed, with any
    parent directories made for it: a failed export leaves nothing behind."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"export: {out} exists and is not a directory; pass a directory")
    made = [p for p in [out.parent, *out.parent.parents] if not p.exists()]  # deepest first
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.glmc-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in made:
            with contextlib.suppress(OSError):
                d.rmdir()
        raise


def _publish(tmp: Path, out: Path) -> None:
    if not out.exists():
        tmp.rename(out)
        return
    # an existing directory (maybe the cwd, so never replaced itself): move the files in,
    # replacing an earlier export's and keeping the user's own
    written = {f.name for f in tmp.iterdir()}
    for name in written:
        os.replace(tmp / name, out / name)
    for name in set(EXPORT_FILES) - written:  # stale: step.onnx of an earlier onnx=True export
        (out / name).unlink(missing_ok=True)
    tmp.rmdir()


def _constants(graph: TrainGraph) -> dict[str, torch.Tensor]:
    consts = {}
    for n in graph.graph.nodes:
        if n.op == "get_attr":
            value = getattr(graph.gm, n.target)
            if isinstance(value, torch.Tensor):
                consts[n.target.replace(".", "_")] = value.detach().clone().contiguous()
    return consts


def _source(graph: TrainGraph) -> str:
    g = graph.graph
    renamed = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in g.nodes:  # dotted get_attr targets become flat buffer names
        env[n] = renamed.node_copy(n, lambda a: env[a])
        if n.op == "get_attr":
            env[n].target = n.target.replace(".", "_")
    code = renamed.python_code(root_module="self")
    imports = []
    for name in code.globals:
        if name not in _ALLOWED_GLOBALS:
            raise GlmcError(f"export: the step's code refers to '{name}', which the exported "
                            "module cannot import; file a glmc issue with the model")
        if _ALLOWED_GLOBALS[name]:
            imports.append(_ALLOWED_GLOBALS[name])
    header = (f'"""glmc export: the optimized training step ({len(g.nodes)} nodes).\n\n'
              "forward(*inputs) -> (loss, new params/buffers/optimizer state); input and "
              "output order in signature.json.\n"
              'Run: python step.py --steps 5 [--seed S] [--onnx] [--save]\n"""\n'
              "import json\nfrom pathlib import Path\n\n" + "\n".join(sorted(set(imports)))
              + "\n\nHERE = Path(__file__).resolve().parent\n")
    return header + code.src + _RUNNER


def require_onnx() -> None:
    import importlib.util
    missing = [m for m in ("onnx", "onnxscript") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"export: ONNX export needs {', '.join(missing)} (pip install "
                          "'glmc[onnx]')")


def _decompose(gm: fx.GraphModule, inputs: list[torch.Tensor], fake: bool) -> fx.GraphModule:
    """The step in core ATen, as `export_onnx` hands it to the exporter; `fake` traces it on
    fake tensors (nothing computed)."""
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    from glmc.kernels import decompositions

    table = {**core_aten_decompositions(), **decompositions()}
    rng = torch.get_rng_state()
    with torch.no_grad():
        decomposed = make_fx(gm, decomposition_table=table,
                             tracing_mode="fake" if fake else "real")(*inputs)
    torch.set_rng_state(rng)
    return decomposed


def export_onnx(graph: TrainGraph, inputs: list[torch.Tensor], path: Path) -> Path:
    """The functional step as ONNX: decompose to core ATen, torch.export, dynamo ONNX exporter."""
    require_onnx()
    real = [t.detach().clone() for t in inputs]
    decomposed = _decompose(graph.gm, real, fake=False)

    class _Step(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.step = decomposed

        def forward(self, *xs: torch.Tensor) -> Any:
            return tuple(self.step(*xs))

    try:
        program = torch.export.export(_Step(), tuple(real))
        onnx_program = torch.onnx.export(program, (), dynamo=True, optimize=False,
                                         verify=False, verbose=False)
    except Exception as e:
        raise OnnxExportError(f"export: torch's ONNX exporter failed on the step: "
                              f"{_exporter_message(e)}") from e
    onnx_program.model.ir_version = 10  # onnxruntime 1.19 loads IR <= 10
    onnx_program.save(str(path))
    _check_outputs(graph, path)
    return path


def _exporter_message(e: Exception) -> str:
    """The exporter's message without its terminal colours and boilerplate."""
    text = _ANSI.sub("", str(e))
    _, found, summary = text.partition("## Exception summary")
    text = summary if found else text
    for noise in ("(Refer to the full stack trace above for more information.)", "⬆️"):
        text = text.replace(noise, "")
    return text.strip()


# ---- what the ONNX exporter cannot take ----------------------------------------------------------

def onnx_export_offenses(trainer: Any) -> list[Offense]:
    """Every op of the trainer's optimized step that `export(dir, onnx=True)` would fail on."""
    from glmc.kernels import lower_to_aten

    graph: TrainGraph = trainer.graph
    graph = TrainGraph(lower_to_aten(graph.gm), graph.inputs, graph.outputs, graph.meta)
    return onnx_offenses(graph, _step_inputs(trainer))


def check_onnx_export(trainer: Any) -> None:
    """Raise `OnnxExportError` (or ConfigError without onnx/onnxscript) now, before training,
    if `trainer.export(dir, onnx=True)` could not succeed."""
    require_onnx()
    offenses = onnx_export_offenses(trainer)
    if offenses:
        raise _unsupported(offenses)


def _unsupported(offenses: list[Offense]) -> OnnxExportError:
    return OnnxExportError(f"export: {len(offenses)} op(s) torch's ONNX exporter cannot take; "
                           "nothing was written. Export the step without the pass named below "
                           "or change the model:", offenses)


def onnx_offenses(graph: TrainGraph, inputs: list[torch.Tensor]) -> list[Offense]:
    """Every op of the ATen-lowered `graph` that torch's ONNX exporter has no function for, once
    the decompositions `export_onnx` and the exporter apply are done, with the source lines of
    the nodes it comes from. Traces on fake tensors: seconds, not the export's minutes. Empty
    when this torch has no exporter registry to ask (the export then fails or succeeds)."""
    known = _onnx_registry()
    if known is None:
        return []
    registry, exporter_decomposes = known
    try:
        decomposed = _decompose(graph.gm, inputs, fake=True)
    except Exception as e:  # e.g. an op without a fake kernel: the export itself will tell
        warnings.warn(f"export: could not check the step against the ONNX exporter ahead of "
                      f"time ({type(e).__name__}: {e})", stacklevel=2)
        return []
    missing: dict[Any, set[Any]] = {}  # op of the step -> ops without a function it became
    for n in decomposed.graph.nodes:
        t = n.target
        if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or \
                registry.is_registered(t) or t in exporter_decomposes:
            continue
        missing.setdefault(n.meta.get("original_aten") or t, set()).add(t)
    offenses = []
    for origin, leaves in missing.items():
        offenses += _offenses_of(graph, origin, leaves)
    return offenses


def _offenses_of(graph: TrainGraph, origin: Any, leaves: set[Any]) -> list[Offense]:
    """One offense per source line (and creating pass) of the step's nodes calling `origin`."""
    name = str(origin)
    via = "" if leaves == {origin} else \
        f" (it decomposes to {', '.join(sorted(map(str, leaves)))})"
    sites: dict[tuple[str, str], int] = {}
    for n in graph.compute_nodes():
        if n.target == origin:
            info = n.meta.get("glmc")
            where = (info.source or info.module) if info is not None else None
            key = (where or n.name, info.created_by if info is not None else "capture")
            sites[key] = sites.get(key, 0) + 1
    offenses = []
    for (where, created_by), count in (sites or {("<step>", "capture"): 1}).items():
        times = f" [{count} nodes]" if count > 1 else ""
        offenses.append(Offense(f"{name}: no ONNX function in torch's exporter{via}{times}; "
                                f"{_fix(origin, created_by)}", where))
    return offenses


def _fix(origin: Any, created_by: str) -> str:
    if created_by == "capture":
        return "the model's own op: change the model, or register an ONNX function for it"
    why = " (glmc's op has no ATen decomposition; please file a glmc issue)" \
        if getattr(origin, "namespace", "") == "glmc" else ""
    return (f"from the '{created_by}' pass{why}: export the step without it (--disable "
            f"{created_by}, disable=('{created_by}',)), or change the model if it has the op too")


@functools.lru_cache(maxsize=1)
def _onnx_registry() -> tuple[Any, frozenset] | None:
    """torch's ONNX function registry (torchlib), and the ops the exporter decomposes itself
    before it looks functions up (`_fx_passes.decompose_with_registry`)."""
    import logging

    import torch._decomp
    try:  # private to torch; without it the exporter's own error is what the user gets
        from torch.onnx._internal.exporter._registration import ONNXRegistry
    except ImportError:
        return None
    log = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = log.level
    log.setLevel(logging.ERROR)  # "torchvision is not installed. Skipping torchvision::nms"
    try:
        registry = ONNXRegistry.from_torchlib()
    finally:
        log.setLevel(level)
    decomposes = {*torch.export.default_decompositions(), *torch._decomp.decomposition_table}
    return registry, frozenset(decomposes)


def _check_outputs(graph: TrainGraph, path: Path) -> None:
    import onnx
    model = onnx.load(str(path), load_external_data=False)
    if len(model.graph.output) != len(graph.outputs) or \
            len(model.graph.input) != len(graph.inputs):
        raise GlmcError(f"export: step.onnx has {len(model.graph.input)} inputs / "
                        f"{len(model.graph.output)} outputs, the step {len(graph.inputs)} / "
                        f"{len(graph.outputs)}; the exporter dropped or merged some")
