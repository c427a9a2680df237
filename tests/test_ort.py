"""backend="ort": the step lowered to ONNX and run by ONNX Runtime every step.

Parity (fp32, rtol 1e-4): the loss at every step and all parameters / optimizer state after 3
steps equal eager PyTorch, with and without fusion. Dropout draws from ONNX Runtime's
generator, so the parity models are dropout-free (the CNN's dropout is replaced by Identity).
"""
from __future__ import annotations

import json
import warnings

import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import glmc  # noqa: E402
from glmc.errors import ExportError  # noqa: E402
from tests.models import BACKEND_CASES, check_backend_parity, glmc_losses, twin  # noqa: E402

STEPS = 3


MAKE = BACKEND_CASES
PARAMS = [
    pytest.param("mlp", True), pytest.param("mlp", False), pytest.param("cnn", False),
    # the GLM example (29 s) under -m slow; ONNX Runtime trains it by default through the
    # training artifacts (test_ort_training_artifacts_train_to_glmcs_losses)
    pytest.param("glm", True, marks=pytest.mark.slow),
    pytest.param("cnn", True, marks=pytest.mark.slow),
    pytest.param("glm", False, marks=pytest.mark.slow),
    pytest.param("hf_glm", True, marks=pytest.mark.slow),
    pytest.param("hf_glm", False, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("case,fusion", PARAMS)
def test_parity(case: str, fusion: bool) -> None:
    trainer = check_backend_parity("ort", case, fusion, STEPS)
    assert trainer.report.compiles[0].fallbacks == []  # nothing ran differently from eager


def test_recompute_under_a_memory_budget_keeps_parity() -> None:
    """The recompute pass's step (activations recomputed in the backward) lowers and trains
    on ONNX Runtime like the plain one. (The CNN: the GLM example's functional step peaks in
    its optimizer update, where recomputing activations lowers nothing, so none are.)"""
    trainer = check_backend_parity("ort", "cnn", True, STEPS, memory_budget="min")
    (rec,) = [p for p in trainer.report.compiles[0].history if p.name == "recompute"]
    assert rec.changed and rec.stats.recomputed > 0


def test_update_runs_in_torch_on_resident_state() -> None:
    """ONNX Runtime runs the forward and backward; the update then runs as ATen's fused Adam,
    in place on the user's tensors: parameters and optimizer state keep their storage (bound
    once, never copied), BatchNorm's running stats (state ONNX Runtime computes) take turns in
    the runner's two buffer sets, and in a steady loop only the fresh outputs (the loss, the
    gradients handed to the update) are bound; each loss is its own tensor."""
    model, x, loss_fn, opt = MAKE["cnn"]()
    trainer = glmc.optimize(model, x, loss_fn=loss_fn, optimizer=opt, backend="ort",
                            predict=False, measure=False)
    hybrid = next(iter(trainer._cache.values())).step.fn
    runner = hybrid.front
    roles = {spec.role.value for spec in hybrid.split.front.inputs}
    assert not roles & {"optimizer_state", "hyperparam"}  # no update inside ONNX Runtime
    assert any(n.target is torch.ops.glmc.fused_adam_.default
               for n in hybrid.update.graph.nodes)
    params = dict(model.named_parameters())
    states = {id(t): t.data_ptr() for st in opt.state.values() for t in st.values()}
    binds: list[str] = []
    original = runner._bind
    runner._bind = lambda bind, name, t: (binds.append(name), original(bind, name, t))
    ptrs, losses = [], []
    for i in range(5):
        if i == 4:
            first = len(binds)
        losses.append(trainer.step(*x))
        ptrs.append({n: t.data_ptr() for n, t in model.state_dict().items()})
    fresh = {n for n, state in zip(runner.out_names, runner.state) if not state}
    assert set(binds[first:]) == fresh and len(binds[first:]) == len(fresh)
    assert {n: p.data_ptr() for n, p in params.items()} == {n: ptrs[0][n] for n in params}
    stats = [n for n in ptrs[0] if n.endswith("running_mean")]
    assert stats and all(ptrs[2][n] == ptrs[4][n] != ptrs[3][n] for n in stats)  # two sets
    assert dict(model.named_parameters()) == params  # same Parameter objects
    assert {id(t): t.data_ptr() for st in opt.state.values() for t in st.values()} == states
    assert len({loss.data_ptr() for loss in losses}) == 5 and losses[0] != losses[1]
    profile = trainer.profile_phases(*x, steps=2)  # the two calls, timed
    assert [k["calls"] for k in profile.kernels] == [1, 1]
    assert all(profile.phases[p] > 0 for p in ("forward", "backward", "optimizer"))
    update = next(k for k in profile.kernels if k["kernel"].startswith("torch update"))
    assert update["phases"] == {"optimizer": 1.0} and "_fused_adam" in update["kernel"]


@pytest.mark.slow
def test_precision_fp16_matches_eager_fp16() -> None:
    (m, x, loss_fn, opt), (m2, _, _, opt2) = twin(MAKE["glm"])
    kw = dict(loss_fn=loss_fn, precision="fp16", predict=False, measure=False)
    trainer = glmc.optimize(m, x, optimizer=opt, backend="ort", **kw)
    ref = glmc.optimize(m2, x, optimizer=opt2, backend="eager", **kw)
    got, want = glmc_losses(trainer, x, STEPS), glmc_losses(ref, x, STEPS)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-3, atol=1e-3)
    # fp16 gradients of near-zero-gradient weights may round to either sign; Adam turns that
    # into +-lr per step, so state is compared to a few lr (3e-4)
    for (name, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=2e-3, msg=lambda s: f"{name}: {s}")
    assert trainer.loss_scale == ref.loss_scale


@pytest.mark.slow
def test_precision_bf16_runs_missing_kernels_in_fp32() -> None:
    (m, x, loss_fn, opt), (m2, _, _, opt2) = twin(MAKE["glm"])
    kw = dict(loss_fn=loss_fn, precision="bf16", predict=False, measure=False)
    trainer = glmc.optimize(m, x, optimizer=opt, backend="ort", **kw)
    ref = glmc.optimize(m2, x, optimizer=opt2, backend="eager", **kw)
    got, want = glmc_losses(trainer, x, STEPS), glmc_losses(ref, x, STEPS)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-3, atol=1e-3)
    fallback = {o.reason.split(":")[0] for o in trainer.report.compiles[0].fallbacks}
    assert {"MatMul", "Add", "Mul", "Softmax"} <= fallback  # no bf16 CPU kernels in ORT 1.19


def test_dropout_runs_with_ort_generator_and_says_so() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5),
                                torch.nn.Linear(8, 1))
    x = (torch.randn(16, 8), torch.randn(16, 1))
    with pytest.warns(UserWarning, match="native_dropout.*ONNX Runtime's generator"):
        trainer = glmc.optimize(model, x, loss_fn=torch.nn.functional.mse_loss, backend="ort",
                                predict=False, measure=False)
    losses = glmc_losses(trainer, x, 3)
    assert all(torch.isfinite(torch.tensor(losses)))
    (note,) = trainer.report.compiles[0].fallbacks
    assert "torch.manual_seed does not seed them" in note.reason


def test_op_that_does_not_lower_is_a_typed_error_listing_every_site(monkeypatch) -> None:
    """No per-op fallback on ORT: every op without an ONNX lowering is named, with its source
    line, before anything is exported (strict: the fake-tensor check runs first)."""
    import glmc.ir.kernels

    full = glmc.ir.kernels.decompositions
    monkeypatch.setattr(glmc.ir.kernels, "decompositions",
                        lambda: {k: v for k, v in full().items() if "rms_norm" not in str(k)})
    model, x, loss_fn, opt = MAKE["glm"]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(glmc.UnsupportedOpError) as e:
            glmc.optimize(model, x, loss_fn=loss_fn, optimizer=opt, backend="ort",
                          strict=True, predict=False, measure=False)
    assert isinstance(e.value, ExportError)
    ops = {o.reason.split(":")[0] for o in e.value.offenses}
    assert ops == {"glmc.rms_norm.default", "glmc.rms_norm_backward.default"}
    assert all("glm.py:" in o.location for o in e.value.offenses)
    assert "no per-op fallback" in str(e.value)


# ---- ONNX Runtime on-device training artifacts --------------------------------------------------

def _run_artifacts(directory, steps: int) -> list[float]:
    import json
    import subprocess
    import sys
    r = subprocess.run([sys.executable, str(directory / "train.py"), "--steps", str(steps)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["glm", pytest.param("hf_glm", marks=pytest.mark.slow)])
def test_ort_training_artifacts_train_to_glmcs_losses(tmp_path, case: str) -> None:
    """training/eval/optimizer models + checkpoint: 5 steps with onnxruntime.training.api
    (AdamW, torch's rule and hyperparameters) reproduce glmc's losses (rtol 1e-3)."""
    pytest.importorskip("onnxruntime.training")
    if case == "hf_glm":
        pytest.importorskip("transformers")
    from glmc.export.artifacts import ORT_TRAINING_FILES, export_ort_training

    model, x, loss_fn, opt = MAKE[case]()
    opt.param_groups[0]["weight_decay"] = 0.1  # not ORT's default (0): must be carried over
    trainer = glmc.optimize(model, x, loss_fn=loss_fn, optimizer=opt, backend="eager",
                            predict=False, measure=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    files = export_ort_training(trainer, str(tmp_path / "ort"))
    assert sorted(p.rsplit("/", 1)[-1] for p in files) == sorted(ORT_TRAINING_FILES)
    for k, v in model.state_dict().items():  # exporting traced the forward: nothing changed
        assert torch.equal(v, before[k]), k
    config = json.loads((tmp_path / "ort" / "config.json").read_text())
    assert config["forward"] == "glmc step"  # glmc's optimized forward, not the model's
    want = glmc_losses(trainer, x, 5)
    got = _run_artifacts(tmp_path / "ort", 5)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-3, atol=1e-5)


def test_ort_training_export_of_a_model_in_pieces_uses_its_own_forward(tmp_path) -> None:
    """A model that breaks into several graphs has no step: its own forward is exported
    (TorchScript exporter), and the artifacts still train to glmc's losses."""
    pytest.importorskip("onnxruntime.training")
    from glmc.export.artifacts import export_ort_training
    from tests.test_graph_breaks import Branches

    torch.manual_seed(0)
    model, x = Branches(), (torch.randn(6, 8), torch.randn(6, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.warns(UserWarning, match="breaks into several graphs"):
        trainer = glmc.optimize(model, x, loss_fn=torch.nn.functional.mse_loss,
                                optimizer=opt, backend="eager", predict=False, measure=False)
    export_ort_training(trainer, str(tmp_path / "ort"))
    config = json.loads((tmp_path / "ort" / "config.json").read_text())
    assert config["forward"] == "model (TorchScript exporter)"
    want = glmc_losses(trainer, x, 3)
    got = _run_artifacts(tmp_path / "ort", 3)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-3, atol=1e-5)


def test_ort_training_export_refuses_a_low_precision_forward(tmp_path) -> None:
    pytest.importorskip("onnxruntime.training")
    from glmc.export.artifacts import export_ort_training

    model, x, loss_fn, opt = MAKE["glm"]()
    opt = torch.optim.AdamW(model.parameters())
    trainer = glmc.optimize(model, x, loss_fn=loss_fn, optimizer=opt, backend="eager",
                            precision="fp16", predict=False, measure=False)
    with pytest.raises(glmc.ConfigError, match="float16.*precision='fp32'"):
        export_ort_training(trainer, str(tmp_path / "ort"))
    assert not (tmp_path / "ort").exists()


def test_ort_training_export_rejects_other_optimizers(tmp_path) -> None:
    pytest.importorskip("onnxruntime.training")
    from glmc.export.artifacts import export_ort_training

    model, x, loss_fn, opt = MAKE["mlp"]()  # SGD with momentum
    trainer = glmc.optimize(model, x, loss_fn=loss_fn, optimizer=opt, backend="eager",
                            predict=False, measure=False)
    with pytest.raises(glmc.ConfigError, match="AdamW; the step uses SGD"):
        export_ort_training(trainer, str(tmp_path / "ort"))
    assert not (tmp_path / "ort").exists()


def test_cli_check_backend_ort(capsys) -> None:
    from glmc.frontend.cli import main
    assert main(["check", "examples/mlp.py", "--backend", "ort"]) == 0
    assert "every op is supported by backend 'ort'" in capsys.readouterr().out
