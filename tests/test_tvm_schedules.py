"""glmc's TVM CPU schedule rules (backends/tvm/schedules.py): each rule schedules the kernels it
is written for, declines the others, and keeps the results equal to PyTorch's.

Every case builds a small torch function for the host through TVM's frontend and the glmc
pipeline, runs it, and compares with torch (fp32: the GEMM tiles sum K in another order, so
rtol 1e-5 / atol 1e-4 for matmuls, exact for data movement). Shapes are chosen to cover the
padded edges: sizes that divide no tile, batch matmul, every transposed layout of the backward.
"""
from __future__ import annotations

import platform
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("tvm")

from glmc.backends.tvm import schedules  # noqa: E402
from glmc.backends.tvm.backend import resolve_target, share_threads  # noqa: E402


def _module(fn: Callable[..., torch.Tensor], *shapes: tuple[int, ...]) -> Any:
    from tvm.relax.frontend.torch import from_exported_program

    class F(torch.nn.Module):
        def forward(self, *xs: torch.Tensor) -> torch.Tensor:
            return fn(*xs)

    ins = tuple(torch.zeros(s) for s in shapes)
    return from_exported_program(torch.export.export(F(), ins))


def _legalized(fn: Callable[..., torch.Tensor], *shapes: tuple[int, ...]) -> list[Any]:
    """The PrimFuncs TVM's CPU pipeline hands the schedule rules for `fn`."""
    import tvm
    from tvm import tirx
    from tvm.relax.backend.cpu_generic import pipeline as cpu
    target = resolve_target("host")
    with target:
        mod = tvm.transform.Sequential(cpu.library_dispatch_passes(target)
                                       + cpu.legalize_passes(target))(_module(fn, *shapes))
    return [f for _, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)]


def _run(fn: Callable[..., torch.Tensor], *shapes: tuple[int, ...],
         target: Any = "host") -> tuple[np.ndarray, Any]:
    import tvm
    from tvm import relax
    target = resolve_target(target)
    schedules.FAILURES.clear()
    ex = tvm.compile(_module(fn, *shapes), target=target,
                     relax_pipeline=schedules.pipeline(target))
    gen = torch.Generator().manual_seed(0)
    ins = [torch.randn(s, generator=gen) for s in shapes]
    dev = tvm.cpu()
    out = relax.VirtualMachine(ex, dev)["main"](*[tvm.runtime.tensor(x.numpy(), dev)
                                                   for x in ins])
    out = out[0] if not hasattr(out, "numpy") else out
    return out.numpy(), fn(*ins).numpy()


MATMULS = {  # every layout the forward and backward of a Linear use, and attention's bmm
    "x @ w.T": (lambda x, w: x @ w.t(), (37, 96), (130, 96)),
    "dy @ w": (lambda g, w: g @ w, (37, 130), (130, 96)),
    "dy.T @ x": (lambda g, x: g.t() @ x, (70, 33), (70, 96)),
    "bias+relu": (lambda x, w: torch.relu(x @ w.t() + 1.5), (64, 300), (96, 300)),
    "bmm": (lambda q, k: q @ k.transpose(-1, -2), (3, 40, 16), (3, 40, 16)),
    "deep K": (lambda x, w: x @ w, (64, 1100), (1100, 64)),
}


@pytest.mark.parametrize("name", list(MATMULS))
def test_matmul_rule_schedules_every_layout_with_torchs_results(name: str) -> None:
    fn, *shapes = MATMULS[name]
    funcs = _legalized(fn, *shapes)
    target = resolve_target("host")
    assert any(schedules.matmul(f, target) is not None for f in funcs), "no GEMM scheduled"
    got, want = _run(fn, *shapes)
    assert schedules.FAILURES == []
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shape", [(64, 48), (2, 32, 80), (33, 7)])
def test_transposes_and_elementwise_are_exact(shape: tuple[int, ...]) -> None:
    fn = lambda x: (x.transpose(-1, -2) * 2 + 1).contiguous()  # noqa: E731
    target = resolve_target("host")
    funcs = _legalized(fn, shape)
    assert all(schedules.elementwise(f, target) is not None for f in funcs)
    assert all(schedules.matmul(f, target) is None for f in funcs)  # not a GEMM: declined
    got, want = _run(fn, shape)
    assert schedules.FAILURES == []
    np.testing.assert_array_equal(got, want)


REDUCTIONS = {
    "column sum (bias grad)": (lambda g: g.sum(0), (300, 96)),
    "row sum": (lambda x: x.sum(-1), (64, 257)),
    "softmax": (lambda x: torch.softmax(x, -1), (4, 33, 128)),
    "log_softmax + mean": (lambda x: torch.log_softmax(x, -1).mean(), (16, 1000)),
    "layer norm": (lambda x: torch.nn.functional.layer_norm(x, (96,)), (8, 17, 96)),
}


@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_reductions_keep_torchs_results(name: str) -> None:
    fn, shape = REDUCTIONS[name]
    target = resolve_target("host")
    funcs = _legalized(fn, shape)
    reducing = [f for f in funcs if schedules.reduction(f, target) is not None]
    assert reducing
    assert all(schedules.elementwise(f, target) is None for f in reducing)
    got, want = _run(fn, shape)
    assert schedules.FAILURES == []
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


X86_TARGETS = {"avx2": "haswell", "sse2": "x86-64"}  # 8 and 4 lanes: other tiles than the host's


@pytest.mark.skipif(platform.machine() != "x86_64", reason="runs x86 builds on the host")
@pytest.mark.parametrize("isa", list(X86_TARGETS))
def test_narrower_x86_vectors_keep_torchs_results(isa: str) -> None:
    """The tiles an AVX2-only or SSE-only CPU gets (4 x 16 / 8 x 8 register blocks), built
    for that CPU and run here (its instructions are a subset of any x86-64 host's)."""
    target = {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": X86_TARGETS[isa]}
    for name in ("x @ w.T", "dy.T @ x", "bmm"):
        fn, *shapes = MATMULS[name]
        got, want = _run(fn, *shapes, target=target)
        assert schedules.FAILURES == [], name
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4, err_msg=name)
    got, want = _run(lambda x: torch.softmax(x.transpose(0, 1), -1), (48, 40), target=target)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert schedules.FAILURES == []


def test_vector_width_follows_the_target() -> None:
    lanes = {name: schedules._lanes(resolve_target(t)) for name, t in [
        ("neon", "kunpeng920"),
        ("avx2", {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "haswell"}),
        ("avx512", {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "skylake-avx512"})]}
    assert lanes == {"neon": 4, "avx2": 8, "avx512": 16}


def test_k_tiles_and_panels() -> None:
    assert schedules._k_tile(384, 256) == 384  # all of K
    assert schedules._k_tile(1024, 256) == 512  # a divisor in [128, 512]
    assert schedules._k_tile(1030, 256) == 256  # none divides: padded to 256s
    assert schedules._panel(64, 384, 32, 1 << 18) == 4  # 4 x 32 x 384 floats = 192 KiB
    assert schedules._panel(3, 4096, 32, 1 << 18) == 1


def test_tvm_threads_follow_torch_unless_the_user_set_them(monkeypatch: Any) -> None:
    monkeypatch.delenv("TVM_NUM_THREADS", raising=False)
    share_threads()
    import os
    assert os.environ["TVM_NUM_THREADS"] == str(torch.get_num_threads())
    monkeypatch.setenv("TVM_NUM_THREADS", "1")
    share_threads()
    assert os.environ["TVM_NUM_THREADS"] == "1"
