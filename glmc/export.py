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
  Runtime's generator there, so only dropout-free steps reproduce torch's losses.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from glmc.errors import ConfigError, GlmcError
from glmc.ir import RANDOM_OPS, Role, TrainGraph, op_name

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
    from safetensors.torch import save_file

    from glmc.kernels import lower_to_aten

    graph: TrainGraph = trainer.graph
    graph = TrainGraph(lower_to_aten(graph.gm), graph.inputs, graph.outputs, graph.meta)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    inputs = _step_inputs(trainer)
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
    random_ops = sorted({op_name(n) for n in graph.compute_nodes() if op_name(n) in RANDOM_OPS})
    sig = {"inputs": [{"role": s.role.value, "target": s.target} for s in graph.inputs],
           "outputs": [{"kind": s.kind.value, "target": s.target} for s in graph.outputs],
           "random_ops": random_ops}
    (out / "signature.json").write_text(json.dumps(sig, indent=1))
    if onnx:
        export_onnx(graph, inputs, out / "step.onnx")
        written.append(out / "step.onnx")
    return [str(p) for p in written]


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


def export_onnx(graph: TrainGraph, inputs: list[torch.Tensor], path: Path) -> Path:
    """The functional step as ONNX: decompose to core ATen, torch.export, dynamo ONNX exporter."""
    import importlib.util
    missing = [m for m in ("onnx", "onnxscript") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"export: ONNX export needs {', '.join(missing)} (pip install "
                          "'glmc[onnx]')")
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    from glmc.kernels import decompositions

    real = [t.detach().clone() for t in inputs]
    rng = torch.get_rng_state()
    table = {**core_aten_decompositions(), **decompositions()}
    with torch.no_grad():
        decomposed = make_fx(graph.gm, decomposition_table=table)(*real)
    torch.set_rng_state(rng)

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
        raise GlmcError(f"export: the ONNX exporter failed on the step: {e}") from e
    onnx_program.model.ir_version = 10  # onnxruntime 1.19 loads IR <= 10
    onnx_program.save(str(path))
    _check_outputs(graph, path)
    return path


def _check_outputs(graph: TrainGraph, path: Path) -> None:
    import onnx
    model = onnx.load(str(path), load_external_data=False)
    if len(model.graph.output) != len(graph.outputs) or \
            len(model.graph.input) != len(graph.inputs):
        raise GlmcError(f"export: step.onnx has {len(model.graph.input)} inputs / "
                        f"{len(model.graph.output)} outputs, the step {len(graph.inputs)} / "
                        f"{len(graph.outputs)}; the exporter dropped or merged some")
