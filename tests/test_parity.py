"""Loss at every step and all parameters / optimizer state after 3 steps equal eager PyTorch."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import glmc
from glmc.trace.optim import RULES
from tests.models import ATOL, CASES, RTOL, assert_state_close, eager_losses, glmc_losses, twin

STEPS = 3

PARAMS = [
    pytest.param("mlp", "eager"), pytest.param("cnn", "eager"), pytest.param("glm", "eager"),
    pytest.param("mlp", "inductor"), pytest.param("cnn", "inductor"),
    pytest.param("glm", "inductor", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("case,backend", PARAMS)
def test_parity(case: str, backend: str) -> None:
    (m, x, loss_fn, opt), (m2, _, _, opt2) = twin(CASES[case].make)
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend=backend)
    got = glmc_losses(trainer, x, STEPS)
    want = eager_losses(m2, x, loss_fn, opt2, STEPS)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
    assert got[0] != got[-1], "training must change the loss"
    assert_state_close(m, m2, opt, opt2)


@pytest.mark.parametrize("opt_cls,kwargs", [
    (torch.optim.SGD, dict(lr=0.1)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2)),
    (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=1e-2)),
    (torch.optim.Adam, dict(lr=1e-2, maximize=True)),
    (torch.optim.AdamW, dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)),
])
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_optimizers(opt_cls, kwargs, backend) -> None:
    def make():
        model, x, loss_fn, _ = CASES["mlp"].make()
        return model, x, loss_fn, opt_cls(model.parameters(), **kwargs)
    (m, x, loss_fn, opt), (m2, _, _, opt2) = twin(make)
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend=backend)
    got, want = glmc_losses(trainer, x, STEPS), eager_losses(m2, x, loss_fn, opt2, STEPS)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
    assert_state_close(m, m2, opt, opt2)


def test_lr_scheduler_changes_lr_without_recompile() -> None:
    (m, x, loss_fn, opt), (m2, _, _, opt2) = twin(CASES["mlp"].make)
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend="eager")
    s1 = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    s2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    for i in range(3):
        torch.manual_seed(i)
        trainer.step(*x)
        s1.step()
        eager_losses(m2, x, loss_fn, opt2, 1, seed=i)
        s2.step()
    assert_state_close(m, m2, opt, opt2)
    assert len(trainer.report.compiles) == 1


class _StandInRecorder:
    """CUDA graph semantics on the CPU: recording runs nothing; a replay runs what was
    recorded, into the tensor recording returned."""

    def record(self, fn):
        self.fn, self.out = fn, torch.zeros(())
        return "graph", self.out

    def replay(self, graph) -> None:
        self.out.copy_(self.fn())


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_graphed_step_replays_new_batches_and_records_again_when_lr_changes(backend) -> None:
    """glmc.runtime.cudagraph's logic (partial: no GPU here) through a stand-in recorder: every step
    on a new batch, an lr change mid-way; losses and state equal eager PyTorch's."""
    from glmc.errors import ConfigError
    from glmc.runtime.cudagraph import GraphedStep
    (m, x, loss_fn, opt), (m2, _, _, opt2) = twin(CASES["mlp"].make)
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend=backend,
                            measure=False)
    (entry,) = trainer._cache.values()
    entry.graphed = GraphedStep(entry.step, entry.graph, _StandInRecorder())
    got, want = [], []
    for i in range(5):
        batch = tuple(t + 0.1 * i if t.is_floating_point() else t for t in x)  # new each step
        if i == 3:
            for o in (opt, opt2):
                o.param_groups[0]["lr"] *= 0.5
        got.append(trainer.step(*batch).item())
        want += eager_losses(m2, batch, loss_fn, opt2, 1, seed=i)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=0)
    assert_state_close(m, m2, opt, opt2)
    assert entry.graphed.recordings == 2  # after the first step, again after the lr change
    with pytest.raises(ConfigError, match="CUDA graphs need the model and batch on a CUDA"):
        glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, cuda_graphs=True)


def test_state_dict_roundtrip_and_resume(tmp_path) -> None:
    (m, x, loss_fn, opt), (m2, _, _, opt2) = twin(CASES["mlp"].make)
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend="eager")
    glmc_losses(trainer, x, 2)
    torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt")
    m2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    got = glmc_losses(trainer, x, 2, seed=10)
    want = eager_losses(m2, x, loss_fn, opt2, 2, seed=10)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
    assert_state_close(m, m2, opt, opt2)


def test_dropout_masks_equal_eager() -> None:
    """The CNN has dropout: identical losses under the same seed prove identical masks."""
    (m, x, loss_fn, opt), (m2, _, _, opt2) = twin(CASES["cnn"].make)
    # fusion=False: the fused cross-entropy rounds the loss differently (1 ulp here), which
    # would hide what this test checks, the masks (the optimizer update is bit-identical)
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend="eager", fusion=False)
    rng_nodes = [n for n in trainer.graph.compute_nodes() if trainer.graph.info(n).rng]
    assert [trainer.graph.info(n).rng.ordinal for n in rng_nodes] == [0]
    assert glmc_losses(trainer, x, 2) == eager_losses(m2, x, loss_fn, opt2, 2)


def test_changed_batch_size_recompiles() -> None:
    (m, x, loss_fn, opt), (m2, _, _, opt2) = twin(CASES["mlp"].make)
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend="eager")
    small = (x[0][:5], x[1][:5])
    for batch in (x, small, x):
        torch.manual_seed(0)
        got = trainer.step(*batch).item()
        want = eager_losses(m2, batch, loss_fn, opt2, 1)[0]
        assert got == pytest.approx(want, rel=RTOL, abs=ATOL)
    assert len(trainer.report.compiles) == 2
    assert_state_close(m, m2, opt, opt2)


# ---- the update rules alone, bit for bit against torch.optim ---------------------------------

UPDATE_CONFIGS = [
    (torch.optim.SGD, dict(lr=0.1)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2)),
    (torch.optim.SGD, dict(lr=0.03, momentum=0.5, weight_decay=1e-3, maximize=True)),
    (torch.optim.Adam, dict(lr=1e-3)),
    (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=1e-2)),
    (torch.optim.Adam, dict(lr=1e-2, maximize=True)),
    (torch.optim.AdamW, dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=3e-4, amsgrad=True, maximize=True, weight_decay=0.05)),
]
#: odd sizes put elements both in ATen's vectorized loop body and in its scalar tail
UPDATE_SHAPES = [(7,), (33, 17), (4, 3, 5), (1,), (1000,)]
UPDATE_STEPS = 5


def _config_id(cfg) -> str:
    cls, kwargs = cfg
    return cls.__name__ + "".join(f"-{k}={v}" for k, v in kwargs.items() if k != "lr")


def _update_gap(opt_cls, kwargs, foreach: bool | str, dtype: torch.dtype) -> float:
    """Runs torch.optim (single-tensor path; its fused kernel for `foreach="fused"`) and
    glmc's rule side by side for UPDATE_STEPS steps, the lr changing every step as a
    scheduler would; returns the largest difference of any parameter or state tensor after
    any step, in units of eps(dtype) × max|param|."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).to(dtype) for s in UPDATE_SHAPES]
    ref = [p.clone().requires_grad_() for p in params]
    fused = foreach == "fused"
    opt = opt_cls(ref, fused=True, **kwargs) if fused else opt_cls(ref, foreach=False, **kwargs)
    rule, group = RULES[opt_cls], dict(opt.param_groups[0])
    ps, states = params, [rule.init_state(p, group) for p in params]
    gap = 0.0
    for step in range(UPDATE_STEPS):
        lr = kwargs["lr"] * 0.7 ** step
        opt.param_groups[0]["lr"] = lr
        grads = [torch.randn(s, generator=gen).to(dtype) for s in UPDATE_SHAPES]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
        lr_t = torch.tensor(lr, dtype=torch.float64)  # as glmc's graph receives it
        if fused:
            ps, states = rule.update_fused(ps, grads, states, lr_t, group)
        elif foreach:
            ps, states = rule.update_foreach(ps, grads, states, lr_t, group)
        else:
            ps, states = map(list, zip(*(rule.update(p, g, s, lr_t, group)
                                         for p, g, s in zip(ps, grads, states))))
        for p, s, r in zip(ps, states, ref):
            scale = torch.finfo(dtype).eps * max(1.0, r.detach().abs().max().item())
            for got, want in [(p, r.detach()), *((s[k], opt.state[r][k]) for k in s)]:
                if not torch.equal(got, want):
                    gap = max(gap, (got.double() - want.double()).abs().max().item() / scale)
    return gap


@pytest.mark.parametrize("foreach", [False, True], ids=["update", "update_foreach"])
@pytest.mark.parametrize("opt_cls,kwargs", UPDATE_CONFIGS,
                         ids=[_config_id(c) for c in UPDATE_CONFIGS])
def test_update_rules_bit_identical_to_torch_optim(opt_cls, kwargs, foreach) -> None:
    """fp32, the dtype glmc's updates run in: every rule equals torch.optim to the last bit."""
    assert _update_gap(opt_cls, kwargs, foreach, torch.float32) == 0


FUSED_CONFIGS = [c for c in UPDATE_CONFIGS if RULES[c[0]].update_fused is not None]


@pytest.mark.parametrize("opt_cls,kwargs", FUSED_CONFIGS,
                         ids=[_config_id(c) for c in FUSED_CONFIGS])
def test_fused_update_bit_identical_to_torch_fused(opt_cls, kwargs) -> None:
    """The fused form (ATen's `_fused_adam(w)`, Inductor's default update) equals
    `torch.optim.Adam(W)(fused=True)` to the last bit (the same kernel, lr as a tensor)."""
    assert _update_gap(opt_cls, kwargs, "fused", torch.float32) == 0


def test_fused_update_declines_low_precision() -> None:
    """bf16 parameters keep the multi-tensor form: the fused rule returns None for them."""
    rule = RULES[torch.optim.AdamW]
    p = torch.zeros(4, dtype=torch.bfloat16)
    group = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
             "maximize": False}
    state = rule.init_state(p, group)
    assert rule.update_fused([p], [p.clone()], [state], torch.tensor(1e-3), group) is None


@pytest.mark.parametrize("opt_cls,kwargs", UPDATE_CONFIGS,
                         ids=[_config_id(c) for c in UPDATE_CONFIGS])
def test_update_rules_on_bf16_params(opt_cls, kwargs) -> None:
    """bf16 params (a user's bf16 model): Adam/AdamW stay bit-identical. SGD cannot: torch's
    `param.add_(grad, alpha=-lr)` rounds the vector body once (fused multiply-add in fp32) and
    the scalar tail after each bf16 op, and no elementwise formula with `lr` a tensor does
    both; glmc matches the body, the tail elements within 2 ulps at the param's scale."""
    tolerance = 2.0 if opt_cls is torch.optim.SGD else 0.0
    for foreach in (False, True):
        assert _update_gap(opt_cls, kwargs, foreach, torch.bfloat16) <= tolerance


def _lower_capabilities() -> list[str]:
    order = ["default", "avx2", "avx512"]
    host = torch.backends.cpu.get_cpu_capability().lower()
    return order[:order.index(host)] if host in order else ["default"]


@pytest.mark.parametrize("capability", _lower_capabilities())
def test_update_rules_bit_identical_on_other_cpu_kernels(capability) -> None:
    """ATen picks its CPU kernels at startup (DEFAULT without FMA, AVX2, AVX-512); the rounding
    of `add(alpha=...)` differs between them, so check each one this CPU can run."""
    code = ("import torch; from tests.test_parity import UPDATE_CONFIGS, _update_gap; "
            "print(torch.backends.cpu.get_cpu_capability(), sum(_update_gap(c, k, f, "
            "torch.float32) > 0 for c, k in UPDATE_CONFIGS for f in (False, True)))")
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == [capability.upper(), "0"]
