"""Capture a whole training step (forward, loss, backward, optimizer update) into a TrainGraph.

Dynamo captures the model and loss (so every Dynamo-traceable model works unchanged, and nodes keep
the user's source lines); AOTAutograd's joint export turns that into one functional ATen graph of
forward and backward; the optimizer rule (glmc.trace.optim) is traced on fake tensors and appended.
"""
from __future__ import annotations

import contextlib
import re
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn

from glmc.errors import CaptureError, GraphBreakError, InputError, Offense
from glmc.ir.graph import TrainGraph
from glmc.trace.optim import ensure_state, rule_for
from glmc.trace.step import (OptimizerSpec, StepSpec, build_step, first_line, joint_export,
                             user_frame)

Batch = tuple[tuple[Any, ...], dict[str, Any]]


def split_batch(example_inputs: Any) -> Batch:
    """`example_inputs` is a tuple of positional args or a dict of keyword args."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise InputError(f"capture: example_inputs must be a tuple or dict of tensors, got "
                     f"{type(example_inputs).__name__}")


def batch_leaves(batch: Batch) -> list[torch.Tensor]:
    """The batch's tensors in step-input order: positional args, then keyword values."""
    args, kwargs = batch
    return [*args, *kwargs.values()]


class LossModule(nn.Module):
    """model + loss as one module returning the scalar loss.

    Without `loss_fn` the model returns the loss (a scalar, or an object with `.loss`).
    With `loss_fn`, the last positional batch element (or the "labels" key) is the target:
    `loss_fn(model(*batch[:-1]), batch[-1])`.
    """

    def __init__(self, model: nn.Module, loss_fn: Any = None) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor]:
        if self.loss_fn is None:
            out = self.model(*args, **kwargs)
            loss = getattr(out, "loss", None) if not isinstance(out, torch.Tensor) else out
            if loss is None and isinstance(out, (tuple, list)) and out:
                loss = out[0]
        elif kwargs:
            target = kwargs.pop("labels")
            loss = self.loss_fn(self.model(*args, **kwargs), target)
        else:
            loss = self.loss_fn(self.model(*args[:-1]), args[-1])
        return (loss,)


def capture(model: nn.Module, example_inputs: Any, loss_fn: Any = None,
            optimizer: torch.optim.Optimizer | None = None) -> TrainGraph:
    """The whole training step of (model, loss, optimizer) on `example_inputs` as a TrainGraph."""
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return capture_step(model, split_batch(example_inputs), loss_fn, optimizer)


def capture_step(model: nn.Module, batch: Batch, loss_fn: Any,
                 optimizer: torch.optim.Optimizer) -> TrainGraph:
    """The step graph of (model, loss, optimizer) on `batch`. The graph holds no reference to
    the model, optimizer or batch: the optimizer is recorded as an `OptimizerSpec`."""
    rule_for(optimizer)
    ensure_state(optimizer)
    _check_loss_convention(batch, loss_fn)
    wrapper = LossModule(model, loss_fn)
    was_training = model.training
    model.train()
    try:
        dyn = _dynamo_capture(wrapper, batch)
        with contextlib.ExitStack() as stack, fx_traceback.preserve_node_meta():
            joint = joint_export(stack, dyn, *batch)
            graph = build_step(joint.graph_module, step_spec(model, optimizer))
    finally:
        model.train(was_training)
    return graph


def step_spec(model: nn.Module, optimizer: torch.optim.Optimizer) -> StepSpec:
    """The optimizer of `model` as data, with its current state tensors."""
    names = {id(p): n for n, p in model.named_parameters()}
    spec = OptimizerSpec.of(optimizer, names)
    params = dict(model.named_parameters())
    state = {}
    for group in spec.groups:
        for name in group.params:
            for key in spec.state_keys(group):
                state[f"{key}:{name}"] = optimizer.state[params[name]][key]
    return StepSpec(spec, state, aliases=_aliases(model))


def _aliases(model: nn.Module) -> dict[str, str]:
    """Every other name of a tied parameter or buffer -> its first name."""
    first: dict[int, str] = {}
    out = {}
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        canonical = first.setdefault(id(t), name)
        if canonical != name:
            out[name] = canonical
    return out


def _check_loss_convention(batch: Batch, loss_fn: Any) -> None:
    args, kwargs = batch
    if loss_fn is None:
        return
    if kwargs and "labels" not in kwargs:
        raise InputError("capture: with loss_fn and dict inputs, the target must be under the "
                         "key 'labels'; add it or let the model compute its own loss")
    if not kwargs and len(args) < 2:
        raise InputError("capture: with loss_fn, example_inputs must be (inputs..., target); "
                         "got a single element")


# ---- Dynamo / AOT ----------------------------------------------------------------------------

def _dynamo_capture(wrapper: LossModule, batch: Batch) -> fx.GraphModule:
    from torch._dynamo.functional_export import dynamo_graph_capture_for_export

    args, kwargs = batch
    try:
        # static shapes: glmc compiles one step per shape signature
        with torch._dynamo.config.patch(ignore_logging_functions=_logging_functions(),
                                        automatic_dynamic_shapes=False), \
                _quiet_fake_tensor_errors():
            return dynamo_graph_capture_for_export(wrapper)(*args, **kwargs)
    except Exception as e:  # Dynamo raises many internal types; all become one CaptureError
        failed = _model_failure(e)
        if failed is not None:
            raise InputError(f"capture: the model cannot run on the batch {describe(batch)}: "
                             f"{failed}; pass tensors of the sizes the model expects") from e
        breaks = _explain_breaks(wrapper, batch)
        if breaks:
            raise GraphBreakError("capture: the model breaks into several graphs at these "
                                  "locations; rewrite or move that code out of the forward, "
                                  "or let glmc compile the pieces (strict=False)", breaks) from e
        raise CaptureError("capture: the model cannot be captured as one graph; rewrite or move "
                           "the code at this location out of the model forward",
                           [Offense(plain_reason(first_line(e)), user_frame(e))]) from e


def describe(batch: Batch) -> str:
    """The batch's shapes, e.g. "((4, 9), (4,))"."""
    args, kwargs = batch
    parts = [f"{tuple(t.shape)}" for t in args] + [f"{k}={tuple(v.shape)}"
                                                   for k, v in kwargs.items()]
    return "(" + ", ".join(parts) + ")"


@contextlib.contextmanager
def _quiet_fake_tensor_errors() -> Any:
    """FakeTensor logs a full traceback (~90 lines) at ERROR before Dynamo raises the same
    failure; glmc reports it once, typed. The filter is removed on exit."""
    import logging

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    drop = logging.Filter("glmc-never-matches")  # rejects every record of this logger
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def _model_failure(e: BaseException) -> str | None:
    """When the model itself fails on the batch (a shape mismatch found while tracing on fake
    tensors), what failed and where in the user's code; else None."""
    text = str(e)
    if "when making fake tensor call" not in text:
        return None
    m = re.search(r"got (\w+)\('(.*?)'\)", text, re.S) or re.search(r"got (\w+)\(\"(.*?)\"\)",
                                                                     text, re.S)
    what = m.group(2).rstrip(".") if m else first_line(e)
    stack = [f for f in getattr(e, "real_stack", None) or []
             if "/torch/" not in f.filename and "/glmc/" not in f.filename]
    if stack:
        frame = stack[-1]
        what += f" (at {frame.filename}:{frame.lineno} in {frame.name})"
    return what


def _logging_functions() -> set[Any]:
    """Logging and warning calls Dynamo should skip inside a forward, as torch.compile users
    expect (transformers' `logger.warning_once` in GPT-2's forward broke capture)."""
    import logging
    import warnings

    names = ("debug", "info", "warning", "warn", "error", "exception", "critical", "log",
             "warning_once", "info_once")  # the last two: added to Logger by transformers
    return {getattr(logging.Logger, n) for n in names if hasattr(logging.Logger, n)} | \
        {warnings.warn}


#: Dynamo's reason strings -> what they mean in the user's code
_PLAIN = (
    ("generic_jump", "control flow (`if`/`while`) on a tensor's value"),
    ("data-dependent", "control flow or shapes that depend on a tensor's value"),
    ("data dependent", "control flow or shapes that depend on a tensor's value"),
    (".item()", "a tensor converted to a Python number (`.item()`)"),
    ("tolist", "a tensor converted to a Python list (`.tolist()`)"),
    ("print", "a `print` call"),
    ("logging", "a logging call"),
    ("step_unsupported", "a Python statement Dynamo cannot trace (e.g. a call into an "
                         "unsupported library function)"),
    ("numpy", "a conversion to or from NumPy"),
    ("graph_break", "an explicit `torch._dynamo.graph_break()`"),
    ("skip", "a call to a function Dynamo is told to skip"),
)


def plain_reason(reason: str) -> str:
    """Dynamo's reason for a graph break, in plain words (Dynamo's own text after it)."""
    low = reason.lower()
    for key, words in _PLAIN:
        if key in low:
            return f"{words} [Dynamo: {reason[:160]}]"
    return reason


def _explain_breaks(wrapper: nn.Module, batch: Batch) -> list[Offense]:
    """Every graph break Dynamo finds, with the user's source location.

    Runs the forward once under `torch.compile` with a backend that only records why each
    graph ended — what `torch._dynamo.explain` does, without its `reset()` of every cache in
    the process. The cache entries this leaves are guarded by that backend, so no other
    compile reuses them. The forward runs in no_grad on a deep copy of the model, so its
    buffers (BatchNorm statistics) are not touched."""
    import copy

    reasons: list[Any] = []

    def record(gm: fx.GraphModule, _inputs: Any) -> Any:
        reason = getattr(gm, "compile_subgraph_reason", None)
        if reason is not None and reason.graph_break:
            reasons.append(reason)
        return gm.forward

    args, kwargs = batch
    try:
        with torch.no_grad(), \
                torch._dynamo.config.patch(ignore_logging_functions=_logging_functions()):
            torch.compile(copy.deepcopy(wrapper), backend=record, dynamic=False)(*args, **kwargs)
    except Exception:
        return []
    offenses = []
    for br in reasons:
        frame = br.user_stack[-1] if br.user_stack else None
        where = f"{frame.filename}:{frame.lineno} in {frame.name}" if frame else "<unknown>"
        offenses.append(Offense(plain_reason(first_line(br.reason)), where))
    return list(dict.fromkeys(offenses))
