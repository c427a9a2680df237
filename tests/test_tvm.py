"""backend="tvm": the step imported into TVM Relax, built for the host and run by Relax's VM;
ahead-of-time builds for aarch64 (Kunpeng 920, run under qemu) and CUDA (codegen only).

Parity (fp32, rtol 1e-4): the loss at every step and all parameters / optimizer state after 3
steps equal eager PyTorch. TVM has no training RNG (its frontend makes dropout the identity),
so the parity models are dropout-free and a step with dropout is a typed error.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("tvm")

from glmc.backends.tvm.backend import TvmBackend, resolve_target, to_tvm  # noqa: E402
from glmc.backends.tvm.ops import (  # noqa: E402
    cat,
    index_put,
    max_pool2d_with_indices,
    native_layer_norm,
    var_mean,
)

import glmc  # noqa: E402
from glmc.errors import ConfigError, ExportError  # noqa: E402
from tests.models import ATOL, BACKEND_CASES, RTOL, check_backend_parity, glmc_losses  # noqa: E402

STEPS = 3
aten = torch.ops.aten


MAKE = BACKEND_CASES
PARAMS = [  # default run: the MLP (5 s), fusion on; the GLM example (35-42 s) under -m slow
    pytest.param("mlp", True), pytest.param("glm", True, marks=pytest.mark.slow),
    pytest.param("mlp", False, marks=pytest.mark.slow),
    pytest.param("glm", False, marks=pytest.mark.slow),
    pytest.param("cnn", False, marks=pytest.mark.slow),
    pytest.param("cnn", True, marks=pytest.mark.slow),
    pytest.param("hf_glm", True, marks=pytest.mark.slow),
    pytest.param("hf_glm", False, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("case,fusion", PARAMS)
def test_parity(case: str, fusion: bool) -> None:
    trainer = check_backend_parity("tvm", case, fusion, STEPS)
    assert trainer.report.compiles[0].backend == "tvm"


# ---- training semantics the frontend lacks (golden: equal to ATen) ---------------------------

@pytest.mark.parametrize("cfg", [([2, 2], [2, 2], [0, 0], [1, 1]), ([3, 3], [2, 2], [1, 1], [1, 1]),
                                 ([3, 2], [1, 2], [1, 0], [2, 1])])
def test_max_pool_indices_equal_aten(cfg) -> None:
    """TVM's converter returns zeros for the indices max-pool's backward reads."""
    x = torch.randn(2, 3, 9, 10)
    want = aten.max_pool2d_with_indices.default(x, *cfg)
    got = max_pool2d_with_indices(x, *cfg)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_norm_statistics_and_scatter_decompositions_equal_aten() -> None:
    x, w, b = torch.randn(4, 5, 8), torch.randn(8), torch.randn(8)
    for got, want in zip(native_layer_norm(x, [8], w, b, 1e-5),
                         aten.native_layer_norm.default(x, [8], w, b, 1e-5)):
        torch.testing.assert_close(got, want)  # mean and rstd too: the backward reads them
    for got, want in zip(var_mean(x, [0, 2], correction=0, keepdim=True),
                         aten.var_mean.correction(x, [0, 2], correction=0, keepdim=True)):
        torch.testing.assert_close(got, want)
    ids = torch.tensor([[1, 3, 1], [0, 3, 3]])  # repeated ids accumulate (embedding backward)
    grad = torch.randn(2, 3, 4)
    torch.testing.assert_close(index_put(torch.zeros(5, 4), [ids], grad, True),
                               aten.index_put.default(torch.zeros(5, 4), [ids], grad, True))
    assert index_put(torch.zeros(5, 4), [ids, ids], grad, True) is NotImplemented
    k = torch.randn(2, 2, 3, 4)
    assert torch.equal(cat([torch.tensor([]), k], -2), torch.cat([torch.tensor([]), k], -2))


# ---- typed errors ----------------------------------------------------------------------------

def test_dropout_is_a_typed_error_naming_the_line() -> None:
    """TVM's frontend makes dropout the identity (no RNG): refused, never silently changed."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5),
                                torch.nn.Linear(8, 1))
    x = (torch.randn(16, 8), torch.randn(16, 1))
    with pytest.raises(ExportError) as e:
        glmc.optimize(model, x, loss_fn=torch.nn.functional.mse_loss, backend="tvm",
                      predict=False, measure=False)
    (offense,) = e.value.offenses
    assert offense.reason.startswith("native_dropout: TVM has no training RNG")
    assert "dropout" in str(e.value) and isinstance(e.value, glmc.UnsupportedOpError)


@pytest.mark.parametrize("strict", [True, False])
def test_op_without_converter_is_a_typed_error_listing_every_site(monkeypatch,
                                                                  strict: bool) -> None:
    """No per-op fallback: every op TVM's frontend cannot import is named with its source line,
    ahead of time under strict, after the frontend fails otherwise."""
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter
    full = ExportedProgramImporter.create_convert_map
    monkeypatch.setattr(ExportedProgramImporter, "create_convert_map",
                        lambda self: {k: v for k, v in full(self).items() if k != "erf.default"})
    model, x, loss_fn, opt = MAKE["mlp"]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ExportError) as e:
            glmc.optimize(model, x, loss_fn=loss_fn, optimizer=opt, backend="tvm",
                          strict=strict, predict=False, measure=False)
    ops = {o.reason.split(":")[0] for o in e.value.offenses}
    assert ops == {"aten.gelu_backward.default"}  # the forward's gelu has its own converter
    assert all("mlp.py:" in o.location for o in e.value.offenses)
    assert "no converter in TVM's PyTorch frontend (it decomposes to aten.erf.default)" \
        in str(e.value)
    assert "no per-op fallback" in str(e.value)


def test_targets_resolve_or_fail_typed() -> None:
    kunpeng = resolve_target("kunpeng920")
    assert str(kunpeng.attrs["mtriple"]) == "aarch64-linux-gnu"
    assert str(kunpeng.attrs["mcpu"]) == "tsv110"
    assert resolve_target(None).kind.name == "llvm"  # the host CPU
    with pytest.raises(ConfigError, match="not a TVM target"):
        resolve_target({"kind": "no-such-kind"})
    with pytest.raises(ConfigError, match="cannot update state in place"):
        TvmBackend().compile(None, inplace=True)


def test_inputs_are_handed_to_tvm_without_copy() -> None:
    t = torch.randn(64, 32, requires_grad=True)
    assert to_tvm(t).data_ptr() == t.data_ptr()
    lr = torch.tensor(0.1, dtype=torch.float64)
    assert to_tvm(lr).dtype == "float64"


def test_cli_check_backend_tvm(capsys) -> None:
    from glmc.frontend.cli import main
    assert main(["check", "examples/mlp.py", "--backend", "tvm"]) == 0
    assert "every op is supported by backend 'tvm'" in capsys.readouterr().out


def test_cli_target_needs_export_tvm(capsys) -> None:
    from glmc.frontend.cli import main
    with pytest.raises(SystemExit) as e:
        main(["compile", "examples/mlp.py", "--backend", "tvm", "--target", "kunpeng920"])
    assert e.value.code == 2
    assert "--target needs --export-tvm" in capsys.readouterr().err


# ---- ahead-of-time builds --------------------------------------------------------------------

def _export(tmp_path: Path, case: str, target) -> tuple[Path, list[float], Any]:
    """The step of `case` exported for `target`; glmc's losses of the next steps, and the
    trainer that took them."""
    from glmc.export.artifacts import export_tvm
    model, x, loss_fn, opt = MAKE[case]()
    trainer = glmc.optimize(model, x, loss_fn=loss_fn, optimizer=opt, backend="eager",
                            predict=False, measure=False)
    out = tmp_path / str(target if isinstance(target, str) else target["kind"])
    export_tvm(trainer, str(out), target=target)
    return out, glmc_losses(trainer, x, STEPS), trainer


def _run(cmd: list[str], env: dict | None = None) -> list[float]:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _aarch64_sysroot() -> Path:
    root = Path(os.environ.get("GLMC_AARCH64_SYSROOT", Path.home() / ".cache/glmc/aarch64"))
    missing = [t for t in ("aarch64-linux-gnu-gcc", "qemu-aarch64") if shutil.which(t) is None]
    if missing or not (root / "rootfs/usr/bin/python3.11").exists() or \
            not (root / "site/tvm").exists():
        pytest.skip(f"needs {', '.join(missing) or 'an aarch64 sysroot'}: "
                    "tools/aarch64_sysroot.sh (apt: gcc-aarch64-linux-gnu qemu-user)")
    return root


def test_export_trains_without_torch_and_saves_the_state_as_safetensors(tmp_path) -> None:
    """The host build's run_tvm.py (TVM runtime, numpy, safetensors) trains 3 steps to glmc's
    losses, and `--save` leaves the trained parameters in state.safetensors under the model's
    names, equal to glmc's after the same steps."""
    from safetensors.torch import load_file
    out, want, trainer = _export(tmp_path, "mlp", "host")
    got = _run([sys.executable, str(out / "run_tvm.py"), "--steps", str(STEPS), "--save"])
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
    state = load_file(str(out / "state.safetensors"))
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=RTOL, atol=ATOL)
    assert any(k.startswith("optimizer_state/") for k in state)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mlp", "glm"])
def test_kunpeng920_build_runs_under_qemu_with_x86_losses(tmp_path, case: str) -> None:
    """The step built for aarch64 (mcpu tsv110) and for this x86 host, each run 3 steps by
    run_tvm.py (TVM runtime + numpy, no torch): equal losses, and equal to glmc's."""
    root = _aarch64_sysroot()
    arm, want, _ = _export(tmp_path, case, "kunpeng920")
    x86, _, _ = _export(tmp_path, case, "host")
    assert "ARM aarch64" in subprocess.run(["file", str(arm / "step.so")], capture_output=True,
                                           text=True).stdout
    env = {**os.environ, "PYTHONPATH": str(root / "site")}
    got_arm = _run(["qemu-aarch64", "-L", str(root / "rootfs"),
                    str(root / "rootfs/usr/bin/python3.11"), str(arm / "run_tvm.py"),
                    "--steps", str(STEPS)], env)
    got_x86 = _run([sys.executable, str(x86 / "run_tvm.py"), "--steps", str(STEPS)])
    torch.testing.assert_close(torch.tensor(got_arm), torch.tensor(got_x86), rtol=1e-5,
                               atol=1e-6)
    torch.testing.assert_close(torch.tensor(got_arm), torch.tensor(want), rtol=RTOL, atol=ATOL)


@pytest.mark.slow
def test_cuda_build_is_codegen_only_without_a_gpu(tmp_path) -> None:
    """CUDA (sm_90, H100/H200): kernels generated and compiled by nvcc into step.so; running
    it needs a GPU with TVM installed (not on the test machine)."""
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc (CUDA toolkit) to compile TVM's CUDA kernels")
    out, _, _ = _export(tmp_path, "mlp", "h200")
    assert (out / "step.so").stat().st_size > 0
    source = (out / "step.cu").read_text()
    assert "__global__" in source
    sig = json.loads((out / "signature.json").read_text())
    assert '"kind":"cuda"' in sig["target"].replace(" ", "") and "sm_90" in sig["target"]
