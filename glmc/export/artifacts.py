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
import json
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.fx as fx

# the lowering lives in the compiler layer; the old names stay importable from here
from glmc.compiler.onnx_lowering import (_ANSI, _check_outputs, _decompose,  # noqa: F401
                                         _exporter_message, _fix, _offenses_of, _onnx_registry,
                                         export_onnx, onnx_offenses, onnx_ready, require_onnx)
from glmc.errors import ConfigError, ExportError, GlmcError, Offense
from glmc.ir.graph import RANDOM_OPS, Role, TrainGraph, op_name

#: every file an export may write; a new export into the same directory replaces them all
EXPORT_FILES = ("step.py", "signature.json", "state.safetensors", "batch.safetensors",
                "constants.safetensors", "step.onnx")


#: the export's typed error (kept under this name for callers of glmc.export.artifacts)
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
    from glmc.trace.capture import batch_leaves
    leaves = batch_leaves(trainer.example)
    return [get(leaves) for get in entry.getters]


def export_step(trainer: Any, directory: str, onnx: bool = False,
                ort_training: bool = False) -> list[str]:
    """The step export (module docstring); with `ort_training`, ONNX Runtime's on-device
    training artifacts of the model in `directory/ort_training` too (export_ort_training)."""
    from glmc.ir.kernels import lower_to_aten

    graph: TrainGraph = trainer.graph
    graph = TrainGraph(lower_to_aten(graph.gm), graph.inputs, graph.outputs, graph.meta)
    inputs = _step_inputs(trainer)
    randoms = random_ops(graph)
    if onnx:
        require_onnx()
        offenses = onnx_offenses(onnx_ready(graph), inputs, extra_decompositions=True)
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
    files = [str(out / p.name) for p in written]
    if ort_training:
        files += export_ort_training(trainer, str(out / "ort_training"))
    return files


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
    if onnx:  # lowered as the ORT backend lowers it (`onnx_ready`)
        export_onnx(onnx_ready(graph), inputs, out / "step.onnx", extra_decompositions=True)
        written.append(out / "step.onnx")
    return written


def random_ops(graph: TrainGraph) -> list[str]:
    return sorted({op_name(n) for n in graph.compute_nodes() if op_name(n) in RANDOM_OPS})


@contextlib.contextmanager
def _staging(out: Path, owned: tuple[str, ...] = EXPORT_FILES) -> Iterator[Path]:
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
        _publish(tmp, out, owned)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in made:
            with contextlib.suppress(OSError):
                d.rmdir()
        raise


def _publish(tmp: Path, out: Path, owned: tuple[str, ...] = EXPORT_FILES) -> None:
    if not out.exists():
        tmp.rename(out)
        return
    # an existing directory (maybe the cwd, so never replaced itself): move the files in,
    # replacing an earlier export's and keeping the user's own
    written = {f.name for f in tmp.iterdir()}
    for name in written:
        os.replace(tmp / name, out / name)
    for name in set(owned) - written:  # stale: step.onnx of an earlier onnx=True export
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


# ---- what the ONNX exporter cannot take ----------------------------------------------------------

def onnx_export_offenses(trainer: Any) -> list[Offense]:
    """Every op of the trainer's optimized step that `export(dir, onnx=True)` would fail on."""
    return onnx_offenses(onnx_ready(trainer.graph), _step_inputs(trainer),
                         extra_decompositions=True)


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


# ---- ONNX Runtime on-device training artifacts -------------------------------------------------

#: what export_ort_training writes (a new export into the same directory replaces them all)
ORT_TRAINING_FILES = ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx",
                      "checkpoint", "batch.npz", "config.json", "train.py")


def export_ort_training(trainer: Any, directory: str) -> list[str]:
    """ONNX Runtime on-device training artifacts of the trainer's model (forward + loss):
    `training_model.onnx`, `eval_model.onnx`, `optimizer_model.onnx` (AdamW with the torch
    optimizer's betas, eps, weight decay and torch's update rule, `adam_mode=0`),
    `checkpoint` (the model's current weights), `batch.npz` (the example batch),
    `config.json` (learning rate, input names) and `train.py`, a runner that trains with
    `onnxruntime.training.api` (CheckpointState, Module, Optimizer): `python train.py
    --steps 5` prints the losses.

    The forward is glmc's: the optimized step's forward (fusion, precision, cleanup
    applied; glmc's ops decomposed to ATen), onnxruntime derives the backward itself. A model
    that broke into several graphs has no step: its own forward is exported by torch's
    TorchScript exporter (`config.json` "forward" says which). The optimizer state starts
    fresh (zero moments, step 0); BatchNorm running statistics are not updated by
    onnxruntime's training graph; dropout uses onnxruntime's generator.
    """
    from glmc.export.ort_training import write_ort_training

    require_onnx()
    out = Path(directory)
    with _staging(out, ORT_TRAINING_FILES) as tmp:
        args, kwargs = trainer.example
        entry = trainer.entry_for(*args, **kwargs)
        graph = entry.graph if entry is not None else None  # None: compiled in pieces
        write_ort_training(trainer.model, trainer.example, trainer.loss_fn, trainer.optimizer,
                           tmp, graph)
    return [str(out / name) for name in ORT_TRAINING_FILES]


def export_tvm(trainer: Any, directory: str, target: Any = "kunpeng920",
               cc: str | None = None) -> list[str]:
    """The optimized step built by Apache TVM for `target` (a name in
    glmc.backends.tvm.backend.TARGETS such as "kunpeng920" or "cuda", or a TVM target dict), with its
    inputs and a torch-free runner (glmc.backends.tvm.export). Writes into a staging directory
    first: a failed build leaves nothing behind."""
    from glmc.backends.tvm.export import TVM_EXPORT_FILES, write_tvm

    out = Path(directory)
    with _staging(out, TVM_EXPORT_FILES) as tmp:
        written = write_tvm(trainer.graph, _step_inputs(trainer), tmp, target, cc)
    return [str(out / p.name) for p in written]
