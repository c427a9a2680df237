"""Functional optimizer updates, traced into the step graph.

Each rule reproduces the single-tensor update of its `torch.optim` class (capturable=False) op
for op and bit for bit on every ATen CPU kernel set (DEFAULT, AVX2, AVX-512): the same ATen
ops in the same order, and the same scalar rounding — torch computes step counts, bias
corrections and step sizes as Python floats (float64, `**` is libm's `pow`), and each kernel
rounds a float argument once to its opmath dtype. The learning rate arrives as a float64 0-d
tensor, and ATen takes no tensor for `alpha=` or `value=`; where that matters the rule uses an
op that rounds the same (`_add_scaled`, `_addcdiv`). tests/test_parity.py checks every
configuration against torch.optim with `torch.equal` (bf16/fp16 SGD, which cannot be exact,
within 2 ulps: see `_add_scaled`). The rules read the hyperparameters of the
user's param group and the user's `optimizer.state` tensors, so `optimizer.state_dict()` stays
the truth. The learning rate is a graph input so LR schedulers work without recompiling; the
other hyperparameters are baked in and guarded (`OptimizerRule.guard`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from glmc.errors import ConfigError

State = dict[str, Tensor]


@dataclass(frozen=True)
class OptimizerRule:
    """How one torch.optim class updates a parameter."""

    name: str
    state_keys: Callable[[dict], list[str]]
    init_state: Callable[[Tensor, dict], State]
    update: Callable[[Tensor, Tensor, State, Tensor, dict], tuple[Tensor, State]]
    guarded: tuple[str, ...]  #: group keys baked into the graph
    #: the same update for all parameters of a group at once with multi-tensor (`_foreach_*`)
    #: ops, op for op the single-tensor formula (bit-identical): (params, grads, states, lr,
    #: group) -> (new params, new states)
    update_foreach: Callable[..., tuple[list[Tensor], list[State]]] | None = None
    #: the same update as one of ATen's fused multi-tensor kernels (`_fused_adamw` ...): one
    #: pass over each parameter's memory instead of one per op; rounds differently from the
    #: single-tensor formula (within the backends' rtol). Same signature as `update_foreach`;
    #: returns None where the kernel does not apply (then the group runs `update_foreach`)
    update_fused: Callable[..., tuple[list[Tensor], list[State]] | None] | None = None

    def guard(self, group: dict) -> tuple:
        return tuple((k, _freeze(group.get(k))) for k in self.guarded)

    def update_group(self, ps: list[Tensor], gs: list[Tensor], ss: list[State], lr: Tensor,
                     group: dict, kind: str = "foreach") -> tuple[list[Tensor], list[State]]:
        """One param group's update: `kind` "fused" — ATen's fused kernel where the rule has
        one and it applies, else as "foreach"; "foreach" — one multi-tensor update where the
        rule has one, else as "single"; "single" — parameter by parameter."""
        if not ps:  # multi-tensor ops refuse empty lists
            return [], []
        if kind != "single" and self.update_foreach is not None:
            done = self.update_fused(ps, gs, ss, lr, group) \
                if kind == "fused" and self.update_fused is not None else None
            return done or self.update_foreach(ps, gs, ss, lr, group)
        pairs = [self.update(p, g, s, lr, group) for p, g, s in zip(ps, gs, ss)]
        return [p for p, _ in pairs], [s for _, s in pairs]


def _freeze(v: Any) -> Any:
    return tuple(v) if isinstance(v, (list, tuple)) else v


def _opmath(t: Tensor) -> torch.dtype:
    """The dtype ATen's CPU kernels compute `t`'s elementwise ops in (float32 for bf16/fp16)."""
    return torch.float32 if t.dtype in (torch.bfloat16, torch.float16) else t.dtype


def _scalar(x: Tensor, like: Tensor) -> Tensor:
    """A float64 scalar rounded once to `like`'s opmath dtype, as ATen rounds a Python float
    argument (`mul(t, 0.9)`, `addcdiv(..., value=s)`); a 0-d tensor of that dtype is read
    unrounded by the kernels of `like`'s dtype."""
    return x.to(_opmath(like))


def _py_pow(base: Tensor, exp: float) -> Tensor:
    """`base ** exp` as Python computes it for a float: libm's `pow` (ATen's
    `pow.Tensor_Tensor` runs `std::pow` on a 0-d tensor). Not `sqrt` for 0.5: ATen's
    `pow.Tensor_Scalar(x, 0.5)` is `sqrt`, and libm's `pow(x, 0.5)` is one ulp off the correctly
    rounded `sqrt(x)` for about 2% of Adam's bias corrections."""
    return torch.pow(base, torch.full_like(base, exp))


def _add_scaled(p: Tensor, g: Tensor, scale: Tensor) -> Tensor:
    """`p.add(g, alpha=scale)` with `scale` a float64 0-d tensor (`alpha` must be a number).
    `add` rounds `alpha` to the param dtype and its vector kernel is a fused multiply-add where
    ATen's CPU kernels are built with FMA (AVX2, AVX-512), a multiply then an add where not
    (DEFAULT); `addcmul`'s `p + 1 * g * scale` compiles to the same instructions on each, while
    `p + scale * g` always rounds twice. (bf16/fp16 params: `add`'s scalar tail rounds per op,
    its vector body once, so no elementwise formula matches every element; this matches the
    vector body.)"""
    return torch.addcmul(p, g, scale.to(p.dtype))


def _addcdiv(p: Tensor, t1: Tensor, t2: Tensor, value: Tensor) -> Tensor:
    """`p.addcdiv(t1, t2, value=value)` with `value` a 0-d tensor (`value` must be a number):
    the kernel computes `p + (value * t1) / t2` in the opmath dtype and rounds once."""
    o = _opmath(p)
    return torch.addcdiv(p.to(o), t1.to(o) * value, t2.to(o)).to(p.dtype)


def _up(ts: list[Tensor]) -> list[Tensor]:
    return [t.to(_opmath(t)) for t in ts]  # no op for float32


def _down(ts: list[Tensor], like: list[Tensor]) -> list[Tensor]:
    return [t.to(p.dtype) for t, p in zip(ts, like)]


def _bias_corrections(beta1: float, beta2: float, step: Tensor) -> tuple[Tensor, Tensor]:
    """`1 - beta1 ** step` and `(1 - beta2 ** step) ** 0.5` in float64, as torch computes them
    in Python on `step.item()` (single-tensor path, capturable=False)."""
    step64 = step.to(torch.float64)
    return 1 - torch.pow(beta1, step64), _py_pow(1 - torch.pow(beta2, step64), 0.5)


# ---- SGD -------------------------------------------------------------------------------------

def _sgd_keys(group: dict) -> list[str]:
    return ["momentum_buffer"] if group["momentum"] != 0 else []


def _sgd_init(p: Tensor, group: dict) -> State:
    if group["momentum"] == 0:
        return {}
    if group["dampening"] != 0:
        raise ConfigError("optimizer: SGD with dampening != 0 is not supported yet; "
                          "use dampening=0 or backend='eager' without glmc")
    # torch starts the buffer as a copy of the first gradient; with dampening 0 a zero buffer
    # gives bit-identical results (0 * momentum + grad == grad).
    return {"momentum_buffer": torch.zeros_like(p, memory_format=torch.preserve_format)}


def _sgd_update(p: Tensor, g: Tensor, s: State, lr: Tensor, group: dict) -> tuple[Tensor, State]:
    """torch's `_single_tensor_sgd`, op for op."""
    wd, momentum = group["weight_decay"], group["momentum"]
    if group["maximize"]:
        g = -g
    if wd != 0:
        g = g.add(p, alpha=wd)
    new: State = {}
    if momentum != 0:
        buf = s["momentum_buffer"].mul(momentum).add(g, alpha=1 - group["dampening"])
        new["momentum_buffer"] = buf
        g = g.add(buf, alpha=momentum) if group["nesterov"] else buf
    return _add_scaled(p, g, -lr), new  # param.add_(grad, alpha=-lr)


# ---- Adam / AdamW ----------------------------------------------------------------------------

def _adam_keys(group: dict) -> list[str]:
    keys = ["step", "exp_avg", "exp_avg_sq"]
    return keys + ["max_exp_avg_sq"] if group["amsgrad"] else keys


def _adam_init(p: Tensor, group: dict) -> State:
    z = lambda: torch.zeros_like(p, memory_format=torch.preserve_format)  # noqa: E731
    state = {"step": torch.tensor(0.0, dtype=torch.float32), "exp_avg": z(), "exp_avg_sq": z()}
    if group["amsgrad"]:
        state["max_exp_avg_sq"] = z()
    return state


def _adam_update(p: Tensor, g: Tensor, s: State, lr: Tensor, group: dict,
                 decoupled: bool) -> tuple[Tensor, State]:
    """torch's `_single_tensor_adam` (capturable=False), op for op."""
    beta1, beta2 = group["betas"]
    wd, eps = group["weight_decay"], group["eps"]
    if group["maximize"]:
        g = -g
    step = s["step"] + 1
    if wd != 0:
        if decoupled:
            p = p * _scalar(1 - lr * wd, p)  # param.mul_(1 - lr * weight_decay)
        else:
            g = g.add(p, alpha=wd)
    exp_avg = s["exp_avg"].lerp(g, 1 - beta1)
    exp_avg_sq = s["exp_avg_sq"].mul(beta2).addcmul(g, g, value=1 - beta2)
    bc1, bc2_sqrt = _bias_corrections(beta1, beta2, step)
    new = {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    second = exp_avg_sq
    if group["amsgrad"]:
        second = torch.maximum(s["max_exp_avg_sq"], exp_avg_sq)
        new["max_exp_avg_sq"] = second
    denom = (second.sqrt() / _scalar(bc2_sqrt, p)).add(eps)
    # param.addcdiv_(exp_avg, denom, value=-step_size)
    return _addcdiv(p, exp_avg, denom, _scalar(-(lr / bc1), p)), new


def _adam_foreach(ps: list[Tensor], gs: list[Tensor], ss: list[State], lr: Tensor, group: dict,
                  decoupled: bool) -> tuple[list[Tensor], list[State]]:
    """`_adam_update` with `_foreach_*` ops; torch's `_multi_tensor_adam` (capturable=False)
    computes the same per tensor on CPU."""
    fe = torch
    beta1, beta2 = group["betas"]
    wd, eps = group["weight_decay"], group["eps"]
    if group["maximize"]:
        gs = fe._foreach_neg(gs)
    steps = [s["step"] + 1 for s in ss]
    if wd != 0:
        if decoupled:
            ps = fe._foreach_mul(ps, [_scalar(1 - lr * wd, p) for p in ps])
        else:
            gs = fe._foreach_add(gs, ps, alpha=wd)
    exp_avg = fe._foreach_lerp([s["exp_avg"] for s in ss], gs, 1 - beta1)
    exp_avg_sq = fe._foreach_addcmul(fe._foreach_mul([s["exp_avg_sq"] for s in ss], beta2),
                                     gs, gs, value=1 - beta2)
    bcs = [_bias_corrections(beta1, beta2, st) for st in steps]
    second = exp_avg_sq
    if group["amsgrad"]:
        second = fe._foreach_maximum([s["max_exp_avg_sq"] for s in ss], exp_avg_sq)
    denom = fe._foreach_add(fe._foreach_div(fe._foreach_sqrt(second),
                                            [_scalar(b2, p) for (_, b2), p in zip(bcs, ps)]), eps)
    neg_step = [_scalar(-(lr / b1), p) for (b1, _), p in zip(bcs, ps)]
    # param.addcdiv_(exp_avg, denom, value=-step_size) per tensor, as `_addcdiv`
    new_ps = _down(fe._foreach_addcdiv(_up(ps), fe._foreach_mul(_up(exp_avg), neg_step),
                                       _up(denom)), ps)
    news = []
    for i in range(len(ps)):
        new = {"step": steps[i], "exp_avg": exp_avg[i], "exp_avg_sq": exp_avg_sq[i]}
        if group["amsgrad"]:
            new["max_exp_avg_sq"] = second[i]
        news.append(new)
    return new_ps, news


def _adam_fused(ps: list[Tensor], gs: list[Tensor], ss: list[State], lr: Tensor, group: dict,
                decoupled: bool) -> tuple[list[Tensor], list[State]] | None:
    """`_adam_foreach` as ATen's fused CPU/CUDA kernel (`torch.optim.Adam(W)(fused=True)`),
    in its functional form; fp32 parameters, gradients and state only."""
    tensors = [*ps, *gs, *(t for s in ss for k, t in s.items() if k != "step")]
    if any(t.dtype != torch.float32 for t in tensors):
        return None
    beta1, beta2 = group["betas"]
    steps = [s["step"] + 1 for s in ss]
    amsgrad = bool(group["amsgrad"])
    maxs = [s["max_exp_avg_sq"] for s in ss] if amsgrad else []
    op = torch.ops.aten._fused_adamw if decoupled else torch.ops.aten._fused_adam
    new_ps, _, exp_avg, exp_avg_sq, new_maxs = op.tensor_lr(
        ps, gs, [s["exp_avg"] for s in ss], [s["exp_avg_sq"] for s in ss], maxs, steps, lr=lr,
        beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
        amsgrad=amsgrad, maximize=bool(group["maximize"]))
    news = []
    for i in range(len(ps)):
        new = {"step": steps[i], "exp_avg": exp_avg[i], "exp_avg_sq": exp_avg_sq[i]}
        if amsgrad:
            new["max_exp_avg_sq"] = new_maxs[i]
        news.append(new)
    return list(new_ps), news


def _sgd_foreach(ps: list[Tensor], gs: list[Tensor], ss: list[State], lr: Tensor,
                 group: dict) -> tuple[list[Tensor], list[State]]:
    """`_sgd_update` with `_foreach_*` ops (torch's `_multi_tensor_sgd` on CPU)."""
    fe = torch
    wd, momentum = group["weight_decay"], group["momentum"]
    if group["maximize"]:
        gs = fe._foreach_neg(gs)
    if wd != 0:
        gs = fe._foreach_add(gs, ps, alpha=wd)
    news: list[State] = [{} for _ in ps]
    if momentum != 0:
        bufs = fe._foreach_add(fe._foreach_mul([s["momentum_buffer"] for s in ss], momentum),
                               gs, alpha=1 - group["dampening"])
        for new, b in zip(news, bufs):
            new["momentum_buffer"] = b
        gs = fe._foreach_add(gs, bufs, alpha=momentum) if group["nesterov"] else bufs
    # _foreach_add_(params, grads, alpha=-lr), rounded as `_add_scaled` explains
    return fe._foreach_addcmul(ps, gs, [(-lr).to(p.dtype) for p in ps]), news


def _is_decoupled(group: dict, default: bool) -> bool:
    return bool(group.get("decoupled_weight_decay", default))


_ADAM_GUARD = ("betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay")

RULES: dict[type, OptimizerRule] = {
    torch.optim.SGD: OptimizerRule(
        "sgd", _sgd_keys, _sgd_init, _sgd_update,
        ("momentum", "dampening", "nesterov", "weight_decay", "maximize"), _sgd_foreach),
    torch.optim.Adam: OptimizerRule(
        "adam", _adam_keys, _adam_init,
        lambda p, g, s, lr, grp: _adam_update(p, g, s, lr, grp, _is_decoupled(grp, False)),
        _ADAM_GUARD,
        lambda ps, gs, ss, lr, grp: _adam_foreach(ps, gs, ss, lr, grp, _is_decoupled(grp, False)),
        lambda ps, gs, ss, lr, grp: _adam_fused(ps, gs, ss, lr, grp, _is_decoupled(grp, False))),
    torch.optim.AdamW: OptimizerRule(
        "adamw", _adam_keys, _adam_init,
        lambda p, g, s, lr, grp: _adam_update(p, g, s, lr, grp, _is_decoupled(grp, True)),
        _ADAM_GUARD,
        lambda ps, gs, ss, lr, grp: _adam_foreach(ps, gs, ss, lr, grp, _is_decoupled(grp, True)),
        lambda ps, gs, ss, lr, grp: _adam_fused(ps, gs, ss, lr, grp, _is_decoupled(grp, True))),
}


def rule_for(optimizer: torch.optim.Optimizer) -> OptimizerRule:
    rule = RULES.get(type(optimizer))
    if rule is None:
        known = ", ".join(sorted(c.__name__ for c in RULES))
        raise ConfigError(f"optimizer: no glmc rule for {type(optimizer).__name__}; "
                          f"known optimizers: {known}")
    return rule


def ensure_state(optimizer: torch.optim.Optimizer) -> None:
    """Create missing state the way torch's first step would, so the graph always reads it."""
    rule = rule_for(optimizer)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue  # frozen: torch.optim makes no state for it
            state = optimizer.state[p]
            keys = rule.state_keys(group)
            if keys and not all(k in state for k in keys):
                state.update({k: v for k, v in rule.init_state(p, group).items()
                              if k not in state})


def resolve_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
                      ) -> torch.optim.Optimizer:
    """The one place a workload's missing optimizer is defaulted, for every strategy (one
    process, data parallel, pipeline): AdamW(lr=1e-3) over the model's parameters."""
    if optimizer is None:
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    return optimizer
