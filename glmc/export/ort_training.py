"""ONNX Runtime on-device training artifacts of a step's forward + loss, for glmc.export.artifacts.

    glmc's optimized step --forward_program--> its forward (after fusion, precision, cleanup)
        --glmc ops and torch's composite ops decomposed to core ATen--> torch.export
        --dynamo ONNX exporter (opset 18, no graph optimization)--> forward.onnx
        --onnxruntime.training.artifacts.generate_artifacts--> training / eval / optimizer
        models + checkpoint; the optimizer model's AdamW node set to torch's rule

The forward is the one glmc trains: the step's forward nodes, parameters as initializers named
as in the model. Decomposing to core ATen first matters: onnxruntime-training 1.19's gradient
builder has no gradient for the composite ops the exporter would otherwise emit (opset 17's
LayerNormalization, attention functions). A model that breaks into several graphs has no
step; its artifacts are exported from the model's own forward by torch's TorchScript exporter
at opset 16 (`config.json` says which forward was used). Three TorchScript-exporter gaps met on
transformers' GLM are patched for the duration of that export (custom symbolics): `diff`,
`repeat_interleave` on a negative dim, `cumsum` of bool.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from glmc.compiler.onnx_lowering import _exporter_message
from glmc.errors import ConfigError, ExportError, GlmcError
from glmc.ir.graph import Role, TrainGraph
from glmc.trace.rederive import ForwardProgram, owner_of

#: torch's legacy exporter at opset 16 (see the module docstring)
_ORT_TRAINING_OPSET = 16
#: the dynamo exporter's opset for a step's forward (the exporter's default, 20, has ops
#: onnxruntime 1.19 lacks)
_STEP_OPSET = 18


def write_ort_training(model: torch.nn.Module, example: Any, loss_fn: Any,
                       optimizer: torch.optim.Optimizer, out: Path,
                       graph: TrainGraph | None = None) -> None:
    """Write the artifacts, batch.npz, config.json and train.py into the directory `out`:
    of `graph`'s forward (glmc's optimized step), or without a step of the model's own."""
    from glmc.trace.capture import batch_leaves

    try:
        from onnxruntime.training import artifacts  # noqa: F401
    except ImportError as e:
        raise ConfigError("export_ort_training: needs onnxruntime-training (pip install "
                          "onnxruntime-training)") from e
    hyper = _adamw_hyperparameters(optimizer)
    args, kwargs = example
    names = [f"input_{i}" for i in range(len(args))] + list(kwargs)
    leaves = [t.detach() for t in batch_leaves(example)]
    if graph is not None:
        onnx_model, prefix = _step_forward_onnx(graph, model, leaves, names), ""
    else:
        onnx_model = _legacy_onnx(model, loss_fn, len(args), list(kwargs), leaves, names)
        prefix = "inner.model."  # _LossOf's attribute path to the user's model
    _artifacts(onnx_model, model, out, hyper, prefix)
    import numpy as np
    np.savez(out / "batch.npz", **{n: t.cpu().numpy() for n, t in zip(names, leaves)})
    forward = "glmc step" if graph is not None else "model (TorchScript exporter)"
    (out / "config.json").write_text(json.dumps({**hyper, "inputs": names,
                                                 "forward": forward}, indent=1))
    (out / "train.py").write_text(_ORT_RUNNER)


class _StepForward(torch.nn.Module):
    """A step's forward program over the model's parameters and buffers, registered under
    their names in the model (so the ONNX initializers carry them); returns the loss."""

    def __init__(self, program: ForwardProgram, gm: fx.GraphModule,
                 values: dict[str, torch.Tensor], trainable: set[str]) -> None:
        super().__init__()
        self.step = gm
        self.specs = program.inputs
        for spec in program.inputs:
            if spec.role in (Role.PARAMETER, Role.BUFFER):
                owner, leaf = owner_of(self, spec.target)
                value = values[spec.target]
                if spec.role is Role.PARAMETER:
                    owner.register_parameter(leaf, torch.nn.Parameter(
                        value, requires_grad=spec.target in trainable))
                else:
                    owner.register_buffer(leaf, value)

    def forward(self, *leaves: torch.Tensor) -> torch.Tensor:
        own = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        args = [own[s.target] if s.role in (Role.PARAMETER, Role.BUFFER)
                else leaves[int(s.target.split(":")[1])] for s in self.specs]
        return self.step(*args)[0]  # new buffer values (BatchNorm statistics) are dropped


def _step_forward_onnx(graph: TrainGraph, model: torch.nn.Module,
                       leaves: list[torch.Tensor], names: list[str]) -> Any:
    """The forward of glmc's step as ONNX the gradient builder can differentiate."""
    from glmc.compiler.onnx_lowering import _decompose, lower_to_reshapes
    from glmc.trace.rederive import forward_program

    program = forward_program(graph)
    computed = [n.meta.get("val") for n in program.graph.nodes if n.op == "call_function"]
    low = sorted({str(v.dtype).removeprefix("torch.") for v in computed
                  if isinstance(v, torch.Tensor) and v.dtype in (torch.bfloat16, torch.float16)})
    if low:  # fp16: e.g. the gradient of Concat (SplitTraining) has no fp16 CPU kernel
        raise ConfigError(f"export_ort_training: the step's forward computes in "
                          f"{'/'.join(low)}, which onnxruntime-training's CPU kernels do not "
                          "train (fp16 SplitTraining, bf16 most ops); export a trainer with "
                          "precision='fp32'")
    values = {**{n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)},
              **{n: b.detach() for n, b in model.named_buffers(remove_duplicate=False)}}
    trainable = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    inputs = [values[s.target] if s.role in (Role.PARAMETER, Role.BUFFER)
              else leaves[int(s.target.split(":")[1])] for s in program.inputs]
    try:
        gm = _decompose(lower_to_reshapes(program.gm), inputs, fake=False,
                        extra_decompositions=True)
        exported = torch.onnx.export(_StepForward(program, gm, values, trainable),
                                     tuple(leaves), dynamo=True, optimize=False, verify=False,
                                     verbose=False, opset_version=_STEP_OPSET,
                                     input_names=names, output_names=["loss"])
    except Exception as e:
        raise ExportError(f"export_ort_training: torch's ONNX exporter failed on the step's "
                          f"forward: {type(e).__name__}: {_exporter_message(e)[:500]}") from e
    exported.model.ir_version = 10  # onnxruntime 1.19 loads IR <= 10
    return _cast_like_to_cast(exported.model_proto)


def _cast_like_to_cast(model: Any) -> Any:
    """CastLike(x, like) -> Cast(x, to=like's type): the gradient builder knows Cast only."""
    import onnx
    from onnx import helper

    typed = onnx.shape_inference.infer_shapes(model)
    elem = {v.name: v.type.tensor_type.elem_type for v in (*typed.graph.value_info,
                                                            *typed.graph.input,
                                                            *typed.graph.output)}
    elem.update({t.name: t.data_type for t in model.graph.initializer})
    nodes = []
    for node in model.graph.node:
        if node.op_type == "CastLike" and elem.get(node.input[1]):
            node = helper.make_node("Cast", [node.input[0]], list(node.output), name=node.name,
                                    to=elem[node.input[1]])
        nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def _adamw_hyperparameters(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """AdamW's (or weight-decay-free Adam's) hyperparameters, the same in every group."""
    groups = opt.param_groups
    g = groups[0]
    adamw = type(opt) is torch.optim.AdamW or \
        (type(opt) is torch.optim.Adam and g.get("weight_decay", 0) == 0)
    if not adamw or g.get("amsgrad") or g.get("maximize"):
        raise ConfigError(f"export_ort_training: ONNX Runtime's training optimizer here is "
                          f"AdamW; the step uses {type(opt).__name__} "
                          f"(amsgrad={g.get('amsgrad')}, maximize={g.get('maximize')}); "
                          "train with torch.optim.AdamW to export")
    keys = ("lr", "betas", "eps", "weight_decay")
    if any(any(other[k] != g[k] for k in keys) for other in groups[1:]):
        raise ConfigError("export_ort_training: the optimizer's parameter groups differ in "
                          f"{', '.join(keys)}; ONNX Runtime's optimizer has one set")
    return {"lr": float(g["lr"]), "betas": [float(b) for b in g["betas"]],
            "eps": float(g["eps"]), "weight_decay": float(g["weight_decay"])}


class _LossOf(torch.nn.Module):
    """model + loss over the batch's leaves as positional inputs (the ONNX model's inputs)."""

    def __init__(self, model: torch.nn.Module, loss_fn: Any, n_args: int,
                 keys: list[str]) -> None:
        super().__init__()
        from glmc.trace.capture import LossModule
        self.inner = LossModule(model, loss_fn)
        self.n_args, self.keys = n_args, keys

    def forward(self, *leaves: torch.Tensor) -> torch.Tensor:
        kwargs = dict(zip(self.keys, leaves[self.n_args:]))
        (loss,) = self.inner(*leaves[:self.n_args], **kwargs)
        return loss


def _legacy_onnx(model: torch.nn.Module, loss_fn: Any, n_args: int, keys: list[str],
                 leaves: list[torch.Tensor], names: list[str]) -> Any:
    """The forward + loss as ONNX by the TorchScript exporter, in training mode. The trace
    runs the forward once: the model's buffers (BatchNorm statistics) and the RNG are
    restored afterwards, so exporting does not change training."""
    import io

    import onnx
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    rng, training = torch.get_rng_state(), model.training
    config = getattr(model, "config", None)  # transformers: no KV cache in a training graph
    use_cache = getattr(config, "use_cache", None)  # (its cat(empty(0), k) does not export)
    if use_cache:
        config.use_cache = False
    f = io.BytesIO()
    symbolics = {"aten::diff": _diff_symbolic,
                 "aten::repeat_interleave": _repeat_interleave_symbolic,
                 "aten::cumsum": _cumsum_symbolic}
    for name, fn in symbolics.items():  # registered for this export only
        torch.onnx.register_custom_op_symbolic(name, fn, _ORT_TRAINING_OPSET)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TracerWarnings about Python values in the model
            torch.onnx.export(_LossOf(model, loss_fn, n_args, keys), tuple(leaves), f,
                              dynamo=False, opset_version=_ORT_TRAINING_OPSET,
                              input_names=names, output_names=["loss"], export_params=True,
                              do_constant_folding=False,
                              training=torch.onnx.TrainingMode.TRAINING)
    except Exception as e:
        raise ExportError(f"export_ort_training: torch's TorchScript ONNX exporter failed on "
                          f"the model: {type(e).__name__}: {_exporter_message(e)[:500]}") from e
    finally:
        for name in symbolics:
            torch.onnx.unregister_custom_op_symbolic(name, _ORT_TRAINING_OPSET)
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(buffers[n])
        torch.set_rng_state(rng)
        model.train(training)
        if use_cache:
            config.use_cache = use_cache
    return onnx.load_from_string(f.getvalue())


def _diff_symbolic(g: Any, x: Any, n: Any, dim: Any, prepend: Any, append: Any) -> Any:
    """torch.diff (n=1) as Slice - Slice: the TorchScript exporter has none, and transformers'
    causal-mask code calls it on the position ids (with `prepend`)."""
    from torch.onnx._internal.torchscript_exporter import symbolic_helper as sh

    if sh._get_const(n, "i", "n") != 1:
        return sh._unimplemented("diff", "n != 1")
    d = sh._get_const(dim, "i", "dim")
    parts = [t for t in (prepend, x, append) if not sh._is_none(t)]
    if len(parts) > 1:
        x = g.op("Concat", *parts, axis_i=d)
    later = sh._slice_helper(g, x, axes=[d], starts=[1], ends=[2**63 - 1])
    earlier = sh._slice_helper(g, x, axes=[d], starts=[0], ends=[-1])
    return g.op("Sub", later, earlier)


def _repeat_interleave_symbolic(g: Any, x: Any, repeats: Any, dim: Any = None,
                                output_size: Any = None) -> Any:
    """repeat_interleave by an int along a dim of a static shape as Unsqueeze, Expand,
    Reshape. The TorchScript exporter's own gives a wrong rank for a negative dim
    (transformers' GLM: `cos.repeat_interleave(2, dim=-1)`); other forms go to it."""
    from torch.onnx._internal.torchscript_exporter import symbolic_helper as sh
    from torch.onnx._internal.torchscript_exporter import symbolic_opset13

    sizes = sh._get_tensor_sizes(x)
    r = sh._maybe_get_const(repeats, "i")
    if sh._is_none(dim) or not isinstance(r, int) or sizes is None or None in sizes:
        return symbolic_opset13.repeat_interleave(g, x, repeats, dim, output_size)
    d = sh._get_const(dim, "i", "dim") % len(sizes)
    wide = sh._unsqueeze_helper(g, x, [d + 1])
    shape = [*sizes[:d + 1], r, *sizes[d + 1:]]
    wide = g.op("Expand", wide, g.op("Constant", value_t=torch.tensor(shape)))
    out = [*sizes[:d], sizes[d] * r, *sizes[d + 1:]]
    return g.op("Reshape", wide, g.op("Constant", value_t=torch.tensor(out)))


def _cumsum_symbolic(g: Any, x: Any, dim: Any, dtype: Any = None) -> Any:
    """cumsum of a bool tensor sums int64 (as torch does); the exporter's own emits CumSum
    on bool, which ONNX has no type for (transformers' packed-sequence check)."""
    from torch.onnx._internal.torchscript_exporter import symbolic_helper as sh
    from torch.onnx._internal.torchscript_exporter import symbolic_opset11

    if sh._type_utils.JitScalarType.from_value(x) == sh._type_utils.JitScalarType.BOOL:
        x = g.op("Cast", x, to_i=7)  # TensorProto.INT64
    return symbolic_opset11.cumsum(g, x, dim, dtype)


def _artifacts(onnx_model: Any, model: torch.nn.Module, out: Path,
               hyper: dict[str, Any], prefix: str) -> None:
    """`prefix`: the path to the user's model in the exported module's parameter names."""
    from onnxruntime.training import artifacts

    initializers = {t.name for t in onnx_model.graph.initializer}
    trained = [prefix + n for n, p in model.named_parameters() if p.requires_grad
               and prefix + n in initializers]
    if not trained:
        raise ExportError("export_ort_training: no trainable parameter of the model is an "
                          "initializer of the exported graph; the exporter renamed or folded "
                          "them")
    frozen = sorted(initializers - set(trained))
    import logging

    import onnxruntime
    level = logging.getLogger().level
    onnxruntime.set_default_logger_severity(3)  # the gradient builder logs every transformer
    try:
        artifacts.generate_artifacts(onnx_model, requires_grad=trained, frozen_params=frozen,
                                     loss=None, optimizer=artifacts.OptimType.AdamW,
                                     artifact_directory=str(out))
    except Exception as e:
        raise ExportError(f"export_ort_training: onnxruntime's artifact generator failed: "
                          f"{type(e).__name__}: {str(e).strip()[:500]}") from e
    finally:
        logging.getLogger().setLevel(level)
        onnxruntime.set_default_logger_severity(2)  # onnxruntime's default (warning)
    _set_adamw(out / "optimizer_model.onnx", hyper)


def _set_adamw(path: Path, hyper: dict[str, Any]) -> None:
    """The optimizer model's AdamW node with torch's hyperparameters and update rule:
    `adam_mode=0` (torch: decay before the update, bias-corrected moments; onnxblock writes 1,
    transformers' rule) and torch's betas, eps and weight decay (onnxblock's defaults differ:
    eps 1e-6, weight decay 0)."""
    import onnx
    from onnx import helper

    model = onnx.load(str(path))
    values = {"alpha": hyper["betas"][0], "beta": hyper["betas"][1], "epsilon": hyper["eps"],
              "weight_decay": hyper["weight_decay"], "adam_mode": 0, "correct_bias": 1}
    nodes = [n for n in model.graph.node if n.op_type == "AdamWOptimizer"]
    if len(nodes) != 1:
        raise GlmcError(f"export_ort_training: expected one AdamWOptimizer node in "
                        f"{path.name}, found {len(nodes)}")
    node = nodes[0]
    kept = [a for a in node.attribute if a.name not in values]
    del node.attribute[:]
    node.attribute.extend(kept + [helper.make_attribute(k, v) for k, v in values.items()])
    model.ir_version = min(model.ir_version, 10)  # onnx's helper writes 14; onnxruntime 1.19
    onnx.save(model, str(path))                   # loads <= 10


_ORT_RUNNER = '''"""glmc export: ONNX Runtime on-device training artifacts (the model's forward + loss,
AdamW with the torch optimizer's hyperparameters). Needs onnxruntime-training and numpy.

Run: python train.py --steps 5 [--save]     prints the losses as JSON
"""
import argparse
import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def run(steps, directory=HERE, save=False):
    import onnxruntime
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    onnxruntime.set_default_logger_severity(3)  # "removing unused initializer" warnings

    d = Path(directory)
    cfg = json.loads((d / "config.json").read_text())
    batch = np.load(d / "batch.npz")
    inputs = [batch[name] for name in cfg["inputs"]]
    state = CheckpointState.load_checkpoint(str(d / "checkpoint"))
    module = Module(str(d / "training_model.onnx"), state, str(d / "eval_model.onnx"),
                    device="cpu")
    optimizer = Optimizer(str(d / "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(cfg["lr"])
    module.train()
    losses = []
    for _ in range(steps):
        loss = module(*inputs)
        optimizer.step()
        module.lazy_reset_grad()
        losses.append(float(loss))
    if save:
        CheckpointState.save_checkpoint(state, str(d / "checkpoint"))
    return losses


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Train the exported model with ONNX Runtime.")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--save", action="store_true", help="write the trained weights back")
    a = ap.parse_args()
    print(json.dumps(run(a.steps, save=a.save)))
'''
