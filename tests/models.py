"""One registry of model cases, run across passes x backends, and the eager reference loop."""
from __future__ import annotations

import copy
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from glmc.frontend.workload import load_workload
from glmc.trace.capture import LossModule, split_batch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# fp32 parity tolerances (the contract)
RTOL, ATOL = 1e-4, 1e-5


@dataclass
class Case:
    name: str
    make: Callable[[], tuple[Any, Any, Any, Any]]  # -> (model, example_inputs, loss_fn, optimizer)


def example_module(file: str) -> Any:
    """examples/`file` imported as a module (its classes and configs)."""
    spec = importlib.util.spec_from_file_location(f"ex_{file}", EXAMPLES / file)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def _example(file: str, **kwargs: Any) -> Callable:
    def make():
        if kwargs:
            return example_module(file).workload(**kwargs)
        w = load_workload(str(EXAMPLES / file))
        return w.model, w.example_inputs, w.loss_fn, w.optimizer
    return make


CASES = {
    "mlp": Case("mlp", _example("mlp.py")),
    "cnn": Case("cnn", _example("cnn.py")),
    "glm": Case("glm", _example("glm.py")),
}


def eager_losses(model, example_inputs, loss_fn, optimizer, steps: int, seed: int = 0,
                 clip: float | None = None):
    """Plain PyTorch training: the reference every backend and pass must match (`clip`:
    `clip_grad_norm_` to that norm before each update)."""
    wrapper = LossModule(model, loss_fn)
    args, kwargs = split_batch(example_inputs)
    losses = []
    for i in range(steps):
        torch.manual_seed(seed + i)
        optimizer.zero_grad(set_to_none=True)
        (loss,) = wrapper(*args, **dict(kwargs))
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        losses.append(loss.item())
    return losses


def glmc_losses(trainer, example_inputs, steps: int, seed: int = 0):
    args, kwargs = split_batch(example_inputs)
    losses = []
    for i in range(steps):
        torch.manual_seed(seed + i)
        losses.append(trainer.step(*args, **kwargs).item())
    return losses


def twin(make: Callable):
    """Two identical (model, inputs, loss_fn, optimizer) sets: one for glmc, one for eager."""
    model, inputs, loss_fn, opt = make()
    model2 = copy.deepcopy(model)
    params = dict(model2.named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    opt2 = copy.deepcopy(opt)  # same class, groups and hyperparameters ...
    for g2, g in zip(opt2.param_groups, opt.param_groups):
        g2["params"] = [params[names[id(p)]] for p in g["params"]]  # ... over model2's params
    opt2.state.clear()
    return (model, inputs, loss_fn, opt), (model2, inputs, loss_fn, opt2)


def assert_state_close(model_a, model_b, opt_a, opt_b, zero_grad_params: tuple = ()) -> None:
    """`zero_grad_params`: name fragments of parameters whose exact gradient is zero (e.g. the
    key-projection bias: softmax is invariant to it). Their computed gradient is rounding
    noise that Adam normalises to lr-sized steps, so any two correct implementations differ
    there by up to ~lr per step; they are checked with atol 1e-4 instead of 1e-5."""
    for (name, a), b in zip(model_a.state_dict().items(), model_b.state_dict().values()):
        atol = 1e-4 if any(f in name for f in zero_grad_params) else ATOL
        torch.testing.assert_close(a, b, rtol=RTOL, atol=atol, msg=lambda m: f"{name}: {m}")
    if zero_grad_params:
        return  # the optimizer state of those parameters is the same rounding noise
    def tensors(opt):  # torch's SGD without momentum stores momentum_buffer=None
        return {k: {n: v for n, v in st.items() if v is not None}
                for k, st in opt.state_dict()["state"].items()}
    sa, sb = tensors(opt_a), tensors(opt_b)
    assert {k: set(v) for k, v in sa.items() if v} == {k: set(v) for k, v in sb.items() if v}
    for k in sa:
        for key in sb.get(k, {}):
            torch.testing.assert_close(sa[k][key], sb[k][key], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"state {k}.{key}: {m}")


def train_side_by_side(model, batch, loss_fn, backend: str = "eager", steps: int = 3,
                       lr: float = 1e-2, **options):
    """`steps` AdamW steps of `model` through glmc and of a copy in eager PyTorch, comparing
    the losses at every step; returns (trainer, model, reference, optimizer, its reference)."""
    import pytest

    import glmc

    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=lr)
    trainer = glmc.optimize(model, batch, loss_fn=loss_fn, optimizer=opt, backend=backend,
                            measure=False, **options)
    for _ in range(steps):
        got = trainer.step(*batch).item()
        opt_ref.zero_grad()
        want = loss_fn(ref(*batch[:-1]), batch[-1])
        want.backward()
        opt_ref.step()
        assert got == pytest.approx(want.item(), rel=1e-5)
    return trainer, ref, opt, opt_ref


def no_dropout(make: Callable) -> Callable:
    """A case whose model's top-level `dropout` is Identity: for backends that draw their own
    masks (ONNX Runtime) or none (TVM), where parity needs a dropout-free model."""
    def made():
        model, x, loss_fn, opt = make()
        if isinstance(getattr(model, "dropout", None), torch.nn.Dropout):
            model.dropout = torch.nn.Identity()
        return model, x, loss_fn, opt
    return made


#: the cases external-compiler backends (ort, tvm) are checked on
BACKEND_CASES = {"mlp": CASES["mlp"].make, "cnn": no_dropout(CASES["cnn"].make),
                 "glm": CASES["glm"].make, "hf_glm": _example("hf_glm.py")}


def check_backend_parity(backend: str, case: str, fusion: bool, steps: int = 3, **options):
    """Train `case` with glmc on `backend` (and `options`) and with eager PyTorch: the loss at
    every step and all parameters and optimizer state after `steps` steps agree (fp32
    tolerances). Returns the trainer for backend-specific checks."""
    import pytest

    import glmc
    if case == "hf_glm":
        pytest.importorskip("transformers")
    (m, x, loss_fn, opt), (m2, _, _, opt2) = twin(BACKEND_CASES[case])
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend=backend,
                            fusion=fusion, **{"predict": False, "measure": False, **options})
    got = glmc_losses(trainer, x, steps)
    want = eager_losses(m2, x, loss_fn, opt2, steps)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
    assert got[0] != got[-1], "training must change the loss"
    # transformers' GLM has a key bias: its exact gradient is zero (softmax is invariant to
    # it), so Adam turns rounding noise into ~lr steps there
    assert_state_close(m, m2, opt, opt2,
                       zero_grad_params=("k_proj.bias",) if case == "hf_glm" else ())
    return trainer
